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
* checkpoint / resume in ``args.ckpt_dir`` at epoch boundaries and, with
  ``checkpoint_every_steps`` N > 0, after every N-th optimiser step: trainable
  parameters (safetensors; under DeepSpeed the engine's own checkpoint),
  optimiser, scheduler, RNG states, the step counter and the caller's
  ``extra_state`` tensors. A run that is interrupted and started again with the
  same arguments continues at the next optimiser step: the epoch's batch order
  is rebuilt by ``make_steps(epoch)`` and the steps already done are skipped;
  the metrics log is cut back to the checkpoint's step. Each checkpoint goes
  into its own ``step########/`` directory and is committed by replacing
  ``meta.json`` atomically (the previous one is removed only then), see
  :func:`write_checkpoint`.
* ``hooks.on_step(step, model)`` after every optimiser step (the policy
  refreshes pi_old there).

Distributed / DeepSpeed ZeRO-2/3: ``args.deepspeed`` names a JSON config
(``configs/deepspeed/zero2.json`` / ``zero3.json``). The loop then runs through a
:class:`DeepSpeedBackend` (one ``deepspeed.initialize`` engine, DeepSpeed
imported lazily; on CPU its CPU accelerator with gloo). Launch with
``torchrun --standalone --nproc_per_node N -m qevolve_cli ...`` (or ``deepspeed`` /
``accelerate launch``); without a launcher a one-rank group is created. Every
``"auto"`` of the config is resolved here (:func:`resolve_deepspeed_config`).
The micro-batches of each optimiser step are dealt round-robin to the ranks
(every rank runs the same number of backward passes; a missing one is
micro-batch 0 with weight 0) and each rank's loss is scaled by
``world_size * w / (sum of w over the whole step)``, so the gradient averaged
over ranks is exactly the step's weighted mean: fp32 runs equal the
single-process run up to rounding. Logged losses/tokens are summed over ranks
and written by rank 0. Checkpoints under DeepSpeed are the engine's own
(``engine.save_checkpoint``: every rank writes its ZeRO partition of the
optimiser state, ZeRO-3 its parameter shards too) in the same committed layout;
they resume with the same number of ranks and ZeRO stage only. With ``WORLD_SIZE > 1`` and no DeepSpeed config the
loop runs plain DDP through :class:`AccelerateBackend`; otherwise
:class:`TorchBackend`.
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

from qevolve_cli.device import resolve_device
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
    checkpoint_every_steps: int = 0  # also checkpoint after every N-th optimiser step (0 = epoch boundaries only)
    fingerprint: str | None = None  # the run's identity (config, data, model): a checkpoint of another one is refused


@dataclass
class TrainResult:
    steps: int
    epochs_done: int
    resumed_from_epoch: int
    seconds: float
    tokens: int
    last_metrics: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    resumed_from_step: int = 0


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

    checkpoint_kind = "torch"

    def save_state(self, tag_dir: Path, model, optimizer) -> None:
        """Write the trainable parameters (safetensors) and the optimiser state into ``tag_dir`` (rank 0:
        the state is replicated). Called on every rank (the DeepSpeed backend's is a collective)."""
        import torch
        from safetensors.torch import save_file

        if self.is_main:
            save_file(_trainable_state(self.unwrap(model)), str(tag_dir / "trainable.safetensors"))
            torch.save(optimizer.state_dict(), tag_dir / "optimizer.pt")

    def load_state(self, tag_dir: Path, model, optimizer) -> None:
        import torch
        from safetensors.torch import load_file

        params = load_file(str(tag_dir / "trainable.safetensors"))
        m = self.unwrap(model)
        unknown = set(params) - set(m.state_dict())
        if unknown:
            raise QevolveError(f"{tag_dir}: checkpoint does not match the model (e.g. {sorted(unknown)[0]}); "
                               "delete it to start over")
        m.load_state_dict(params, strict=False)
        optimizer.load_state_dict(torch.load(tag_dir / "optimizer.pt", map_location="cpu", weights_only=True))

    def optimizer_step(self, model, optimizer, params, max_norm: float) -> float:
        """Clip (``max_norm`` > 0) and step -> the gradient norm before clipping."""
        gnorm = self.clip_grad_norm(model, params, max_norm)
        optimizer.step()
        return gnorm

    def zero_grad(self, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def unwrap(self, model):
        return model

    def full_state_dict(self, model) -> dict:
        return model.state_dict()

    def barrier(self) -> None:
        pass

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return list(values)


class AccelerateBackend(TorchBackend):
    """Plain multi-process data parallelism (DDP through ``accelerate``), used when ``WORLD_SIZE > 1``
    without a DeepSpeed config. DeepSpeed runs through :class:`DeepSpeedBackend`."""

    def __init__(self, precision: str):
        try:
            from accelerate import Accelerator
        except ImportError as e:  # pragma: no cover - accelerate is a dependency
            raise QevolveError(f"distributed training needs accelerate ({e})") from None
        self.acc = Accelerator(mixed_precision="bf16" if precision == "bf16" else "no")
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
        return self.acc.get_state_dict(model)

    def barrier(self) -> None:
        self.acc.wait_for_everyone()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return _dist_sum(values, self.device)


# --------------------------------------------------------------------------- DeepSpeed

DS_STAGES = (0, 1, 2, 3)


def load_deepspeed_config(path: str | Path, what: str = "deepspeed") -> dict[str, Any]:
    """Read and check a DeepSpeed JSON config (one-line errors naming the file and field)."""
    p = Path(path)
    if not p.is_file():
        raise QevolveError(f"{what}: {p}: no such DeepSpeed config")
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise QevolveError(f"{p}: not a JSON DeepSpeed config ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise QevolveError(f"{p}: a DeepSpeed config must be a JSON object")
    zero = raw.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise QevolveError(f"{p}: field zero_optimization: must be an object")
    stage = zero.get("stage", 0)
    if stage not in DS_STAGES:
        raise QevolveError(f"{p}: field zero_optimization.stage: {stage!r} is not one of 0, 1, 2, 3")
    for key in ("optimizer", "scheduler"):
        if key in raw:
            raise QevolveError(f"{p}: field {key}: not supported (qevolve builds AdamW and the LR schedule "
                               "from its own config: lr, weight_decay, warmup_ratio, lr_scheduler)")
    if isinstance(raw.get("fp16"), dict) and raw["fp16"].get("enabled") is True:
        raise QevolveError(f"{p}: field fp16.enabled: fp16 (loss scaling) is not supported; use bf16")
    for key in ("zero_optimization.offload_optimizer", "zero_optimization.offload_param"):
        sub = zero.get(key.split(".")[1])
        if isinstance(sub, dict) and sub.get("device", "none") not in ("none", None):
            raise QevolveError(f"{p}: field {key}: offloading is not supported by qevolve's DeepSpeed path "
                               "(it needs DeepSpeed's compiled CPU Adam)")
    return raw


def _auto(d: dict, key: str, value: Any) -> None:
    if d.get(key, "auto") == "auto":
        d[key] = value


def resolve_deepspeed_config(raw: dict[str, Any], *, precision: str, device: str, world_size: int,
                             grad_accum: int, max_grad_norm: float, hidden_size: int | None,
                             managed_accumulation: bool) -> dict[str, Any]:
    """Replace every ``"auto"`` of a DeepSpeed config by a concrete value (DeepSpeed itself accepts none).

    * ``bf16.enabled`` / ``fp16.enabled``: bf16 iff ``precision == "bf16"`` (fp32 on CPU by default);
    * batch sizes: our micro-batches are token-budgeted, so DeepSpeed's batch sizes are only
      bookkeeping: ``train_micro_batch_size_per_gpu`` 1, ``gradient_accumulation_steps`` the
      per-rank micro-batches of one optimiser step, ``train_batch_size`` their product times the
      world size;
    * ``gradient_clipping``: ``max_grad_norm``;
    * ZeRO buckets from the model's hidden size as Hugging Face does (``reduce_bucket_size`` h^2,
      ``stage3_prefetch_bucket_size`` 0.9 h^2, ``stage3_param_persistence_threshold`` 10 h);
    * on the CPU accelerator (``device == "cpu"``) ``overlap_comm`` is switched off: its side
      streams are CUDA-only (GPU runs keep the config's value).
    ``managed_accumulation=False`` makes ``engine.step()`` the accumulation boundary, so an
    optimiser step may have any number of micro-batches (our loop owns the accumulation).
    """
    cfg = json.loads(json.dumps(raw))
    bf16 = precision == "bf16"
    for key, on in (("bf16", bf16), ("fp16", False)):
        sec = cfg.get(key)
        if isinstance(sec, dict):
            _auto(sec, "enabled", on)
        elif key == "bf16":
            cfg[key] = {"enabled": on}
    ga = max(1, int(grad_accum))
    _auto(cfg, "train_micro_batch_size_per_gpu", 1)
    _auto(cfg, "gradient_accumulation_steps", ga)
    _auto(cfg, "train_batch_size",
          int(cfg["train_micro_batch_size_per_gpu"]) * int(cfg["gradient_accumulation_steps"]) * world_size)
    _auto(cfg, "gradient_clipping", float(max_grad_norm or 0.0))
    cfg["managed_gradient_accumulation"] = bool(managed_accumulation)
    zero = cfg.setdefault("zero_optimization", {"stage": 0})
    h = int(hidden_size) if hidden_size else 0
    _auto(zero, "reduce_bucket_size", h * h if h else int(5e8))
    _auto(zero, "stage3_prefetch_bucket_size", int(0.9 * h * h) if h else int(5e7))
    _auto(zero, "stage3_param_persistence_threshold", 10 * h if h else int(1e5))
    if device == "cpu":
        zero["overlap_comm"] = False
    left = [k for k, v in _flatten(cfg).items() if v == "auto"]
    if left:
        raise QevolveError(f"deepspeed config: field {left[0]}: 'auto' is not resolved by qevolve; give a value")
    return cfg


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_deepspeed(device: str = "auto"):
    """Import DeepSpeed for ``device`` and join (or create) the process group -> (deepspeed, device string).

    On CPU ``DS_ACCELERATOR=cpu`` is set (unless already set) before DeepSpeed is imported, so its
    CPU accelerator is used (communication backend ``ccl`` when oneCCL is installed, else ``gloo``).
    Without a launcher (no ``WORLD_SIZE``) a one-process group is created on a free local port.
    """
    dev = resolve_device(device)
    if dev == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed JIT-compiles its ops with ninja, which pip puts next to the interpreter
    import sys

    bindir = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and (Path(bindir) / "ninja").exists():
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except ImportError as e:
        raise QevolveError(f"deepspeed: DeepSpeed is not installed or broken ({e}); `make setup` installs it") from None
    acc = get_accelerator()
    if dev == "cpu" and acc.device_name() != "cpu":
        raise QevolveError(f"deepspeed: device cpu requested but DS_ACCELERATOR selects {acc.device_name()!r}")
    if dev.startswith("cuda") and acc.device_name() != "cuda":
        raise QevolveError(f"deepspeed: device cuda requested but DeepSpeed's accelerator is {acc.device_name()!r} "
                           "(unset DS_ACCELERATOR)")
    if "WORLD_SIZE" not in os.environ:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if acc.device_name() != "cpu":
        acc.set_device(local_rank)
        dev = acc.device_name(local_rank)
    import logging

    ds_logger = logging.getLogger("DeepSpeed")
    ds_logger.setLevel(logging.WARNING)
    for h in ds_logger.handlers:  # DeepSpeed logs to stdout; stdout is for results (--json)
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
            h.setStream(sys.stderr)
    deepspeed.init_distributed(dist_backend=acc.communication_backend_name(), auto_mpi_discovery=False)
    _register_distributed_shutdown()
    return deepspeed, dev


# DeepSpeed engines of this process, torn down (with the process group) before the interpreter exits
_ENGINES: list[Any] = []
_SHUTDOWN_REGISTERED = False
_COMPLETED = False  # the command finished without an error (commands.common.run_command sets it)


def mark_completed() -> None:
    """The command's work is done on this rank: at exit, wait for the other ranks before tearing down."""
    global _COMPLETED
    _COMPLETED = True


def _register_distributed_shutdown() -> None:
    global _SHUTDOWN_REGISTERED
    if not _SHUTDOWN_REGISTERED:
        import atexit

        atexit.register(shutdown_distributed)
        _SHUTDOWN_REGISTERED = True


def shutdown_distributed() -> None:
    """Tear down DeepSpeed and the process group while the interpreter is still whole (atexit).

    Left to interpreter finalization, the gloo process group and the engines' ZeRO-3 state were
    destroyed in no fixed order, with each rank's collective threads still attached and, under
    ZeRO-3, a parameter prefetch still in flight while the other rank was saving. Now and then a
    rank died there with SIGABRT: ``terminate called without an active exception``, a C++ thread
    destroyed while still joinable. torchrun then killed the other rank. The teardown order is
    now fixed: release the engines (``engine.destroy()``: ZeRO-3 hooks and prefetches), wait for
    every rank (``barrier``, after a completed command only: no rank closes its connections while
    a peer still talks to it), then ``destroy_process_group()`` (joins gloo's threads). Errors
    here are ignored: a peer that already died makes the barrier fail at once.
    """
    import sys

    while _ENGINES:
        engine = _ENGINES.pop()
        try:
            engine.destroy()
        except Exception:
            pass
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        # only after a completed command: a rank that failed may have left its peers inside another
        # collective, and a barrier would then wait for the process group's timeout (30 min) instead
        # of letting them see the closed connection at once, as before
        if _COMPLETED and dist.get_world_size() > 1:
            dist.barrier()
    except Exception:
        pass
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def model_hidden_size(model) -> int | None:
    h = getattr(model, "hidden_size", None)
    if isinstance(h, int):
        return h
    cfg = getattr(model, "config", None)
    h = getattr(cfg, "hidden_size", None)
    return h if isinstance(h, int) else None


class DeepSpeedBackend(TorchBackend):
    """DeepSpeed ZeRO-0/1/2/3 through ``deepspeed.initialize`` (one engine over the model).

    Launch with ``torchrun --nproc_per_node N -m qevolve_cli ...`` (or ``deepspeed`` /
    ``accelerate launch``: anything that sets RANK / WORLD_SIZE / MASTER_ADDR). The engine averages
    gradients over ranks; :func:`train_loop` scales each rank's loss so that the average is the
    exact token-weighted mean of the whole optimiser step. ``engine.step()`` is the accumulation
    boundary (``managed_gradient_accumulation: false``), gradient clipping is DeepSpeed's
    (``gradient_clipping`` = ``max_grad_norm``) and the LR schedule is ours (a ``LambdaLR`` on the
    client AdamW, stepped after every optimiser step). Checkpoints are DeepSpeed's own
    (:meth:`save_state`).
    """

    checkpoint_kind = "deepspeed"

    def __init__(self, config_path: str | Path, precision: str, device: str = "auto", grad_accum: int = 1,
                 max_grad_norm: float = 1.0):
        import torch.distributed as dist

        self.config_path = Path(config_path)
        self.raw_config = load_deepspeed_config(config_path)
        self.ds, self.device = init_deepspeed(device)
        self.precision = precision
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.stage = int(self.raw_config.get("zero_optimization", {}).get("stage", 0))
        self.grad_accum = grad_accum
        self.max_grad_norm = max_grad_norm
        self.engine = None
        self.config: dict[str, Any] | None = None

    def resolve(self, model, grad_accum: int | None = None, max_grad_norm: float | None = None,
                managed_accumulation: bool = False) -> dict[str, Any]:
        return resolve_deepspeed_config(
            self.raw_config, precision=self.precision, device="cpu" if self.device == "cpu" else "cuda",
            world_size=self.world_size, grad_accum=grad_accum or self.grad_accum,
            max_grad_norm=self.max_grad_norm if max_grad_norm is None else max_grad_norm,
            hidden_size=model_hidden_size(model), managed_accumulation=managed_accumulation)

    def initialize(self, model, optimizer, config: dict[str, Any]):
        try:
            engine, ds_opt, _, _ = self.ds.initialize(model=model, optimizer=optimizer, config=config)
        except (AssertionError, ValueError) as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise QevolveError(f"{self.config_path}: DeepSpeed rejected the config ({msg})") from None
        _ENGINES.append(engine)  # destroyed by shutdown_distributed() at exit
        return engine, ds_opt

    def prepare(self, model, optimizer, scheduler):
        model.to(self.device)
        self.config = self.resolve(model, grad_accum=max(1, -(-self.grad_accum // self.world_size)))
        self.engine, ds_opt = self.initialize(model, optimizer, self.config)
        return self.engine, ds_opt, scheduler

    def backward(self, loss) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self, model, optimizer, params, max_norm: float) -> float:
        model.step()  # clips (gradient_clipping), steps the ZeRO optimiser, zeroes the gradients
        n = model.get_global_grad_norm()
        return float(n) if n is not None else float("nan")

    def zero_grad(self, optimizer) -> None:
        pass  # the engine zeroes after each step

    def unwrap(self, model):
        return self.engine.module if (self.engine is not None and model is self.engine) else model

    def full_state_dict(self, model) -> dict | None:
        """Full weights of the engine's module (collective: call on every rank); under ZeRO-3 gathered
        layer by layer on rank 0 (None on the other ranks)."""
        if self.stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict()
        return self.engine.module.state_dict()

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return _dist_sum(values, self.device)

    def _frozen(self) -> bool:
        return any(not p.requires_grad for p in self.engine.module.parameters())

    def save_state(self, tag_dir: Path, model, optimizer) -> None:
        """``engine.save_checkpoint`` (a collective): the module's trainable weights (frozen ones, e.g. the
        base model under a LoRA adapter, are left out), every rank's ZeRO partition of the fp32 master
        weights and Adam moments (and its parameter shard under ZeRO-3) in ``tag_dir/engine/``."""
        self.engine.save_checkpoint(str(tag_dir), tag="engine", client_state={}, save_latest=False,
                                    exclude_frozen_parameters=self._frozen())

    def load_state(self, tag_dir: Path, model, optimizer) -> None:
        path, _ = self.engine.load_checkpoint(str(tag_dir), tag="engine", load_module_strict=not self._frozen(),
                                              load_optimizer_states=True, load_lr_scheduler_states=False)
        if path is None:
            raise QevolveError(f"{tag_dir}: DeepSpeed found no checkpoint to load; delete it to start over")


def _dist_sum(values: list[float], device: str) -> list[float]:
    import torch
    import torch.distributed as dist

    if not values or not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(x) for x in t.cpu()]


def is_main_process() -> bool:
    """False on the ranks > 0 of a multi-process launch (they print nothing); True otherwise."""
    import sys

    dist_mod = sys.modules.get("torch.distributed")
    if dist_mod is not None and dist_mod.is_available() and dist_mod.is_initialized():
        return dist_mod.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def make_backend(args: TrainArgs, grad_accum: int = 1):
    device = resolve_device(args.device)
    precision = resolve_precision(args.precision, device)
    if args.deepspeed is not None:
        return DeepSpeedBackend(args.deepspeed, precision, args.device, grad_accum, args.max_grad_norm)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return AccelerateBackend(precision)
    return TorchBackend(device, precision)


# --------------------------------------------------------------------------- checkpoints

KILL_AFTER_CHECKPOINT = "QEVOLVE_KILL_AFTER_CHECKPOINT"


def _trainable_state(model) -> dict:
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k in names}


def checkpoint_tag(step: int) -> str:
    return f"step{step:08d}"


def rng_state() -> dict[str, Any]:
    """This process's python / numpy / torch (and CUDA) RNG states, loadable with ``weights_only``."""
    import numpy as np
    import torch

    kind, key, pos, has_gauss, gauss = np.random.get_state()
    st: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                          "numpy": (kind, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss))}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    kind, key, pos, has_gauss, gauss = st["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` (a checkpoint is committed only once its files are on disk)."""
    for f in sorted(Path(path).rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())


def start_checkpoint(ckpt_dir: Path, tag: str, is_main: bool) -> Path:
    """The (empty) directory of checkpoint ``tag``; one left by an attempt that died before committing it is
    cleared first (rank 0; the caller then waits for it on a barrier)."""
    tag_dir = Path(ckpt_dir) / tag
    if is_main:
        shutil.rmtree(tag_dir, ignore_errors=True)
        tag_dir.mkdir(parents=True)
    return tag_dir


def checkpoint_manifest(tag_dir: Path) -> dict[str, int]:
    """Every file of a checkpoint directory -> its size in bytes (written into the pointer that commits it)."""
    tag_dir = Path(tag_dir)
    return {str(f.relative_to(tag_dir)): f.stat().st_size for f in sorted(tag_dir.rglob("*")) if f.is_file()}


def commit_checkpoint(ckpt_dir: Path, pointer: str, meta: dict[str, Any]) -> None:
    """Make ``meta["tag"]`` THE checkpoint: replace the pointer file atomically, then remove the other
    ``step*`` directories (the previous checkpoint, uncommitted leftovers). A kill at any moment leaves
    either the previous checkpoint or the new one, both complete. The pointer lists the checkpoint's
    files and sizes (``files``): a resume reads a checkpoint only when all of them are there
    (:func:`check_checkpoint_files`). Rank 0 only, after every rank has written and fsynced its files."""
    from qevolve_cli.atomic import write_json

    meta = {**meta, "files": checkpoint_manifest(Path(ckpt_dir) / str(meta["tag"]))}
    write_json(Path(ckpt_dir) / pointer, meta)
    for d in Path(ckpt_dir).glob("step*"):
        if d.name != meta["tag"] and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)


def read_checkpoint_pointer(ckpt_dir: Path, pointer: str = "meta.json",
                            needs: tuple[str, ...] = ("epoch", "epoch_step", "step")) -> dict[str, Any] | None:
    """The committed checkpoint's pointer (None when there is none); one-line errors for a broken one: an
    unreadable or half-written pointer, one without the fields ``needs``, a checkpoint directory or file it
    lists that is missing or of another size (:func:`check_checkpoint_files`)."""
    p = Path(ckpt_dir) / pointer
    if not p.is_file():
        return None
    try:
        meta = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError):
        raise QevolveError(f"{p}: unreadable checkpoint pointer; delete {ckpt_dir} to start over") from None
    if not isinstance(meta, dict) or "tag" not in meta:
        raise QevolveError(f"{ckpt_dir}: checkpoint of an older qevolve version (no tag); delete it to start over")
    lacking = [k for k in needs if k not in meta]
    if lacking:
        raise QevolveError(f"{p}: field {lacking[0]}: missing from the checkpoint pointer; delete {ckpt_dir} to "
                           "start over")
    check_checkpoint_files(Path(ckpt_dir), meta)
    return meta


def check_checkpoint_files(ckpt_dir: Path, meta: dict[str, Any]) -> None:
    """The committed checkpoint ``meta["tag"]`` is whole: its directory exists and every file the pointer lists
    (``files``: pointers written before qevolve listed them are taken as they are) has its recorded size."""
    tag_dir = Path(ckpt_dir) / str(meta["tag"])
    if not tag_dir.is_dir():
        raise QevolveError(f"{ckpt_dir}: the committed checkpoint {meta['tag']} is missing; delete it to start over")
    files = meta.get("files")
    if files is None:
        return
    if not isinstance(files, dict):
        raise QevolveError(f"{ckpt_dir}: field files: not a file list in the checkpoint pointer; delete it to start over")
    for rel, size in files.items():
        f = tag_dir / rel
        try:
            have = f.stat().st_size
        except OSError:
            raise QevolveError(f"{ckpt_dir}: the committed checkpoint {meta['tag']} is incomplete ({rel} is missing: "
                               "another process may be writing or removing it); delete it to start over") from None
        if have != size:
            raise QevolveError(f"{ckpt_dir}: the committed checkpoint {meta['tag']} is incomplete ({rel} has {have} "
                               f"bytes, the pointer says {size}); delete it to start over")


def check_checkpoint_backend(ckpt_dir: Path, meta: dict[str, Any], backend) -> None:
    """A checkpoint resumes under the backend that wrote it: DeepSpeed ones with the same ranks and ZeRO stage."""
    kind = getattr(backend, "checkpoint_kind", "torch")
    if meta.get("backend", "torch") != kind:
        raise QevolveError(f"{ckpt_dir}: the checkpoint was written by a {meta.get('backend', 'torch')} run, this is a "
                           f"{kind} run; resume with the same command (or delete it to start over)")
    if kind == "deepspeed":
        have = (int(meta.get("world_size", 0)), int(meta.get("zero_stage", -1)))
        if have != (backend.world_size, backend.stage):
            raise QevolveError(f"{ckpt_dir}: the checkpoint was written by {have[0]} ranks with ZeRO-{have[1]}, this run "
                               f"has {backend.world_size} with ZeRO-{backend.stage}; resume with the same launch "
                               "(or delete it to start over)")


def checkpoint_meta(backend) -> dict[str, Any]:
    kind = getattr(backend, "checkpoint_kind", "torch")
    meta: dict[str, Any] = {"backend": kind}
    if kind == "deepspeed":
        meta.update(world_size=backend.world_size, zero_stage=backend.stage)
    return meta


def kill_after_checkpoint(step: int) -> None:
    """Fault injection for the recovery tests: with ``QEVOLVE_KILL_AFTER_CHECKPOINT=K`` in the environment the
    process SIGKILLs itself right after the checkpoint of step K is committed (every rank does: a node lost)."""
    if os.environ.get(KILL_AFTER_CHECKPOINT) == str(step):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def write_checkpoint(backend, ckpt_dir: Path, model, optimizer, scheduler, pos: dict[str, int],
                     extra: dict[str, Any] | None = None, fingerprint: str | None = None) -> None:
    """Checkpoint of the loop at ``pos`` (``epoch``, ``epoch_step``: steps done in it, ``step``: global);
    collective: every rank calls it.

    ``ckpt_dir/stepNNNNNNNN/`` gets the backend's state (:meth:`TorchBackend.save_state`,
    :meth:`DeepSpeedBackend.save_state`), one RNG file per rank, and from rank 0 ``state.pt``
    (scheduler, position) and ``extra.safetensors`` (the caller's tensors: pi_old / pi_ref log-probs);
    every rank fsyncs, all wait, then rank 0 commits it (:func:`commit_checkpoint`).
    """
    import torch
    from safetensors.torch import save_file

    tag = checkpoint_tag(pos["step"])
    tag_dir = start_checkpoint(Path(ckpt_dir), tag, backend.is_main)
    backend.barrier()
    backend.save_state(tag_dir, model, optimizer)
    torch.save(rng_state(), tag_dir / f"rng_rank{backend.rank}.pt")
    if backend.is_main:
        torch.save({"scheduler": scheduler.state_dict(), **pos}, tag_dir / "state.pt")
        tensors = {k: v for k, v in (extra or {}).items() if isinstance(v, torch.Tensor)}
        if tensors:
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tag_dir / "extra.safetensors"))
    fsync_tree(tag_dir)
    backend.barrier()
    if backend.is_main:
        commit_checkpoint(Path(ckpt_dir), "meta.json", {"tag": tag, **pos, **checkpoint_meta(backend),
                                                        "fingerprint": fingerprint})
    backend.barrier()
    kill_after_checkpoint(pos["step"])


def load_checkpoint(backend, ckpt_dir: Path, meta: dict[str, Any], model, optimizer,
                    scheduler) -> tuple[dict[str, int], dict[str, Any]]:
    """Load the committed checkpoint ``meta`` -> (position, extra tensors); every rank calls it."""
    import torch
    from safetensors.torch import load_file

    tag_dir = Path(ckpt_dir) / meta["tag"]
    backend.load_state(tag_dir, model, optimizer)
    st = torch.load(tag_dir / "state.pt", map_location="cpu", weights_only=True)
    scheduler.load_state_dict(st["scheduler"])
    for g, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        g["lr"] = lr  # the LR of the next step (DeepSpeed's optimiser state need not carry it)
    rng = tag_dir / f"rng_rank{backend.rank}.pt"
    set_rng_state(torch.load(rng if rng.is_file() else tag_dir / "rng_rank0.pt", weights_only=True))
    extra = load_file(str(tag_dir / "extra.safetensors")) if (tag_dir / "extra.safetensors").exists() else {}
    return {k: int(st[k]) for k in ("epoch", "epoch_step", "step")}, extra


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
    if args.log_path is not None and backend.is_main:
        Path(args.log_path).parent.mkdir(parents=True, exist_ok=True)
        if step == 0 and Path(args.log_path).exists():
            Path(args.log_path).unlink()
        elif step > 0 and Path(args.log_path).exists():
            # drop the lines of the steps after the checkpoint (they are run again) and a line cut by the kill
            Path(args.log_path).write_text("".join(ln + "\n" for ln in Path(args.log_path).read_text().splitlines()
                                                   if _log_step(ln) is not None and _log_step(ln) <= step))
        log_f = open(args.log_path, "a")  # noqa: SIM115
    every = max(0, int(args.checkpoint_every_steps))

    from qevolve_cli.progress import progress

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
                    # checkpoint after every `every`-th step and at the end of every epoch but the last
                    # (not after the very last step: the caller writes its output right away)
                    end_of_epoch = i + 1 == len(steps)
                    if (ckpt_dir is not None and step < total
                            and ((every and step % every == 0) or (end_of_epoch and epoch + 1 < args.epochs))):
                        pos = ({"epoch": epoch + 1, "epoch_step": 0, "step": step} if end_of_epoch
                               else {"epoch": epoch, "epoch_step": i + 1, "step": step})
                        extra = hooks.extra_state() if hooks.extra_state is not None else None
                        write_checkpoint(backend, ckpt_dir, model, optimizer, scheduler, pos, extra,
                                         args.fingerprint)
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


def remove_checkpoint(ckpt_dir: Path | None) -> None:
    if ckpt_dir is not None and Path(ckpt_dir).exists():
        shutil.rmtree(ckpt_dir, ignore_errors=True)
