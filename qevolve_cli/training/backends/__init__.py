"""The backends the loop runs through, chosen by :func:`make_backend` from :class:`TrainArgs`.

* ``args.deepspeed`` set (a JSON config, ``configs/deepspeed/zero2.json`` / ``zero3.json``):
  :class:`~qevolve_cli.training.backends.deepspeed.DeepSpeedBackend`, one ``deepspeed.initialize``
  engine (on CPU DeepSpeed's CPU accelerator with gloo). Launch with ``torchrun --nproc_per_node N -m
  qevolve_cli ...`` (or ``deepspeed`` / ``accelerate launch``); without a launcher a one-rank group is
  created. Checkpoints are the engine's own (every rank writes its ZeRO partition) and resume with the
  same number of ranks and ZeRO stage only;
* ``WORLD_SIZE > 1`` without a DeepSpeed config: :class:`~qevolve_cli.training.backends.torch.AccelerateBackend`
  (plain DDP through accelerate);
* otherwise :class:`~qevolve_cli.training.backends.torch.TorchBackend` (one process, CPU or one GPU).

Every backend has the same small interface (``prepare``, ``autocast``, ``backward``, ``optimizer_step``,
``zero_grad``, ``save_state`` / ``load_state``, ``barrier``, ``all_reduce_sum``, ``unwrap``,
``full_state_dict``); torch, accelerate and DeepSpeed are imported lazily.
"""
from __future__ import annotations

import os

from qevolve_cli import precision as precision_rule
from qevolve_cli.device import resolve_device
from qevolve_cli.training.args import TrainArgs
from qevolve_cli.training.backends.deepspeed import DeepSpeedBackend
from qevolve_cli.training.backends.torch import AccelerateBackend, TorchBackend


def resolve_precision(precision: str, device: str, deepspeed: bool = False) -> str:
    """``auto`` | ``fp32`` | ``bf16`` -> ``fp32`` or ``bf16`` (the rule: :mod:`qevolve_cli.precision`; bf16 here
    is autocast over fp32 master weights). DeepSpeed's CPU accelerator stays fp32 under ``auto``: its bf16
    engine would keep the model in 16 bits, and the CPU runs are launch tests, not speed runs."""
    if precision == "auto" and deepspeed and not device.startswith("cuda") and not os.environ.get(precision_rule.ENV_VAR):
        return "fp32"
    return precision_rule.resolve(precision, device, training=True).name


def is_main_process() -> bool:
    """False on the ranks > 0 of a multi-process launch (they print nothing); True otherwise."""
    import sys

    dist_mod = sys.modules.get("torch.distributed")
    if dist_mod is not None and dist_mod.is_available() and dist_mod.is_initialized():
        return dist_mod.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def make_backend(args: TrainArgs, grad_accum: int = 1):
    device = resolve_device(args.device)
    precision = resolve_precision(args.precision, device, deepspeed=args.deepspeed is not None)
    if args.deepspeed is not None:
        return DeepSpeedBackend(args.deepspeed, precision, args.device, grad_accum, args.max_grad_norm)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return AccelerateBackend(precision)
    return TorchBackend(device, precision)
