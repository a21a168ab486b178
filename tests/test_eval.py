"""`qevolve eval`: greedy evaluation of the tiny model (subprocess CLI runs) and the metrics."""
from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from tests.conftest import run_qevolve
from tests.test_rollout import _react_model

FAST = ["--max-new-tokens", "24", "--workers", "2", "--envs-per-worker", "2", "-q"]


@pytest.fixture(scope="session")
def react_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    return _react_model(tmp_path_factory, tiny_model_dir)


def test_eval_textcraft_json(react_model_dir: Path, tmp_path: Path) -> None:
    from qevolve_cli import schema

    out = tmp_path / "ev.parquet"
    res = run_qevolve("eval", "--env", "textcraft", "--policy", react_model_dir, "--split", "test_seen",
                      "--max-tasks", "3", "--max-steps", "3", "--out", out, "--json", *FAST, check=True)
    m = json.loads(res.stdout)
    assert m["env"] == "textcraft" and m["split"] == "test_seen" and m["temperature"] == 0.0
    assert m["n"] == 3 and m["n_tasks"] == 3 and m["failed"] == 0
    df = schema.read_table(out)
    assert set(df["split"]) == {"test_seen"} and df["traj_id"].n_unique() == 3
    final = df.group_by("traj_id").agg(pl.col("reward_env").sum())["reward_env"]
    assert m["avg_reward"] == pytest.approx(float(final.mean()), abs=1e-6)
    assert m["success_rate"] == pytest.approx(float((final >= 1).mean()), abs=1e-6)
    assert sum(d["n"] for d in m["by_task_type"].values()) == 3
    assert json.loads((tmp_path / "ev.parquet.metrics.json").read_text())["avg_reward"] == m["avg_reward"]
    # greedy: a second evaluation plays exactly the same trajectories
    out2 = tmp_path / "ev2.parquet"
    run_qevolve("eval", "--env", "textcraft", "--policy", react_model_dir, "--split", "test_seen",
                "--max-tasks", "3", "--max-steps", "3", "--out", out2, "--seed", "99", *FAST, check=True)
    a, b = (pl.read_parquet(p).sort(["traj_id", "step"]) for p in (out, out2))
    assert a["action"].to_list() == b["action"].to_list()


def test_eval_sciworld_table(react_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "sw.parquet"
    res = run_qevolve("eval", "--env", "sciworld", "--policy", react_model_dir, "--split", "test_unseen",
                      "--max-tasks", "2", "--max-steps", "2", "--out", out, *FAST, check=True)
    text = res.stdout
    assert "sciworld / test_unseen" in text and "overall" in text and "avg reward" in text
    df = pl.read_parquet(out)
    assert df["traj_id"].n_unique() == 2 and set(df["split"]) == {"test_unseen"}
    for tt in df["task_type"].unique():  # one table row per task type
        assert tt in text


def test_summarize_metrics() -> None:
    from qevolve_cli.rollout.evaluate import summarize

    rows = []

    def traj(tid, tt, rewards, error=None):
        for i, r in enumerate(rewards):
            rows.append({"traj_id": tid, "task_type": tt, "step": i, "reward_env": r,
                         "error": error})

    traj("a", "boil", [0.0, 1.0])
    traj("b", "boil", [0.0, 0.0, 0.5])
    traj("c", "melt", [0.0])
    traj("d", "melt", [0.0, 1.0], error="worker crashed")  # failed: counts as 0
    m = summarize(pl.DataFrame(rows))
    assert m["n"] == 4 and m["failed"] == 1
    assert m["avg_reward"] == pytest.approx(1.5 / 4)
    assert m["success_rate"] == pytest.approx(1 / 4)
    assert m["nonzero_rate"] == pytest.approx(2 / 4)
    assert m["by_task_type"]["boil"]["avg_reward"] == pytest.approx(0.75)
    assert m["by_task_type"]["melt"] == {"n": 2, "avg_reward": 0.0, "success_rate": 0.0, "nonzero_rate": 0.0,
                                         "avg_steps": 1.5, "failed": 1}


def test_eval_critic_needs_candidates(react_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "critic").mkdir()
    res = run_qevolve("eval", "--env", "textcraft", "--policy", react_model_dir, "--split", "test_seen",
                      "--max-tasks", "1", "--critic", tmp_path / "critic", "--out", tmp_path / "e.parquet", "-q")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ["error: --critic: needs --candidates N with N >= 2"]
    assert not (tmp_path / "e.parquet").exists()


def test_best_of_n_keeps_the_highest_final_reward_per_task() -> None:
    from qevolve_cli.rollout.evaluate import best_of_n, summarize

    def traj(task, sample, rewards, error=None):
        return [dict(traj_id=f"s{sample}/{task}", task_id=task, sample=sample, step=t, reward_env=float(r),
                     task_type="all", error=error) for t, r in enumerate(rewards)]

    rows = (traj("a", 0, [0, 0]) + traj("a", 1, [0, 1]) + traj("a", 2, [1])  # tie 1 = 1: lowest sample wins
            + traj("b", 0, [0, 0.5]) + traj("b", 1, [1], error="worker crashed")  # a failed episode counts 0
            + traj("c", 1, [0]) + traj("c", 0, [0, 0, 0]))  # all 0: sample 0
    sel = best_of_n(pl.DataFrame(rows))
    assert sorted(sel["traj_id"].unique().to_list()) == ["s0/b", "s0/c", "s1/a"]
    m = summarize(sel)
    assert m["n"] == 3 and m["avg_reward"] == pytest.approx(0.5) and m["success_rate"] == pytest.approx(1 / 3)


@pytest.mark.slow
def test_eval_best_of_n_on_lamps_is_marked_oracle(tiny_model_dir: Path, tmp_path: Path, tmp_path_factory) -> None:
    from qevolve_cli.rollout.evaluate import trajectory_outcomes
    from qevolve_cli.rollout.warm import react_tune

    model = react_tune(tiny_model_dir, tmp_path / "react_lamps", ["lamps"])
    out = tmp_path / "bon.parquet"
    res = run_qevolve("eval", "--env", "lamps", "--policy", model, "--split", "test_seen", "--max-tasks", "5",
                      "--max-steps", "4", "--best-of", "3", "--temperature", "1.0", "--out", out, "--json", *FAST,
                      check=True)
    m = json.loads(res.stdout)
    assert m["best_of"] == 3 and m["oracle"] is True and m["temperature"] == 1.0
    df = pl.read_parquet(out)  # all N trajectories per task are kept in the table
    per = trajectory_outcomes(df)
    assert per.height == 15 and per.group_by("task_id").len()["len"].to_list() == [3] * 5
    assert m["n"] == 5 and m["env_steps"] == df.height
    best = per.group_by("task_id").agg(pl.col("reward").max())["reward"]
    assert m["avg_reward"] == pytest.approx(float(best.mean()), abs=1e-6)
    # never worse than any single sample index (what one sampled trajectory per task would score)
    for s in range(3):
        assert m["avg_reward"] >= float(per.filter(pl.col("sample") == s)["reward"].mean()) - 1e-9
    assert len(set(df["action"].to_list())) > 1  # sampled, not one greedy action
    text = run_qevolve("eval", "--env", "lamps", "--policy", model, "--split", "test_seen", "--max-tasks", "5",
                       "--max-steps", "4", "--best-of", "3", "--temperature", "1.0", "--out", out, "--resume",
                       *FAST, check=True).stdout
    assert "best-of-3 by env reward (oracle upper bound)" in " ".join(text.split())  # rich may wrap the title
    bad = run_qevolve("eval", "--env", "lamps", "--policy", model, "--split", "test_seen", "--best-of", "2",
                      "--critic", tmp_path, "--candidates", "2", "--out", tmp_path / "x.parquet", *FAST)
    assert bad.returncode == 2 and "cannot be combined with --critic" in bad.stderr
