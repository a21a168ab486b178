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


def test_environments_of_a_process_share_one_jvm_and_no_state():
    """Interleaved episodes of two envs in one JVM equal the same episodes in separate JVMs."""
    import os
    import signal

    tasks = [list_tasks("sciworld", "train")[i] for i in (1, 4)]
    a, b = make_env("sciworld"), make_env("sciworld")
    own = make_env("sciworld", shared_jvm=False)
    try:
        assert a.java_pid == b.java_pid != own.java_pid
        obs = [e.reset(t, with_expert=True, max_steps=1000) for e, t in zip((a, b), tasks, strict=True)]
        plans = [a.expert_plan(), b.expert_plan()]
        logs: list[list[str]] = [[], []]
        for i in range(max(map(len, plans))):
            for k, (e, plan) in enumerate(zip((a, b), plans, strict=True)):
                if i < len(plan) and not (logs[k] and logs[k][-1] == "<done>"):
                    res = act(e, expert_output(plan[i]))
                    logs[k].append(res.observation)
                    if res.done:
                        assert res.reward == 1.0
                        logs[k].append("<done>")
        for k, t in enumerate(tasks):  # the reference: each episode alone in its own JVM
            assert own.reset(t, max_steps=1000) == obs[k]
            ref = []
            for cmd in plans[k]:
                res = act(own, expert_output(cmd))
                ref.append(res.observation)
                if res.done:
                    ref.append("<done>")
                    break
            assert ref == logs[k], tasks[k].task_id
        # a JVM that died is started again by the next environment of the process
        dead = a.java_pid
        os.kill(dead, signal.SIGKILL)
        a._host._gateway.java_process.wait(timeout=30)
        c = make_env("sciworld")
        assert c.java_pid != dead
        assert c.reset(tasks[0]).startswith("This room is called")
        c.close()
    finally:
        for e in (a, b, own):
            e.close()
