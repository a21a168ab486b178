"""Hugging Face Hub ids wherever a model is named: resolved through a real local HF cache (HF_HOME in a
temporary directory, offline: nothing is downloaded), and one line saying how to download a model that is
neither cached nor reachable."""
from __future__ import annotations

import shutil
from pathlib import Path

import polars as pl
import pytest

from tests.conftest import run_qevolve

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture()
def hf_cache(tmp_path, monkeypatch, tiny_model_dir) -> Path:
    """``$HF_HOME/hub`` holding ``qevolve-test/tiny`` (main and revision ``v1``) in huggingface_hub's layout."""
    home = tmp_path / "hf_home"
    repo = home / "hub" / "models--qevolve-test--tiny"
    snap = repo / "snapshots" / REV
    shutil.copytree(tiny_model_dir, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    (repo / "refs" / "v1").write_text(REV)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snap


def test_resolve_model_local_cached_and_missing(hf_cache, tmp_path) -> None:
    import subprocess
    import sys

    from tests.conftest import qevolve_env

    code = (
        "from qevolve_cli.models.hub import resolve_model, is_hub_id\n"
        "from qevolve_cli.errors import QevolveError\n"
        f"print(resolve_model('qevolve-test/tiny'))\n"
        f"print(resolve_model('qevolve-test/tiny@v1'))\n"
        f"print(resolve_model({str(tmp_path)!r}))\n"
        "print(resolve_model('nobody/nothing', required=False))\n"
        "print(is_hub_id('runs/bc'), is_hub_id('runs/bc/policy'), is_hub_id('./x/y'), is_hub_id('a/b/c'), is_hub_id('Qwen/Qwen2.5-7B-Instruct'))\n"
        "try:\n    resolve_model('nobody/nothing', '--policy')\nexcept QevolveError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=qevolve_env(), capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert lines[0] == str(hf_cache) and lines[1] == str(hf_cache)
    assert lines[2] == str(tmp_path) and lines[3] == "nobody/nothing"
    # runs/bc is Hub-id-shaped: with no such directory it is taken as an id (whose error says both)
    assert lines[4] == "True False False False True"
    assert lines[5].startswith("--policy nobody/nothing: not a local directory and not in the Hugging Face cache")
    assert "hf download nobody/nothing" in lines[5]


def test_rollout_with_hub_id_equals_local_dir(hf_cache, tiny_model_dir, tmp_path) -> None:
    common = ["--env", "textcraft", "--split", "train", "--max-tasks", "2", "--n-per-task", "1", "--max-steps", "2",
              "--max-new-tokens", "8", "--temperature", "0", "--workers", "1", "-q"]
    run_qevolve("rollout", "--policy", "qevolve-test/tiny", "--out", tmp_path / "hub.parquet", *common, check=True)
    run_qevolve("rollout", "--policy", tiny_model_dir, "--out", tmp_path / "dir.parquet", *common, check=True)
    a = pl.read_parquet(tmp_path / "hub.parquet").sort(["traj_id", "step"])
    b = pl.read_parquet(tmp_path / "dir.parquet").sort(["traj_id", "step"])
    assert a.select("traj_id", "step", "action").equals(b.select("traj_id", "step", "action"))
    # the resolved config names the cached snapshot
    assert str(hf_cache) in (tmp_path / "hub.parquet.config.yaml").read_text()


@pytest.mark.parametrize("argv,option", [
    (["rollout", "--env", "textcraft", "--policy", "nobody/nothing", "--out", "o.parquet"], "--policy"),
    (["eval", "--env", "textcraft", "--policy", "nobody/nothing", "--split", "test_seen", "--out", "o.parquet"], "--policy"),
    (["rollout", "--env", "textcraft", "--policy", "qevolve-test/tiny", "--adapter", "nobody/lora", "--out", "o.parquet"],
     "--adapter"),
    (["policy", "--data", "d.parquet", "--model", "nobody/nothing", "--out", "p"], "--model"),
    (["policy", "--data", "d.parquet", "--model", "qevolve-test/tiny", "--ref", "nobody/ref", "--out", "p"], "--ref"),
    (["critic", "--data", "d.parquet", "--model", "nobody/nothing", "--out", "c"], "--model"),
    (["evolve", "--env", "textcraft", "--model", "nobody/nothing", "--run-dir", "r"], "--model"),
    (["label", "d.parquet", "--out", "l.parquet", "--tokenizer", "nobody/nothing"], "--tokenizer"),
])
def test_uncached_hub_id_offline_is_one_line(hf_cache, tmp_path, argv, option) -> None:
    res = run_qevolve(*argv, "-q" if argv[0] not in ("label", "policy", "critic") else "--json", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {option} nobody/"), lines
    assert "not in the Hugging Face cache" in lines[0] and "hf download nobody/" in lines[0]
    assert not any(p.name.startswith(("o.parquet", "p", "c", "r", "l.parquet")) for p in tmp_path.iterdir()
                   if p.name != "hf_home")


def test_openai_backend_sends_the_hub_id_as_model(hf_cache, tmp_path) -> None:
    """With --backend openai a cached Hub id is still the served model's name (the cache only gives the
    tokenizer for prompt lengths); an uncached one is passed through unchanged."""
    from tests.test_rollout import _ChatServer

    server = _ChatServer(hf_cache)
    try:
        for name in ("qevolve-test/tiny", "someone/served-only"):
            out = tmp_path / f"{name.split('/')[0]}.parquet"
            run_qevolve("rollout", "--env", "textcraft", "--policy", name, "--backend", "openai", "--base-url",
                        server.url, "--split", "train", "--max-tasks", "1", "--n-per-task", "1", "--max-steps", "1",
                        "--max-new-tokens", "8", "--workers", "1", "--out", out, "-q", check=True)
            assert server.requests[-1]["model"] == name
    finally:
        server.close()
