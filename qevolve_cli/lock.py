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
flock works on local file systems; on NFS it depends on the server (Linux ≥ 2.6.12 emulates
it with POSIX locks).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from qevolve_cli.errors import QevolveError

RUN_DIR_LOCK = ".qevolve.lock"

# realpath of a lock file -> [fd, depth] for the locks this process holds
_held: dict[str, list[int]] = {}


class LockedError(QevolveError):
    """Another live process holds the lock."""

    def __init__(self, what: str | Path, lock_file: Path, pid: int | None):
        self.pid = pid
        who = f"pid {pid}" if pid else "a process whose pid is not written yet"
        super().__init__(f"{what}: in use by another qevolve process ({who}; lock {lock_file}); "
                         "wait for it to end or stop it, then rerun with --resume")


def holder_pid(lock_file: str | Path) -> int | None:
    """The PID written by the last process that took the lock (it may have ended)."""
    try:
        text = Path(lock_file).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


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


def acquire(lock_file: str | Path, what: str | Path) -> None:
    """Take the lock or raise :class:`LockedError`; nests within one process."""
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
        raise LockedError(what, lock_file, holder_pid(lock_file)) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
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
def exclusive(lock_file: str | Path, what: str | Path) -> Iterator[None]:
    """Hold the lock on ``lock_file`` for the block (``what`` names the resource in the error)."""
    acquire(lock_file, what)
    try:
        yield
    finally:
        release(lock_file)


def run_dir_lock(run_dir: str | Path) -> Path:
    """The lock file of an evolve run directory."""
    return Path(run_dir) / RUN_DIR_LOCK


def output_lock(out: str | Path) -> Path:
    """The lock file of a rollout/eval output table (guards its journal too): ``.<name>.lock`` beside it."""
    out = Path(out)
    return out.with_name(f".{out.name}.lock")
