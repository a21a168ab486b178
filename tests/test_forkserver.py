"""The suite's fork server (tests/forkserver.py, conftest.run_qevolve): a forked command is the process
``python -m qevolve_cli`` would be: same output, exit code, working directory and environment; a
timeout kills it; an environment a preloaded library would read differently gets a fresh interpreter."""
from __future__ import annotations

import json
import subprocess

import pytest

import tests.conftest as conftest
from tests.conftest import ROOT, ForkServer, run_qevolve


@pytest.fixture(scope="module")
def own_server():
    s = ForkServer()
    yield s
    s.close()


@pytest.fixture
def server(own_server, monkeypatch) -> ForkServer:
    """A server of this file's own, so that its counters (commands forked, restarts) count this file's
    commands only."""
    monkeypatch.setattr(conftest, "FORK_SERVER", own_server)
    return own_server


def untimed(stdout: str) -> str:
    """A command's stdout without the wall time its --json object reports (and the second model's name)."""
    out = stdout.replace("/m2", "/m")
    if out.startswith("{"):
        d = json.loads(out)
        d.pop("seconds", None)
        return json.dumps(d)
    return out


def test_a_forked_command_prints_and_exits_as_a_fresh_one(server, tmp_path):
    for args in (["label", tmp_path / "missing.parquet", "--out", tmp_path / "o.parquet"],  # a one-line error, exit 2
                 ["init-model", "--out", tmp_path / "m", "--json"],  # torch + transformers, a model written
                 ["label", "--no-such-option"]):  # Click's usage error
        n = server.forked
        forked = run_qevolve(*args)
        assert server.forked == n + 1
        if args[0] == "init-model":
            args[2] = tmp_path / "m2"
        fresh = run_qevolve(*args, fresh=True)
        assert server.forked == n + 1
        assert forked.returncode == fresh.returncode
        assert forked.stderr.replace("/m2", "/m") == fresh.stderr.replace("/m2", "/m")
        assert untimed(forked.stdout) == untimed(fresh.stdout)
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == (tmp_path / "m2" / "model.safetensors").read_bytes()
    usage = run_qevolve("label", "--no-such-option")
    assert usage.returncode == 2 and "Usage: python -m qevolve_cli label" in usage.stderr, usage.stderr


def test_working_directory_and_late_read_variables_reach_the_child(server, tmp_path):
    log = tmp_path / "splits.log"
    n = server.forked
    r = run_qevolve("expert", "--env", "lamps", "--limit", "1", "--out", "e.parquet", "-q", cwd=tmp_path,
                    env={"QEVOLVE_SPLIT_LOG": str(log)})
    assert r.returncode == 0, r.stderr
    assert server.forked == n + 1
    assert (tmp_path / "e.parquet").is_file() and not (ROOT / "e.parquet").exists()
    lines = log.read_text().splitlines()
    assert lines and all(ln.split("\t")[1:] == ["lamps", "train"] for ln in lines), lines


def test_other_variables_get_a_fresh_interpreter(server, tmp_path):
    n = server.forked
    r = run_qevolve("init-model", "--out", tmp_path / "m", "-q", env={"HF_HOME": str(tmp_path / "hf")})
    assert r.returncode == 0, r.stderr
    assert server.forked == n  # read by huggingface_hub when it is imported: not the server's value


def test_a_timeout_kills_the_child_and_the_server_goes_on(server, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_qevolve("expert", "--env", "textcraft", "--limit", "200", "--workers", "1", "--out", tmp_path / "e.parquet",
                    timeout=0.5)
    assert not (tmp_path / "e.parquet").exists()
    n = server.forked
    assert run_qevolve("--version").returncode == 0 and server.forked == n + 1


def test_a_changed_environment_restarts_the_server(server, tmp_path, monkeypatch):
    """A test that changes os.environ for good (in-process DeepSpeed sets MASTER_ADDR): the first command under
    the change runs in a fresh interpreter, the second gets a server started with the new environment, and the
    commands after it are forked again."""
    assert run_qevolve("--version").returncode == 0
    n, restarts = server.forked, server.restarts
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # read by huggingface_hub when it is imported
    for _ in range(3):
        assert run_qevolve("--version").returncode == 0
    assert server.forked == n + 2 and server.restarts == restarts + 1
    assert server.env["HF_HOME"] == str(tmp_path / "hf")


def test_a_change_for_one_command_keeps_the_server(server, tmp_path, monkeypatch):
    """A test that sets HF_HOME for one command and reverts it (tests/test_hub.py): that command runs fresh,
    and the server, still right for the environment after it, forks the next one without a restart."""
    for _ in range(2):  # a server for this test's environment, whatever the test before left
        assert run_qevolve("--version").returncode == 0
    n, restarts, proc = server.forked, server.restarts, server.proc
    with monkeypatch.context() as m:
        m.setenv("HF_HOME", str(tmp_path / "hf"))
        assert run_qevolve("--version").returncode == 0
    assert server.forked == n and server.restarts == restarts
    assert run_qevolve("--version").returncode == 0
    assert server.forked == n + 1 and server.restarts == restarts and server.proc is proc
