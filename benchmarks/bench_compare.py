"""The paper's comparison table on `lamps` with the tiny model: SFT, RFT, ETO, Best-of-N (oracle), Q-Evolve.

Per seed: `qevolve evolve --env lamps --preset cpu --iters 1 --seed S` then `qevolve compare` on its run
directory, both through the library (the same functions as the commands). Prints one JSON object: the
per-seed tables and, per method and split, the mean and standard error over the seeds of the average
reward (binary on lamps, so = success rate). --runs DIR keeps the run directories; re-running with the
same DIR resumes / re-reads finished stages.

    python benchmarks/bench_compare.py --seeds 0 1 2 --runs runs/compare
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", default="lamps")
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--best-of", type=int, default=6)
    ap.add_argument("--runs", type=Path, default=None, help="Keep run directories here (default: a temp dir).")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from qevolve_cli.evolve.compare import ARM_NAMES, CompareConfig, mean_se, run_compare
    from qevolve_cli.evolve.config import resolve
    from qevolve_cli.evolve.loop import run_evolve

    root = a.runs or Path(tempfile.mkdtemp(prefix="qevolve-compare-"))
    echo = (lambda m: print(m, file=sys.stderr, flush=True)) if a.verbose else (lambda _m: None)
    per_seed = []
    for seed in a.seeds:
        t0 = time.perf_counter()
        run = root / f"{a.env}-{a.preset}-s{seed}"
        cfg = resolve(a.env, a.preset, None, {"iters": 1, "seed": seed})
        run_evolve(cfg, run, resume=True, echo=echo, quiet=not a.verbose)
        t1 = time.perf_counter()
        table = run_compare(run, CompareConfig(best_of=a.best_of), resume=True, echo=echo, quiet=not a.verbose)
        table["evolve_s"], table["compare_s"] = round(t1 - t0, 1), round(time.perf_counter() - t1, 1)
        per_seed.append(table)
        print(f"seed {seed}: {json.dumps({r['arm']: {c: s['avg_reward'] for c, s in r['scores'].items()} for r in table['rows']})}",
              file=sys.stderr, flush=True)
    summary = {}
    cols = per_seed[0]["columns"]
    for i, row in enumerate(per_seed[0]["rows"]):
        arm = row["arm"]
        s = {}
        for c in cols:
            vals = [t["rows"][i]["scores"][c]["avg_reward"] for t in per_seed]
            m, se = mean_se(vals)
            s[c] = {"mean": round(m, 4), "se": round(se, 4), "per_seed": vals}
        s["self_play_steps"] = [t["rows"][i]["self_play_steps"] for t in per_seed]
        s["eval_steps"] = [t["rows"][i]["eval_steps"] for t in per_seed]
        summary[ARM_NAMES[arm] + (" (oracle)" if row["oracle"] else "")] = s
    print(json.dumps({"env": a.env, "preset": a.preset, "seeds": a.seeds, "best_of": a.best_of, "runs": str(root),
                      "summary": summary, "tables": per_seed}, indent=1))


if __name__ == "__main__":
    main()
