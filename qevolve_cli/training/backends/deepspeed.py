"""DeepSpeed ZeRO-0/1/2/3: config checking and ``"auto"`` resolution, process-group start-up and teardown,
and :class:`DeepSpeedBackend`. DeepSpeed itself is imported lazily (:func:`init_deepspeed`).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from qevolve_cli.device import resolve_device
from qevolve_cli.errors import QevolveError
from qevolve_cli.training.backends.torch import (
    TorchBackend,
    _dist_sum,
    _read_trainable_state,
    _trainable_state,
)

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
        weights and Adam moments (and its parameter shard under ZeRO-3) in ``tag_dir/engine/``.
        ``optimizer`` None (a final checkpoint, which nothing trains from): only the trainable weights, gathered
        on rank 0 under ZeRO-3, in ``tag_dir/trainable.safetensors`` (the torch backend's file)."""
        if optimizer is not None:
            self.engine.save_checkpoint(str(tag_dir), tag="engine", client_state={}, save_latest=False,
                                        exclude_frozen_parameters=self._frozen())
            return
        from safetensors.torch import save_file

        module = self.engine.module
        with self._gathered([p for p in module.parameters() if p.requires_grad], modifier_rank=None):
            if self.is_main:  # written inside the context, while the gathered tensors are whole
                save_file(_trainable_state(module), str(tag_dir / "trainable.safetensors"))

    def load_state(self, tag_dir: Path, model, optimizer) -> None:
        if optimizer is not None:
            path, _ = self.engine.load_checkpoint(str(tag_dir), tag="engine", load_module_strict=not self._frozen(),
                                                  load_optimizer_states=True, load_lr_scheduler_states=False)
            if path is None:
                raise QevolveError(f"{tag_dir}: DeepSpeed found no checkpoint to load; delete it to start over")
            return
        # a final checkpoint: the weights alone (the ZeRO optimiser's master copies stay behind; nothing steps again)
        import torch

        state = _read_trainable_state(tag_dir, self.engine.module)
        params = dict(self.engine.module.named_parameters())
        with self._gathered([params[n] for n in state], modifier_rank=0), torch.no_grad():
            if self.stage < 3 or self.is_main:  # ZeRO-3: rank 0 writes, the context partitions it again
                for n, t in state.items():
                    params[n].data.copy_(t.to(params[n].dtype))

    def _gathered(self, params: list, modifier_rank: int | None):
        """ZeRO-3: the full tensors of ``params`` inside the context (``deepspeed.zero.GatheredParameters``, a
        collective); other stages hold them whole already."""
        import contextlib

        if self.stage < 3:
            return contextlib.nullcontext()
        return self.ds.zero.GatheredParameters(params, modifier_rank=modifier_rank)
