"""The one place that decides fp32 or bf16 (docs/performance.md "Precision").

``auto`` means bf16 on CUDA; on a CPU that reports ``avx512_bf16`` or AMX (``amx_bf16``) in
``/proc/cpuinfo`` (native bf16 matrix instructions) bf16 for generation (rollout, eval: greedy actions
identical to fp32 on SmolLM2, 1.6x faster) and fp32 for training (the policy's autocast, the critic's
backbone: bf16 with LoRA learned less than fp32 on SmolLM2); fp32 on any other CPU (bf16 there is
emulated and slower than fp32).
``QEVOLVE_PRECISION=fp32|bf16`` in the environment replaces ``auto`` everywhere (the test suite sets
fp32 so that its figures do not depend on the machine); an explicit ``fp32``/``bf16`` in a config
always wins.

What bf16 means depends on the stage, and every stage asks this module:

* generation (rollout, eval: the hf backend, vLLM on CPU), the feature critic's no-grad pass and the
  critic's frozen backbone load **bf16 weights** (``dtype`` fields: auto | float32 | bfloat16);
* training (policy BC / BPPO, ``precision`` field: auto | fp32 | bf16) keeps **fp32 master weights**
  and runs the forward pass under bf16 **autocast**.

No torch import at module level: ``qevolve doctor`` and config validation read it cheaply.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from qevolve_cli.errors import QevolveError

PRECISIONS = ("auto", "fp32", "bf16")
ENV_VAR = "QEVOLVE_PRECISION"
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # any one is enough
DTYPE_OF = {"fp32": "float32", "bf16": "bfloat16"}
PRECISION_OF = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class Choice:
    """A resolved precision: ``name`` is ``fp32`` or ``bf16``; ``reason`` says why, in one phrase."""

    name: str
    reason: str

    @property
    def dtype(self) -> str:
        """The torch dtype's name (``float32`` / ``bfloat16``)."""
        return DTYPE_OF[self.name]


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags of the first processor in ``cpuinfo`` (empty where the file does not exist:
    macOS, Windows)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_bf16_flag(flags: frozenset[str] | set[str]) -> str | None:
    """The flag that makes bf16 fast on this CPU (``avx512_bf16`` or ``amx_bf16``), None without one."""
    return next((f for f in BF16_CPU_FLAGS if f in flags), None)


def _device_type(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else device


TRAINING_ON_CPU = ("auto: training on CPU stays fp32 (bf16 autocast with LoRA learned less than fp32 on "
                   "SmolLM2: docs/performance.md)")


def resolve(precision: str = "auto", device: str = "auto", *, flags: frozenset[str] | set[str] | None = None,
            env: dict[str, str] | None = None, training: bool = False) -> Choice:
    """``precision`` (auto | fp32 | bf16, or a dtype name: float32 | bfloat16) on ``device`` -> a :class:`Choice`.

    ``flags`` (default: this machine's ``/proc/cpuinfo``) and ``env`` (default: ``os.environ``) are
    parameters so that the rule is testable on any machine. ``training``: the policy's autocast and the
    critic's backbone, which stay fp32 on CPU under ``auto`` (the measurement: docs/performance.md)."""
    name = PRECISION_OF.get(precision, precision)
    if name not in PRECISIONS:
        raise QevolveError(f"precision: unknown value {precision!r} (choose from auto, fp32, bf16)")
    if name != "auto":
        return Choice(name, f"{name} requested")
    env = os.environ if env is None else env
    forced = env.get(ENV_VAR, "").strip()
    if forced:
        if forced not in ("fp32", "bf16"):
            raise QevolveError(f"{ENV_VAR}: unknown value {forced!r} (fp32 or bf16; unset it for auto)")
        return Choice(forced, f"{ENV_VAR}={forced}")
    kind = _device_type(device)
    if kind == "cuda":
        return Choice("bf16", "auto: CUDA device")
    flag = cpu_bf16_flag(cpu_flags() if flags is None else flags)
    if flag is None:
        return Choice("fp32", "auto: the CPU reports neither avx512_bf16 nor amx_bf16 (bf16 would be emulated)")
    if training:
        return Choice("fp32", TRAINING_ON_CPU)
    return Choice("bf16", f"auto: the CPU reports {flag}")


def resolve_dtype(dtype: str = "auto", device: str = "auto", **kw: object):
    """A ``dtype`` field (auto | float32 | bfloat16 | float16) -> the torch dtype (float16 passes through)."""
    import torch

    if dtype == "float16":
        return torch.float16
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[resolve(dtype, device, **kw).name]
