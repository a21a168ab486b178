"""Add the rows of a new `qevolve evolve` run to a kept seed table, so that `bench_compare.py --tables` sets them
beside the rows measured before (RFT, SFT, oracle V ...) on the same tasks, paired.

A seed's earlier rows are kept as they are; the run adds two: its BC policy (``ARM_sft``, iteration 0's
evaluations: it shows whether the run's BC reproduces the earlier SFT row, task by task) and its iteration-K
policy (``ARM``); a run without BC evaluations adds the second only. Only the seeds named are written, so the summary pairs like with like.

    python benchmarks/add_run_row.py --tables benchmarks/results/compare_smollm2_lamps_habit_all_rows_2026-11-30.json \\
        --seed 0 --run runs/smol-hab-s0 --arm qevolve_feat --method "Q-Evolve, iteration 1 (BPPO, feature critic)" \\
        --out benchmarks/results/compare_smollm2_lamps_habit_feature_critic_2026-12-02.json
    python benchmarks/bench_compare.py --tables benchmarks/results/compare_smollm2_lamps_habit_feature_critic_2026-12-02.json --markdown

Prints one JSON object: per seed, the new rows' held-out success and how many tasks the run's BC decides as the
earlier SFT row did.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run_row(run: Path, iteration: int, table: dict, arm: str, method: str) -> dict:
    """A table row (``bench_compare`` / ``qevolve compare`` format) of ``run``'s iteration-``iteration`` evaluations."""
    from qevolve_cli.evolve.compare_table import per_task_rewards

    row: dict = {"arm": arm, "method": method, "oracle": False, "budget": [], "per_task": {}, "scores": {},
                 "selection": None, "selection_note": f"{run}/iter_{iteration}", "eval_steps": 0,
                 "expert_steps": 0, "self_play_steps": 0}
    for col, split in zip(table["columns"], table["splits"], strict=True):
        path = run / f"iter_{iteration}" / f"eval_{split}.parquet"
        if not path.is_file():
            raise SystemExit(f"error: {path}: missing (the run has not evaluated iteration {iteration} on {split})")
        pt = per_task_rewards(path)
        want = set(table["rows"][0]["per_task"][col])
        if set(pt) != want:
            raise SystemExit(f"error: {path}: task_id: {len(set(pt) ^ want)} tasks differ from the table's {col}")
        row["per_task"][col] = pt
        rate = sum(pt.values()) / len(pt)
        row["scores"][col] = {"avg_reward": round(rate, 6), "n": len(pt), "success_rate": round(rate, 6),
                              "source": f"{run.name}/iter_{iteration}/eval_{split}"}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=Path, required=True, help="Kept tables: {'seeds': {seed: table}} or one table.")
    ap.add_argument("--seed", type=int, nargs="+", required=True, help="Seed(s), one per --run.")
    ap.add_argument("--run", type=Path, nargs="+", required=True, help="The evolve run of each seed.")
    ap.add_argument("--iteration", type=int, default=1)
    ap.add_argument("--arm", required=True)
    ap.add_argument("--method", required=True)
    ap.add_argument("--what", default="", help="Appended to the file's 'what'.")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if len(a.seed) != len(a.run):
        raise SystemExit("error: --seed and --run: one seed per run")
    try:
        src = json.loads(a.tables.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"error: {a.tables}: cannot read the kept tables ({e.__class__.__name__}: {e})") from None
    seeds = src["seeds"] if "seeds" in src else {str(src["seed"]): src}
    out: dict = {"what": (src.get("what", "") + " " + a.what).strip(), "seeds": {}}
    report: dict = {}
    for seed, run in zip(a.seed, a.run, strict=True):
        if str(seed) not in seeds:
            raise SystemExit(f"error: {a.tables}: seeds: no table of seed {seed}")
        t = json.loads(json.dumps(seeds[str(seed)]))
        # the run's BC row where it evaluated BC (evolve's eval_bc); only seeds that all have it form that row
        has_bc = all((run / "iter_0" / f"eval_{sp}.parquet").is_file() for sp in t["splits"])
        sft = run_row(run, 0, t, f"{a.arm}_sft", f"{a.method}: its BC policy") if has_bc else None
        new = run_row(run, a.iteration, t, a.arm, a.method)
        t["rows"] = [r for r in t["rows"] if r["arm"] not in (a.arm, f"{a.arm}_sft")] + [r for r in (sft, new) if r]
        out["seeds"][str(seed)] = t
        old_sft = next((r for r in t["rows"] if r["arm"] == "sft"), None)
        rep = {"run": str(run)}
        for r in (sft, new) if sft else (new,):
            tasks = [v for c in t["columns"] for v in r["per_task"][c].values()]
            rep[r["arm"]] = round(100 * sum(tasks) / len(tasks), 1)
        if old_sft is not None and sft is not None:
            same = sum(old_sft["per_task"][c][k] == v for c in t["columns"] for k, v in sft["per_task"][c].items())
            rep["bc_same_outcome_as_sft_row"] = f"{same}/{sum(len(sft['per_task'][c]) for c in t['columns'])}"
        report[str(seed)] = rep
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    tmp.replace(a.out)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
