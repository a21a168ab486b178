"""ALFWorld reset cost in a rollout, with and without the per-worker game cache (issue 14). Prints one JSON object.

Runs, as real subprocesses, the rollout of the issue:
  qevolve rollout --env alfworld --max-tasks 6 --n-per-task 3 --max-steps 1 --workers 1
with a tiny offline policy, first with ``QEVOLVE_ALFWORLD_GAME_CACHE=0`` (TextWorld's own load at
every reset: the baseline) and then with the cache (default), and reports the workers' reset
seconds per reset. Both tables must be identical (same seed: same actions, and the same
observations, rewards and done flags for them).

Usage: python benchmarks/bench_alfworld_reset.py [--max-tasks 6] [--n-per-task 3] [--max-steps 1] [--split train]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rollout(model: Path, out: Path, a: argparse.Namespace, cache: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), QEVOLVE_ALFWORLD_GAME_CACHE=cache, HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "qevolve_cli", "rollout", "--env", "alfworld", "--policy", str(model),
           "--split", a.split, "--max-tasks", str(a.max_tasks), "--n-per-task", str(a.n_per_task),
           "--max-steps", str(a.max_steps), "--workers", str(a.workers), "--max-new-tokens", "16",
           "--seed", "0", "--out", str(out), "--json", "-q"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"rollout failed ({p.returncode}):\n{p.stderr[-3000:]}")
    st = json.loads(p.stdout)["stats"]
    n = st["total"]
    return {"episodes": n, "reset_s": st["reset_s"], "mean_reset_s": round(st["reset_s"] / n, 3),
            "step_s": st["step_s"], "steps": st["steps"],
            "mean_step_s": round(st["step_s"] / max(1, st["steps"]), 3), "wall_s": st["wall_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tasks", type=int, default=6)
    ap.add_argument("--n-per-task", type=int, default=3)
    ap.add_argument("--max-steps", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--split", default="train")
    a = ap.parse_args()
    import polars as pl

    from qevolve_cli.envs.alfworld import ensure_alfworld_data
    from qevolve_cli.models.tiny import create_tiny_model

    ensure_alfworld_data()
    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny_model(Path(tmp) / "tiny", seed=0)
        base = rollout(model, Path(tmp) / "nocache.parquet", a, "0")
        cached = rollout(model, Path(tmp) / "cache.parquet", a, "32")
        cols = ["traj_id", "step", "observation", "action", "command", "next_observation", "reward_env", "done"]
        t0 = pl.read_parquet(Path(tmp) / "nocache.parquet").select(cols)
        t1 = pl.read_parquet(Path(tmp) / "cache.parquet").select(cols)
        same = t0.equals(t1)
    res = {"benchmark": "alfworld_reset", "command": f"rollout --env alfworld --split {a.split} --max-tasks {a.max_tasks} "
           f"--n-per-task {a.n_per_task} --max-steps {a.max_steps} --workers {a.workers}",
           "no_cache": base, "game_cache": cached,
           "reset_speedup": round(base["mean_reset_s"] / max(1e-9, cached["mean_reset_s"]), 2),
           "tables_identical": same, "rows": t0.height,
           "targets": {"mean_reset_le_0.3s": cached["mean_reset_s"] <= 0.3, "identical_trajectories": same}}
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
