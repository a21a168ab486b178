"""The one precision rule (qevolve_cli/precision.py): auto = bf16 on CUDA and on CPUs with native bf16, fp32
elsewhere; an explicit value or QEVOLVE_PRECISION wins; every stage asks it."""
from __future__ import annotations

import pytest

from qevolve_cli import precision as P
from qevolve_cli.errors import QevolveError

AMD = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n\nprocessor\t: 1\n"
SPR = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_tile amx_bf16 amx_int8\n"
OLD = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes\n"


@pytest.mark.parametrize("text,flag", [(AMD, "avx512_bf16"), (SPR, "amx_bf16"), (OLD, None), (ARM, None), ("", None)])
def test_cpu_flags_and_bf16_flag(tmp_path, text, flag):
    p = tmp_path / "cpuinfo"
    p.write_text(text)
    assert P.cpu_bf16_flag(P.cpu_flags(p)) == flag


def test_missing_cpuinfo_means_no_flags(tmp_path):
    assert P.cpu_flags(tmp_path / "absent") == frozenset()


def test_auto_rule():
    no_env: dict[str, str] = {}
    bf = P.resolve("auto", "cpu", flags={"avx512_bf16"}, env=no_env)
    assert (bf.name, bf.dtype) == ("bf16", "bfloat16") and "avx512_bf16" in bf.reason
    assert P.resolve("auto", "cpu", flags={"amx_bf16"}, env=no_env).name == "bf16"
    fp = P.resolve("auto", "cpu", flags={"avx2", "avx512f"}, env=no_env)
    assert (fp.name, fp.dtype) == ("fp32", "float32") and "neither" in fp.reason
    assert P.resolve("auto", "cuda:1", flags=set(), env=no_env).name == "bf16"
    # training (policy autocast, critic backbone) stays fp32 on CPU, bf16 on CUDA
    tr = P.resolve("auto", "cpu", flags={"avx512_bf16"}, env=no_env, training=True)
    assert tr.name == "fp32" and "training on CPU" in tr.reason
    assert P.resolve("auto", "cpu", flags=set(), env=no_env, training=True).reason == fp.reason
    assert P.resolve("auto", "cuda", flags=set(), env=no_env, training=True).name == "bf16"
    assert P.resolve("bf16", "cpu", flags=set(), env=no_env, training=True).name == "bf16"


def test_explicit_and_environment_win():
    assert P.resolve("fp32", "cpu", flags={"avx512_bf16"}, env={}).name == "fp32"
    assert P.resolve("float32", "cuda", flags=set(), env={"QEVOLVE_PRECISION": "bf16"}).name == "fp32"
    assert P.resolve("bfloat16", "cpu", flags=set(), env={}).name == "bf16"
    forced = P.resolve("auto", "cpu", flags={"avx512_bf16"}, env={"QEVOLVE_PRECISION": "fp32"})
    assert forced.name == "fp32" and "QEVOLVE_PRECISION" in forced.reason
    with pytest.raises(QevolveError, match="QEVOLVE_PRECISION"):
        P.resolve("auto", "cpu", flags=set(), env={"QEVOLVE_PRECISION": "fp16"})
    with pytest.raises(QevolveError, match="unknown value 'int8'"):
        P.resolve("int8", "cpu")


def test_stages_follow_the_rule(monkeypatch):
    """Training (autocast), the critic backbone and the hf backend's dtype all come from the one rule."""
    import torch

    from qevolve_cli.critic.model import resolve_dtype as critic_dtype
    from qevolve_cli.training import resolve_precision

    monkeypatch.setenv("QEVOLVE_PRECISION", "bf16")
    assert resolve_precision("auto", "cpu") == "bf16"
    assert critic_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert P.resolve_dtype("auto", "cpu") == torch.bfloat16
    # DeepSpeed's CPU accelerator keeps fp32 under auto unless forced
    monkeypatch.delenv("QEVOLVE_PRECISION")
    assert resolve_precision("auto", "cpu", deepspeed=True) == "fp32"
    assert resolve_precision("auto", "cpu") == "fp32"  # training on CPU stays fp32 under auto
    assert critic_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setenv("QEVOLVE_PRECISION", "fp32")
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("bf16", "cpu") == "bf16"
    assert critic_dtype("auto", torch.device("cpu")) == torch.float32
    assert critic_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_evolve_precision_sets_every_stage():
    from qevolve_cli.evolve.config import resolve

    cfg = resolve("lamps", "cpu", None, {"precision": "bf16"})
    assert cfg.stage("bc", 0).precision == "bf16" and cfg.stage("policy", 1).precision == "bf16"
    assert cfg.stage("rollout", 1).dtype == "bfloat16" and cfg.stage("critic", 1).dtype == "bfloat16"
    cfg = resolve("lamps", "cpu", None, {"precision": "fp32"})
    assert cfg.stage("policy", 2).precision == "fp32" and cfg.stage("rollout", 0).dtype == "float32"
    auto = resolve("lamps", "paper", None, {"model": "/some/model"})
    assert auto.stage("policy", 1).precision == "auto" and auto.stage("rollout", 1).dtype == "auto"
    # the tiny-model presets pin fp32 (bf16 is slower on its small matrices: docs/performance.md)
    for preset in ("cpu", "smoke"):
        tiny = resolve("lamps", preset, None, {})
        assert tiny.stage("bc", 0).precision == tiny.stage("policy", 1).precision == "fp32"
        assert tiny.stage("rollout", 1).dtype == tiny.stage("critic", 1).dtype == "float32"


def test_doctor_report_follows_the_cpu_flags(monkeypatch):
    from qevolve_cli.commands.doctor import precision_report

    monkeypatch.delenv("QEVOLVE_PRECISION", raising=False)
    r = precision_report(cuda=False)
    flag = P.cpu_bf16_flag(P.cpu_flags())
    assert r["cpu_bf16_flag"] == flag and "cuda" not in r
    assert r["cpu"]["precision"] == ("bf16" if flag else "fp32")
    assert (flag or "neither") in r["cpu"]["reason"]
    assert r["cpu_training"]["precision"] == "fp32"
    assert precision_report(cuda=True)["cuda"]["precision"] == "bf16"


def test_precision_flag_of_rollout_eval_evolve():
    from qevolve_cli.commands.common import precision_dtype
    from tests.conftest import run_qevolve

    assert [precision_dtype(v) for v in (None, "auto", "fp32", "bf16")] == [None, "auto", "float32", "bfloat16"]
    for cmd in (["eval", "--split", "test_seen"], ["rollout", "--out", "x.parquet"]):
        r = run_qevolve(*cmd, "--env", "lamps", "--policy", "nowhere", "--precision", "fp16")
        assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].endswith(
            "--precision: unknown value 'fp16' (choose from auto, fp32, bf16)"), r.stderr
    r = run_qevolve("evolve", "--env", "lamps", "--preset", "cpu", "--precision", "fp16", "--run-dir", "/nonexistent/x")
    assert r.returncode != 0 and "precision" in r.stderr and "fp16" in r.stderr, r.stderr
