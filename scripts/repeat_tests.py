"""Run pytest tests N times in a row, each time in a fresh process, and count the passes (flakiness check).

Issue 14: ``tests/test_deepspeed_cpu.py::test_policy_bppo_lora_zero3_refreshes_pi_old_and_equals_single_process``
failed now and then (rank 1: SIGABRT, ``terminate called without an active exception``).
This script is the evidence that it no longer does. It is a loop outside the suite, because
each run launches two DeepSpeed ranks. Prints one JSON object: runs, passes, the longest run
of passes, each run's seconds and result, and any run whose output mentions ``terminate called``.

Usage:
  python scripts/repeat_tests.py --runs 20 [--fresh-extensions] [PYTEST_NODE ...]
  (default node: the flaky DeepSpeed test; --fresh-extensions: every run with a new, empty
  TORCH_EXTENSIONS_DIR, so DeepSpeed JIT-builds its CPU op first, as on a fresh machine)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = "tests/test_deepspeed_cpu.py::test_policy_bppo_lora_zero3_refreshes_pi_old_and_equals_single_process"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("nodes", nargs="*", default=[DEFAULT])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--fresh-extensions", action="store_true",
                    help="an empty TORCH_EXTENSIONS_DIR per run (the shared ~/.cache/torch_extensions is left alone)")
    ap.add_argument("--stop-on-failure", action="store_true")
    a = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    runs = []
    streak = best = 0
    for i in range(a.runs):
        with tempfile.TemporaryDirectory(prefix="qevolve-torch-ext-") as ext:
            if a.fresh_extensions:
                env["TORCH_EXTENSIONS_DIR"] = ext
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *a.nodes], cwd=ROOT,
                               env=env, capture_output=True, text=True)
            dt = time.perf_counter() - t0
            built = sorted(os.listdir(ext)) if a.fresh_extensions else None
        out = p.stdout + p.stderr
        ok = p.returncode == 0
        streak = streak + 1 if ok else 0
        best = max(best, streak)
        rec = {"run": i + 1, "ok": ok, "seconds": round(dt, 1), "summary": (p.stdout.strip().splitlines() or [""])[-1]}
        if a.fresh_extensions:
            rec["extensions_built"] = built
        if "terminate called" in out:
            rec["terminate_called"] = True
        if not ok:
            rec["tail"] = out[-3000:]
        runs.append(rec)
        print(json.dumps(rec), file=sys.stderr, flush=True)
        if not ok and a.stop_on_failure:
            break
    res = {"nodes": a.nodes, "runs": len(runs), "passes": sum(r["ok"] for r in runs), "longest_pass_streak": best,
           "fresh_extensions": a.fresh_extensions, "terminate_called": sum(bool(r.get("terminate_called")) for r in runs),
           "mean_seconds": round(sum(r["seconds"] for r in runs) / max(1, len(runs)), 1), "each": runs}
    print(json.dumps(res, indent=2))
    sys.exit(0 if res["passes"] == res["runs"] else 1)


if __name__ == "__main__":
    main()
