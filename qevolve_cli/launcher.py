"""Workers of a launcher (torchrun, ``deepspeed``, ``accelerate launch``) die with it.

torchrun starts its workers in sessions of their own (``start_new_session``), so a scheduler that
kills the launcher's process group (Slurm's ``scancel``, a requeue, a SIGKILL to the job step) does
not reach them: they used to train on, rotating checkpoints under the requeued job. A worker now
asks the kernel, as it starts, to SIGKILL it when its parent (the launcher) dies
(``prctl(PR_SET_PDEATHSIG, SIGKILL)``, Linux).

Why the kernel and not a watchdog thread polling ``os.getppid()``: the signal is delivered at once
and whatever the worker is doing (a thread needs the GIL, which a rank blocked in a gloo/NCCL
collective or a long C++ kernel may hold for minutes), and it costs nothing while the launcher
lives. Why SIGKILL: a worker whose launcher is gone can no longer report to anyone, and every file a
stage writes is committed atomically (outputs, checkpoint pointers), so a kill at any moment leaves
the last complete state; the output lock dies with the rank 0 worker that held it.

Only processes started by a launcher do this (``LOCAL_RANK`` in the environment): a plain
``qevolve`` under ``nohup`` must outlive its shell. The signal follows the parent *thread* that
started the worker; torchrun's agent and DeepSpeed's launcher start workers from their main thread.
Not on Linux (macOS): nothing is done; stop the workers with the launcher's process group by hand.
"""
from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def launched_worker(environ: dict[str, str] | None = None) -> bool:
    """True in a worker process started by a distributed launcher (it sets ``LOCAL_RANK``)."""
    env = os.environ if environ is None else environ
    return "LOCAL_RANK" in env and "WORLD_SIZE" in env


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux) -> whether it is set up.

    A parent that died before the call (the process was reparented to init) is treated as dead now."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent == 1 or os.getppid() != parent:  # the launcher is already gone
        os.kill(os.getpid(), sig)
    return True


def die_with_launcher() -> bool:
    """At the start of a command: a launcher's worker dies with its launcher (see the module docstring)."""
    return launched_worker() and die_with_parent()
