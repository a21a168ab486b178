"""``qevolve doctor``: what this machine can run (versions, devices, backends), and with ``--smoke`` a short
real run of each path: hf generation, the vLLM engine with a LoRA adapter, a critic step, a BPPO step and
DeepSpeed ZeRO-2 on 2 ranks."""
from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from qevolve_cli.commands.common import JsonOpt, QuietOpt, emit_json, run_command, stderr_console

HELP = """Report versions, devices and which backends work here; --smoke runs each path once.

The first thing to run on a new GPU node. Without --smoke: Python, torch, transformers, peft,
vllm, deepspeed and CUDA versions, the devices with their memory, and which generation backends
import (hf, vllm, openai). With --smoke (about a minute or two), each path runs for real on a
tiny offline model in a temporary directory: hf generation; the vLLM engine with a LoRA adapter
(greedy output compared with hf + peft); a critic step (weighted IQL on LoRA adapters) and a BPPO
step on TextCraft expert data; DeepSpeed ZeRO-2 on 2 ranks (torchrun; bf16 on 2+ GPUs, else
DeepSpeed's CPU accelerator in fp32). Each check reports pass, fail or skip with the reason.
Exit code 1 when a check fails.
\b
Examples:
  qevolve doctor
  qevolve doctor --smoke
  qevolve doctor --smoke --json | jq '.checks[] | select(.status != "pass")'
"""


def _version(mod: str) -> str | None:
    import importlib
    import importlib.metadata as md

    if mod == "qevolve":
        from qevolve_cli import __version__

        return __version__
    for dist in (mod, mod.replace("_", "-"), f"{mod}-cpu"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    try:
        return str(getattr(importlib.import_module(mod), "__version__", None))
    except Exception:
        return None


def environment() -> dict[str, Any]:
    """Versions, devices and memory, backends that import (no model is loaded)."""
    import importlib.util
    import os
    import platform
    import sys

    info: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable,
                            "platform": platform.platform(), "cpus": os.cpu_count()}
    info["versions"] = {m: _version(m) for m in ("torch", "transformers", "peft", "vllm", "deepspeed",
                                                  "huggingface_hub", "polars", "qevolve")}
    try:
        with open("/proc/meminfo") as f:
            mem = {ln.split(":")[0]: int(ln.split()[1]) for ln in f if ln.startswith(("MemTotal", "MemAvailable"))}
        info["memory_gib"] = {"total": round(mem["MemTotal"] / 2**20, 1), "available": round(mem["MemAvailable"] / 2**20, 1)}
    except (OSError, KeyError, ValueError):
        info["memory_gib"] = None
    import torch

    info["cuda"] = {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
                    "devices": []}
    if torch.cuda.is_available():
        info["cuda"]["bf16"] = bool(torch.cuda.is_bf16_supported())
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            info["cuda"]["devices"].append({"index": i, "name": p.name, "memory_gib": round(total / 2**30, 1),
                                            "free_gib": round(free / 2**30, 1), "capability": f"{p.major}.{p.minor}"})
    info["precision"] = precision_report(info["cuda"]["available"])
    backends = {"hf": "ok"}
    backends["vllm"] = "ok" if importlib.util.find_spec("vllm") is not None else (
        "not installed (GPU node: pip install vllm; CPU: make vllm-venv)")
    backends["openai"] = "ok" if importlib.util.find_spec("httpx") is not None else "httpx not installed"
    info["backends"] = backends
    return info


def precision_report(cuda: bool) -> dict[str, Any]:
    """Which precision ``auto`` picks here, and why (qevolve_cli/precision.py; docs/performance.md)."""
    from qevolve_cli import precision as P

    flag = P.cpu_bf16_flag(P.cpu_flags())
    cpu, cpu_train = P.resolve("auto", "cpu"), P.resolve("auto", "cpu", training=True)
    out: dict[str, Any] = {"cpu_bf16_flag": flag, "cpu": {"precision": cpu.name, "reason": cpu.reason},
                           "cpu_training": {"precision": cpu_train.name, "reason": cpu_train.reason}}
    if cuda:
        g = P.resolve("auto", "cuda")
        out["cuda"] = {"precision": g.name, "reason": g.reason}
    out["meaning"] = ("bf16: bf16 weights for rollout/eval and the critic's frozen backbone, bf16 autocast over "
                      "fp32 master weights for policy training; force fp32 with QEVOLVE_PRECISION=fp32, "
                      "--precision fp32 (rollout, eval, evolve), `--set precision=fp32` (policy) or "
                      "`--set dtype=float32` (critic)")
    return out


# --------------------------------------------------------------------------- smoke checks


class Skip(Exception):
    """A check that this machine cannot run (the message is the reason)."""


def _tiny(work, size: str):
    from qevolve_cli.models.tiny import create_tiny_model

    out = work / f"model_{size}"
    if not out.exists():
        create_tiny_model(out, arch="llama", size=size, seed=0)
    return out


def _prompts():
    from qevolve_cli.rollout.backends import Request

    return [Request([{"role": "system", "content": "You craft items."},
                     {"role": "user", "content": f"Goal: craft {k} stick. Inventory: {k} planks."}]) for k in (1, 2, 3)]


def check_hf(work) -> str:
    from qevolve_cli.rollout.backends import HFBackend

    with HFBackend(_tiny(work, "tiny64"), max_new_tokens=16) as b:
        outs = b.generate(_prompts(), temperature=0.0)
        again = b.generate(_prompts(), temperature=0.0)
        dev = str(b.device)
    if outs != again:
        raise AssertionError("greedy generation is not deterministic")
    return f"3 prompts x 16 tokens on {dev}, greedy output deterministic"


def _lora_adapter(work, model):
    """A PEFT LoRA adapter (rank 8, q_proj/v_proj) with non-zero B, so it changes the output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = work / "lora"
    if out.exists():
        return out
    torch.manual_seed(0)
    m = get_peft_model(AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32),
                       LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    m.save_pretrained(str(out))
    return out


def check_vllm(work) -> str:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise Skip("vLLM is not installed in this Python (GPU node: pip install vllm; CPU: make vllm-venv, "
                   "then run doctor with ~/.cache/qevolve/vllm-venv/bin/python -m qevolve_cli)")
    from qevolve_cli.rollout.backends import HFBackend, VLLMBackend

    model = _tiny(work, "tiny64")
    adapter = _lora_adapter(work, model)
    with VLLMBackend(model, adapter, max_new_tokens=16, max_context=1024, dtype="float32") as v:
        got = v.generate(_prompts(), temperature=0.0)
    with HFBackend(model, adapter, max_new_tokens=16, dtype="float32") as h:
        ref = h.generate(_prompts(), temperature=0.0)
    with HFBackend(model, None, max_new_tokens=16, dtype="float32") as h:
        base = h.generate(_prompts(), temperature=0.0)
    if got != ref:
        raise AssertionError(f"vLLM + LoRA differs from hf + peft (greedy, float32): {got} vs {ref}")
    note = "" if base != ref else " (the adapter did not change this output)"
    return f"engine started, LoRA adapter served (LoRARequest); greedy output equals hf + peft{note}"


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _data(work):
    """TextCraft expert data (2 train tasks) labelled with retrospective rewards and weights."""
    from qevolve_cli import schema
    from qevolve_cli.envs.expert import collect_expert
    from qevolve_cli.labeling import LabelConfig, label_tables

    labeled = work / "labeled.parquet"
    if not labeled.exists():
        df = collect_expert("textcraft", "train", limit=2, workers=1)
        schema.write_table(df, work / "expert.parquet", producer="qevolve doctor")
        label_tables([work / "expert.parquet"], labeled, LabelConfig())
    return labeled


def check_critic(work) -> str:
    from qevolve_cli.critic.config import load_critic_config
    from qevolve_cli.critic.trainer import train_critic

    cfg = load_critic_config(None, None, {"epochs": 1, "batch_size": 4, "lora_rank": 4, "head_hidden": 32,
                                          "device": _device()})
    s = train_critic(cfg, _data(work), _tiny(work, "tiny64"), work / "critic", resume=False)
    final = s.get("final") or {}
    losses = ", ".join(f"{k} {v:.4g}" for k, v in final.items() if isinstance(v, float) and "loss" in k)
    return f"weighted IQL on LoRA adapters, 1 epoch, {s['steps']} steps on {_device()}: {losses}"


def check_bppo(work) -> str:
    from qevolve_cli.labeling import LabelConfig, label_tables
    from qevolve_cli.policy.config import load_policy_config
    from qevolve_cli.policy.trainer import train_policy

    if not (work / "critic").exists():
        check_critic(work)
    adv = work / "advantages.parquet"
    label_tables([_data(work)], adv, LabelConfig(), critic=work / "critic")
    model = _tiny(work, "tiny64")
    cfg = load_policy_config(None, None, {"objective": "bppo", "epochs": 1, "lr": 1e-4, "max_length": 1024,
                                          "micro_batch_tokens": 4096, "device": _device()})
    m = train_policy(cfg, adv, model, work / "bppo", ref=model, quiet=True)
    return f"1 epoch on {_device()}: {m['optimizer_steps']} steps, action NLL {m['nll_before']:.4f} -> {m['nll_after']:.4f}"


def check_deepspeed(work) -> str:
    import importlib.util
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import torch

    if importlib.util.find_spec("deepspeed") is None:
        raise Skip("deepspeed is not installed (pip install deepspeed)")
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # ninja for JIT ops
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    sets = ["--set", "micro_batch_size=1", "--set", "grad_accum_steps=2", "--epochs", "1"]
    if n_gpu >= 2:
        where, sets = "2 GPUs, bf16", sets + ["--set", "device=cuda", "--set", "precision=bf16"]
    else:
        if shutil.which("c++") is None and shutil.which("g++") is None:
            raise Skip("DeepSpeed's CPU accelerator JIT-compiles a C++ op: no C++ compiler found")
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        where = "2 CPU ranks (DeepSpeed CPU accelerator, gloo, fp32" + (
            f"; {n_gpu} GPU here, 2 needed for the GPU run)" if n_gpu else ")")
    from qevolve_cli.config import configs_dir

    zero2 = Path(configs_dir()) / "deepspeed" / "zero2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "qevolve_cli",
           "policy", "--data", str(_data(work)), "--model", str(_tiny(work, "tiny64")), "--out", str(work / "ds"),
           "--objective", "bc", "--set", f"deepspeed={zero2}", *sets, "--json", "-q"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        tail = [ln for ln in p.stderr.strip().splitlines() if ln.strip()][-1:] or [f"exit {p.returncode}"]
        raise AssertionError(f"torchrun ZeRO-2 failed: {tail[0][:300]}")
    if not (work / "ds" / "config.json").is_file():
        raise AssertionError("torchrun ZeRO-2 wrote no model")
    return f"ZeRO-2 BC epoch on {where}"


CHECKS = [("hf_generation", check_hf), ("vllm_engine_lora", check_vllm), ("critic_step", check_critic),
          ("bppo_step", check_bppo), ("deepspeed_zero2_2ranks", check_deepspeed)]


def run_smoke(only: list[str] | None = None, echo=None) -> list[dict[str, Any]]:
    import tempfile
    from pathlib import Path

    results = []
    with tempfile.TemporaryDirectory(prefix="qevolve-doctor-") as tmp:
        work = Path(tmp)
        for name, fn in CHECKS:
            if only and name not in only:
                continue
            t0 = time.perf_counter()
            try:
                detail, status = fn(work), "pass"
            except Skip as e:
                detail, status = str(e), "skip"
            except Exception as e:  # a failed check is reported, the others still run
                msg = str(e).strip().splitlines()
                detail, status = f"{type(e).__name__}: {msg[0] if msg else ''}"[:400], "fail"
            r = {"check": name, "status": status, "seconds": round(time.perf_counter() - t0, 1), "detail": detail}
            if echo:
                echo(r)
            results.append(r)
    return results


def register(app: typer.Typer) -> None:
    @app.command("doctor", help=HELP)
    def doctor(
        smoke: Annotated[bool, typer.Option("--smoke", help="Run each path once on a tiny model (a minute or two).")] = False,
        only: Annotated[str | None, typer.Option("--only", help="Comma list of smoke checks: " + ", ".join(
            n for n, _ in CHECKS) + ".")] = None,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        def body() -> None:
            from qevolve_cli.errors import QevolveError

            names = [s.strip() for s in only.split(",")] if only else None
            for n in names or []:
                if n not in [c for c, _ in CHECKS]:
                    raise QevolveError(f"--only: unknown check {n!r} (choose from {', '.join(c for c, _ in CHECKS)})")
            import os

            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            info = environment()
            con = stderr_console()
            if not json_out:
                _print_env(info)
            checks = []
            if smoke or names:
                def echo(r):
                    if not json_out:
                        colour = {"pass": "green", "skip": "yellow", "fail": "red"}[r["status"]]
                        con.print(f"[{colour}]{r['status']:4}[/{colour}] {r['check']:24} {r['seconds']:6.1f} s  {r['detail']}")
                    elif not quiet:  # --json: one progress line per check on stderr
                        con.print(f"{r['check']}: {r['status']} ({r['seconds']} s)")

                checks = run_smoke(names, echo)
            if json_out:
                emit_json({**info, "checks": checks})
            if any(c["status"] == "fail" for c in checks):
                raise typer.Exit(1)

        run_command(body)


def _print_env(info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="qevolve doctor", show_header=False)
    t.add_row("python", f"{info['python']} ({info['executable']})")
    for k, v in info["versions"].items():
        t.add_row(k, v or "[yellow]not installed[/yellow]")
    cuda = info["cuda"]
    t.add_row("cuda", f"torch built for CUDA {cuda['torch_cuda']}; available: {cuda['available']}")
    for d in cuda["devices"]:
        t.add_row(f"gpu {d['index']}", f"{d['name']}, {d['memory_gib']} GiB ({d['free_gib']} free), sm {d['capability']}")
    if info.get("memory_gib"):
        t.add_row("cpu", f"{info['cpus']} cores, {info['memory_gib']['total']} GiB RAM "
                         f"({info['memory_gib']['available']} available)")
    pr = info.get("precision")
    if pr:
        for where, label in (("cuda", "cuda"), ("cpu", "cpu, rollout/eval"), ("cpu_training", "cpu, training")):
            if where in pr:
                t.add_row(f"precision ({label})", f"{pr[where]['precision']} ({pr[where]['reason']})")
        t.add_row("", pr["meaning"])
    for b, s in info["backends"].items():
        t.add_row(f"backend {b}", s if s != "ok" else "[green]ok[/green]")
    Console().print(t)
