"""Single-process PyTorch (:class:`TorchBackend`) and plain DDP through accelerate (:class:`AccelerateBackend`).

torch, safetensors and accelerate are imported inside the methods (this module is imported by every
command that trains, and by ``--help``).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from qevolve_cli.errors import QevolveError


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
        """Write the trainable parameters (safetensors) and the optimiser state (none when ``optimizer`` is
        None: a final checkpoint) into ``tag_dir`` (rank 0: the state is replicated). Called on every rank
        (the DeepSpeed backend's is a collective)."""
        import torch
        from safetensors.torch import save_file

        if self.is_main:
            save_file(_trainable_state(self.unwrap(model)), str(tag_dir / "trainable.safetensors"))
            if optimizer is not None:
                torch.save(optimizer.state_dict(), tag_dir / "optimizer.pt")

    def load_state(self, tag_dir: Path, model, optimizer) -> None:
        import torch

        m = self.unwrap(model)
        m.load_state_dict(_read_trainable_state(tag_dir, m), strict=False)
        if optimizer is not None:  # None: a final checkpoint, written without it
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


def _dist_sum(values: list[float], device: str) -> list[float]:
    import torch
    import torch.distributed as dist

    if not values or not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(x) for x in t.cpu()]


def _read_trainable_state(tag_dir: Path, model) -> dict:
    """``tag_dir/trainable.safetensors`` (what :meth:`TorchBackend.save_state` writes), checked against ``model``'s
    names: a checkpoint of another model is a one-line error."""
    from safetensors.torch import load_file

    params = load_file(str(tag_dir / "trainable.safetensors"))
    unknown = set(params) - set(model.state_dict())
    if unknown:
        raise QevolveError(f"{tag_dir}: checkpoint does not match the model (e.g. {sorted(unknown)[0]}); "
                           "delete it to start over")
    return params


def _trainable_state(model) -> dict:
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k in names}
