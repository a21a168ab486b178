"""The comparison's statistics (evolve/compare.py): paired bootstrap against a plain loop, per-task rewards of an
evaluation table against a hand count."""
from __future__ import annotations

import random

import numpy as np
import polars as pl
import pytest

from qevolve_cli.evolve.compare import paired_bootstrap, per_task_rewards


def ref_bootstrap(d, n_boot, seed, level):
    """Plain loops over the same draws (numpy's generator in the documented order)."""
    n_s, n_t = len(d), len(d[0])
    rng = np.random.default_rng(seed)
    si = rng.integers(0, n_s, (n_boot, n_s)).tolist()
    ti = rng.integers(0, n_t, (n_boot, n_s, n_t)).tolist()
    reps = []
    for b in range(n_boot):
        tot = 0.0
        for j in range(n_s):
            for k in range(n_t):
                tot += d[si[b][j]][ti[b][j][k]]
        reps.append(tot / (n_s * n_t))
    reps.sort()

    def q(p):  # numpy's default (linear) quantile
        x = p * (n_boot - 1)
        i = int(x)
        return reps[i] + (reps[min(i + 1, n_boot - 1)] - reps[i]) * (x - i)

    mean = sum(sum(r) for r in d) / (n_s * n_t)
    return mean, q((1 - level) / 2), q((1 + level) / 2)


@pytest.mark.parametrize("seed", [0, 1])
def test_paired_bootstrap_matches_a_plain_loop(seed):
    r = random.Random(seed)
    d = [[r.choice([-1.0, 0.0, 0.0, 1.0]) + (0.3 if s == 2 else 0.0) for _ in range(7)] for s in range(4)]
    got = paired_bootstrap(d, n_boot=300, seed=seed, level=0.9)
    mean, lo, hi = ref_bootstrap(d, 300, seed, 0.9)
    assert got["mean"] == pytest.approx(mean, abs=1e-12)
    assert (got["lo"], got["hi"]) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))
    assert (got["seeds"], got["tasks"]) == (4, 7) and got["lo"] <= got["mean"] <= got["hi"]


def test_paired_bootstrap_hand_cases():
    # the same difference everywhere: a point interval
    c = paired_bootstrap([[0.25] * 5] * 3, n_boot=200)
    assert c["mean"] == c["lo"] == c["hi"] == pytest.approx(0.25)
    # a seed spread makes the interval wider than task noise alone: seeds at +1 / -1 (mean 0)
    spread = paired_bootstrap([[1.0] * 10, [-1.0] * 10], n_boot=2000)
    assert spread["mean"] == 0.0 and spread["lo"] == pytest.approx(-1.0) and spread["hi"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="seeds x tasks"):
        paired_bootstrap([[1.0, 0.0], [1.0]])


def test_per_task_rewards_best_trajectory_and_crashes(tmp_path):
    rows = [  # (traj, task, step, reward, error)
        ("a1", "t1", 0, 0.0, None), ("a1", "t1", 1, 1.0, None),          # t1: 1
        ("b1", "t2", 0, 0.0, None),                                        # t2: best of 0 and 0.5 -> 0.5
        ("b2", "t2", 0, 0.5, None),
        ("c1", "t3", 0, 1.0, None), ("c1", "t3", 1, 0.0, "worker died"),  # crashed episode counts 0
    ]
    df = pl.DataFrame({"traj_id": [r[0] for r in rows], "task_id": [r[1] for r in rows],
                       "step": [r[2] for r in rows], "reward_env": [r[3] for r in rows],
                       "error": [r[4] for r in rows]})
    p = tmp_path / "e.parquet"
    df.write_parquet(p)
    assert per_task_rewards(p) == {"t1": 1.0, "t2": 0.5, "t3": 0.0}
