"""The arguments, the hooks and the result of :func:`qevolve_cli.training.loop.train_loop`.

Plain dataclasses; the stage configs (``policy/config.py``, ``critic/config.py``) map their fields onto
:class:`TrainArgs`. Imports nothing heavy.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
