"""The shared training loop of the policy and the critic (one loop, losses passed in).

Usage (sketch)::

    from qevolve_cli.training import TrainArgs, train_loop, token_budget_batches

    def make_batches(epoch):                  # -> list of optimiser steps, each a list of micro-batches
        mbs = token_budget_batches(lengths, max_tokens=4096, max_seqs=8, seed=args.seed + epoch)
        return group_steps(mbs, grad_accum=4)

    def loss_fn(model, micro, ctx):           # -> (mean loss of the micro-batch, {metric: float})
        ...

    result = train_loop(model, make_batches, loss_fn, args,
                        micro_weight=lambda micro: n_loss_tokens(micro))

What the loop does:

* AdamW over the parameters with ``requires_grad`` (LoRA adapters, heads or
  the full model), weight decay ``args.weight_decay``;
* cosine schedule with linear warm-up over ``warmup_ratio`` of all optimiser
  steps (``lr_scheduler="constant"`` also available);
* gradient accumulation: an optimiser step is a list of micro-batches; each
  micro-batch loss (a *mean* over its own items) is scaled by
  ``micro_weight(micro) / sum(micro_weight over the step)``, so the step's
  gradient equals the gradient of the mean over all items of the step however
  the items were split ("dynamic" token-budget batching, see
  :func:`token_budget_batches`);
* gradient-norm clipping (``max_grad_norm``; 0 = off);
* precision: fp32 on CPU; bf16 autocast (fp32 master weights) on CUDA unless
  ``precision`` says otherwise;
* seeding of python / numpy / torch, deterministic per-epoch batch order
  (the caller derives shuffling from ``seed + epoch``);
* metrics: one JSON line per optimiser step appended to ``args.log_path``
  (``{"epoch", "step", "lr", "loss", "grad_norm", "tokens", ...loss metrics}``),
  a rich progress bar on stderr;
* checkpoint / resume at epoch boundaries in ``args.ckpt_dir``: trainable
  parameters (safetensors), optimiser, scheduler, RNG states and the caller's
  ``extra_state`` tensors; a run that is interrupted and started again with the
  same arguments continues after the last finished epoch. Checkpoints are
  written atomically (temp dir + rename).
* ``hooks.on_step(step, model)`` after every optimiser step (the policy
  refreshes pi_old there).

Distributed / DeepSpeed ZeRO-2/3: ``args.deepspeed`` names a JSON config
(``configs/deepspeed/zero2.json`` / ``zero3.json``). The loop then runs through
an :class:`AccelerateBackend` (``accelerate`` with its DeepSpeed plugin,
imported lazily) and each rank takes its share of the micro-batches. Launch
with ``accelerate launch`` / ``deepspeed`` / ``torchrun``. Without a DeepSpeed
config and with ``WORLD_SIZE`` unset the plain :class:`TorchBackend` is used.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qevolve_cli.errors import QevolveError

# --------------------------------------------------------------------------- arguments


@dataclass
class TrainArgs:
    """Plain arguments of :func:`train_loop` (stage configs map their fields onto these)."""

    epochs: int = 1
    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_ratio: float = 0.03
    lr_scheduler: str = "cosine"  # cosine | constant
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0
    betas: tuple[float, float] = (0.9, 0.999)
    seed: int = 0
    precision: str = "auto"  # auto | fp32 | bf16
    device: str = "auto"  # auto | cpu | cuda
    log_path: Path | None = None
    ckpt_dir: Path | None = None
    resume: bool = True
    deepspeed: Path | None = None
    quiet: bool = False
    desc: str = "train"
    max_steps: int = 0  # stop after this many optimiser steps (0 = no limit; for tests/benchmarks)


@dataclass
class TrainResult:
    steps: int
    epochs_done: int
    resumed_from_epoch: int
    seconds: float
    tokens: int
    last_metrics: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Hooks:
    on_step: Callable[[int, Any], None] | None = None
    on_epoch_start: Callable[[int, Any], None] | None = None
    extra_state: Callable[[], dict[str, Any]] | None = None  # tensors to checkpoint
    load_extra_state: Callable[[dict[str, Any]], None] | None = None


# --------------------------------------------------------------------------- helpers


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def resolve_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise QevolveError("device: cuda requested but no CUDA device is available")
    return device


def resolve_precision(precision: str, device: str) -> str:
    if precision == "auto":
        return "bf16" if device.startswith("cuda") else "fp32"
    if precision == "bf16" and device == "cpu":
        return "bf16"
    return precision


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


def token_budget_batches(lengths: Sequence[int], max_tokens: int, max_seqs: int = 0, shuffle: bool = True,
                         seed: int = 0) -> list[list[int]]:
    """Dynamic batching: group item indices into micro-batches whose *padded* size fits a token budget.

    Items are sorted by length (so padding is small), packed greedily so that
    ``len(batch) * max_len(batch) <= max_tokens`` (an item longer than the
    budget goes alone) and ``len(batch) <= max_seqs`` (0 = no cap); the batch
    order is then shuffled with ``seed``. Every index appears exactly once.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        ln = max(1, int(lengths[i]))
        new_max = max(cur_max, ln)
        if cur and ((new_max * (len(cur) + 1) > max_tokens) or (max_seqs and len(cur) >= max_seqs)):
            batches.append(cur)
            cur, cur_max = [], 0
            new_max = ln
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    if shuffle:
        random.Random(seed).shuffle(batches)
    return batches


def group_steps(micro_batches: list[Any], grad_accum: int) -> list[list[Any]]:
    """Group micro-batches into optimiser steps of ``grad_accum`` micro-batches (last may be shorter)."""
    g = max(1, grad_accum)
    return [micro_batches[i : i + g] for i in range(0, len(micro_batches), g)]


# --------------------------------------------------------------------------- backends


class TorchBackend:
    """Single-process PyTorch (CPU or one GPU)."""

    def __init__(self, device: str, precision: str):
        self.device = device
        self.precision = precision
        self.rank, self.world_size, self.is_main = 0, 1, True

    def prepare(self, model, optimizer, scheduler):
        model.to(self.device)
        return model, optimizer, scheduler

    def autocast(self):
        import torch

        if self.precision == "bf16":
            return torch.autocast(device_type="cuda" if self.device.startswith("cuda") else "cpu",
                                  dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def backward(self, loss) -> None:
        loss.backward()

    def clip_grad_norm(self, model, params, max_norm: float) -> float:
        import torch

        if max_norm and max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        grads = [p.grad.detach().norm() for p in params if p.grad is not None]
        return float(torch.norm(torch.stack(grads))) if grads else 0.0

    def unwrap(self, model):
        return model

    def full_state_dict(self, model) -> dict:
        return model.state_dict()

    def barrier(self) -> None:
        pass


class AccelerateBackend(TorchBackend):
    """Multi-process / DeepSpeed ZeRO-2/3 through ``accelerate`` (imported lazily)."""

    def __init__(self, precision: str, deepspeed_config: Path | None, grad_accum: int):
        try:
            from accelerate import Accelerator
            from accelerate.utils import DeepSpeedPlugin
        except ImportError as e:  # pragma: no cover - accelerate is a dependency
            raise QevolveError(f"distributed training needs accelerate ({e})") from None
        plugin = None
        if deepspeed_config is not None:
            try:
                import deepspeed  # noqa: F401
            except ImportError:
                raise QevolveError(
                    f"{deepspeed_config}: DeepSpeed is not installed (pip install 'qevolve[gpu]')"
                ) from None
            if not Path(deepspeed_config).exists():
                raise QevolveError(f"{deepspeed_config}: no such DeepSpeed config")
            plugin = DeepSpeedPlugin(hf_ds_config=str(deepspeed_config), gradient_accumulation_steps=grad_accum)
        self.acc = Accelerator(mixed_precision="bf16" if precision == "bf16" else "no", deepspeed_plugin=plugin)
        self.device = str(self.acc.device)
        self.precision = precision
        self.rank = self.acc.process_index
        self.world_size = self.acc.num_processes
        self.is_main = self.acc.is_main_process

    def prepare(self, model, optimizer, scheduler):
        return self.acc.prepare(model, optimizer, scheduler)

    def autocast(self):
        return self.acc.autocast()

    def backward(self, loss) -> None:
        self.acc.backward(loss)

    def clip_grad_norm(self, model, params, max_norm: float) -> float:
        if max_norm and max_norm > 0:
            n = self.acc.clip_grad_norm_(model.parameters(), max_norm)
            return float(n) if n is not None else float("nan")
        return float("nan")

    def unwrap(self, model):
        return self.acc.unwrap_model(model)

    def full_state_dict(self, model) -> dict:
        return self.acc.get_state_dict(model)  # gathers ZeRO-3 shards

    def barrier(self) -> None:
        self.acc.wait_for_everyone()


def make_backend(args: TrainArgs, grad_accum: int = 1):
    device = resolve_device(args.device)
    precision = resolve_precision(args.precision, device)
    if args.deepspeed is not None or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return AccelerateBackend(precision, args.deepspeed, grad_accum)
    return TorchBackend(device, precision)


# --------------------------------------------------------------------------- checkpoints


def _trainable_state(model) -> dict:
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k in names}


def save_checkpoint(ckpt_dir: Path, model, optimizer, scheduler, epoch: int, step: int,
                    extra: dict[str, Any] | None = None) -> None:
    """Atomic epoch-boundary checkpoint (trainable params in safetensors; the rest via torch.save)."""
    import torch
    from safetensors.torch import save_file

    from qevolve_cli.atomic import atomic_dir

    with atomic_dir(ckpt_dir) as tmp:
        save_file(_trainable_state(model), str(tmp / "trainable.safetensors"))
        tensors = {k: v for k, v in (extra or {}).items() if isinstance(v, torch.Tensor)}
        if tensors:
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / "extra.safetensors"))
        torch.save(
            {
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "epoch": epoch,
                "step": step,
            },
            tmp / "state.pt",
        )
        (tmp / "meta.json").write_text(json.dumps({"epoch": epoch, "step": step}) + "\n")


def load_checkpoint(ckpt_dir: Path, model, optimizer, scheduler) -> tuple[int, int, dict[str, Any]]:
    """Load a checkpoint written by :func:`save_checkpoint` -> (epochs done, step, extra tensors)."""
    import torch
    from safetensors.torch import load_file

    params = load_file(str(ckpt_dir / "trainable.safetensors"))
    missing = set(params) - set(model.state_dict())
    if missing:
        raise QevolveError(f"{ckpt_dir}: checkpoint does not match the model (e.g. {sorted(missing)[0]})")
    model.load_state_dict(params, strict=False)
    st = torch.load(ckpt_dir / "state.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(st["optimizer"])
    scheduler.load_state_dict(st["scheduler"])
    torch.set_rng_state(st["torch_rng"])
    extra = load_file(str(ckpt_dir / "extra.safetensors")) if (ckpt_dir / "extra.safetensors").exists() else {}
    return int(st["epoch"]), int(st["step"]), extra


# --------------------------------------------------------------------------- the loop

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
    model, optimizer, scheduler = backend.prepare(model, optimizer, scheduler)
    start_epoch, step = 0, 0
    if args.ckpt_dir is not None and args.resume and (Path(args.ckpt_dir) / "meta.json").exists():
        start_epoch, step, extra = load_checkpoint(Path(args.ckpt_dir), backend.unwrap(model), optimizer, scheduler)
        if hooks.load_extra_state is not None:
            hooks.load_extra_state(extra)
    resumed_from = start_epoch
    log_f = None
    if args.log_path is not None and backend.is_main:
        Path(args.log_path).parent.mkdir(parents=True, exist_ok=True)
        if start_epoch == 0 and Path(args.log_path).exists():
            Path(args.log_path).unlink()
        elif start_epoch > 0 and Path(args.log_path).exists():
            # drop log lines of the unfinished epoch so that the curve has no duplicates
            kept = [ln for ln in Path(args.log_path).read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) <= step]
            Path(args.log_path).write_text("".join(k + "\n" for k in kept))
        log_f = open(args.log_path, "a")  # noqa: SIM115

    from qevolve_cli.commands.common import progress

    t0 = time.perf_counter()
    tokens_total = 0
    history: list[dict[str, Any]] = []
    last: dict[str, float] = {}
    done = False
    model.train()
    try:
        with progress(quiet=args.quiet or not backend.is_main) as bar:
            task = bar.add_task(args.desc, total=total, info="", completed=min(step, total))
            for epoch in range(start_epoch, args.epochs):
                if hooks.on_epoch_start is not None:
                    hooks.on_epoch_start(epoch, model)
                steps = steps_ep0 if epoch == 0 else make_steps(epoch)
                for micro_batches in steps:
                    if args.max_steps and step >= args.max_steps:
                        done = True
                        break
                    mine = micro_batches[backend.rank :: backend.world_size] or micro_batches[:1]
                    weights = [float(micro_weight(m)) if micro_weight else 1.0 for m in mine]
                    wsum = sum(weights) or 1.0
                    optimizer.zero_grad(set_to_none=True)
                    agg: dict[str, float] = {}
                    loss_acc = 0.0
                    ntok = 0
                    for m, w in zip(mine, weights, strict=False):
                        ctx = {"device": backend.device, "epoch": epoch, "step": step, "autocast": backend.autocast}
                        with backend.autocast():
                            loss, metrics = loss_fn(model, m, ctx)
                        backend.backward(loss * (w / wsum))
                        loss_acc += float(loss.detach()) * w / wsum
                        for k, v in metrics.items():
                            agg[k] = agg.get(k, 0.0) + float(v) * w / wsum
                        ntok += int(micro_tokens(m)) if micro_tokens else 0
                    gnorm = backend.clip_grad_norm(model, params, args.max_grad_norm)
                    optimizer.step()
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
                if done:
                    break
                if args.ckpt_dir is not None and backend.is_main and epoch + 1 < args.epochs:
                    extra = hooks.extra_state() if hooks.extra_state is not None else None
                    save_checkpoint(Path(args.ckpt_dir), backend.unwrap(model), optimizer, scheduler,
                                    epoch + 1, step, extra)
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
    )


def remove_checkpoint(ckpt_dir: Path | None) -> None:
    if ckpt_dir is not None and Path(ckpt_dir).exists():
        shutil.rmtree(ckpt_dir, ignore_errors=True)
