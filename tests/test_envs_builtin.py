"""The built-in ``lamps`` environment: expert, invalid actions vs labelling rules, splits, registration."""
from __future__ import annotations

import re

import polars as pl
import pytest
import yaml

from qevolve_cli import labeling, react
from qevolve_cli.envs import MAX_STEPS, act, list_tasks, make_env, task_from_id
from qevolve_cli.envs.builtin import build_splits, parse_task_id
from qevolve_cli.envs.expert import collect_expert, expert_output
from qevolve_cli.envs.prompts import instruction_prompt
from qevolve_cli.errors import QevolveError
from tests.conftest import ROOT


def rules() -> dict:
    return yaml.safe_load((ROOT / "configs/labels.yaml").read_text())["lamps"]


def is_invalid(obs: str) -> bool:
    return any(re.search(p, obs) for p in rules()["invalid_patterns"])


def play(env, commands):
    return [act(env, expert_output(c)) for c in commands]


def test_expert_succeeds_on_every_train_task_with_episodic_reward():
    env = make_env("lamps")
    tasks = list_tasks("lamps", "train")
    assert len(tasks) == 389
    for task in tasks:
        env.reset(task, with_expert=True)
        plan = env.expert_plan()
        start, targets = parse_task_id(task.task_id)
        assert plan.count("turn on lamp") == len(targets) and len(plan) <= MAX_STEPS["lamps"]
        res = play(env, plan)
        assert [r.command for r in res] == plan
        assert all(r.reward == 0 and not r.done for r in res[:-1])
        assert res[-1].done and res[-1].reward == 1.0 and res[-1].info["won"], task.task_id


def test_observations_and_instruction_follow_the_task():
    env = make_env("lamps")
    task = task_from_id("lamps", "lamps:bedroom:hallway+kitchen")  # corridor: kitchen bedroom bathroom hallway ...
    obs = env.reset(task)
    assert obs == "You are in the bedroom. The lamp here is off. The next lamp to turn on is to the east."
    assert env.instruction == "turn on the lamp in the hallway, then in the kitchen"
    assert env.step("go east")[0] == "You are in the bathroom. The lamp here is off."
    assert env.step("go east")[0].endswith("This is the room of the next lamp.")
    assert env.step("turn on lamp")[0].endswith("The next lamp to turn on is to the west.")
    # another order than the instruction's also succeeds; a non-target lamp does not end the episode
    env.reset(task)
    res = play(env, ["go west", "turn on lamp", "go east", "turn on lamp", "go east", "go east", "turn on lamp"])
    assert [r.done for r in res] == [False] * 6 + [True] and res[-1].reward == 1.0


def test_invalid_actions_match_label_patterns_and_valid_ones_do_not():
    env = make_env("lamps", max_steps=30)
    env.reset(task_from_id("lamps", "lamps:kitchen:bedroom+hallway"))
    bad = [env.step(c)[0] for c in ("jump around", "go west", "go to kitchen", "turn off lamp")]
    env.step("turn on lamp")
    bad.append(env.step("turn on lamp")[0])
    assert all(is_invalid(o) for o in bad), bad
    assert env.lamps["kitchen"] and env.room == "kitchen"  # invalid actions change nothing
    good = [env.step(c)[0] for c in ("look", "go east", "turn on lamp", "turn off lamp", "look")]
    assert not any(is_invalid(o) for o in good), good
    assert is_invalid(react.FORMAT_ERROR_OBSERVATION)


def test_format_error_repeat_and_step_limit():
    env = make_env("lamps")
    obs0 = env.reset(task_from_id("lamps", "lamps:kitchen:office"))
    r = act(env, "I will just chat.")
    assert r.command is None and r.observation == react.FORMAT_ERROR_OBSERVATION and not r.done
    look = act(env, expert_output("look")).observation
    assert look == obs0 and act(env, expert_output("look")).observation == look  # look twice: a repeat
    res = [act(env, expert_output("go east")) for _ in range(MAX_STEPS["lamps"] - 3)]
    assert res[-1].done and res[-1].info["truncated"] and res[-1].reward == 0.0
    with pytest.raises(RuntimeError):
        env.step("look")


def test_retrospective_labels_recognise_the_feedback():
    """The real labelling code (Rust core + configs/labels.yaml) on a lamps trajectory."""
    env = make_env("lamps")
    obs = env.reset(task_from_id("lamps", "lamps:kitchen:bedroom"))
    outputs = ["no action here", expert_output("go west"), expert_output("look"), expert_output("look"),
               expert_output("go east"), expert_output("turn on lamp")]
    rows = []
    for t, out in enumerate(outputs):
        r = act(env, out)
        rows.append({"traj_id": "x", "env": "lamps", "task_id": "lamps:kitchen:bedroom", "split": "train",
                     "source": "self", "iteration": 1, "step": t, "instruction": env.instruction,
                     "observation": obs, "action": out, "command": r.command, "next_observation": r.observation,
                     "reward_env": r.reward, "done": r.done})
        obs = r.observation
    df = pl.DataFrame(rows, schema_overrides={"iteration": pl.Int32, "step": pl.Int32, "reward_env": pl.Float32})
    out, _ = labeling.label_frame(df, labeling.LabelConfig())
    assert out["aux_kind"].to_list() == ["format", "invalid", "none", "repeat", "none", "none"]
    assert out["reward_aux"].to_list() == pytest.approx([-0.3, -0.2, 0.0, -0.1, 0.0, 0.0])
    assert out["success"].all()


def test_splits_are_disjoint_deterministic_and_held_out():
    s1 = build_splits()
    build_splits.cache_clear()
    s2 = build_splits()
    assert s1 == s2
    ids = {k: set(v) for k, v in s1.items()}
    assert all(len(ids[k]) == len(s1[k]) for k in ids)
    assert not (ids["train"] & ids["test_seen"]) and not (ids["train"] & ids["test_unseen"])
    assert not (ids["test_seen"] & ids["test_unseen"])
    assert sum(len(v) for v in ids.values()) == 8 * (8 + 56)
    sets = {k: {frozenset(parse_task_id(i)[1]) for i in v} for k, v in ids.items()}
    assert not (sets["test_unseen"] & sets["train"])  # unseen target sets
    assert sets["test_seen"] <= sets["train"]  # seen target sets, other start/order
    # the registry lists the same ids in the same (fixed) order, and ids round-trip
    assert [t.task_id for t in list_tasks("lamps", "test_seen")] == list(s1["test_seen"])
    assert list_tasks("lamps", "train", limit=5) == list_tasks("lamps", "train")[:5]
    t = list_tasks("lamps", "test_unseen")[3]
    assert task_from_id("lamps", t.task_id, "test_unseen") == t


def test_bad_input_is_a_one_line_error():
    with pytest.raises(QevolveError, match="malformed task id"):
        task_from_id("lamps", "lamps:attic:kitchen")
    with pytest.raises(QevolveError, match="unknown split"):
        list_tasks("lamps", "test")
    assert "go east" in instruction_prompt("lamps") and "turn on lamp" in instruction_prompt("lamps")


def test_expert_collection_through_the_worker_pool():
    stats: dict = {}
    df = collect_expert("lamps", "train", limit=6, workers=1, stats=stats)
    assert stats["succeeded"] == 6 and df["traj_id"].n_unique() == 6
    assert df.filter(pl.col("done"))["reward_env"].to_list() == [1.0] * 6
    assert set(df["source"]) == {"expert"}
