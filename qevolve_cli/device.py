"""The device a stage runs on: ``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda[:N]``."""
from __future__ import annotations

from qevolve_cli.errors import QevolveError


def resolve_device(device: str = "auto") -> str:
    """``auto`` -> ``cuda`` or ``cpu``; ``cuda`` without a CUDA device is an error. Returns the name
    (``torch.device(resolve_device(x))`` where a device object is needed)."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise QevolveError("device: cuda requested but no CUDA device is available")
    return device
