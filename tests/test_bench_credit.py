"""benchmarks/bench_credit.py: the credit measures against hand-computed cases."""
from __future__ import annotations

import polars as pl
import pytest

from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_credit")


def test_auc_counts_pairs_and_ties(bench):
    assert bench.auc([2.0, 3.0], [1.0]) == 1.0
    assert bench.auc([1.0], [1.0]) == 0.5
    assert bench.auc([0.0, 2.0], [1.0]) == 0.5
    assert bench.auc([], [1.0]) is None


def frame():
    # two failed self-play trajectories of 3 steps, one successful of 2; a_exact 0 = an optimal step
    rows = [("f1", 0, -0.5), ("f1", 1, 0.0), ("f1", 2, 0.0), ("f2", 0, -0.4), ("f2", 1, -0.3), ("f2", 2, 0.0),
            ("s1", 0, 0.0), ("s1", 1, -0.1)]
    df = pl.DataFrame({"traj_id": [r[0] for r in rows], "step": [r[1] for r in rows],
                       "source": ["self"] * len(rows), "success": [r[0].startswith("s") for r in rows]})
    return df, pl.Series([r[2] for r in rows], dtype=pl.Float64)


def test_credit_of_the_exact_advantages_and_of_their_reverse(bench):
    df, a_x = frame()
    opt, reach = a_x > -1e-6, pl.Series([True] * df.height)
    same = bench.credit(df, a_x, a_x, opt, reach)
    assert same["within_traj_corr"] == 1.0
    assert same["failed"]["auc_optimal"] == 1.0 and same["successful"]["auc_optimal"] == 1.0
    assert same["failed"]["optimal_share_of_reachable"] == 0.5 and same["failed"]["trajectories"] == 2
    rev = bench.credit(df, -a_x, a_x, opt, reach)
    assert rev["within_traj_corr"] == -1.0 and rev["failed"]["auc_optimal"] == 0.0
    # a constant shift per trajectory (the outcome) carries no step credit: the within-trajectory measure
    # and the AUC inside one trajectory's steps do not move, the mean does
    shifted = a_x + pl.Series([5.0, 5.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    s = bench.credit(df, shifted, a_x, opt, reach)
    assert s["within_traj_corr"] == 1.0 and s["failed"]["mean_advantage"] > same["failed"]["mean_advantage"]
    # across trajectories the shift does count: f1's optimal steps (5.0, 5.0) beat all three suboptimal ones
    # (4.5, -0.4, -0.3), f2's optimal 0.0 beats two of them: 8 of 9 pairs
    assert s["failed"]["auc_optimal"] == round(8 / 9, 3)
    # steps from which the goal is out of reach do not count in the AUC: without f1 (unreachable), f2's
    # optimal 0.0 against its -0.4, -0.3
    out_of_reach = pl.Series([r.startswith("f1") for r in df["traj_id"].to_list()])
    s2 = bench.credit(df, shifted, a_x, opt, ~out_of_reach)
    assert s2["failed"]["auc_optimal"] == 1.0 and s2["failed"]["reachable_steps"] == 3

