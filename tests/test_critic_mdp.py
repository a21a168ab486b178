"""Correctness of the whole critic: a small text MDP whose dataset-constrained IQL solution is exact.

The MDP (a tree, so transcript histories and tabular states coincide)::

    gate --go north--> hall --go east--> treasure (r = 1, done)     [win]
    gate --go north--> hall --go west--> pit      (r = 0, done)     [pit]
    gate --go south--> swamp --go east--> drowned (r = 0, done)     [swamp]

The tabular reference (``qevolve_cli.tabular.tabular_iql``: expectile
value iteration over dataset actions, with the same step weights) gives
V(hall) > V(gate) > V(swamp) and advantages Q - V > 0 for the good actions
(north at the gate, east in the hall) and < 0 for the bad ones (south, west).
The critic on the tiny model, trained through the real pipeline (prefix
indexing, one forward per trajectory, alternating Double-Q / expectile
updates, EMA target), must reproduce that ordering and those signs, and its
values must be close to the reference.
"""
from __future__ import annotations

import polars as pl
import pytest

from qevolve_cli import core
from qevolve_cli.critic.config import CriticConfig
from qevolve_cli.critic.score import score_table
from qevolve_cli.critic.trainer import train_critic
from qevolve_cli.tabular import tabular_iql

GAMMA, M = 0.95, 0.7
TYPES = [
    ("win", [("You are at the gate.", "Thought: the hall is north.\nAction: go north", "You are in the hall."),
             ("You are in the hall.", "Thought: the treasure is east.\nAction: go east", "You found the treasure!")], 1.0),
    ("pit", [("You are at the gate.", "Thought: the hall is north.\nAction: go north", "You are in the hall."),
             ("You are in the hall.", "Thought: maybe west.\nAction: go west", "You fell into a pit.")], 0.0),
    ("swamp", [("You are at the gate.", "Thought: try south.\nAction: go south", "You are in the swamp."),
               ("You are in the swamp.", "Thought: try east.\nAction: go east", "You drowned.")], 0.0),
]


def mdp_table() -> pl.DataFrame:
    rows = []
    for name, steps, reward in TYPES:
        for t, (o, a, nxt) in enumerate(steps):
            last = t == len(steps) - 1
            rows.append(dict(traj_id=name, env="textcraft", task_id="treasure", split="train",
                             source="expert" if name == "win" else "self", iteration=0, step=t,
                             instruction="Find the treasure.", observation=o, action=a,
                             command=a.split("Action: ")[1], next_observation=nxt,
                             reward_env=reward if last else 0.0, done=last))
    df = pl.DataFrame(rows).with_columns(pl.col("iteration").cast(pl.Int32), pl.col("step").cast(pl.Int32),
                                         pl.col("reward_env").cast(pl.Float32))
    offs = core.offsets(df)
    succ = core.trajectory_success(offs, df["reward_env"])
    return df.with_columns(pl.lit(0.0, pl.Float32).alias("reward_aux"), pl.lit("none").alias("aux_kind"),
                           core.broadcast(offs, succ, "success"), core.step_weights(offs, succ, df.height))


def tabular_reference(df: pl.DataFrame):
    """States = transcript histories (the tree's nodes); weights = the table's w_t."""
    trans, ws, keys = [], [], []
    for r in df.iter_rows(named=True):
        prev = df.filter((pl.col("traj_id") == r["traj_id"]) & (pl.col("step") < r["step"]))
        hist = tuple(prev.select("observation", "action").rows())
        s = (hist, r["observation"])
        s2 = ((*hist, (r["observation"], r["action"])), r["next_observation"])
        trans.append((s, r["action"], float(r["reward_env"]) + float(r["reward_aux"]), s2, bool(r["done"])))
        ws.append(float(r["weight"]))
        keys.append((r["traj_id"], r["step"]))
    V, Q = tabular_iql(trans, GAMMA, M, ws)
    ref = {k: (V[t[0]], Q[(t[0], t[1])] - V[t[0]]) for k, t in zip(keys, trans, strict=True)}
    return ref


# one thread: on the shared 2-core machine spinning OpenMP threads only slow tiny matmuls
pytestmark = pytest.mark.usefixtures("one_thread")


def test_reference_solution_has_the_expected_structure():
    ref = tabular_reference(mdp_table())
    v_gate, v_hall, v_swamp = ref[("win", 0)][0], ref[("win", 1)][0], ref[("swamp", 1)][0]
    assert v_hall > v_gate > v_swamp == 0.0
    assert ref[("win", 1)][1] > 0 > ref[("pit", 1)][1]      # east vs west in the hall
    assert ref[("win", 0)][1] > 0 > ref[("swamp", 0)][1]    # north vs south at the gate


def test_critic_reproduces_tabular_iql(tiny_model_dir, tmp_path):
    df = mdp_table()
    ref = tabular_reference(df)
    cfg = CriticConfig(epochs=80, lr=2e-3, head_lr=5e-3, batch_size=8, schedule="both", ema_lambda=0.2,
                       warmup_ratio=0.0, lr_scheduler="constant", lora_rank=8, head_hidden=64,
                       gamma=GAMMA, expectile=M, device="cpu", checkpoint=False)
    summary = train_critic(cfg, df, tiny_model_dir, tmp_path / "critic")
    first, last = summary["metrics"][0], summary["metrics"][-1]
    assert last["td_error"] < first["td_error"]
    # schedule both: three backbone forwards per batch (value, q, q_target), one row per trajectory (3 trajectories,
    # one batch)
    assert last["q_updates"] == last["v_updates"] == 1 and last["forward_rows"] == 3 * 3

    sc = score_table(df, tmp_path / "critic", device="cpu")
    got = {(r["traj_id"], r["step"]): (r["value"], r["q_value"] - r["value"]) for r in sc.iter_rows(named=True)}
    v_gate, v_hall, v_swamp = got[("win", 0)][0], got[("win", 1)][0], got[("swamp", 1)][0]
    assert v_hall > v_gate > v_swamp, got
    # same state, same value wherever it occurs
    assert got[("pit", 0)][0] == pytest.approx(v_gate, abs=1e-5)
    assert got[("pit", 1)][0] == pytest.approx(v_hall, abs=1e-5)
    for key in [("win", 0), ("win", 1)]:
        assert got[key][1] > 0, (key, got)
    for key in [("swamp", 0), ("pit", 1)]:
        assert got[key][1] < 0, (key, got)
    for key, (v_ref, _a_ref) in ref.items():
        assert got[key][0] == pytest.approx(v_ref, abs=0.15), (key, got[key], v_ref)
    # next_value: V(s_{t+1}) for non-terminal steps (= the next step's value), 0 after the terminal step
    assert got[("win", 1)][0] == pytest.approx(sc.filter((pl.col("traj_id") == "win") & (pl.col("step") == 0))
                                               ["next_value"][0], abs=1e-5)
    assert (sc.filter(pl.col("done"))["next_value"] == 0).all()

    # test-time reranking (ablation "w/o PI"): in the hall, "go east" beats "go west"; the scores are
    # the same Q - V that score_table gives for the dataset's actions
    from qevolve_cli.critic.rerank import CriticReranker, rerank
    from qevolve_cli.envs.prompts import instruction_prompt
    from qevolve_cli.tokenizer import load_tokenizer
    from qevolve_cli.transcript import build_messages, needs_system_in_user

    tok = load_tokenizer(tiny_model_dir)
    win = df.filter(pl.col("traj_id") == "win").sort("step")
    state = build_messages(instruction_prompt("textcraft"), "Find the treasure.", win["observation"].to_list(),
                           win["action"].to_list()[:1], needs_system_in_user(tok))
    west, east = TYPES[1][1][1][1], TYPES[0][1][1][1]
    rr = CriticReranker(tmp_path / "critic", device="cpu")
    best, scores = rerank(rr, state, [west, east])
    assert best == 1 and scores[1] > 0 > scores[0]
    assert scores[1] == pytest.approx(got[("win", 1)][1], abs=1e-4)
    assert scores[0] == pytest.approx(got[("pit", 1)][1], abs=1e-4)
