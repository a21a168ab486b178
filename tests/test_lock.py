"""qevolve_cli/lock.py against real processes: a live holder refuses others, a SIGKILLed one frees the lock.

The CLI-level checks (two `evolve` on one run directory, two `rollout --resume` on one journal) are in
tests/test_evolve.py::test_resume_after_kill_mid_stage and tests/test_rollout.py::test_rollout_resume_after_kill.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from qevolve_cli import lock
from qevolve_cli.errors import QevolveError
from tests.conftest import ROOT, qevolve_env

HOLD = ("import sys, time; from qevolve_cli.lock import acquire; acquire(sys.argv[1], 'run'); "
        "print('held', flush=True); time.sleep(600)")


def _holder(lock_file) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(lock_file)], cwd=ROOT, env=qevolve_env(),
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_live_holder_refuses_and_sigkill_frees(tmp_path):
    lf = lock.run_dir_lock(tmp_path / "run")
    p = _holder(lf)
    try:
        assert lock.is_locked(lf) and lock.holder_pid(lf) == p.pid
        with pytest.raises(lock.LockedError) as e:
            lock.acquire(lf, tmp_path / "run")
        assert isinstance(e.value, QevolveError) and e.value.pid == p.pid
        msg = str(e.value)
        assert msg.startswith(f"{tmp_path / 'run'}: in use by another qevolve process (pid {p.pid};") and "\n" not in msg
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    # no cleanup by hand: the kernel dropped the lock with the process
    assert not lock.is_locked(lf) and lf.exists()
    with lock.exclusive(lf, "run"):
        assert lock.is_locked(lf) and lock.holder_pid(lf) == __import__("os").getpid()
    assert not lock.is_locked(lf)


def test_nested_in_one_process_and_released_after(tmp_path):
    lf = lock.output_lock(tmp_path / "r.parquet")
    assert lf.name == ".r.parquet.lock"
    with lock.exclusive(lf, "r"):
        with lock.exclusive(lf, "r"):  # the evolve loop's stages take the same lock again
            pass
        # still held after the inner block: another process is refused
        p = subprocess.run([sys.executable, "-c", "import sys; from qevolve_cli.lock import acquire; "
                            "acquire(sys.argv[1], 'r')", str(lf)], cwd=ROOT, env=qevolve_env(),
                           capture_output=True, text=True)
        assert p.returncode == 1 and "LockedError" in p.stderr
    assert not lock.is_locked(lf)
    # and free once the outer block ended: another process takes it
    t0 = time.time()
    p = _holder(lf)
    p.kill()
    p.wait(timeout=30)
    assert time.time() - t0 < 60
