"""Two jobs on one machine: what OpenMP's waiting policy and the thread count do to a model's forward passes.

PyTorch's OpenMP threads spin while they wait for each other, so a 2-thread job beside a second busy job
loses much of its speed. This measures one probe (a prefill of ``--batch`` x ``--prompt`` tokens, then
``--decode`` one-token steps of the same rows with the KV cache) in a fresh process per arm, in six arms:
{2 threads with the default (active) waiting, 2 threads with ``OMP_WAIT_POLICY=PASSIVE``, 1 thread} x
{alone, beside a competing process that runs a 1-thread matmul loop}. The baseline (2 threads, default,
alone) is measured in the same run; every arm reports its prefill seconds (best of 3) and decode ms per
step, and the slowdown against the baseline. Prints one JSON object (docs/performance.md, "Two jobs on
one machine"). Run it on an otherwise idle machine: a third job would be a competitor of its own.

    python benchmarks/bench_threads.py                      # SmolLM2-135M-Instruct (converted once, cached)
    python benchmarks/bench_threads.py --model tiny --batch 8 --prompt 256   # the tiny test model, another shape
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ARMS = [  # (name, torch threads, OMP_WAIT_POLICY or None, competitor)
    ("2t_active_alone", 2, None, False),
    ("2t_passive_alone", 2, "PASSIVE", False),
    ("1t_alone", 1, None, False),
    ("2t_active_busy", 2, None, True),
    ("2t_passive_busy", 2, "PASSIVE", True),
    ("1t_busy", 1, None, True),
]

PROBE = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
model_dir, batch, prompt, decode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
x = torch.randint(0, min(1000, m.config.vocab_size), (batch, prompt), generator=torch.Generator().manual_seed(0))
pre = []
with torch.no_grad():
    m(x[:, :16])  # warm-up
    for _ in range(3):
        t = time.perf_counter(); m(x); pre.append(time.perf_counter() - t)
    pkv = m(x, use_cache=True).past_key_values
    t = time.perf_counter()
    for _ in range(decode):
        pkv = m(x[:, :1], past_key_values=pkv, use_cache=True).past_key_values
    dec = (time.perf_counter() - t) / decode
print(json.dumps({"threads": torch.get_num_threads(), "prefill_s": min(pre), "decode_ms": 1000 * dec}))
"""

BUSY = "import torch, time\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True:\n    a @ a\n"


def model_dir(name: str, cache: Path) -> str:
    if name == "smollm2":
        from qevolve_cli.models.pretrained import cached

        return str(cached("smollm2-135m-instruct", "fp32"))
    if name == "tiny":
        from qevolve_cli.models.tiny import create_tiny_model

        out = cache / "tiny"
        if not (out / "config.json").is_file():
            create_tiny_model(out)
        return str(out)
    return name


def run_arm(model: str, threads: int, wait: str | None, busy: bool, a) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("OMP_WAIT_POLICY", None)
    if wait:
        env["OMP_WAIT_POLICY"] = wait
    comp = None
    if busy:
        comp = subprocess.Popen([sys.executable, "-c", BUSY], env={**os.environ, "OMP_NUM_THREADS": "1"})
        time.sleep(2.0)
    try:
        out = subprocess.run([sys.executable, "-c", PROBE, model, str(a.batch), str(a.prompt), str(a.decode)],
                             env=env, capture_output=True, text=True, check=True)
    finally:
        if comp is not None:
            comp.kill()
            comp.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, tiny, or a Hugging Face model directory.")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=20)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "qevolve" / "bench_threads")
    a = ap.parse_args()
    model = model_dir(a.model, a.cache)
    res: dict = {"model": a.model, "batch": a.batch, "prompt": a.prompt, "decode_steps": a.decode,
                 "cpus": os.cpu_count(), "arms": {}}
    for name, threads, wait, busy in ARMS:
        print(f"[bench_threads] {name}", file=sys.stderr, flush=True)
        res["arms"][name] = {"threads": threads, "omp_wait_policy": wait or "default", "competitor": busy,
                             **run_arm(model, threads, wait, busy, a)}
    base = res["arms"]["2t_active_alone"]
    for r in res["arms"].values():
        r["prefill_vs_baseline"] = round(r["prefill_s"] / base["prefill_s"], 3)
        r["decode_vs_baseline"] = round(r["decode_ms"] / base["decode_ms"], 3)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
