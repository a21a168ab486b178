"""The suite's fork server (tests/forkserver.py, conftest.run_qevolve): a forked command is the process
``python -m qevolve_cli`` would be: same output, exit code, working directory and environment; a
timeout kills it; an environment a preloaded library would read differently gets a fresh interpreter."""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import FORK_SERVER, ROOT, run_qevolve


def untimed(stdout: str) -> str:
    """A command's stdout without the wall time its --json object reports (and the second model's name)."""
    out = stdout.replace("/m2", "/m")
    if out.startswith("{"):
        d = json.loads(out)
        d.pop("seconds", None)
        return json.dumps(d)
    return out


def test_a_forked_command_prints_and_exits_as_a_fresh_one(tmp_path):
    for args in (["label", tmp_path / "missing.parquet", "--out", tmp_path / "o.parquet"],  # a one-line error, exit 2
                 ["init-model", "--out", tmp_path / "m", "--json"],  # torch + transformers, a model written
                 ["label", "--no-such-option"]):  # Click's usage error
        n = FORK_SERVER.forked
        forked = run_qevolve(*args)
        assert FORK_SERVER.forked == n + 1
        if args[0] == "init-model":
            args[2] = tmp_path / "m2"
        fresh = run_qevolve(*args, fresh=True)
        assert FORK_SERVER.forked == n + 1
        assert forked.returncode == fresh.returncode
        assert forked.stderr.replace("/m2", "/m") == fresh.stderr.replace("/m2", "/m")
        assert untimed(forked.stdout) == untimed(fresh.stdout)
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == (tmp_path / "m2" / "model.safetensors").read_bytes()
    usage = run_qevolve("label", "--no-such-option")
    assert usage.returncode == 2 and "Usage: python -m qevolve_cli label" in usage.stderr, usage.stderr


def test_working_directory_and_late_read_variables_reach_the_child(tmp_path):
    log = tmp_path / "splits.log"
    n = FORK_SERVER.forked
    r = run_qevolve("expert", "--env", "lamps", "--limit", "1", "--out", "e.parquet", "-q", cwd=tmp_path,
                    env={"QEVOLVE_SPLIT_LOG": str(log)})
    assert r.returncode == 0, r.stderr
    assert FORK_SERVER.forked == n + 1
    assert (tmp_path / "e.parquet").is_file() and not (ROOT / "e.parquet").exists()
    lines = log.read_text().splitlines()
    assert lines and all(ln.split("\t")[1:] == ["lamps", "train"] for ln in lines), lines


def test_other_variables_get_a_fresh_interpreter(tmp_path):
    n = FORK_SERVER.forked
    r = run_qevolve("init-model", "--out", tmp_path / "m", "-q", env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert FORK_SERVER.forked == n  # read by torch's OpenMP runtime when it loads: not the server's value


def test_a_timeout_kills_the_child_and_the_server_goes_on(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_qevolve("expert", "--env", "textcraft", "--limit", "200", "--workers", "1", "--out", tmp_path / "e.parquet",
                    timeout=0.5)
    assert not (tmp_path / "e.parquet").exists()
    n = FORK_SERVER.forked
    assert run_qevolve("--version").returncode == 0 and FORK_SERVER.forked == n + 1
