"""ALFWorld adapter (alfworld + textworld text engine) on the shared json_2.1.1 games."""
from __future__ import annotations

import pytest

from qevolve_cli import react
from qevolve_cli.envs import act, list_tasks, make_env
from qevolve_cli.envs.expert import expert_output
from qevolve_cli.errors import QevolveError
from tests.test_envs_textcraft import is_invalid

pytestmark = pytest.mark.alfworld


@pytest.fixture(scope="module")
def alf():
    from qevolve_cli.envs.alfworld import ensure_alfworld_data

    try:
        ensure_alfworld_data()
    except QevolveError as e:
        pytest.skip(f"ALFWorld data unavailable: {e}")
    env = make_env("alfworld")
    yield env
    env.close()


def _replay(env, task):
    obs = env.reset(task, with_expert=True, max_steps=200)
    plan = env.expert_plan()
    assert plan and obs and env.instruction
    for cmd in plan:
        res = act(env, expert_output(cmd))
        if res.done:
            break
    return res, plan


def test_gt_traj_replay_wins_on_a_few_train_games(alf):
    tasks = list_tasks("alfworld", "train")
    picks = [tasks[i] for i in (0, 1000, 2500)]
    assert len({t.task_type for t in picks}) == 3
    for task in picks:
        res, _ = _replay(alf, task)
        assert res.done and res.reward == 1.0 and res.info["won"], task.task_id


def test_planner_expert_on_an_unseen_game(alf):
    task = list_tasks("alfworld", "test_unseen")[0]
    assert not (alf.game_path(task).parent / "gt_traj.json").exists()
    res, _ = _replay(alf, task)
    assert res.done and res.reward == 1.0


def test_observation_layout_and_invalid_pattern(alf):
    task = list_tasks("alfworld", "train")[0]
    obs = alf.reset(task)
    assert "Welcome to TextWorld" not in obs and obs.startswith("You are in the middle of a room")
    assert alf.instruction == "look at alarmclock under the desklamp."
    bad = [alf.step(c)[0] for c in ("go to narnia", "take apple 1 from desk 1", "fly")]
    assert all(is_invalid("alfworld", o) for o in bad), bad
    good = [alf.step(c)[0] for c in ("go to desk 1", "inventory")]
    assert not any(is_invalid("alfworld", o) for o in good), good
    assert is_invalid("alfworld", react.FORMAT_ERROR_OBSERVATION)
    assert alf.max_steps == 30
