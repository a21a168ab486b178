"""The training loop (:func:`train_loop`): one loop, the loss passed in.

What it does:

* AdamW over the parameters with ``requires_grad`` (LoRA adapters or the full model), weight decay
  ``args.weight_decay``, betas ``args.betas``;
* the LR schedule :func:`lr_lambda`: linear warm-up over ``ceil(warmup_ratio * total)`` optimiser
  steps, then cosine (or ``linear`` / ``constant``) down to ``min_lr_ratio``;
* gradient accumulation: an optimiser step is a list of micro-batches; each micro-batch loss (a
  *mean* over its own items) is scaled by ``micro_weight(micro) / sum(micro_weight over the step)``,
  so the step's gradient is the gradient of the weighted mean over the whole step however the items
  were split (token-budget batching, :func:`qevolve_cli.training.batching.token_budget_batches`);
* gradient-norm clipping (``max_grad_norm``; 0 = off);
* precision: bf16 autocast (fp32 master weights) on CUDA and on CPUs with native bf16
  (``avx512_bf16`` / AMX), fp32 elsewhere, unless ``precision`` says otherwise
  (:mod:`qevolve_cli.precision`; DeepSpeed on CPU stays fp32 under ``auto``,
  :func:`qevolve_cli.training.backends.resolve_precision`);
* seeding of python / numpy / torch; ``make_steps(epoch)`` must be deterministic in ``epoch``
  (the caller shuffles with ``seed + epoch``) so that a resumed run sees the same order;
* metrics: one JSON line per optimiser step appended to ``args.log_path`` (``epoch``, ``step``,
  ``lr``, ``loss``, ``grad_norm``, ``tokens`` and the loss's own metrics), a progress bar on stderr;
* checkpoints in ``args.ckpt_dir`` at the end of every epoch, after the very last optimiser step
  and, with ``checkpoint_every_steps`` N > 0, after every N-th one; layout and commit in
  :mod:`qevolve_cli.training.checkpoints`. Started again with the same arguments (the same
  ``fingerprint``), the loop continues at the next optimiser step: the epoch's batch order is rebuilt
  and the steps already done are skipped, and the metrics log is cut back to the checkpoint's step.
  The checkpoint after the last step is what the caller's closing work (the policy's summary pass over
  the data, its output) resumes from: a run killed there trains nothing again, and its
  ``last_metrics`` are the logged last step's.
  A checkpoint of another fingerprint or backend is refused with one line;
* hooks: ``on_epoch_start(epoch, model)``, ``on_step(step, model)`` after every optimiser step (the
  policy refreshes pi_old there), ``extra_state()`` / ``load_extra_state(tensors)`` for the caller's
  tensors in the checkpoint (pi_old / pi_ref log-probs).

Distributed (``backends/``): the micro-batches of each optimiser step are dealt round-robin to the
ranks (every rank runs the same number of backward passes; a missing one is micro-batch 0 with weight
0) and each rank's loss is scaled by ``world_size * w / (sum of w over the whole step)``, so the
gradient averaged over ranks is exactly the step's weighted mean: fp32 runs equal the one-process run
up to rounding. Logged losses and tokens are summed over ranks and written by rank 0.
"""
from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qevolve_cli.errors import QevolveError
from qevolve_cli.training.args import Hooks, TrainArgs, TrainResult
from qevolve_cli.training.backends import make_backend
from qevolve_cli.training.checkpoints import (
    check_checkpoint_backend,
    load_checkpoint,
    read_checkpoint_pointer,
    write_checkpoint,
)


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def lr_lambda(step: int, total: int, warmup: int, kind: str = "cosine", min_ratio: float = 0.0) -> float:
    """LR multiplier at optimiser step ``step`` (0-based) of ``total``: linear warm-up then cosine/linear/constant."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if kind == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


LossFn = Callable[[Any, Any, dict], tuple[Any, dict[str, float]]]


def train_loop(model, make_steps: Callable[[int], list[list[Any]]], loss_fn: LossFn, args: TrainArgs,
               micro_weight: Callable[[Any], float] | None = None, micro_tokens: Callable[[Any], int] | None = None,
               hooks: Hooks | None = None, backend=None) -> TrainResult:
    """Train ``model`` for ``args.epochs`` epochs. See the module docstring.

    ``make_steps(epoch)`` returns that epoch's optimiser steps (each a list of
    micro-batches, any objects ``loss_fn`` understands); it must be
    deterministic in ``epoch`` so that resumed runs see the same order.
    ``loss_fn(model, micro, ctx)`` returns ``(loss, metrics)`` with ``loss`` the
    mean over the micro-batch; ``ctx`` has ``device``, ``epoch``, ``step``,
    ``autocast``. ``micro_weight(micro)`` is the micro-batch's share of its
    optimiser step (default 1 each); ``micro_tokens(micro)`` counts tokens for
    throughput logging.
    """
    import torch

    hooks = hooks or Hooks()
    seed_everything(args.seed)
    steps_ep0 = make_steps(0)
    grad_accum = max((len(s) for s in steps_ep0), default=1)
    backend = backend or make_backend(args, grad_accum)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise QevolveError("nothing to train: the model has no trainable parameters")
    steps_per_epoch = len(steps_ep0)
    total = steps_per_epoch * args.epochs
    if args.max_steps:
        total = min(total, args.max_steps)
    warmup = int(math.ceil(args.warmup_ratio * total)) if args.warmup_ratio > 0 else 0
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=tuple(args.betas))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, total, warmup, args.lr_scheduler, args.min_lr_ratio)
    )
    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir is not None else None
    meta = read_checkpoint_pointer(ckpt_dir) if (ckpt_dir is not None and args.resume) else None
    if meta is not None:  # refused before DeepSpeed builds its engine
        check_checkpoint_backend(ckpt_dir, meta, backend)
        if meta.get("fingerprint") != args.fingerprint:
            raise QevolveError(f"{ckpt_dir}: the checkpoint is of another configuration, data or model; rerun with "
                               "the same arguments to resume it (or delete it to start over)")
    model, optimizer, scheduler = backend.prepare(model, optimizer, scheduler)
    start_epoch, skip, step = 0, 0, 0
    if meta is not None:
        pos, extra = load_checkpoint(backend, ckpt_dir, meta, model, optimizer, scheduler)
        start_epoch, skip, step = pos["epoch"], pos["epoch_step"], pos["step"]
        if hooks.load_extra_state is not None:
            hooks.load_extra_state(extra)
    resumed_from, resumed_step = start_epoch, step
    log_f = None
    last: dict[str, Any] = {}  # the last step's log line (a resumed run that trains nothing reports the logged one)
    if args.log_path is not None and backend.is_main:
        from qevolve_cli.atomic import write_text

        Path(args.log_path).parent.mkdir(parents=True, exist_ok=True)
        if step == 0 and Path(args.log_path).exists():
            Path(args.log_path).unlink()
        elif step > 0 and Path(args.log_path).exists():
            # drop the lines of the steps after the checkpoint (they are run again) and a line cut by the kill
            kept = [ln for ln in Path(args.log_path).read_text().splitlines()
                    if _log_step(ln) is not None and _log_step(ln) <= step]
            write_text(args.log_path, "".join(ln + "\n" for ln in kept))
            last = json.loads(kept[-1]) if kept and _log_step(kept[-1]) == step else {}
        log_f = open(args.log_path, "a")  # noqa: SIM115
    every = max(0, int(args.checkpoint_every_steps))

    from qevolve_cli.progress import progress

    t0 = time.perf_counter()
    tokens_total = 0
    history: list[dict[str, Any]] = []
    done = False
    model.train()
    try:
        with progress(quiet=args.quiet or not backend.is_main) as bar:
            task = bar.add_task(args.desc, total=total, info="", completed=min(step, total))
            for epoch in range(start_epoch, args.epochs):
                if hooks.on_epoch_start is not None:
                    hooks.on_epoch_start(epoch, model)
                steps = steps_ep0 if epoch == 0 else make_steps(epoch)
                first = skip if epoch == start_epoch else 0  # resumed mid-epoch: these steps are done
                for i in range(first, len(steps)):
                    micro_batches = steps[i]
                    if args.max_steps and step >= args.max_steps:
                        done = True
                        break
                    # rank r takes micro-batches r, r + W, ...; every rank runs the same number of
                    # backward passes (collectives), a missing one is micro-batch 0 with weight 0.
                    # Loss scale W * w / (sum of w over the WHOLE step): the gradient average over
                    # ranks is then exactly the weighted mean of the step, however it was sharded.
                    world = backend.world_size
                    all_w = [float(micro_weight(m)) if micro_weight else 1.0 for m in micro_batches]
                    wtot = sum(all_w) or 1.0
                    n_local = -(-len(micro_batches) // world)
                    mine = [(m, w, True) for m, w in zip(micro_batches[backend.rank :: world],
                                                         all_w[backend.rank :: world], strict=True)]
                    mine += [(micro_batches[0], 0.0, False)] * (n_local - len(mine))
                    backend.zero_grad(optimizer)
                    agg: dict[str, float] = {}
                    loss_acc = 0.0
                    ntok = 0
                    for m, w, real in mine:
                        ctx = {"device": backend.device, "epoch": epoch, "step": step, "autocast": backend.autocast}
                        with backend.autocast():
                            loss, metrics = loss_fn(model, m, ctx)
                        backend.backward(loss * (w * world / wtot))
                        loss_acc += float(loss.detach()) * w / wtot
                        for k, v in metrics.items():
                            agg[k] = agg.get(k, 0.0) + float(v) * w / wtot
                        ntok += int(micro_tokens(m)) if (micro_tokens and real) else 0
                    if world > 1:  # the logged numbers are those of the whole step
                        keys = sorted(agg)
                        red = backend.all_reduce_sum([loss_acc, float(ntok), *[agg[k] for k in keys]])
                        loss_acc, ntok = red[0], int(round(red[1]))
                        agg = dict(zip(keys, red[2:], strict=True))
                    gnorm = backend.optimizer_step(model, optimizer, params, args.max_grad_norm)
                    scheduler.step()
                    step += 1
                    tokens_total += ntok
                    rec = {"epoch": epoch, "step": step, "lr": scheduler.get_last_lr()[0], "loss": loss_acc,
                           "grad_norm": gnorm, "tokens": ntok, **agg}
                    last = rec
                    history.append(rec)
                    if log_f is not None:
                        log_f.write(json.dumps(rec) + "\n")
                        log_f.flush()
                    bar.update(task, advance=1, info=f"epoch {epoch + 1}/{args.epochs} loss {loss_acc:.4f}")
                    if hooks.on_step is not None:
                        hooks.on_step(step, model)
                    # checkpoint after every `every`-th step, at the end of every epoch and after the very
                    # last step (the caller's closing pass over the data then resumes without training again)
                    end_of_epoch = i + 1 == len(steps)
                    if ckpt_dir is not None and ((every and step % every == 0) or end_of_epoch or step >= total):
                        pos = ({"epoch": epoch + 1, "epoch_step": 0, "step": step} if end_of_epoch
                               else {"epoch": epoch, "epoch_step": i + 1, "step": step})
                        extra = hooks.extra_state() if hooks.extra_state is not None else None
                        write_checkpoint(backend, ckpt_dir, model, optimizer, scheduler, pos, extra,
                                         args.fingerprint, final=step >= total)
                if done:
                    break
                backend.barrier()
    finally:
        if log_f is not None:
            log_f.close()
    return TrainResult(
        steps=step,
        epochs_done=args.epochs if not done else start_epoch,
        resumed_from_epoch=resumed_from,
        seconds=time.perf_counter() - t0,
        tokens=tokens_total,
        last_metrics={k: v for k, v in last.items() if isinstance(v, (int, float))},
        history=history,
        resumed_from_step=resumed_step,
    )


def _log_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
