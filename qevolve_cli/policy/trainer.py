"""``train_policy``: behaviour cloning, BPPO, AWR, RFT and DPO on a trajectory table (or several).

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

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qevolve_cli.errors import QevolveError, TableError
from qevolve_cli.policy.config import PolicyConfig
from qevolve_cli.policy.data import PolicyExample, build_examples, collate
from qevolve_cli.tokenizer import load_tokenizer, pad_id_of

# --------------------------------------------------------------------------- loading


def check_model_dir(path: str | Path, what: str = "--model") -> Path:
    p = Path(path)
    if not p.exists():
        raise QevolveError(f"{what} {p}: no such model directory")
    if not p.is_dir():
        raise QevolveError(f"{what} {p}: not a directory")
    if not (p / "config.json").exists() and not (p / "adapter_config.json").exists():
        raise QevolveError(f"{what} {p}: not a Hugging Face model directory (no config.json or adapter_config.json)")
    return p


def load_causal_lm(path: str | Path, trainable_lora: bool = False, what: str = "--model"):
    """Load a causal LM (or a PEFT adapter over its base) in float32 from safetensors, no remote code."""
    import torch
    from transformers import AutoModelForCausalLM

    p = check_model_dir(path, what)
    kw = dict(dtype=torch.float32, trust_remote_code=False, use_safetensors=True)
    try:
        if (p / "adapter_config.json").exists() and not (p / "config.json").exists():
            from peft import PeftModel

            base_path = json.loads((p / "adapter_config.json").read_text()).get("base_model_name_or_path")
            if not base_path:
                raise QevolveError(f"{p}/adapter_config.json: no base_model_name_or_path")
            base = AutoModelForCausalLM.from_pretrained(base_path, **kw)
            model = PeftModel.from_pretrained(base, str(p), is_trainable=trainable_lora)
            if not trainable_lora:
                model = model.merge_and_unload()
            return model
        return AutoModelForCausalLM.from_pretrained(str(p), **kw)
    except QevolveError:
        raise
    except (OSError, ValueError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise QevolveError(f"{what} {p}: cannot load the model ({msg})") from None


def data_paths(data) -> list[Path]:
    """``--data``: one table or several (a list); returned as a list of paths."""
    if isinstance(data, (str, Path)):
        return [Path(data)]
    paths = [Path(d) for d in data]
    if not paths:
        raise QevolveError("--data: no trajectory table given")
    return paths


def read_tables(data, require: tuple[str, ...] | list[str] = ()):
    """Read and validate one or several tables; several are stacked (a trajectory id may appear in one only)."""
    import polars as pl

    from qevolve_cli.schema import read_table

    paths = data_paths(data)
    frames, seen = [], set()
    for p in paths:
        df = read_table(p, require=require)
        ids = set(df["traj_id"].unique().to_list())
        dup = sorted(ids & seen)
        if dup:
            raise TableError(p, "traj_id", f"trajectory {dup[0]!r} also appears in an earlier --data table")
        seen |= ids
        frames.append(df)
    return frames[0] if len(frames) == 1 else pl.concat(frames, how="diagonal_relaxed")


def load_policy_table(cfg: PolicyConfig, data):
    """Read (one or several tables) and select the training rows of ``data`` for ``cfg.objective``.

    -> (rows, info): ``info`` holds the rft counts or the dpo ``pairs`` and counts.
    """
    import polars as pl

    from qevolve_cli.policy.data import dpo_pairs, rft_select
    from qevolve_cli.schema import drop_failed

    paths = data_paths(data)
    where = paths[0] if len(paths) == 1 else ", ".join(map(str, paths))
    need = ["advantage"] if cfg.objective in ("bppo", "awr") else []
    df = read_tables(paths, need)
    if cfg.drop_failed:
        df = drop_failed(df)
    info: dict[str, Any] = {}
    if cfg.objective == "bc" and cfg.bc_source == "expert":
        df = df.filter(pl.col("source") == "expert")
        if df.height == 0:
            raise TableError(where, "source", "no expert rows to clone (bc uses rows with source == 'expert')")
    elif cfg.objective == "rft":
        df, info = rft_select(df, cfg.rft_min_reward)
        if df.height == 0:
            raise TableError(where, "source", "no expert rows and no self trajectory with final reward >= "
                             f"{cfg.rft_min_reward} (rft trains on these)")
    elif cfg.objective == "dpo":
        pairs, info = dpo_pairs(df, cfg.dpo_pairs)
        if not pairs:
            raise TableError(where, "reward_env", f"no preference pair: no task has an {cfg.dpo_pairs.replace('_', ' ')} "
                             "trajectory and a self trajectory with a different final reward "
                             f"(tie {info['tie']}, without anchor {info['no_anchor']})")
        used = {t for pr in pairs for t in pr}
        df = df.filter(pl.col("traj_id").is_in(list(used)))
        info = {**info, "pairs": pairs}
    if df.height == 0:
        raise TableError(where, None, "no trajectories left to train on")
    if need:
        nulls = df.filter(pl.col("advantage").is_null())
        if nulls.height:
            r = nulls.row(0, named=True)
            raise TableError(where, "advantage", f"{nulls.height} null values (first at traj_id={r['traj_id']!r} "
                             f"step={r['step']}); run `qevolve label --critic` first")
    return df, info


# --------------------------------------------------------------------------- log-probs


def batch_logprobs(model, batch: dict, device: str, per_sequence: bool = False):
    """Per-token log pi of the next token, (B, T) prediction-aligned.

    ``per_sequence``: one forward per row, cut to its own length (the batch is right-padded), so no
    padding position is computed and no attention mask is needed; the real positions hold the same
    values as the padded forward (causal attention), the positions past a row's end hold 0."""
    import torch

    from qevolve_cli.algos import sequence_logprobs

    ids = batch["input_ids"].to(device)
    att = batch["attention_mask"]
    lens = att.sum(dim=1).tolist()
    if per_sequence and min(lens) < ids.shape[1]:
        T = ids.shape[1]
        rows = []
        for b, n in enumerate(lens):
            row = ids[b : b + 1, :n]
            lp = sequence_logprobs(model(input_ids=row, use_cache=False).logits, row)
            rows.append(torch.nn.functional.pad(lp, (0, T - n)))
        return torch.cat(rows, dim=0)
    out = model(input_ids=ids, attention_mask=att.to(device), use_cache=False)
    return sequence_logprobs(out.logits, ids)


def compute_logprobs(model, examples: list[PolicyExample], pad_id: int, max_tokens: int, device: str,
                     autocast=None, per_sequence: bool = False) -> list[np.ndarray]:
    """Log-probs of every example under ``model`` (eval mode, no grad) -> one (L,) array per example."""
    import contextlib

    import torch

    from qevolve_cli.training import token_budget_batches

    was_training = model.training
    model.eval()
    res: list[np.ndarray | None] = [None] * len(examples)
    with torch.no_grad():
        for idx in token_budget_batches([len(e) for e in examples], max_tokens, 0, shuffle=False):
            batch = collate([examples[i] for i in idx], pad_id)
            with autocast() if autocast else contextlib.nullcontext():
                lp = batch_logprobs(model, batch, device, per_sequence).float().cpu().numpy()
            for b, i in enumerate(idx):
                res[i] = lp[b, : len(examples[i])].copy()
    if was_training:
        model.train()
    return res  # type: ignore[return-value]


def step_logprob_stats(examples: list[PolicyExample], logps: list[np.ndarray]) -> dict[str, Any]:
    """Per-step summed action log-prob (over loss tokens) and the mean NLL per target token."""
    per_step: list[tuple[float, float]] = []  # (advantage, summed logp)
    tot, n = 0.0, 0
    for e, lp in zip(examples, logps, strict=False):
        m = e.loss_mask[1:]
        st = e.step[1:]
        v = lp[: len(e) - 1]
        tot += float(-(v[m]).sum())
        n += int(m.sum())
        for s in np.unique(st[m]):
            sel = m & (st == s)
            per_step.append((float(e.advantages[s]), float(v[sel].sum())))
    return {"nll": tot / max(1, n), "per_step": per_step, "tokens": n}


def dpo_pair_stats(examples: list[PolicyExample], pairs: list[tuple[int, int]], lp_before: list[np.ndarray],
                   lp_after: list[np.ndarray], lp_ref: list[np.ndarray], beta: float) -> dict[str, Any]:
    """Trajectory log-probs (summed over the loss tokens) of the pairs before / after training.

    ``dpo_chosen_logp_delta`` / ``dpo_rejected_logp_delta``: mean change of log pi(chosen) / log pi(rejected);
    ``dpo_margin_before/after``: mean of log pi(chosen) - log pi(rejected); ``dpo_accuracy_after``: share of
    pairs whose implicit reward beta * (log-ratio to pi_ref) is higher for the chosen trajectory.
    """
    def tot(lps: list[np.ndarray], i: int) -> float:
        e = examples[i]
        return float(lps[i][: len(e) - 1][e.loss_mask[1:]].sum())

    cb = np.array([tot(lp_before, c) for c, _ in pairs])
    rb = np.array([tot(lp_before, r) for _, r in pairs])
    ca = np.array([tot(lp_after, c) for c, _ in pairs])
    ra = np.array([tot(lp_after, r) for _, r in pairs])
    cref = np.array([tot(lp_ref, c) for c, _ in pairs])
    rref = np.array([tot(lp_ref, r) for _, r in pairs])
    return {
        "dpo_pairs": len(pairs),
        "dpo_chosen_logp_delta": float((ca - cb).mean()),
        "dpo_rejected_logp_delta": float((ra - rb).mean()),
        "dpo_margin_before": float((cb - rb).mean()),
        "dpo_margin_after": float((ca - ra).mean()),
        "dpo_accuracy_after": float((beta * (ca - cref) > beta * (ra - rref)).mean()),
    }


# --------------------------------------------------------------------------- training


def _apply_lora(model, cfg: PolicyConfig):
    from peft import LoraConfig, PeftModel, get_peft_model

    if isinstance(model, PeftModel):
        return model
    targets: Any = cfg.lora_target_modules
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    lc = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                    target_modules=targets, task_type="CAUSAL_LM")
    return get_peft_model(model, lc)


def _fingerprint(cfg_hash: str, data, model: Path, ref) -> str:
    import hashlib

    parts = [cfg_hash, *(str(Path(p).resolve()) for p in data_paths(data)), str(Path(model).resolve()),
             str(Path(ref).resolve()) if ref is not None else ""]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def train_policy(cfg: PolicyConfig, data: str | Path | Sequence[str | Path], model: str | Path, out: str | Path,
                 ref: str | Path | None = None, quiet: bool = False) -> dict[str, Any]:
    """Train a policy with ``cfg.objective`` on table ``data`` (or several, stacked) from ``model``; write ``out``.

    -> metrics. ``ref``: the frozen reference of bppo's KL and dpo (default: the starting policy).
    """
    import torch

    from qevolve_cli.algos import awr_loss, bppo_loss, dpo_nll_loss, sequence_logratio, token_nll
    from qevolve_cli.atomic import atomic_dir, partial_dir, write_json
    from qevolve_cli.config import dump_yaml
    from qevolve_cli.training import (
        Hooks,
        TrainArgs,
        group_steps,
        make_backend,
        per_sequence_layout,
        remove_checkpoint,
        token_budget_batches,
        train_loop,
    )

    t_start = time.perf_counter()
    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    out = Path(out)
    model_path = check_model_dir(model)
    if ref is not None:
        check_model_dir(ref, "--ref")
    df, table_info = load_policy_table(cfg, data)
    data_str = str(data) if isinstance(data, (str, Path)) else ", ".join(map(str, data))
    work = partial_dir(out)

    args = TrainArgs(
        epochs=cfg.epochs, lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_ratio=cfg.warmup_ratio,
        lr_scheduler=cfg.lr_scheduler, max_grad_norm=cfg.max_grad_norm, seed=cfg.seed,
        precision=cfg.precision, device=cfg.device, log_path=work / "metrics.jsonl", ckpt_dir=work,
        deepspeed=Path(cfg.deepspeed) if cfg.deepspeed else None, quiet=quiet, desc=f"policy {cfg.objective}",
        max_steps=cfg.max_steps, checkpoint_every_steps=cfg.checkpoint_every_steps,
        # how often checkpoints are written does not change the run: a resume may change it
        fingerprint=_fingerprint(cfg.replace(checkpoint_every_steps=0).hash(), data, model_path, ref),
    )
    backend = make_backend(args, cfg.grad_accum_steps)
    device = backend.device
    per_seq = per_sequence_layout(cfg.batch_layout, device)  # no padding computed (docs/performance.md)
    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(model_path, what="--model", fill_pad=True)
    policy = load_causal_lm(model_path, trainable_lora=cfg.lora)
    init_dtype = getattr(policy.config, "dtype", None)
    if cfg.lora:
        policy = _apply_lora(policy, cfg)
    if cfg.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        if cfg.lora:
            policy.enable_input_require_grads()
    policy.to(device)

    examples = build_examples(df, tok, cfg.max_length, with_advantage=cfg.objective in ("bppo", "awr"),
                              path=data_str)
    examples = [e for e in examples if e.n_targets > 0]
    if not examples:
        raise TableError(data_str, "action", "no action tokens left to train on after truncation")
    # dpo: the training units are (chosen, rejected) pairs of example indices
    pairs: list[tuple[int, int]] = []
    if cfg.objective == "dpo":
        pos = {e.traj_id: i for i, e in enumerate(examples)}
        pairs = [(pos[c], pos[r]) for c, r in table_info["pairs"] if c in pos and r in pos]
        if not pairs:
            raise TableError(data_str, "action", "no preference pair left with action tokens after truncation")
    if cfg.normalize_advantage and cfg.objective in ("bppo", "awr"):
        allv = np.concatenate([e.advantages for e in examples])
        mu, sd = float(allv.mean()), float(allv.std()) + 1e-8
        for e in examples:
            e.advantages = ((e.advantages - mu) / sd).astype(np.float32)
    pad_id = pad_id_of(tok)

    # ---- reference and old-policy log-probs (precomputed; only the policy stays loaded)
    state: dict[str, list[np.ndarray] | None] = {"old": None, "ref": None}
    lp_init = compute_logprobs(policy, examples, pad_id, cfg.micro_batch_tokens, device, backend.autocast, per_seq)
    if cfg.objective in ("bppo", "dpo"):
        if cfg.objective == "bppo":
            state["old"] = lp_init
        if ref is not None:
            ref_model = load_causal_lm(ref, what="--ref").to(device)
            state["ref"] = compute_logprobs(ref_model, examples, pad_id, cfg.micro_batch_tokens, device,
                                            backend.autocast, per_seq)
            del ref_model
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        else:
            state["ref"] = lp_init
    before = step_logprob_stats(examples, lp_init)

    def make_steps(epoch: int) -> list[list[list[int]]]:
        if cfg.objective == "dpo":  # a pair is two sequences padded together
            lens = [2 * max(len(examples[c]), len(examples[r])) for c, r in pairs]
            cap = max(1, cfg.micro_batch_size // 2) if cfg.micro_batch_size else 0
            mbs = token_budget_batches(lens, cfg.micro_batch_tokens, cap, shuffle=True,
                                       seed=cfg.seed * 1000003 + epoch)
            return group_steps(mbs, cfg.grad_accum_steps)
        mbs = token_budget_batches([len(e) for e in examples], cfg.micro_batch_tokens, cfg.micro_batch_size,
                                   shuffle=True, seed=cfg.seed * 1000003 + epoch)
        return group_steps(mbs, cfg.grad_accum_steps)

    def dpo_loss_fn(m, pidx: list[int], ctx: dict):
        idx = [pairs[p][0] for p in pidx] + [pairs[p][1] for p in pidx]
        batch = collate([examples[i] for i in idx], pad_id, cfg.thought_weight, None,
                        [state["ref"][i] for i in idx])
        lp = batch_logprobs(m, batch, ctx["device"], per_seq).float()
        mask = batch["mask"].to(lp.device)
        ratio = sequence_logratio(lp, batch["logp_ref"].to(lp.device), mask)
        n = len(pidx)
        return dpo_nll_loss(ratio[:n], ratio[n:], lp[:n], mask[:n], cfg.dpo_beta, cfg.dpo_nll_weight)

    def loss_fn(m, idx: list[int], ctx: dict):
        if cfg.objective == "dpo":
            return dpo_loss_fn(m, idx, ctx)
        exs = [examples[i] for i in idx]
        old = [state["old"][i] for i in idx] if state["old"] is not None else None
        refl = [state["ref"][i] for i in idx] if state["ref"] is not None else None
        batch = collate(exs, pad_id, cfg.thought_weight, old, refl)
        lp = batch_logprobs(m, batch, ctx["device"], per_seq).float()
        mask = batch["mask"].to(lp.device)
        tw = batch["token_weights"].to(lp.device)
        if cfg.objective in ("bc", "rft"):
            loss = token_nll(lp, mask)
            return loss, {"nll": float(loss.detach())}
        adv = batch["adv"].to(lp.device)
        if cfg.objective == "awr":
            return awr_loss(lp, adv, mask, tw, cfg.awr_beta, cfg.awr_max_weight)
        return bppo_loss(lp, batch["logp_old"].to(lp.device), adv, mask, tw, cfg.eps_low, cfg.eps_high,
                         batch["logp_ref"].to(lp.device), cfg.kl_coef, cfg.kl_estimator)

    def on_step(step: int, m) -> None:
        if cfg.objective == "bppo" and cfg.old_refresh_steps and step % cfg.old_refresh_steps == 0:
            state["old"] = compute_logprobs(m, examples, pad_id, cfg.micro_batch_tokens, device, backend.autocast,
                                            per_seq)

    def flat(key: str) -> dict[str, torch.Tensor]:
        v = state[key]
        return {} if v is None else {f"logp_{key}": torch.from_numpy(np.concatenate(v).astype(np.float32))}

    def load_extra(extra: dict[str, torch.Tensor]) -> None:
        lens = np.cumsum([0] + [len(e) for e in examples])
        for key in ("old", "ref"):
            t = extra.get(f"logp_{key}")
            if t is not None:
                a = t.numpy()
                if a.shape[0] != lens[-1]:
                    raise QevolveError(f"{work}: checkpoint does not match the data (delete it to start over)")
                state[key] = [a[lens[i] : lens[i + 1]].copy() for i in range(len(examples))]

    hooks = Hooks(on_step=on_step, extra_state=lambda: {**flat("old"), **flat("ref")}, load_extra_state=load_extra)
    result = train_loop(
        policy, make_steps, loss_fn, args,
        micro_weight=(lambda idx: len(idx)) if cfg.objective == "dpo" else
        (lambda idx: sum(examples[i].n_targets for i in idx)),
        micro_tokens=(lambda idx: sum(len(examples[pairs[p][0]]) + len(examples[pairs[p][1]]) for p in idx))
        if cfg.objective == "dpo" else (lambda idx: sum(len(examples[i]) for i in idx)),
        hooks=hooks, backend=backend,
    )
    unwrapped = backend.unwrap(policy)
    lp_final = compute_logprobs(unwrapped, examples, pad_id, cfg.micro_batch_tokens, device, backend.autocast,
                                per_seq)
    after = step_logprob_stats(examples, lp_final)

    def delta(sign: int) -> float | None:
        d = [a2[1] - a1[1] for a1, a2 in zip(before["per_step"], after["per_step"], strict=False) if np.sign(a1[0]) == sign]
        return float(np.mean(d)) if d else None

    metrics: dict[str, Any] = {
        "objective": cfg.objective,
        "trajectories": len(examples),
        "steps": int(sum(e.advantages.size for e in examples)),
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
        "truncated_trajectories": sum(1 for e in examples if e.dropped_turns or e.cut),
        "final_loss": result.last_metrics.get("loss"),
        "device": device,
        "data": data_str,
        "model": str(model_path),
        "ref": str(ref) if ref is not None else None,
        "out": str(out),
    }

    if cfg.objective == "rft":
        metrics.update({f"rft_{k}": v for k, v in table_info.items()})
    if cfg.objective == "dpo":
        metrics.update({f"dpo_{k}": v for k, v in table_info.items() if k != "pairs"})
        metrics.update(dpo_pair_stats(examples, pairs, lp_init, lp_final, state["ref"], cfg.dpo_beta))

    # full weights: a collective under DeepSpeed ZeRO-3 (gathered on rank 0), so every rank calls it
    state = backend.full_state_dict(unwrapped)
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
    return metrics


def save_model(model, tok, out_dir: Path, cfg: PolicyConfig, init_dtype, state: dict) -> None:
    """Save full weights (safetensors) or the LoRA adapter, plus tokenizer files.

    ``state``: the model's full state dict (gathered from the ranks under DeepSpeed ZeRO-3).
    """
    import torch

    if cfg.lora:
        model.save_pretrained(str(out_dir), safe_serialization=True, state_dict=state)
    else:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(cfg.save_dtype)
        if dtype is None:
            dtype = init_dtype if isinstance(init_dtype, torch.dtype) else torch.float32
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        model.save_pretrained(str(out_dir), state_dict=state, safe_serialization=True)
        model.config.dtype = dtype
        model.config.save_pretrained(str(out_dir))
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
