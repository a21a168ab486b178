"""benchmarks/bench_oracle.py: arm names and the BPPO stage it reads from runs of either policy step."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qevolve_cli.config import dump_yaml
from qevolve_cli.evolve.config import resolve
from tests.conftest import load_benchmark

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_oracle")


def test_arm_suffixes(bench):
    assert bench.split_arm("learned_lr10_ep4_ref25") == ("learned", {"lr_factor": 10.0, "epochs": 4,
                                                                     "old_refresh_steps": 25})
    assert bench.split_arm("oracle_gae_clip02_hi4") == ("oracle_gae", {"eps_high": 4.0, "eps_low": 0.2})
    assert bench.split_arm("awr_oracle_beta0.25_ep12") == ("awr_oracle", {"epochs": 12, "awr_beta": 0.25})
    for good in ("rft_bc_lr10", "bc_ep24", "rft_full_ep24", "awr_full_lr0.5_ep6", "awr_oracle_beta0.25", "awr_bc_beta2"):
        assert bench.arm_name(good) == good
    # the arms from the base model scale the bc budget only (no clip, no old policy); bc alone is sft;
    # only the AWR arms have a temperature
    for bad in ("awr_full_clip02", "rft_full_ref25", "bc", "nope", "rft_full_beta0.5", "learned_beta0.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="unknown arm"):
            bench.arm_name(bad)


def test_bppo_stage_of_a_run_made_with_either_policy_step(bench, tmp_path):
    """A bppo run's BPPO arms train with its own stages/policy_1.yaml; an awr run (the cpu preset on lamps-hard)
    has an AWR config there, so the BPPO arms get the same run's config resolved with policy_step bppo."""
    for step in ("bppo", "awr"):
        run = tmp_path / step
        cfg = resolve("lamps-hard", "cpu", overrides={"iters": 1, "seed": 3, "policy_step": step})
        dump_yaml(cfg, run / "config.yaml")
        dump_yaml(cfg.stage("policy", 1), run / "stages" / "policy_1.yaml")
        got = bench.bppo_stage(run)
        assert (got == run / "stages" / "policy_1.yaml") == (step == "bppo")
        p = yaml.safe_load(got.read_text())
        assert (p["objective"], p["lr"], p["epochs"], p["eps_low"], p["seed"]) == ("bppo", 1e-4, 2, 0.2, 3)


def test_validation_is_never_averaged_with_a_held_out_split(tmp_path):
    """The per-arm `mean` averages the requested splits; validation (a selection score) mixed with test splits
    is refused before anything is read or trained, and alone it is accepted."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_oracle.py"), "--runs", str(tmp_path), "--report-only"]
    bad = subprocess.run(cmd + ["--splits", "test_seen", "validation"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--splits: validation is reported on its own" in bad.stderr
    # alone it passes the check (and fails later, on the missing run's config, not on --splits)
    alone = subprocess.run(cmd + ["--splits", "validation"], capture_output=True, text=True)
    assert "--splits:" not in alone.stderr and "(no config.yaml)" in alone.stderr


def test_a_run_directory_without_its_config_is_one_line(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_oracle.py"), "--report-only", "--arms", "sft", "--refs", "sft"]
    bad = subprocess.run(cmd + ["--runs", str(tmp_path / "nope")], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stdout == ""
    assert f"--runs {tmp_path / 'nope'}: not a run directory of qevolve evolve (no config.yaml)" in bad.stderr


def test_credit_stats_separates_step_credit_from_outcome_credit(bench):
    """credit_stats against a plain loop: an advantage that is constant inside each trajectory (the outcome, as
    RFT weighs rows) has no within-trajectory share; one equal to the exact advantages has within_corr 1;
    one that blames the opposite steps has within_corr -1; rows only one table has are ignored."""
    import numpy as np
    import polars as pl

    rng = np.random.default_rng(0)
    rows = [(t, s) for t in range(6) for s in range(5)]
    exact = rng.normal(size=len(rows))
    outcome = np.repeat(rng.normal(size=6), 5)

    def tab(a, extra=()):
        return pl.DataFrame({"traj_id": [f"t{t}" for t, _ in rows] + [f"x{i}" for i in range(len(extra))],
                             "step": [s for _, s in rows] + [0] * len(extra), "advantage": list(a) + list(extra)})

    same = bench.credit_stats(tab(exact, extra=[9.0, -9.0]), tab(exact))
    assert same["rows"] == 30 and same["corr"] == 1.0 and same["within_corr"] == 1.0
    flat = bench.credit_stats(tab(outcome), tab(exact))
    assert flat["within_share"]["learned"] == 0.0 and flat["within_corr"] is None

    # the within-trajectory share of the exact advantages by a plain loop
    z = (exact - exact.mean()) / exact.std(ddof=1)
    w = np.concatenate([z[i * 5:(i + 1) * 5] - z[i * 5:(i + 1) * 5].mean() for i in range(6)])
    assert same["within_share"]["exact"] == round(float(w.var(ddof=1) / z.var(ddof=1)), 3)

    # opposite blame inside each trajectory, same outcomes: the overall correlation hides it, within_corr shows it
    flipped = outcome * 10 - (exact - np.repeat(exact.reshape(6, 5).mean(1), 5))
    opp = bench.credit_stats(tab(flipped), tab(exact + outcome * 10))
    assert opp["corr"] > 0.9 and opp["within_corr"] == -1.0


def test_choose_takes_each_runs_best_candidate_on_validation_only(bench, tmp_path):
    """--choose: per run, the candidate with the best validation score (the first on a tie) lends its held-out
    scores to the new arm; the held-out scores play no part in the choice; a run missing a candidate's
    validation evaluation gets no chosen arm."""
    import json

    val = {"r0": {"a": 0.5, "b": 0.7}, "r1": {"a": 0.6, "b": 0.6}, "r2": {"a": 0.9}}
    runs = {}
    for r, arms in val.items():
        runs[r] = tmp_path / r
        for arm, v in arms.items():
            (runs[r] / "oracle" / arm).mkdir(parents=True)
            (runs[r] / "oracle" / arm / "eval_validation.json").write_text(json.dumps({"success_rate": v}))
    # held-out scores ordered against validation: a choice made on them would pick the other candidate
    per_run = {r: {"a": {"scores": {"test_seen": 0.9}, "mean": 0.9}, "b": {"scores": {"test_seen": 0.1}, "mean": 0.1}}
               for r in val}
    bench.choose(per_run, runs, "best", ["a", "b"])
    assert per_run["r0"]["best"]["chosen"] == "b" and per_run["r0"]["best"]["mean"] == 0.1
    assert per_run["r0"]["best"]["validation"] == {"a": 0.5, "b": 0.7}
    assert per_run["r1"]["best"]["chosen"] == "a"  # tie: the first listed
    assert "best" not in per_run["r2"]


def test_choose_and_refs_on_the_command_line(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_oracle.py"), "--runs", str(tmp_path), "--report-only"]
    bad = subprocess.run(cmd + ["--choose", "sel"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--choose sel: expected NAME=ARM,ARM" in bad.stderr
    bad = subprocess.run(cmd + ["--choose", "sel=rft_bc,nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--choose sel=rft_bc,nope:" in bad.stderr and "unknown arm" in bad.stderr
    bad = subprocess.run(cmd + ["--choose", "learned=learned,learned_ep4"], capture_output=True, text=True)
    assert bad.returncode == 2 and "learned is an arm's name" in bad.stderr
    bad = subprocess.run(cmd + ["--refs", "sel"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--refs:" in bad.stderr and "unknown arm" in bad.stderr


def test_learned_trajmean_gives_every_step_its_trajectorys_mean(bench, tmp_path):
    """learned_trajmean's advantages: each row's learned advantage replaced by its trajectory's mean (a plain
    loop), every other column as it was; the run's own table is not touched."""
    import polars as pl

    run = tmp_path / "run"
    (run / "iter_1").mkdir(parents=True)
    src = pl.DataFrame({"traj_id": ["a", "a", "a", "b", "b"], "step": [0, 1, 2, 0, 1],
                        "advantage": pl.Series([1.0, -2.0, 4.0, 0.5, -0.5], dtype=pl.Float32),
                        "command": ["go", "look", "on", "go", "on"]})
    src.write_parquet(run / "iter_1" / "advantages.parquet")
    work = tmp_path / "arm"
    work.mkdir()
    out = pl.read_parquet(bench.advantage_table(run, "learned_trajmean", work))
    means = {t: sum(a for tt, a in zip(src["traj_id"], src["advantage"], strict=True) if tt == t) /
             sum(1 for tt in src["traj_id"] if tt == t) for t in ("a", "b")}
    assert out["advantage"].to_list() == [means[t] for t in src["traj_id"]] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert out.drop("advantage").equals(src.drop("advantage"))
    assert pl.read_parquet(run / "iter_1" / "advantages.parquet").equals(src)


def _eval(work: Path, split: str, outcomes: dict[str, float], with_n: bool = True) -> None:
    """An arm's evaluation of one split: the eval table (one greedy trajectory per task) and its metrics JSON."""
    import json

    import polars as pl

    work.mkdir(parents=True, exist_ok=True)
    pl.DataFrame({"traj_id": [f"{split}-{t}" for t in outcomes], "task_id": list(outcomes), "step": [0] * len(outcomes),
                  "reward_env": list(outcomes.values())}).write_parquet(work / f"eval_{split}.parquet")
    m = {"success_rate": sum(outcomes.values()) / len(outcomes), "n": len(outcomes)}
    if with_n:
        m["n_tasks"] = len(outcomes)
    else:
        m.pop("n")
    (work / f"eval_{split}.json").write_text(json.dumps(m))


def test_held_out_pools_every_task_once_and_keeps_the_splits(bench, tmp_path):
    """docs/results.md, "Held out": an arm's `mean` pools the tasks of both splits (a 2-task and a 4-task split:
    each task weighs 1/6, not the splits 1/2 each), the per-split success and task counts stay in the output and
    the summary, and the paired difference's mean is the difference of the pooled means (each task once)."""
    splits = ["test_seen", "test_unseen"]
    seen = {"r0": {"a": [1, 1], "b": [0, 1]}, "r1": {"a": [1, 0], "b": [0, 0]}}
    unseen = {"r0": {"a": [0, 0, 0, 1], "b": [0, 0, 1, 1]}, "r1": {"a": [1, 1, 1, 1], "b": [0, 1, 1, 1]}}
    runs = {}
    for r in seen:
        runs[r] = tmp_path / r
        runs[r].mkdir()
        (runs[r] / "config.yaml").write_text("env: lamps-habit\n")
        for arm in ("a", "b"):
            work = runs[r] / "oracle" / arm
            _eval(work, "test_seen", {f"s{i}": float(x) for i, x in enumerate(seen[r][arm])}, with_n=(r == "r0"))
            _eval(work, "test_unseen", {f"u{i}": float(x) for i, x in enumerate(unseen[r][arm])})
    per_run = {r: bench.run_arms(p, ["a", "b"], splits, report_only=True) for r, p in runs.items()}
    a0 = per_run["r0"]["a"]
    assert a0["tasks"] == {"test_seen": 2, "test_unseen": 4}  # r1's seen JSON has no count: read from its table
    assert per_run["r1"]["a"]["tasks"] == {"test_seen": 2, "test_unseen": 4}
    assert a0["scores"] == {"test_seen": 1.0, "test_unseen": 0.25}
    assert a0["mean"] == pytest.approx(3 / 6)  # pooled; the split means averaged would be 0.625
    pooled = {r: {arm: (sum(seen[r][arm]) + sum(unseen[r][arm])) / 6 for arm in ("a", "b")} for r in seen}
    for r in seen:
        for arm in ("a", "b"):
            assert per_run[r][arm]["mean"] == pytest.approx(pooled[r][arm])

    diffs = bench.task_diffs(runs["r0"] / "oracle" / "a", runs["r0"] / "oracle" / "b", splits)
    assert diffs == [1.0, 0.0, 0.0, 0.0, -1.0, 0.0]  # every task once, unweighted
    s = bench.summarise(per_run, ["a", "b"], runs, splits, refs=("b",), n_boot=200)
    want = (pooled["r0"]["a"] + pooled["r1"]["a"]) / 2
    assert s["a"]["mean"] == round(100 * want, 1) and s["a"]["per_run"] == {r: round(100 * pooled[r]["a"], 1)
                                                                             for r in seen}
    assert s["a"]["splits"] == {"test_seen": {"mean": 75.0, "se": 25.0}, "test_unseen": {"mean": 62.5, "se": 37.5}}
    d = s["a"]["minus_b"]
    gap = sum(pooled[r]["a"] - pooled[r]["b"] for r in seen) / 2
    # r0 is a tie pooled (3/6 each; its split means averaged, 0.625 against 0.5, would make it a win)
    assert d["mean"] == round(100 * gap, 1) and d["n"] == 2 and d["wins"] == 1
    md = bench.markdown(s, ["r0", "r1"], refs=("b",))
    head, _, row_a, _ = md.splitlines()
    assert head == "| arm | r0 | r1 | held out, mean ± se | test_seen | test_unseen | − b [95 % CI] (wins) |"
    assert row_a.startswith("| a | 50.0 | 83.3 | 66.7 ± 16.7 | 75.0 ± 25.0 | 62.5 ± 37.5 | +16.7 [")
