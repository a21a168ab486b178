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
