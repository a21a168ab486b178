"""``train_policy``: behaviour cloning, BPPO, AWR, RFT and DPO on a trajectory table (or several).

Read top to bottom, as a TRL or CleanRL trainer; :func:`train_policy` is the four steps in order:

1. **load**: :func:`train_args` (the loop's arguments and the run's fingerprint), the backend
   (:func:`qevolve_cli.training.make_backend`), :func:`load_policy` (tokenizer, model, LoRA,
   gradient checkpointing);
2. **data**: :func:`build_policy_data` (tokenised examples, dpo's pairs, normalised advantages),
   :func:`initial_logprobs` (pi_ref and pi_old per token, computed once);
3. **loop**: :func:`qevolve_cli.training.train_loop` over :func:`make_steps` (token-budget
   micro-batches grouped into optimiser steps), :func:`policy_loss` (the objective's loss on one
   micro-batch) and :func:`policy_hooks` (pi_old refresh, log-probs in the checkpoint);
4. **save**: :func:`summarize` (the returned metrics) and :func:`write_output` (``OUT``, atomically).

The pieces it calls live beside it: ``data.py`` (tables, examples, collation), ``model.py``
(loading, LoRA, saving), ``logprobs.py`` (log-probs and their statistics), ``algos.py`` (the losses).

Memory: only the policy is kept during training. pi_ref's per-token log-probs
are computed once before training (from ``--ref`` if given, else from the
initial policy) and the reference model is then freed; pi_old's log-probs are
computed from the current policy at the start and every
``old_refresh_steps`` optimiser steps (0 = never: pi_old is the initial
policy, i.e. the behaviour policy of BPPO). Both use eval mode and no grad.

Output (written atomically: temp dir + rename): a model directory that
transformers and vLLM load directly (full weights as safetensors + tokenizer
files, or a PEFT LoRA adapter + tokenizer files), ``config.yaml`` (the
resolved :class:`PolicyConfig` plus the inputs), ``metrics.jsonl`` (one line
per optimiser step) and ``train_summary.json``. Work in progress (checkpoints
at epoch ends and every ``checkpoint_every_steps`` steps, the running log) lives
in ``OUT.partial/`` beside the output (:func:`qevolve_cli.atomic.partial_dir`, the
convention of every stage) so that an interrupted run, started again with the
same command, resumes at the next optimiser step (under DeepSpeed too).
"""
from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from qevolve_cli.errors import QevolveError, TableError
from qevolve_cli.models import enable_activation_checkpointing
from qevolve_cli.policy.config import PolicyConfig
from qevolve_cli.policy.data import PolicyExample, build_examples, collate, data_paths, load_policy_table
from qevolve_cli.policy.logprobs import (
    Layout,
    batch_logprobs,
    compute_logprobs,
    dpo_pair_stats,
    step_logprob_stats,
)
from qevolve_cli.policy.model import apply_lora, check_model_dir, load_causal_lm, save_model
from qevolve_cli.tokenizer import load_tokenizer, pad_id_of


def train_policy(cfg: PolicyConfig, data: str | Path | Sequence[str | Path], model: str | Path, out: str | Path,
                 ref: str | Path | None = None, quiet: bool = False) -> dict[str, Any]:
    """Train a policy with ``cfg.objective`` on table ``data`` (or several, stacked) from ``model``; write ``out``.

    -> metrics. ``ref``: the frozen reference of bppo's KL and dpo (default: the starting policy).
    """
    from qevolve_cli.training import make_backend, train_loop

    t_start = time.perf_counter()
    out = Path(out)

    # 1. load
    model_path = check_model_dir(model)
    if ref is not None:
        check_model_dir(ref, "--ref")
    df, table_info = load_policy_table(cfg, data)
    args = train_args(cfg, data, model_path, ref, out, quiet)
    backend = make_backend(args, cfg.grad_accum_steps)
    tok, policy, init_dtype = load_policy(cfg, model_path, backend.device)
    layout = Layout.of(cfg, backend.device, policy)  # no padding computed, the shared prefix once (docs/performance.md)

    # 2. data
    pd = build_policy_data(cfg, df, table_info, tok, data_label(data))
    # a --ref that is the --model directory itself (evolve's iteration 1 and ETO: --model bc/policy --ref
    # bc/policy) has the starting policy's log-probs: one pass over the data, not two
    lp = initial_logprobs(cfg, policy, pd, None if same_dir(ref, model_path) else ref, backend, layout)

    # 3. loop
    result = train_loop(policy, partial(make_steps, cfg, pd), partial(policy_loss, cfg, pd, lp, layout), args,
                        micro_weight=pd.micro_weight, micro_tokens=pd.micro_tokens,
                        hooks=policy_hooks(cfg, pd, lp, backend, layout, args.ckpt_dir), backend=backend)

    # 4. save
    unwrapped = backend.unwrap(policy)
    metrics = summarize(cfg, pd, lp, result, unwrapped, backend, layout,
                        inputs={"device": backend.device, "data": pd.label, "model": str(model_path),
                                "ref": str(ref) if ref is not None else None, "out": str(out)})
    write_output(cfg, backend, unwrapped, tok, init_dtype, out, args.ckpt_dir, metrics, t_start)
    return metrics


# --------------------------------------------------------------------------- 1. load


def data_label(data) -> str:
    """``--data`` as the messages and the summary name it (several tables: comma-separated)."""
    return str(data) if isinstance(data, (str, Path)) else ", ".join(map(str, data))


def _fingerprint(cfg_hash: str, data, model: Path, ref) -> str:
    import hashlib

    parts = [cfg_hash, *(str(Path(p).resolve()) for p in data_paths(data)), str(Path(model).resolve()),
             str(Path(ref).resolve()) if ref is not None else ""]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def train_args(cfg: PolicyConfig, data, model_path: Path, ref, out: Path, quiet: bool):
    """The loop's arguments: ``cfg`` mapped onto :class:`~qevolve_cli.training.TrainArgs`, the work in progress in
    ``OUT.partial/`` (checkpoints and the running log) and the run's fingerprint (config, data, model, ref)."""
    from qevolve_cli.atomic import partial_dir
    from qevolve_cli.training import TrainArgs

    work = partial_dir(out)
    return TrainArgs(
        epochs=cfg.epochs, lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_ratio=cfg.warmup_ratio,
        lr_scheduler=cfg.lr_scheduler, max_grad_norm=cfg.max_grad_norm, seed=cfg.seed,
        precision=cfg.precision, device=cfg.device, log_path=work / "metrics.jsonl", ckpt_dir=work,
        deepspeed=Path(cfg.deepspeed) if cfg.deepspeed else None, quiet=quiet, desc=f"policy {cfg.objective}",
        max_steps=cfg.max_steps, checkpoint_every_steps=cfg.checkpoint_every_steps,
        # how often checkpoints are written does not change the run: a resume may change it
        fingerprint=_fingerprint(cfg.hash(), data, model_path, ref),
    )


def load_policy(cfg: PolicyConfig, model_path: Path, device: str):
    """-> (tokenizer, the policy on ``device`` with LoRA and gradient checkpointing as ``cfg`` says, the dtype it
    was stored in). Seeded with ``cfg.seed`` first: the LoRA initialisation is part of the run."""
    import torch

    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(model_path, what="--model", fill_pad=True)
    policy = load_causal_lm(model_path, trainable_lora=cfg.lora)
    init_dtype = getattr(policy.config, "dtype", None)
    if cfg.lora:
        policy = apply_lora(policy, cfg)
    if cfg.gradient_checkpointing:
        enable_activation_checkpointing(policy)
        if cfg.lora:
            policy.enable_input_require_grads()
    policy.to(device)
    return tok, policy, init_dtype


# --------------------------------------------------------------------------- 2. data


@dataclass
class PolicyData:
    """What one run trains on: the tokenised examples (one per window of a trajectory) and, for dpo, the
    (chosen, rejected) trajectory pairs as the example indices of each side's windows, dpo's training units
    (a micro-batch holds example indices, under dpo pair indices)."""

    examples: list[PolicyExample]
    pairs: list[tuple[list[int], list[int]]]
    dpo: bool
    pad_id: int
    table_info: dict[str, Any]
    label: str  # the --data paths, for messages and the summary

    def micro_weight(self, idx: list[int]) -> float:
        """A micro-batch's share of its optimiser step: its target tokens (dpo: its pairs)."""
        return len(idx) if self.dpo else sum(self.examples[i].n_targets for i in idx)

    def micro_tokens(self, idx: list[int]) -> int:
        """Tokens of a micro-batch's sequences (throughput)."""
        if self.dpo:
            return sum(len(self.examples[i]) for p in idx for side in self.pairs[p] for i in side)
        return sum(len(self.examples[i]) for i in idx)

    def pair_rows(self, idx: list[int]) -> tuple[list[int], list[int], int]:
        """dpo: the example rows of pairs ``idx`` (every chosen window, then every rejected window) and the
        trajectory each row belongs to (0..n-1 the chosen sides, n..2n-1 the rejected ones) -> (rows, owner,
        number of chosen rows)."""
        chosen = [(i, k) for k, p in enumerate(idx) for i in self.pairs[p][0]]
        rejected = [(i, len(idx) + k) for k, p in enumerate(idx) for i in self.pairs[p][1]]
        rows = chosen + rejected
        return [i for i, _ in rows], [k for _, k in rows], len(chosen)


def build_policy_data(cfg: PolicyConfig, df, table_info: dict[str, Any], tok, label: str) -> PolicyData:
    """Tokenise the selected rows (one example per window of a trajectory; those with a target token), map
    dpo's trajectory pairs onto the example indices of their windows and normalise the advantages
    (``normalize_advantage``; each trajectory's steps counted once, whatever its number of windows)."""
    dpo = cfg.objective == "dpo"
    examples = build_examples(df, tok, cfg.max_length, with_advantage=cfg.uses_advantage, path=label,
                              window_context=cfg.window_context)
    examples = [e for e in examples if e.n_targets > 0]
    if not examples:
        raise TableError(label, "action", "no action tokens left to train on after truncation")
    pairs: list[tuple[list[int], list[int]]] = []
    if dpo:
        pos: dict[str, list[int]] = {}
        for i, e in enumerate(examples):
            pos.setdefault(e.traj_id, []).append(i)
        pairs = [(pos[c], pos[r]) for c, r in table_info["pairs"] if c in pos and r in pos]
        if not pairs:
            raise TableError(label, "action", "no preference pair left with action tokens after truncation")
    if cfg.normalize_advantage and cfg.uses_advantage:
        per_traj = {e.traj_id: e.advantages for e in examples}
        allv = np.concatenate(list(per_traj.values()))
        mu, sd = float(allv.mean()), float(allv.std()) + 1e-8
        normed = {t: ((a - mu) / sd).astype(np.float32) for t, a in per_traj.items()}
        for e in examples:
            e.advantages = normed[e.traj_id]
    return PolicyData(examples, pairs, dpo, pad_id_of(tok), table_info, label)


@dataclass
class LogProbs:
    """Per-token log-probs of every example (one (L,) array each): under the starting policy (``init``), pi_old
    (bppo; refreshed during training) and pi_ref (bppo's KL, dpo). None: the objective does not use it."""

    init: list[np.ndarray]
    old: list[np.ndarray] | None = None
    ref: list[np.ndarray] | None = None

    def state_tensors(self) -> dict[str, Any]:
        """pi_old and pi_ref, flattened, for the checkpoint (they change with the data, not the weights)."""
        import torch

        return {f"logp_{k}": torch.from_numpy(np.concatenate(v).astype(np.float32))
                for k, v in (("old", self.old), ("ref", self.ref)) if v is not None}

    def load_state_tensors(self, extra: dict[str, Any], examples: list[PolicyExample], where: Path | None) -> None:
        lens = np.cumsum([0] + [len(e) for e in examples])
        for key in ("old", "ref"):
            t = extra.get(f"logp_{key}")
            if t is not None:
                a = t.numpy()
                if a.shape[0] != lens[-1]:
                    raise QevolveError(f"{where}: checkpoint does not match the data (delete it to start over)")
                setattr(self, key, [a[lens[i] : lens[i + 1]].copy() for i in range(len(examples))])


def same_dir(a: str | Path | None, b: str | Path) -> bool:
    """Whether ``a`` names the directory ``b`` (after symlinks and relative paths); False for None or a Hub id."""
    return a is not None and Path(a).is_dir() and Path(a).resolve() == Path(b).resolve()


def initial_logprobs(cfg: PolicyConfig, policy, pd: PolicyData, ref, backend, layout: Layout) -> LogProbs:
    """Log-probs under the starting policy; pi_old (bppo) starts there; pi_ref (bppo, dpo) is ``--ref``'s, loaded,
    measured and freed here (only the policy stays in memory), else the starting policy's. ``layout``: the
    forwards' layout (``batch_layout``, ``shared_prefix``, ``logits``)."""
    device = backend.device
    lp = LogProbs(init=compute_logprobs(policy, pd.examples, pd.pad_id, cfg.micro_batch_tokens, device,
                                        backend.autocast, *layout))
    if cfg.objective in ("bppo", "dpo"):
        if cfg.objective == "bppo":
            lp.old = lp.init
        if ref is not None:
            import torch

            ref_model = load_causal_lm(ref, what="--ref").to(device)
            lp.ref = compute_logprobs(ref_model, pd.examples, pd.pad_id, cfg.micro_batch_tokens, device,
                                      backend.autocast, *layout)
            del ref_model
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        else:
            lp.ref = lp.init
    return lp


# --------------------------------------------------------------------------- 3. loop


def make_steps(cfg: PolicyConfig, pd: PolicyData, epoch: int) -> list[list[list[int]]]:
    """The epoch's optimiser steps: token-budget micro-batches (``micro_batch_tokens``, at most
    ``micro_batch_size`` sequences; a dpo pair is its two trajectories' windows padded together, never split)
    shuffled with the seed and the epoch, ``grad_accum_steps`` per step."""
    from qevolve_cli.training import group_steps, token_budget_batches

    if pd.dpo:
        lens = [(len(c) + len(r)) * max(len(pd.examples[i]) for i in c + r) for c, r in pd.pairs]
        cap = max(1, cfg.micro_batch_size // 2) if cfg.micro_batch_size else 0
        mbs = token_budget_batches(lens, cfg.micro_batch_tokens, cap, shuffle=True, seed=cfg.seed * 1000003 + epoch)
        return group_steps(mbs, cfg.grad_accum_steps)
    mbs = token_budget_batches([len(e) for e in pd.examples], cfg.micro_batch_tokens, cfg.micro_batch_size,
                               shuffle=True, seed=cfg.seed * 1000003 + epoch)
    return group_steps(mbs, cfg.grad_accum_steps)


def policy_loss(cfg: PolicyConfig, pd: PolicyData, lp: LogProbs, layout: Layout, m, idx: list[int], ctx: dict):
    """The objective's loss on one micro-batch -> (mean loss, metrics): bc / rft token NLL, awr, bppo (clipped
    ratio to pi_old, KL to pi_ref) or dpo (+ NLL of the chosen, ``dpo_nll_weight``); the losses are ``algos.py``'s."""
    import torch

    from qevolve_cli.algos import awr_loss, bppo_loss, dpo_nll_loss, token_nll, trajectory_logratio

    if pd.dpo:
        rows, owner, n_chosen = pd.pair_rows(idx)
        batch = collate([pd.examples[i] for i in rows], pd.pad_id, cfg.thought_weight, None,
                        [lp.ref[i] for i in rows])
        logp = batch_logprobs(m, batch, ctx["device"], *layout).float()
        mask = batch["mask"].to(logp.device)
        n = len(idx)
        ratio = trajectory_logratio(logp, batch["logp_ref"].to(logp.device), mask, torch.tensor(owner), 2 * n)
        return dpo_nll_loss(ratio[:n], ratio[n:], logp[:n_chosen], mask[:n_chosen], cfg.dpo_beta,
                            cfg.dpo_nll_weight)
    exs = [pd.examples[i] for i in idx]
    old = [lp.old[i] for i in idx] if lp.old is not None else None
    refl = [lp.ref[i] for i in idx] if lp.ref is not None else None
    batch = collate(exs, pd.pad_id, cfg.thought_weight, old, refl)
    logp = batch_logprobs(m, batch, ctx["device"], *layout).float()
    mask = batch["mask"].to(logp.device)
    tw = batch["token_weights"].to(logp.device)
    if cfg.objective in ("bc", "rft"):
        loss = token_nll(logp, mask)
        return loss, {"nll": float(loss.detach())}
    adv = batch["adv"].to(logp.device)
    if cfg.objective == "awr":
        return awr_loss(logp, adv, mask, tw, cfg.awr_beta, cfg.awr_max_weight)
    return bppo_loss(logp, batch["logp_old"].to(logp.device), adv, mask, tw, cfg.eps_low, cfg.eps_high,
                     batch["logp_ref"].to(logp.device), cfg.kl_coef, cfg.kl_estimator)


def policy_hooks(cfg: PolicyConfig, pd: PolicyData, lp: LogProbs, backend, layout: Layout, ckpt_dir: Path | None):
    """bppo refreshes pi_old from the current policy every ``old_refresh_steps`` optimiser steps; pi_old and pi_ref
    travel in the checkpoint."""
    from qevolve_cli.training import Hooks

    def on_step(step: int, m) -> None:
        if cfg.objective == "bppo" and cfg.old_refresh_steps and step % cfg.old_refresh_steps == 0:
            lp.old = compute_logprobs(m, pd.examples, pd.pad_id, cfg.micro_batch_tokens, backend.device,
                                      backend.autocast, *layout)

    return Hooks(on_step=on_step, extra_state=lp.state_tensors,
                 load_extra_state=lambda extra: lp.load_state_tensors(extra, pd.examples, ckpt_dir))


# --------------------------------------------------------------------------- 4. save


def summarize(cfg: PolicyConfig, pd: PolicyData, lp: LogProbs, result, unwrapped, backend, layout: Layout,
              inputs: dict[str, Any]) -> dict[str, Any]:
    """The run's metrics (``train_summary.json``, the return value): the loop's counters, the NLL of the action
    tokens and the per-step action log-prob change by advantage sign before / after, rft's and dpo's counts."""
    before = step_logprob_stats(pd.examples, lp.init)
    lp_final = compute_logprobs(unwrapped, pd.examples, pd.pad_id, cfg.micro_batch_tokens, backend.device,
                                backend.autocast, *layout)
    after = step_logprob_stats(pd.examples, lp_final)

    def delta(sign: int) -> float | None:
        d = [a2[1] - a1[1] for a1, a2 in zip(before["per_step"], after["per_step"], strict=False) if np.sign(a1[0]) == sign]
        return float(np.mean(d)) if d else None

    trajs = {e.traj_id: e.advantages for e in pd.examples}
    metrics: dict[str, Any] = {
        "objective": cfg.objective,
        "trajectories": len(trajs),
        "sequences": len(pd.examples),
        "steps": int(sum(a.size for a in trajs.values())),
        "steps_trained": int(sum(len(np.unique(e.step[e.loss_mask])) for e in pd.examples)),
        "optimizer_steps": result.steps,
        "epochs": cfg.epochs,
        "resumed_from_epoch": result.resumed_from_epoch,
        "resumed_from_step": result.resumed_from_step,
        "train_tokens": result.tokens,
        "target_tokens": before["tokens"],
        "train_seconds": round(result.seconds, 3),
        "tokens_per_s": round(result.tokens / result.seconds, 1) if result.seconds > 0 else None,
        "nll_before": before["nll"],
        "nll_after": after["nll"],
        "logp_delta_pos_adv": delta(1),
        "logp_delta_neg_adv": delta(-1),
        "truncated_trajectories": len({e.traj_id for e in pd.examples if e.dropped_turns or e.cut}),
        "final_loss": result.last_metrics.get("loss"),
        **inputs,
    }
    if "expert_without_advantage" in pd.table_info:  # bppo / awr on GiGPO's advantages: demonstrations left out
        metrics["expert_without_advantage"] = pd.table_info["expert_without_advantage"]
    if cfg.objective == "rft":
        metrics.update({f"rft_{k}": v for k, v in pd.table_info.items()})
    if cfg.objective == "dpo":
        metrics.update({f"dpo_{k}": v for k, v in pd.table_info.items() if k != "pairs"})
        metrics.update(dpo_pair_stats(pd.examples, pd.pairs, lp.init, lp_final, lp.ref, cfg.dpo_beta))
    return metrics


def write_output(cfg: PolicyConfig, backend, unwrapped, tok, init_dtype, out: Path, work: Path, metrics: dict[str, Any],
                 t_start: float) -> None:
    """``OUT`` atomically (rank 0): the model, ``config.yaml``, the loss curve and ``train_summary.json``; then
    ``OUT.partial/`` is removed. Every rank calls it (the full weights are a collective under ZeRO-3)."""
    from qevolve_cli.atomic import atomic_dir, write_json
    from qevolve_cli.config import dump_yaml
    from qevolve_cli.training import remove_checkpoint

    state = backend.full_state_dict(unwrapped)  # ZeRO-3: gathered on rank 0
    if backend.is_main:
        with atomic_dir(out) as tmp:
            save_model(unwrapped, tok, tmp, cfg, init_dtype, state)
            dump_yaml(cfg, tmp / "config.yaml")  # loadable again with --config
            if (work / "metrics.jsonl").exists():
                shutil.copyfile(work / "metrics.jsonl", tmp / "metrics.jsonl")
            else:
                (tmp / "metrics.jsonl").write_text("")
            metrics["total_seconds"] = round(time.perf_counter() - t_start, 3)
            write_json(tmp / "train_summary.json", metrics)
        remove_checkpoint(work)
    backend.barrier()
