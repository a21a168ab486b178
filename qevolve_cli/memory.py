"""Handing a finished stage's memory back to the operating system.

``qevolve evolve`` and ``qevolve compare`` run every stage in one process. glibc keeps the heap
memory a stage freed (for the process's next allocations) instead of returning it, so a run's
resident size stays at its largest stage's peak for hours: BC of SmolLM2 on TextCraft
(8,192-token micro-batches, fp32 activations) peaks near 20 GB, and the evaluations after it need
about 4. :func:`release_memory` runs after every stage (``RunDir.run_stage``).
"""
from __future__ import annotations

import ctypes
import functools
import gc
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def release_memory() -> bool:
    """Collect garbage, then return the C heap's free pages to the operating system (glibc's
    ``malloc_trim(0)``, which also releases free pages inside the heap, not only at its top).
    Measured after one SmolLM2 LoRA forward and backward on 2 x 2,048 tokens, the tensors freed: resident
    4.79 GiB before, 1.24 GiB after. Returns whether the heap was trimmed (False where there is no
    ``malloc_trim``: then only garbage is collected)."""
    gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
