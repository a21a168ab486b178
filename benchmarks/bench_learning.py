"""Learning check (issue 8): does one Q-Evolve iteration raise held-out success over BC?

For each seed, runs the whole loop (``qevolve evolve --env lamps --preset cpu --iters 1``,
through the library: :func:`qevolve_cli.evolve.config.resolve` +
:func:`qevolve_cli.evolve.loop.run_evolve`) into its own run directory, then reports:

* held-out success rate and average reward of BC (iteration 0) and iteration 1 per split
  and seed, and their means over seeds;
* what the critic learned, read back from ``iter_1/advantages.parquet``: mean advantage
  of expert vs self steps, the share of positive advantages on the steps of successful vs
  failed self trajectories, V(s_0) of successful vs failed self trajectories, and the
  advantage of invalid / repeat / format steps vs the others;
* BPPO statistics from ``iter_1/policy/metrics.jsonl`` (clip fraction, ratio, KL);
* wall-clock time of every stage (from the run manifest) and in total.

Prints ONE JSON object on stdout (progress goes to stderr).

    python benchmarks/bench_learning.py                       # seeds 0 1 2, runs in a temp dir
    python benchmarks/bench_learning.py --seeds 0 --runs runs/learning --keep
    python benchmarks/bench_learning.py --env lamps --preset cpu --iters 1

Reusing ``--runs DIR`` resumes finished runs (a finished run is a no-op), so the table can
be re-read without re-training.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return float(statistics.fmean(xs)) if xs else None


def _eval_scores(run: Path, k: int, split: str) -> dict:
    import polars as pl

    df = pl.read_parquet(run / f"iter_{k}" / f"eval_{split}.parquet")
    per = df.group_by("traj_id").agg(pl.col("reward_env").sum().alias("r"), pl.len().alias("steps"))
    return {"success": float((per["r"] >= 1.0).mean()), "avg_reward": float(per["r"].mean()),
            "tasks": per.height, "mean_steps": float(per["steps"].mean())}


def _critic_stats(run: Path) -> dict:
    import polars as pl

    df = pl.read_parquet(run / "iter_1" / "advantages.parquet")
    out: dict = {}
    by_src = df.group_by("source").agg(pl.col("advantage").mean()).to_dicts()
    out["mean_adv"] = {d["source"]: float(d["advantage"]) for d in by_src}
    self_ = df.filter(pl.col("source") == "self")
    for name, flag in (("success", True), ("failed", False)):
        s = self_.filter(pl.col("success") == flag)
        out[f"self_{name}_steps"] = s.height
        out[f"self_{name}_pos_adv_share"] = float((s["advantage"] > 0).mean()) if s.height else None
        out[f"self_{name}_mean_adv"] = float(s["advantage"].mean()) if s.height else None
        s0 = s.filter(pl.col("step") == 0)
        out[f"self_{name}_V0"] = float(s0["value"].mean()) if s0.height else None
    ex0 = df.filter((pl.col("source") == "expert") & (pl.col("step") == 0))
    out["expert_V0"] = float(ex0["value"].mean()) if ex0.height else None
    kinds = df.group_by("aux_kind").agg(pl.col("advantage").mean(), pl.len()).to_dicts()
    out["adv_by_aux_kind"] = {d["aux_kind"]: {"mean_adv": float(d["advantage"]), "steps": d["len"]} for d in kinds}
    trajs = self_.group_by("traj_id").agg(pl.col("success").first())
    out["self_trajectories"] = trajs.height
    out["self_train_success"] = float(trajs["success"].mean()) if trajs.height else None
    return out


def _policy_stats(run: Path) -> dict:
    path = run / "iter_1" / "policy" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    out: dict = {"optimizer_steps": len(rows)}
    for key in ("clip_frac", "ratio_mean", "kl", "pg_loss", "loss"):
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if vals:
            out[f"{key}_mean"] = float(statistics.fmean(vals))
            out[f"{key}_last"] = float(vals[-1])
    return out


def _timings(run: Path) -> dict:
    m = json.loads((run / "manifest.json").read_text())
    stages = m.get("stages", m)
    out = {}
    for name, st in stages.items():
        if isinstance(st, dict):
            t = st.get("seconds", st.get("duration_s", st.get("elapsed_s")))
            if t is None and isinstance(st.get("timings"), dict):
                t = st["timings"].get("seconds", st["timings"].get("total_s"))
            if isinstance(t, (int, float)):
                out[name] = round(float(t), 2)
    return out


def run_seed(env: str, preset: str, iters: int, seed: int, run: Path, quiet: bool) -> dict:
    from qevolve_cli.evolve.config import resolve
    from qevolve_cli.evolve.loop import run_evolve

    cfg = resolve(env, preset, overrides={"iters": iters, "seed": seed})
    t0 = time.perf_counter()
    run_evolve(cfg, run, resume=(run / "config.yaml").exists(), quiet=quiet,
               echo=(lambda m: None) if quiet else (lambda m: print(m, file=sys.stderr)))
    wall = time.perf_counter() - t0
    res: dict = {"seed": seed, "run_dir": str(run), "wall_s": round(wall, 1), "scores": {}}
    for split in cfg.eval_splits:
        res["scores"][split] = {f"iter_{k}": _eval_scores(run, k, split) for k in range(0, iters + 1)}
    if iters >= 1:
        res["critic"] = _critic_stats(run)
        res["bppo"] = _policy_stats(run)
    res["stage_seconds"] = _timings(run)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", default="lamps")
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--iters", type=int, default=1)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--runs", default=None, help="Directory of the run directories (default: a temp dir).")
    ap.add_argument("--keep", action="store_true", help="Keep the temp run directories.")
    ap.add_argument("--verbose", action="store_true", help="Stage progress on stderr.")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp = None
    if args.runs:
        base = Path(args.runs)
        base.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.mkdtemp(prefix="qevolve-learning-")
        base = Path(tmp)
    t0 = time.perf_counter()
    seeds = []
    try:
        for s in args.seeds:
            print(f"[bench_learning] seed {s} ...", file=sys.stderr, flush=True)
            r = run_seed(args.env, args.preset, args.iters, s, base / f"seed{s}", quiet=not args.verbose)
            seeds.append(r)
            sc = {sp: {k: v["success"] for k, v in d.items()} for sp, d in r["scores"].items()}
            print(f"[bench_learning] seed {s}: {json.dumps(sc)} ({r['wall_s']} s)", file=sys.stderr, flush=True)
    finally:
        if tmp and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    splits = list(seeds[0]["scores"]) if seeds else []
    mean: dict = {}
    for sp in splits:
        mean[sp] = {}
        for k in seeds[0]["scores"][sp]:
            mean[sp][k] = {m: _mean([r["scores"][sp][k][m] for r in seeds]) for m in ("success", "avg_reward")}
    last = f"iter_{args.iters}"
    held_out = {k: _mean([mean[sp][k]["success"] for sp in splits]) for k in ("iter_0", last)} if splits else {}
    out = {
        "benchmark": "learning_check", "env": args.env, "preset": args.preset, "iters": args.iters,
        "seeds": seeds, "mean": mean,
        "held_out_success": held_out,
        "improved": bool(held_out and held_out[last] > held_out["iter_0"]),
        "critic_mean": {key: _mean([r["critic"].get(key) for r in seeds if "critic" in r])
                        for key in ("self_success_pos_adv_share", "self_failed_pos_adv_share", "self_success_V0",
                                    "self_failed_V0", "expert_V0")} if args.iters >= 1 else {},
        "clip_frac_mean": _mean([r.get("bppo", {}).get("clip_frac_mean") for r in seeds]),
        "total_s": round(time.perf_counter() - t0, 1),
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
    }
    print(json.dumps(out, indent=None))


if __name__ == "__main__":
    main()
