"""A requeued job must not run beside its predecessor (docs/cluster.md#locks).

* every stage command that writes an output (policy, critic, label) refuses an output whose lock another live
  process holds, with one line, before reading anything;
* under torchrun, rank 0 holds the output lock for the run's life and the other ranks get its verdict: a
  second launch on the same output stops on every rank with the same line, no traceback of qevolve's;
* the workers die with their launcher (qevolve_cli/launcher.py: PR_SET_PDEATHSIG): SIGKILL to the launcher's
  process group, as a scheduler sends it, leaves no worker training, the lock is free again and the last
  committed checkpoint is complete.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qevolve_cli import lock
from tests.conftest import ROOT, ds_env, qevolve_env
from tests.test_policy import make_table

ZERO2 = ROOT / "configs" / "deepspeed" / "zero2.json"
HOLD = ("import sys, time; from qevolve_cli.lock import acquire, output_lock; acquire(output_lock(sys.argv[1]), "
        "sys.argv[1]); print('held', flush=True); time.sleep(600)")


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("launch") / "hybrid.parquet"
    make_table(p, n_traj=8, steps=2)
    return p


def test_stage_commands_refuse_an_output_held_by_another_process(table, tiny_model_dir, tmp_path):
    """policy, critic and label on an output another process holds: exit 2, one line naming the holder, nothing
    written (in this process through Typer's runner, the holder a real second process)."""
    from typer.testing import CliRunner

    from qevolve_cli.cli import app

    cmds = {"policy": ["policy", "--objective", "bc", "--data", table, "--model", tiny_model_dir],
            "critic": ["critic", "--data", table, "--model", tiny_model_dir],
            "label": ["label", table]}
    for name, args in cmds.items():
        out = tmp_path / name
        holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=ROOT, env=qevolve_env(),
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            r = CliRunner().invoke(app, [str(a) for a in [*args, "--out", out]])
            assert r.exit_code == 2, (name, r.output[-2000:], r.exception)
            lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
            assert len(lines) == 1 and lines[0].startswith(
                f"error: {out}: in use by another qevolve process (pid {holder.pid};"), (name, r.stderr)
            assert "rerun" in lines[0] and "--resume" not in lines[0]  # these commands resume by themselves
            assert not out.exists() and not (tmp_path / f"{name}.partial").exists()
        finally:
            holder.kill()
            holder.wait(timeout=30)


def _children(pid: int) -> list[int]:
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d.name))
    return kids


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper is dead)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait(cond, timeout: float, what: str) -> None:
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
@pytest.mark.usefixtures("deepspeed_cpu")
@pytest.mark.timeout(300)
def test_killed_launcher_takes_its_workers_and_a_second_launch_is_refused(table, tiny_model_dir, tmp_path):
    """A DeepSpeed ZeRO-2 policy run on 2 ranks (torchrun, CPU accelerator, gloo), checkpointing every step. While
    it trains, a second launch on the same output is refused on both ranks with rank 0's one line (the first
    run's rank 0 holds the lock). Then the first launcher's process group is SIGKILLed (its workers are in
    sessions of their own, out of that group's reach): the workers die with it at once, the lock is free and the
    checkpoint they left is complete."""
    pytest.importorskip("deepspeed")
    from qevolve_cli.training import read_checkpoint_pointer

    out = tmp_path / "pol"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "qevolve_cli",
           "policy", "--objective", "bc", "--data", str(table), "--model", str(tiny_model_dir), "--out", str(out),
           "--full", "--set", "micro_batch_size=1", "--set", "grad_accum_steps=2", "--epochs", "1000",
           "--set", f"deepspeed={ZERO2}", "--set", "checkpoint_every_steps=1", "--quiet"]
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115
    first = subprocess.Popen(cmd, cwd=ROOT, env=ds_env(), stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)  # its own process group, as a batch job's
    workers: list[int] = []
    try:
        ckpt = tmp_path / "pol.partial"
        _wait(lambda: (ckpt / "checkpoint.json").exists() or first.poll() is not None, 180, "a committed checkpoint")
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        workers = _children(first.pid)
        assert len(workers) == 2 and lock.holder_pid(lock.output_lock(out)) in workers
        assert all(os.getpgid(w) != first.pid for w in workers)  # torchrun starts them in sessions of their own

        second = subprocess.run(cmd, cwd=ROOT, env=ds_env(), capture_output=True, text=True, timeout=180)
        assert second.returncode != 0
        errs = [ln for ln in second.stderr.splitlines() if ln.startswith("error:")]
        holder = lock.holder_pid(lock.output_lock(out))
        assert len(errs) == 2 and errs[0] == errs[1], second.stderr[-3000:]  # one line per rank, rank 0's verdict
        assert errs[0].startswith(f"error: {out}: in use by another qevolve process (pid {holder};")
        # torchrun reports the failed workers in a traceback of its own; none comes from qevolve or DeepSpeed
        assert f'File "{ROOT / "qevolve_cli"}' not in second.stderr and "AssertionError" not in second.stderr
        assert first.poll() is None and all(_alive(w) for w in workers)  # the first run trains on

        os.killpg(first.pid, signal.SIGKILL)  # what a scheduler does to the job step
        first.wait(timeout=30)
        # (a killed worker's main thread shows as a zombie while its other threads still exit: the lock goes
        # with the last one)
        _wait(lambda: not any(_alive(w) for w in workers) and not lock.is_locked(lock.output_lock(out)), 20,
              "the workers to die with their launcher and their lock with them")
        meta = read_checkpoint_pointer(ckpt)  # complete: every file it lists is there, of its size
        assert meta["step"] >= 1 and meta["world_size"] == 2 and not out.exists()
    finally:
        log.close()
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(timeout=30)
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
