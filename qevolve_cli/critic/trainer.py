"""Training loop of the weighted IQL critic (paper Algorithm "Critic optimization").

Read top to bottom:

1. :func:`train_critic` loads the labelled table, tokenises every trajectory
   once (:mod:`qevolve_cli.critic.data`), builds the critic
   (:class:`~qevolve_cli.critic.model.CriticModel`) and runs the epochs,
   resuming from ``OUT.partial/`` when an earlier run was interrupted; at the
   end it writes ``OUT/`` atomically (adapters, heads, config.yaml,
   metrics.jsonl, tokenizer).
2. :class:`CriticTrainer.run_epoch` shuffles the trajectories into batches;
   for batch n it samples K steps per trajectory and makes ONE update:
   a Q update when n is odd, a V update when n is even (``schedule:
   alternate``; ``both`` does a Q then a V update on every batch). Every
   ``ema_every`` updates the delayed Q adapter and heads follow by EMA.
3. :meth:`CriticTrainer.q_update`: V(s') from the value adapter (no grad),
   y = r + gamma (1 - d) V(s'), Double-Q weighted TD regression of
   (phi_q, g_q1, g_q2).
   :meth:`CriticTrainer.v_update`: min(Qbar1, Qbar2) from the q_target
   adapter and target heads (no grad), weighted expectile regression of
   (phi_v, g_v).

Each update runs exactly two forwards of the backbone per batch row (one per
adapter), whatever the number of steps in the row. Under ``schedule: both`` a
batch runs three, not four: the Q update's V(s') and the V update's V(s) come
from ONE forward of the value adapter (with gradients; the V update backpropagates
it after the Q step), which is exact because the Q step does not change the
value adapter (:meth:`CriticTrainer.value_states`).

Beside it: ``optim.py`` (one optimiser and LR schedule per branch, the
DeepSpeed backend), ``heldout.py`` (held-out split and diagnostics).

This is a loop of its own, not :func:`qevolve_cli.training.train_loop`: two
optimisers updated in turn, each with its own warm-up and schedule, one engine
per branch under DeepSpeed, no gradient accumulation (docs/architecture.md,
"The training loop and the critic"). It shares the LR schedule, the checkpoint
layout and commit and the DeepSpeed start-up with the policy's loop.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qevolve_cli.algos import critic_q_loss, critic_v_loss, td_target
from qevolve_cli.atomic import atomic_dir, partial_dir
from qevolve_cli.config import dump_yaml
from qevolve_cli.critic.config import CriticConfig
from qevolve_cli.critic.data import TrajItem, attach_targets, build_items, collate, load_table, sample_steps
from qevolve_cli.critic.heldout import evaluate_items, split_heldout
from qevolve_cli.critic.model import CriticModel, time_column
from qevolve_cli.critic.optim import BranchOptimizer, deepspeed_backend
from qevolve_cli.errors import QevolveError
from qevolve_cli.tokenizer import load_tokenizer, pad_id_of
from qevolve_cli.training import (
    POINTER,
    check_checkpoint_backend,
    checkpoint_meta,
    checkpoint_tag,
    commit_checkpoint,
    fsync_tree,
    kill_after_checkpoint,
    read_checkpoint_pointer,
    rng_state,
    set_rng_state,
    start_checkpoint,
)

ProgressFn = Callable[[int, str], None]  # (batches advanced, info text)


class CriticTrainer:
    """Holds the critic, its two optimisers and the update counter n."""

    def __init__(self, critic: CriticModel, cfg: CriticConfig, items: list[TrajItem], pad_id: int,
                 per_step: bool = False, ds: Any = None):
        self.critic, self.cfg, self.items, self.pad_id = critic, cfg, items, pad_id
        self.ds = ds  # a training.DeepSpeedBackend (data parallel over its ranks) or None
        self.rank, self.world = (ds.rank, ds.world_size) if ds is not None else (0, 1)
        self.loss_scale = 1.0  # world * (this rank's share of the batch loss); see run_epoch
        self.per_step = per_step  # naive layout (one row per step): the benchmark's baseline
        self.device = next(critic.heads.parameters()).device
        n_batches = math.ceil(len(items) / cfg.batch_size) * cfg.epochs
        q_total = n_batches if cfg.schedule == "both" else (n_batches + 1) // 2
        v_total = n_batches if cfg.schedule == "both" else n_batches // 2
        critic.enable_training()
        self.q = BranchOptimizer(*critic.q_parameters(), cfg, q_total, ds, critic)
        self.v = BranchOptimizer(*critic.value_parameters(), cfg, v_total, ds, critic)
        self.n = 0  # optimisation steps so far (Q and V together)

    # ---------------------------------------------------------------- updates
    def value_states(self, b) -> tuple[torch.Tensor, torch.Tensor]:
        """ONE forward of the value adapter, with gradients -> (pooled states of s (B, K, d), still in the
        graph; V(s') (B, K), detached). For ``schedule: both``: the Q update takes V(s') from it and the V
        update, after the Q step, backpropagates V(s) through it. Both equal what their own forwards
        would give, since the Q step and the EMA change only the Q and q_target adapters and heads.
        (With LoRA dropout on, the two read one dropout draw instead of two.)"""
        c = self.critic
        h_s, h_next = c.pooled("value", b.input_ids, b.attention_mask, b.pos_s, b.pos_next)
        with torch.no_grad():
            v_next = c.head("v", h_next.detach(), c.next_time(b.t))
        return h_s, v_next

    def q_update(self, b, v_next: torch.Tensor | None = None) -> dict[str, float]:
        """``v_next``: V(s') from :meth:`value_states`; None runs the value forward here (no grad)."""
        c, cfg = self.critic, self.cfg
        if v_next is None:
            with torch.no_grad():
                (h_next,) = c.pooled("value", b.input_ids, b.attention_mask, b.pos_next)
                v_next = c.head("v", h_next, c.next_time(b.t))
        (h_sa,) = c.pooled("q", b.input_ids, b.attention_mask, b.pos_sa)
        q1, q2 = c.head("q1", h_sa, b.t), c.head("q2", h_sa, b.t)
        y = td_target(b.reward, b.done, v_next, cfg.gamma)
        loss = critic_q_loss(q1, q2, y, b.weight, b.step_mask, cfg.reduction)
        self.q.step(loss * self.loss_scale)
        m = b.step_mask
        with torch.no_grad():
            td = 0.5 * ((q1 - y).abs() + (q2 - y).abs())
            return {"loss_q": float(loss.detach()), "mean_q": float(0.5 * (q1 + q2)[m].mean()),
                    "td_error": float(td[m].mean()), "mean_y": float(y[m].mean())}

    def v_update(self, b, h_s: torch.Tensor | None = None) -> dict[str, float]:
        """``h_s``: the value adapter's pooled states of s from :meth:`value_states` (in the graph); None runs
        the value forward here."""
        c, cfg = self.critic, self.cfg
        with torch.no_grad():
            (h_sa,) = c.pooled("q_target", b.input_ids, b.attention_mask, b.pos_sa)
            qt1, qt2 = c.head("q1_target", h_sa, b.t), c.head("q2_target", h_sa, b.t)
        if h_s is None:
            (h_s,) = c.pooled("value", b.input_ids, b.attention_mask, b.pos_s)
        else:
            c.activate("value")  # the backward below may recompute the value forward (gradient checkpointing)
        v = c.head("v", h_s, b.t)
        loss = critic_v_loss(v, qt1, qt2, b.weight, b.step_mask, cfg.expectile, cfg.reduction)
        self.v.step(loss * self.loss_scale)
        m = b.step_mask
        return {"loss_v": float(loss.detach()), "mean_v": float(v.detach()[m].mean()),
                "mean_qbar": float(torch.minimum(qt1, qt2)[m].mean())}

    def _after_update(self) -> None:
        self.n += 1
        if self.n % self.cfg.ema_every == 0:
            self.critic.ema_update(self.cfg.ema_lambda)

    # ---------------------------------------------------------------- epoch
    def run_epoch(self, epoch: int, progress: ProgressFn | None = None, resume: dict[str, Any] | None = None,
                  after_batch: Callable[[int, int, Callable[[], dict[str, Any]]], None] | None = None) -> dict[str, Any]:
        """One pass over the trajectories -> the epoch's metrics.

        ``resume``: the ``epoch_state`` of a mid-epoch checkpoint (batches done, the sampling RNG's state,
        the running sums): the epoch continues at the next batch with the same order and draws.
        ``after_batch(batches_done, updates_before, state)``: called after every batch but the epoch's last
        (mid-epoch checkpoints); ``state()`` is the epoch state to save.
        """
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, epoch])
        order = rng.permutation(len(self.items))
        sums: dict[str, list[float]] = {}
        counts = {"q_updates": 0, "v_updates": 0, "forward_calls": 0, "forward_rows": 0, "transitions": 0}
        first, secs0 = 0, 0.0
        if resume is not None:
            rng.bit_generator.state = resume["rng"]
            sums = {k: list(v) for k, v in resume["sums"].items()}
            counts = dict(resume["counts"])
            first, secs0 = int(resume["batch"]), float(resume["seconds"])
        n_batches = math.ceil(len(order) / cfg.batch_size)
        t0 = time.perf_counter()
        for bi in range(first, n_batches):
            start = bi * cfg.batch_size
            n_before = self.n
            chosen = order[start:start + cfg.batch_size]
            picks = [(int(i), sample_steps(self.items[i], cfg.steps_per_traj, rng)) for i in chosen]
            share, step_share = 1.0, 1.0
            batch_steps = sum(len(idx) for _, idx in picks)
            if self.world > 1:
                # every rank drew the same picks (same rng); rank r trains on picks r, r + W, ...
                mine = picks[self.rank :: self.world]
                share, step_share = self._share(picks, mine)
                picks = mine or picks[:1]  # a rank without trajectories still joins the collectives (scale 0)
                self.loss_scale = self.world * share
            b = collate(self.items, picks, self.pad_id, self.device, per_step=self.per_step)
            kinds = ["q", "v"] if cfg.schedule == "both" else ["q" if self.n % 2 == 0 else "v"]
            h_s = v_next = None
            forwards = 2
            if len(kinds) == 2 and cfg.share_value_forward:
                h_s, v_next = self.value_states(b)
                counts["forward_calls"] += 1
                counts["forward_rows"] += b.input_ids.shape[0]
                forwards = 1  # each update adds its other adapter's forward
            for kind in kinds:
                stats = self.q_update(b, v_next) if kind == "q" else self.v_update(b, h_s)
                if self.world > 1:
                    stats = self._reduce_stats(stats, share, step_share)
                counts[f"{kind}_updates"] += 1
                counts["forward_calls"] += forwards
                counts["forward_rows"] += forwards * b.input_ids.shape[0]
                counts["transitions"] += batch_steps
                for k, v in stats.items():
                    sums.setdefault(k, []).append(v)
                self._after_update()
            if progress is not None:
                last = {k: v[-1] for k, v in sums.items() if k in ("loss_q", "loss_v")}
                progress(1, f"epoch {epoch + 1} " + " ".join(f"{k}={v:.4f}" for k, v in last.items()))
            if after_batch is not None and bi + 1 < n_batches:
                after_batch(bi + 1, n_before, lambda bi=bi: {
                    "batch": bi + 1, "rng": rng.bit_generator.state, "sums": sums, "counts": counts,
                    "seconds": secs0 + time.perf_counter() - t0})
        secs = secs0 + time.perf_counter() - t0
        out: dict[str, Any] = {"epoch": epoch + 1}
        for k in ("loss_q", "loss_v", "mean_q", "mean_v", "mean_qbar", "mean_y", "td_error"):
            out[k] = float(np.mean(sums[k])) if k in sums else None
        out.update(counts)
        out["seconds"] = round(secs, 4)
        out["transitions_per_s"] = counts["transitions"] / secs if secs > 0 else None
        out["lr_q"] = self.q.opt.param_groups[0]["lr"]
        out["lr_v"] = self.v.opt.param_groups[0]["lr"]
        return out

    def _share(self, picks: list, mine: list) -> tuple[float, float]:
        """(this rank's share of the batch loss, its share of the batch's sampled steps).

        The loss of the local rows times ``world * share`` makes DeepSpeed's gradient average equal
        to the gradient of the whole batch's loss for every reduction (traj_sum: mean over rows;
        sum; mean over steps).
        """
        def rows_steps(ps: list) -> tuple[int, int]:
            n = [len(idx) for _, idx in ps]
            return (sum(n) if self.per_step else sum(1 for k in n if k)), sum(n)

        rows, steps = rows_steps(picks)
        my_rows, my_steps = rows_steps(mine)
        step_share = my_steps / max(steps, 1)
        if self.cfg.reduction == "traj_sum":
            return my_rows / max(rows, 1), step_share
        if self.cfg.reduction == "mean":
            return step_share, step_share
        return (1.0 if mine else 0.0), step_share

    def _reduce_stats(self, stats: dict[str, float], share: float, step_share: float) -> dict[str, float]:
        """Batch-level numbers from the ranks' local ones (losses by loss share, means by step share)."""
        keys = sorted(stats)
        w = [share if k.startswith("loss") else step_share for k in keys]
        red = self.ds.all_reduce_sum([stats[k] * wk for k, wk in zip(keys, w, strict=True)])
        return dict(zip(keys, red, strict=True))

    # ---------------------------------------------------------------- held-out evaluation
    def score_items(self, items: list[TrajItem], n_rows: int, batch_size: int | None = None) -> dict[str, np.ndarray]:
        """V(s), V(s'), Q1, Q2 (online) and min(Qbar1, Qbar2) (delayed) at every step of ``items``.

        Arrays of length ``n_rows`` indexed like the source frame (rows of other items stay 0).
        Three forwards per trajectory (value, q, q_target), no gradients, all steps scored.
        """
        from qevolve_cli.critic.score import SCORES, score_items

        return score_items(self.critic, items, n_rows, self.pad_id, self.device,
                           batch_size or max(self.cfg.batch_size, 8), SCORES)

    def adapter_state(self) -> dict[str, Any]:
        """A copy of the trainable weights (adapters and heads): checkpoints and the best epoch of early stopping."""
        return {"adapters": {n: p.detach().cpu().clone() for n, p in self.critic.backbone.named_parameters()
                             if "lora_" in n},
                "heads": {k: v.detach().cpu().clone() for k, v in self.critic.heads.state_dict().items()}}

    def _copy_adapters(self, adapters: dict[str, torch.Tensor]) -> None:
        """Copy saved backbone (LoRA) tensors into the live parameters; an unknown name is an error."""
        params = dict(self.critic.backbone.named_parameters())
        with torch.no_grad():
            for n, t in adapters.items():
                if n not in params:
                    raise QevolveError(f"checkpoint: unknown adapter tensor {n}")
                params[n].copy_(t)

    def load_adapter_state(self, s: dict[str, Any]) -> None:
        self._copy_adapters(s["adapters"])
        self.critic.heads.load_state_dict(s["heads"])

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {**self.adapter_state(), "q": self.q.state_dict(), "v": self.v.state_dict(), "n": self.n}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.load_adapter_state(s)
        self.q.load_state_dict(s["q"])
        self.v.load_state_dict(s["v"])
        self.n = int(s["n"])

    def target_state(self) -> dict[str, Any]:
        """A copy of the EMA target (the q_target adapter and the q1/q2 target heads): trained by no optimiser,
        so no engine checkpoint holds it."""
        heads = {f"{h}.{k}": v.detach().cpu().clone() for h in ("q1_target", "q2_target")
                 for k, v in self.critic.heads[h].state_dict().items()}
        return {"adapters": {n: p.detach().cpu().clone() for n, p in self.critic.backbone.named_parameters()
                             if ".q_target." in n}, "heads": heads}

    def load_target_state(self, s: dict[str, Any]) -> None:
        self._copy_adapters(s["adapters"])
        res = self.critic.heads.load_state_dict(s["heads"], strict=False)
        if res.unexpected_keys:
            raise QevolveError(f"checkpoint: unknown head tensor {res.unexpected_keys[0]}")

    def save_engines(self, tag_dir: Path) -> None:
        """DeepSpeed: each branch's engine writes its own checkpoint (``engine.save_checkpoint``, a collective:
        every rank writes its ZeRO partition of that branch's Adam state) into ``tag_dir/q`` and ``tag_dir/v``;
        the Q engine's carries the EMA target, the update counter and the two LR-schedule positions."""
        client = {"ema_target": self.target_state(), "n": self.n, "q_step": self.q.step_i, "v_step": self.v.step_i}
        for name, g, cs in (("q", self.q, client), ("v", self.v, {})):
            g.engine.save_checkpoint(str(tag_dir), tag=name, client_state=cs, save_latest=False,
                                     exclude_frozen_parameters=True)

    def load_engines(self, tag_dir: Path) -> None:
        client: dict[str, Any] = {}
        for name, g in (("q", self.q), ("v", self.v)):
            path, cs = g.engine.load_checkpoint(str(tag_dir), tag=name, load_module_strict=False,
                                                load_optimizer_states=True, load_lr_scheduler_states=False)
            if path is None:
                raise QevolveError(f"{tag_dir}: DeepSpeed found no checkpoint of the {name} engine; delete it to start over")
            if name == "q":
                client = cs
        self.load_target_state(client["ema_target"])
        self.n = int(client["n"])
        for g, key in ((self.q, "q_step"), (self.v, "v_step")):
            g.step_i = int(client[key])
            g.set_lr()


def _read_progress(partial: Path) -> dict[str, Any] | None:
    """The committed checkpoint's pointer (None: none); a broken one (unreadable, half-written, a
    listed file missing) is answered with one line (:func:`qevolve_cli.training.read_checkpoint_pointer`)."""
    return read_checkpoint_pointer(partial, POINTER, needs=("epoch", "metrics"))


def train_critic(cfg: CriticConfig, data: Any, model: str | Path, out: str | Path, *,
                 tokenizer: Any = None, progress: Callable[[int], ProgressFn] | None = None,
                 resume: bool = True) -> dict[str, Any]:
    """Train the weighted IQL critic on a labelled table; write ``out/``; return a summary with per-epoch metrics.

    ``data``: path of a labelled table (``qevolve label``) or a validated frame.
    ``model``: base model directory (the frozen backbone; its tokenizer renders the transcripts).
    ``progress``: optional factory ``total_batches -> callback(advance, info)``.
    An interrupted run leaves ``out.partial/`` (a checkpoint after every epoch and, with
    ``checkpoint_every_steps``, every N updates; under DeepSpeed the engines' own checkpoints) and
    resumes from it when called again with the same configuration, data and launch: mid-epoch at the
    next batch, with the same batch order and step draws.
    """
    if cfg.kind == "features":
        from qevolve_cli.critic.feature_critic import train_feature_critic

        return train_feature_critic(cfg, data, model, out, tokenizer=tokenizer, progress=progress, resume=resume)
    out = Path(out)
    t_start = time.perf_counter()
    df, source = load_table(data)
    tok = tokenizer if tokenizer is not None else load_tokenizer(model, require_chat_template=True)
    items = build_items(df, tok, cfg.max_length, source, time_column=time_column(cfg.time_input),
                        window_context=cfg.window_context)
    attach_targets(items, df, cfg, source)
    skipped_steps = int(sum((~it.usable).sum() for it in items))
    items = [it for it in items if it.usable.any()]
    if not items:
        raise QevolveError(f"{source or 'data'}: no trajectory fits max_length={cfg.max_length}")
    items, heldout = split_heldout(items, df, cfg.heldout_fraction)
    ds = deepspeed_backend(cfg)
    critic = CriticModel.create(model, cfg, device=torch.device(ds.device) if ds is not None else None)
    trainer = CriticTrainer(critic, cfg, items, pad_id_of(tok), ds=ds)
    main = ds is None or ds.is_main

    # how often checkpoints are written does not change the run: a resume may change it
    fingerprint = {"config": cfg.hash(), "model": str(Path(model).resolve()), "n_items": len(items),
                   "n_steps": int(sum(it.n_steps for it in items)),
                   "traj": sorted(it.traj_id for it in items)[:50]}
    partial = partial_dir(out)
    metrics: list[dict[str, Any]] = []
    start_epoch = 0
    # early stopping on the held-out Bellman error (early_stop_metric)
    stop = {"best": None, "best_epoch": 0, "bad": 0, "stopped_at": None}
    best_state: dict[str, Any] | None = None
    epoch_resume: dict[str, Any] | None = None  # the epoch state of a mid-epoch checkpoint
    info = _read_progress(partial) if resume else None
    if info is not None and info.get("fingerprint") == fingerprint:
        check_checkpoint_backend(partial, info, ds)
        tag_dir = partial / info["tag"]
        if ds is None:
            trainer.load_state_dict(torch.load(tag_dir / "state.pt", map_location="cpu", weights_only=True))
        else:
            trainer.load_engines(tag_dir)
        rng_file = tag_dir / f"rng_rank{trainer.rank}.pt"
        set_rng_state(torch.load(rng_file if rng_file.is_file() else tag_dir / "rng_rank0.pt", weights_only=True))
        metrics = info["metrics"]
        start_epoch = int(info["epoch"])
        epoch_resume = info.get("epoch_state")
        stop = info.get("early_stop", stop)
        if (tag_dir / "best.pt").is_file():
            best_state = torch.load(tag_dir / "best.pt", map_location="cpu", weights_only=True)
    elif resume and main and partial.exists():  # another configuration or data (or an unreadable leftover): start over
        shutil.rmtree(partial, ignore_errors=True)
    if ds is not None:
        ds.barrier()  # every rank has read the checkpoint before anything is removed or written
    resumed_step = trainer.n

    def save_checkpoint(progress_info: dict[str, Any]) -> None:
        """Checkpoint ``trainer.n`` (every rank calls it): see :func:`qevolve_cli.training.write_checkpoint`
        for the layout and the commit."""
        tag = checkpoint_tag(trainer.n)
        tag_dir = start_checkpoint(partial, tag, main)
        if ds is not None:
            ds.barrier()
            trainer.save_engines(tag_dir)
        else:
            torch.save(trainer.state_dict(), tag_dir / "state.pt")
        torch.save(rng_state(), tag_dir / f"rng_rank{trainer.rank}.pt")
        if main and best_state is not None:
            torch.save(best_state, tag_dir / "best.pt")
        fsync_tree(tag_dir)
        if ds is not None:
            ds.barrier()
        if main:
            commit_checkpoint(partial, POINTER, {"tag": tag, "fingerprint": fingerprint, "metrics": metrics,
                                                         "early_stop": stop, **progress_info, **checkpoint_meta(ds)})
        if ds is not None:
            ds.barrier()
        kill_after_checkpoint(trainer.n, partial)

    use_stop = cfg.early_stop_patience > 0 and bool(heldout)
    n_batches = math.ceil(len(items) / cfg.batch_size)
    done_batches = int(epoch_resume["batch"]) if epoch_resume else 0
    cb = progress((cfg.epochs - start_epoch) * n_batches - done_batches) if (progress and main) else None
    every = cfg.checkpoint_every_steps if cfg.checkpoint else 0
    for epoch in range(start_epoch, cfg.epochs):
        if stop["stopped_at"] is not None:
            break

        def mid_epoch(batches: int, n_before: int, state: Callable[[], dict[str, Any]], epoch: int = epoch) -> None:
            if trainer.n // every > n_before // every:  # this batch reached a multiple of checkpoint_every_steps
                save_checkpoint({"epoch": epoch, "epochs_done": epoch, "epoch_state": state()})

        m = trainer.run_epoch(epoch, cb, resume=epoch_resume if epoch == start_epoch else None,
                              after_batch=mid_epoch if every else None)
        if heldout:
            m["heldout"] = evaluate_items(trainer, heldout, df, cfg)
            b = m["heldout"].get(cfg.early_stop_metric)
            if ds is not None and b is not None:  # every rank takes the same early-stopping decision
                b = ds.all_reduce_sum([b])[0] / ds.world_size
            if b is not None:
                best = stop["best"]
                if best is None or b < best * (1.0 - cfg.early_stop_min_delta):
                    stop.update(best=b, best_epoch=epoch + 1, bad=0)
                    if use_stop and cfg.restore_best:
                        best_state = trainer.adapter_state()
                else:
                    stop["bad"] += 1
                if use_stop and stop["bad"] >= cfg.early_stop_patience:
                    stop["stopped_at"] = epoch + 1
        metrics.append(m)
        # after the last epoch too: a run killed in the final diagnostics below resumes without training again
        if cfg.checkpoint:
            save_checkpoint({"epoch": epoch + 1, "epochs_done": epoch + 1, "epoch_state": None})
    restored = None
    if use_stop and cfg.restore_best and best_state is not None and stop["best_epoch"] != len(metrics):
        trainer.load_adapter_state(best_state)
        restored = stop["best_epoch"]
    # final diagnostics of the critic that is written: held-out when there is a held-out slice, else train data
    if heldout:
        diagnostics = {"on": "heldout", "trajectories_held_out": len(heldout),
                       **evaluate_items(trainer, heldout, df, cfg, full=True)}
    else:
        diagnostics = {"on": "train", **evaluate_items(trainer, items, df, cfg, full=True)}
    from qevolve_cli.critic.diagnostics import caveats, verdict, warning_line

    if cfg.fit_ladder:  # the critic on its own training steps (docs/critic.md, "The fit ladder")
        from qevolve_cli.critic.data import fit_reward, step_weights_for
        from qevolve_cli.critic.ladder import fit_ladder

        cols = trainer.score_items(items, df.height)
        reward = fit_reward(df, cfg)
        train_rows = np.unique(np.concatenate([it.rows[it.usable] for it in items]))
        diagnostics["fit_ladder"] = fit_ladder(df, cols, train_rows, reward, step_weights_for(df, cfg), cfg,
                                               source=source)
    diagnostics["problems"] = verdict(diagnostics)
    diagnostics["caveats"] = caveats(diagnostics)  # what the slice was too small to judge
    warning = warning_line(diagnostics, "held-out" if heldout else "training data, nothing held out")

    summary = {
        "out": str(out), "base_model": str(model), "trajectories": len(items),
        "heldout_trajectories": len(heldout),
        "steps": int(sum(it.usable.sum() for it in items)), "skipped_steps": skipped_steps,
        "epochs": cfg.epochs, "epochs_run": len(metrics), "resumed_from_epoch": start_epoch,
        "resumed_from_step": resumed_step,
        "early_stopped_at": stop["stopped_at"], "best_epoch": stop["best_epoch"] if heldout else None,
        "restored_epoch": restored,
        "final": metrics[-1] if metrics else None,
        "diagnostics": diagnostics, "warning": warning,
        "seconds": round(time.perf_counter() - t_start, 3),
    }
    if ds is not None:
        summary["deepspeed"] = {"config": str(cfg.deepspeed), "stage": ds.stage, "world_size": ds.world_size}
    if main:  # ZeRO-2 keeps full parameters on every rank: rank 0 writes them
        with atomic_dir(out) as tmp:
            critic.save(tmp, tok, extra_meta={"trained_on": str(source) if source else None,
                                              "gamma": cfg.gamma, "expectile": cfg.expectile})
            dump_yaml(cfg, tmp / "config.yaml")
            (tmp / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
            (tmp / "diagnostics.json").write_text(json.dumps(diagnostics, indent=1) + "\n")
            (tmp / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        shutil.rmtree(partial, ignore_errors=True)
    if ds is not None:
        ds.barrier()
    summary["metrics"] = metrics
    return summary
