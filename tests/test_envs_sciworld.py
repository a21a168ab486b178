"""ScienceWorld adapter on the real ``scienceworld`` JVM: gold replay, invalid actions, ambiguity."""
from __future__ import annotations

import pytest

from qevolve_cli import react
from qevolve_cli.envs import act, list_tasks, make_env
from qevolve_cli.envs.expert import expert_output
from tests.test_envs_textcraft import is_invalid


@pytest.fixture(scope="module")
def sw():
    env = make_env("sciworld")
    yield env
    env.close()


def test_gold_replay_succeeds_on_three_train_variations(sw):
    for task in [list_tasks("sciworld", "train")[i] for i in (1, 3, 4)]:
        obs = sw.reset(task, with_expert=True, max_steps=1000)
        assert obs.startswith("This room is called") and sw.instruction.startswith("Your task is to")
        plan = sw.expert_plan()
        assert plan and not any(c.strip().isdigit() for c in plan)
        rewards = []
        for cmd in plan:
            res = act(sw, expert_output(cmd))
            rewards.append(res.reward)
            if res.done:
                break
        assert res.done and res.reward == 1.0 and res.info["won"], task.task_id
        assert all(r == 0.0 for r in rewards[:-1])


def test_invalid_actions_match_label_patterns(sw):
    sw.reset(list_tasks("sciworld", "train")[1])
    bad = [sw.step(c)[0] for c in ("jump on the table", "teleport to narnia", "xyzzy")]
    assert all(is_invalid("sciworld", o) for o in bad), bad
    good = [sw.step(c)[0] for c in ("look around", "teleport to kitchen", "inventory")]
    assert not any(is_invalid("sciworld", o) for o in good), good
    assert is_invalid("sciworld", react.FORMAT_ERROR_OBSERVATION)


def test_ambiguous_request_is_answered_with_option_0(sw):
    sw.reset(list_tasks("sciworld", "train")[4])  # grow fruit: starts in the greenhouse, two doors
    obs, reward, done, info = sw.step("open door")
    assert info["ambiguous"] and not obs.startswith("Ambiguous request")
    assert not done and reward == 0.0
    _, _, _, info2 = sw.step("look around")
    assert not info2["ambiguous"]


def test_step_limit_gives_final_partial_score(sw):
    env = sw
    task = list_tasks("sciworld", "train")[4]  # grow fruit: a 68-step gold path
    env.reset(task, with_expert=True, max_steps=4)
    plan = env.expert_plan()
    out = [env.step(c) for c in plan[:4]]
    assert out[-1][2] and out[-1][3]["truncated"]
    assert [o[1] for o in out[:-1]] == [0.0, 0.0, 0.0]
    assert out[-1][1] == pytest.approx(out[-1][3]["score"]) and 0.0 <= out[-1][1] < 1.0
    assert env.max_steps == 24
