"""The project's CPU critic preset learns a small deterministic MDP (issue: "the critic converges and says so").

A corridor of rooms 0..5; the goal is room 5 (reward 1, done). ``go east`` moves one room toward
the goal, ``go west`` one room away (in room 0 nothing happens: an invalid action). Expert
trajectories walk east from room 1 or 2; self trajectories take east with probability 0.55 and
stop at 8 steps. The right answer is obvious: V grows with the room number, east has a positive
and west a negative advantage.

The critic is trained through the real pipeline (labels, prefix indexing, the tiny HF model, LoRA
adapters, alternating Double-Q / expectile updates, EMA target) with the UNMODIFIED ``cpu`` preset of
``configs/critic.yaml`` (only ``device``/``seed`` are the preset's own), and scored by
``score_table`` + the paper's GAE (``qevolve label --critic``). An under-trained run (1 epoch) of the
same data must make ``qevolve critic`` print its one-line warning.
"""
from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from conftest import run_qevolve

from qevolve_cli import schema
from qevolve_cli.critic.config import load_critic_config
from qevolve_cli.critic.score import score_table
from qevolve_cli.critic.trainer import train_critic
from qevolve_cli.labeling import LabelConfig, label_frame
from qevolve_cli.rewards import process_rewards

GOAL = 5


def chain_table(n_expert: int = 16, n_self: int = 48, seed: int = 0) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []

    def play(tid: str, source: str, p_east: float) -> None:
        room = int(rng.integers(1, 3))
        for t in range(8):
            east = rng.random() < p_east
            obs = f"You are in room {room}."
            if east:
                nxt_room = room + 1
            else:
                nxt_room = max(room - 1, 0)
            won = nxt_room == GOAL
            nxt = "You reached the exit!" if won else (
                "Nothing happens. You cannot go west." if nxt_room == room else f"You are in room {nxt_room}.")
            cmd = "go east" if east else "go west"
            rows.append(dict(traj_id=tid, env="lamps", task_id="exit", split="train", source=source,
                             iteration=0 if source == "expert" else 1, step=t,
                             instruction="Walk to the exit at the east end of the corridor.", observation=obs,
                             action=f"Thought: I walk.\nAction: {cmd}", command=cmd, next_observation=nxt,
                             reward_env=1.0 if won else 0.0, done=won))
            room = nxt_room
            if won:
                break

    for i in range(n_expert):
        play(f"expert-{i}", "expert", 1.0)
    for i in range(n_self):
        play(f"self-{i}", "self", 0.55)
    df = pl.DataFrame(rows).with_columns(pl.col("iteration").cast(pl.Int32), pl.col("step").cast(pl.Int32),
                                         pl.col("reward_env").cast(pl.Float32))
    return schema.validate(df)


# one thread: on the shared 2-core machine spinning OpenMP threads only slow tiny matmuls
pytestmark = pytest.mark.usefixtures("one_thread")


def _room(obs: str) -> int:
    return int(obs.rsplit(" ", 1)[1].rstrip("."))


def test_chain_table_has_the_intended_structure():
    df = chain_table()
    per = df.group_by("traj_id").agg(pl.col("reward_env").sum(), pl.col("source").first())
    assert per.filter(pl.col("source") == "expert")["reward_env"].min() == 1.0
    self_ok = per.filter(pl.col("source") == "self")["reward_env"]
    assert 0.2 < float(self_ok.mean()) < 0.8  # both outcomes are well represented
    assert df.filter(pl.col("command") == "go west").height > 30


@pytest.mark.slow
def test_cpu_preset_critic_orders_states_and_signs_advantages(tiny_model_dir, tmp_path):
    labeled, _ = label_frame(chain_table(), LabelConfig())
    cfg = load_critic_config(preset="cpu")
    summary = train_critic(cfg, labeled, tiny_model_dir, tmp_path / "critic")
    assert summary["heldout_trajectories"] >= 4
    d = summary["diagnostics"]
    assert d["on"] == "heldout"
    # the held-out diagnostics say it learned (and the run does not warn)
    assert d["auc_v"] > 0.75 and d["ev_return"] > 0.15, d
    assert summary["warning"] is None, summary["warning"]

    sc = schema.sort_steps(score_table(labeled, tmp_path / "critic", device="cpu"))
    sc = sc.with_columns(pl.col("observation").map_elements(_room, return_dtype=pl.Int64).alias("room"))
    v = sc.group_by("room").agg(pl.col("value").mean()).sort("room")
    values = dict(zip(v["room"].to_list(), v["value"].to_list(), strict=True))
    for a, b in [(1, 2), (2, 3), (3, 4)]:  # rooms every trajectory can visit
        assert values[a] < values[b], values

    def mean_adv(kind: str, lam: float) -> dict:
        a = sc.with_columns(process_rewards(sc, kind, 0.95, lam))
        g = a.group_by("source", "command").agg(pl.col("advantage").mean())
        return {(r["source"], r["command"]): r["advantage"] for r in g.to_dicts()}

    # the action's own advantage r + gamma V(s') - V(s) (process reward `td`): east > 0 > west
    td = mean_adv("td", 0.0)
    assert td[("self", "go east")] > 0 > td[("self", "go west")], td
    assert td[("expert", "go east")] > 0, td
    # the paper's GAE (lambda 0.95) also folds in the noisy behaviour after the action (self
    # trajectories go west 45 % of the time): east still above west, west negative, expert positive
    gae = mean_adv("gae", 0.95)
    assert gae[("self", "go east")] > gae[("self", "go west")] and gae[("self", "go west")] < 0, gae
    assert gae[("expert", "go east")] > 0, gae


@pytest.mark.slow
def test_under_trained_critic_warns_on_stderr(tiny_model_dir, tmp_path):
    labeled, _ = label_frame(chain_table(), LabelConfig())
    path = tmp_path / "labeled.parquet"
    schema.write_table(labeled, path)
    out = tmp_path / "critic"
    proc = run_qevolve("critic", "--data", path, "--model", tiny_model_dir, "--out", out, "--preset", "cpu",
                       "--epochs", "1", "--set", "lr=1e-5", "--set", "head_lr=1e-5", "--json")
    assert proc.returncode == 0, proc.stderr
    warn = [ln for ln in proc.stderr.splitlines() if "warning: the critic has not learned" in ln]
    assert len(warn) == 1 and "--epochs" in warn[0] and "docs/critic.md" in warn[0], proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["warning"] == warn[0].split("qevolve critic: ", 1)[1]
    assert summary["diagnostics"]["problems"]
    assert summary["diagnostics"]["caveats"] == []  # 3 successes and 4 failures held out: enough to judge
    # the diagnostics are in the metrics file (every epoch) and in diagnostics.json
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert "bellman_q" in metrics[-1]["heldout"] and "auc_v" in metrics[-1]["heldout"]
    assert json.loads((out / "diagnostics.json").read_text())["on"] == "heldout"


@pytest.mark.slow
def test_early_stopping_keeps_the_best_epoch(tiny_model_dir, tmp_path):
    """Patience 1 with a 50 % min-delta stops long before the cap; the written critic is the best epoch's."""
    labeled, _ = label_frame(chain_table(n_expert=6, n_self=18), LabelConfig())
    cfg = load_critic_config(preset="cpu", overrides={"epochs": 12, "early_stop_patience": 1, "restore_best": True,
                                                      "early_stop_min_delta": 0.5, "heldout_fraction": 0.2})
    summary = train_critic(cfg, labeled, tiny_model_dir, tmp_path / "critic")
    metrics = summary["metrics"]
    stopped = summary["early_stopped_at"]
    assert stopped is not None and stopped == len(metrics) < 12
    errs = [m["heldout"]["bellman_q"] for m in metrics]
    best = summary["best_epoch"]
    # the best epoch is the last one that improved on every earlier best by >= 50 %
    running, expect = None, None
    for i, e in enumerate(errs, start=1):
        if running is None or e < running * 0.5:
            running, expect = e, i
    assert best == expect
    # patience 1: the epoch after the best did not improve enough, and training stopped there
    assert stopped == best + 1
    # the critic written to disk is the best epoch's: its final held-out error equals that epoch's
    assert summary["restored_epoch"] == best
    assert summary["diagnostics"]["bellman_q"] == pytest.approx(errs[best - 1], rel=1e-5)


def test_no_heldout_slice_reports_on_training_data(tiny_model_dir, tmp_path):
    labeled, _ = label_frame(chain_table(n_expert=2, n_self=4), LabelConfig())
    cfg = load_critic_config(preset="cpu", overrides={"epochs": 1, "heldout_fraction": 0.0})
    summary = train_critic(cfg, labeled, tiny_model_dir, tmp_path / "critic")
    assert summary["heldout_trajectories"] == 0 and summary["diagnostics"]["on"] == "train"
    assert summary["diagnostics"]["trajectories"] == labeled["traj_id"].n_unique()
    assert "heldout" not in summary["metrics"][0]
