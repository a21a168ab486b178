"""Exclusive locks on run directories and rollout outputs (``fcntl.flock``).

Two ``qevolve evolve`` processes on one run directory, or two ``qevolve rollout`` on one
output/journal, would overwrite each other's files. :func:`exclusive` takes an
exclusive, non-blocking ``flock`` on a small lock file and holds it while the work runs
(a command holds it until it ends). The kernel drops the lock when the process dies, however
it dies (SIGKILL, OOM, a node reboot), so a crashed run never leaves a stale lock to
clean by hand: the next ``--resume`` simply takes it. The lock file itself stays (it
holds the last holder's PID); deleting it would open a race between a process that has
it open and one that creates a new one.

A second process fails at once with one line naming the holder's PID (:class:`LockedError`,
exit code 2) before it reads or writes anything else.

The lock file is opened close-on-exec, so programs started with exec (env workers,
``torchrun``) do not inherit it. Taking the same lock again in the process that holds it
nests (the evolve loop's stages); it is released when the outermost holder exits.
flock works on local file systems; on NFS it depends on the client and the mount (Linux ≥ 2.6.12
emulates it with NFS byte-range locks, which need a lock manager: NFSv3 lockd/statd, or NFSv4; a
mount with ``nolock`` / ``local_lock=all`` keeps the lock on one node only), see docs/cluster.md.

The stage commands that write an output (``policy``, ``critic``, ``label``; ``rollout`` and ``eval``
through the rollout loop) take :func:`hold_output`: under a multi-process launch (``torchrun``,
``deepspeed``: ``WORLD_SIZE`` > 1) rank 0 takes the lock and holds it for the run's life while the
other ranks wait for its verdict over the process group, so a refused run stops on every rank with
the same one line, before any rank reads a checkpoint.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from qevolve_cli.errors import QevolveError

RUN_DIR_LOCK = ".qevolve.lock"

# realpath of a lock file -> [fd, depth] for the locks this process holds
_held: dict[str, list[int]] = {}


class LockedError(QevolveError):
    """Another live process holds the lock."""

    def __init__(self, what: str | Path, lock_file: Path, pid: int | None, host: str | None = None,
                 hint: str = "wait for it to end or stop it, then rerun with --resume"):
        self.pid = pid
        who = f"pid {pid}" if pid else "a process whose pid is not written yet"
        if pid and host and host != socket.gethostname():
            who += f" on {host}"
        super().__init__(f"{what}: in use by another qevolve process ({who}; lock {lock_file}); {hint}")


def _holder(lock_file: str | Path) -> tuple[int | None, str | None]:
    try:
        words = Path(lock_file).read_text().split()
    except OSError:
        return None, None
    pid = int(words[0]) if words and words[0].isdigit() else None
    return pid, (words[1] if len(words) > 1 else None)


def holder_pid(lock_file: str | Path) -> int | None:
    """The PID written by the last process that took the lock (it may have ended)."""
    return _holder(lock_file)[0]


def is_locked(lock_file: str | Path) -> bool:
    """True while some process (this one included) holds the lock."""
    key = os.path.realpath(lock_file)
    if key in _held:
        return True
    try:
        fd = os.open(lock_file, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock we may just have taken
    return False


def acquire(lock_file: str | Path, what: str | Path, hint: str | None = None) -> None:
    """Take the lock or raise :class:`LockedError` (``hint``: what the user should do); nests within one
    process. The lock file gets this process's PID and host name (the host names the node of a
    multi-node run)."""
    lock_file = Path(lock_file)
    key = os.path.realpath(lock_file)
    if key in _held:
        _held[key][1] += 1
        return
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LockedError(what, lock_file, *_holder(lock_file), **({"hint": hint} if hint else {})) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    _held[key] = [fd, 1]


def release(lock_file: str | Path) -> None:
    key = os.path.realpath(lock_file)
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _held[key]
        os.close(entry[0])  # drops the flock


@contextlib.contextmanager
def exclusive(lock_file: str | Path, what: str | Path, hint: str | None = None) -> Iterator[None]:
    """Hold the lock on ``lock_file`` for the block (``what`` names the resource in the error)."""
    acquire(lock_file, what, hint)
    try:
        yield
    finally:
        release(lock_file)


def run_dir_lock(run_dir: str | Path) -> Path:
    """The lock file of an evolve run directory."""
    return Path(run_dir) / RUN_DIR_LOCK


def output_lock(out: str | Path) -> Path:
    """The lock file of a stage output (a table or a model directory; guards its work in progress,
    ``OUT.partial/``, too): ``.<name>.lock`` beside it."""
    out = Path(out)
    return out.with_name(f".{out.name}.lock")


STAGE_HINT = "wait for it to end or stop it, then rerun the same command (it resumes)"


def world_size() -> int:
    """The number of processes of this launch (``WORLD_SIZE`` set by torchrun / deepspeed; 1 without)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _process_group():
    """torch.distributed, joined (the launch's process group, created here when nothing created it yet:
    gloo for CPU tensors, plus NCCL for CUDA ones on a GPU machine; DeepSpeed and accelerate reuse it)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") == "cuda"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo")
    return dist


def share_verdict(verdict: str | None) -> str | None:
    """Rank 0's ``verdict`` (None: go on; else the error line) sent to every rank of the launch -> the verdict
    (every rank calls it; the ranks > 0 pass None)."""
    dist = _process_group()
    box = [verdict]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def hold_output(out: str | Path, hint: str = STAGE_HINT) -> Iterator[None]:
    """Hold the output lock of ``out`` for the block; under a multi-process launch rank 0 holds it and every
    rank gets its verdict: a run refused because another holds the lock stops on every rank with the same
    :class:`QevolveError` line before reading or writing anything."""
    lf = output_lock(out)
    if world_size() <= 1:
        with exclusive(lf, out, hint):
            yield
        return
    rank = int(os.environ.get("RANK", "0"))
    verdict: str | None = None
    if rank == 0:
        try:
            acquire(lf, out, hint)
        except QevolveError as e:
            verdict = str(e)
        except OSError as e:
            verdict = f"{lf}: cannot take the output lock ({e.strerror or e})"
    verdict = share_verdict(verdict)
    if verdict is not None:
        raise QevolveError(verdict)
    try:
        yield
    finally:
        if rank == 0:
            release(lf)

