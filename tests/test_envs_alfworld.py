"""ALFWorld adapter (alfworld + textworld text engine) on the shared json_2.1.1 games."""
from __future__ import annotations

import pytest

from qevolve_cli import react
from qevolve_cli.envs import act, list_tasks, make_env, task_from_id
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
    first = {}
    for t in list_tasks("alfworld", "train", limit=12):  # the mixed order: six types in the first 12
        first.setdefault(t.task_type, t)
    picks = list(first.values())[:3]
    assert len({t.task_type for t in picks}) == 3
    for task in picks:
        res, _ = _replay(alf, task)
        assert res.done and res.reward == 1.0 and res.info["won"], task.task_id


def test_planner_expert_on_an_unseen_game(alf):
    task = list_tasks("alfworld", "test_unseen")[0]
    assert not (alf.game_path(task).parent / "gt_traj.json").exists()
    res, _ = _replay(alf, task)
    assert res.done and res.reward == 1.0


ALARM_CLOCK = "train/look_at_obj_in_light-AlarmClock-None-DeskLamp-301/trial_T20190907_174127_043461"


def test_observation_layout_and_invalid_pattern(alf):
    task = task_from_id("alfworld", "alfworld:" + ALARM_CLOCK, "train")
    obs = alf.reset(task)
    assert "Welcome to TextWorld" not in obs and obs.startswith("You are in the middle of a room")
    assert alf.instruction == "look at alarmclock under the desklamp."
    bad = [alf.step(c)[0] for c in ("go to narnia", "take apple 1 from desk 1", "fly")]
    assert all(is_invalid("alfworld", o) for o in bad), bad
    good = [alf.step(c)[0] for c in ("go to desk 1", "inventory")]
    assert not any(is_invalid("alfworld", o) for o in good), good
    assert is_invalid("alfworld", react.FORMAT_ERROR_OBSERVATION)
    assert alf.max_steps == 30


def _downward_copies() -> int:
    """Copies of fast-downward's shared library mapped into this process (one per PddlEnv built)."""
    with open("/proc/self/maps") as f:
        return len({tuple(line.split()[3:5]) for line in f if "libdownward" in line})


def _trace(env, task, with_expert=True):
    obs = [env.reset(task, with_expert=with_expert, max_steps=200), env.instruction]
    for cmd in env.expert_plan():
        res = act(env, expert_output(cmd))
        obs.append((res.observation, res.reward, res.done))
        if res.done:
            break
    return obs


def test_games_reuse_one_textworld_env_and_memory_stays_flat():
    """Regression: a fresh TextWorld env per game loaded a new copy of fast-downward's library
    each time and TextWorld's Proposition memo kept every game's facts (~4 MB per game)."""
    import mementos.core

    from qevolve_cli.envs.alfworld import ensure_alfworld_data

    try:
        ensure_alfworld_data()
    except QevolveError as e:
        pytest.skip(f"ALFWorld data unavailable: {e}")
    train = list_tasks("alfworld", "train")
    first, others = train[40], [train[i] for i in (900, 1700, 2600, 3300)]
    planner_game = list_tasks("alfworld", "test_unseen")[3]
    before = _downward_copies()
    env = make_env("alfworld")
    try:
        ref = _trace(env, first)
        memo_one_game = len(mementos.core._memento_cache)
        played = [_trace(env, t) for t in others] + [_trace(env, planner_game)]
        again = _trace(env, first)
        memo_again = len(mementos.core._memento_cache)
        # the memo holds one game's objects, not the sum of all games played
        assert memo_again == memo_one_game
        # one library copy per request-info set (gt_traj games / planner games), not one per game
        assert _downward_copies() - before <= 2
    finally:
        env.close()
    assert again == ref  # a reused env plays a game exactly as the first time
    assert all(p[-1][1] == 1.0 and p[-1][2] for p in played + [ref])
    fresh = make_env("alfworld")  # and exactly as a brand-new env does
    try:
        assert _trace(fresh, others[2]) == played[2]
    finally:
        fresh.close()


def test_memo_cleared_by_another_env_mid_game_changes_nothing():
    """Each reset empties the process-wide memo, also while another env in the same worker
    (envs_per_worker > 1) is mid-game: that game must play on exactly as if alone."""
    from qevolve_cli.envs.alfworld import ensure_alfworld_data

    try:
        ensure_alfworld_data()
    except QevolveError as e:
        pytest.skip(f"ALFWorld data unavailable: {e}")
    train = list_tasks("alfworld", "train")
    task, intruder = train[1200], train[2100]
    a, b = make_env("alfworld"), make_env("alfworld")
    try:
        alone = _trace(a, task)
        mixed = [a.reset(task, with_expert=True, max_steps=200), a.instruction]
        plan = a.expert_plan()
        for i, cmd in enumerate(plan):
            if i in (1, len(plan) // 2):  # b starts a new game (clearing the memo) between a's steps
                b.reset(intruder if i == 1 else train[2900], with_expert=True, max_steps=200)
                act(b, expert_output(b.expert_plan()[0]))
            res = act(a, expert_output(cmd))
            mixed.append((res.observation, res.reward, res.done))
            if res.done:
                break
        assert len(alone) > 4 and mixed == alone and alone[-1][1] == 1.0
    finally:
        a.close()
        b.close()


_TRACE_SCRIPT = r"""
import json, sys
OUT = sys.argv[1]  # fast_downward's translator rewrites sys.argv
from qevolve_cli.envs import act, make_env, task_from_id
from qevolve_cli.envs.expert import expert_output
plans = {}
# two gt_traj games (train) and one the planner solves (test_unseen)
clock = task_from_id("alfworld", "alfworld:train/look_at_obj_in_light-AlarmClock-None-DeskLamp-328/trial_T20190908_212905_950861", "train")
spoon = task_from_id("alfworld", "alfworld:train/pick_clean_then_place_in_recep-Spoon-None-DiningTable-18/trial_T20190909_102022_120766", "train")
book = task_from_id("alfworld", "alfworld:valid_unseen/look_at_obj_in_light-Book-None-DeskLamp-308/trial_T20190908_020029_636862", "test_unseen")

def trace(env, task, with_expert):
    out = [env.reset(task, with_expert=with_expert, max_steps=200), env.instruction]
    if with_expert:
        plans[task.task_id] = env.expert_plan()
        out.append(plans[task.task_id])
    for i, cmd in enumerate(plans[task.task_id]):
        if i % 3 == 1:  # invalid and no-op commands in between
            out += [list(env.step(c)[:3]) for c in ("go to narnia", "look", "inventory")]
        r = act(env, expert_output(cmd))
        out.append([r.observation, r.reward, r.done])
        if r.done:
            break
    return out

env = make_env("alfworld")
games = [(clock, True), (clock, False), (book, True), (spoon, True), (clock, False), (book, False), (clock, True)]
res = [trace(env, t, we) for t, we in games]
from qevolve_cli.envs import alfworld
with open(OUT, "w") as f:
    json.dump({"traces": res, "cache": alfworld._GAME_STATS}, f)
"""


@pytest.mark.slow
def test_cached_games_play_exactly_as_fresh_loads(tmp_path):
    """The per-worker game cache (parsed logic + PDDL translation, memoised templates) gives the
    same observations, rewards and done flags as TextWorld's own load, for the same actions:
    first loads, replays of a game (the n samples of a task), planner (test_unseen) and
    gt_traj games, with and without the expert plan, invalid and no-op commands in between."""
    import json
    import os
    import subprocess
    import sys

    from qevolve_cli.envs.alfworld import ensure_alfworld_data
    from tests.conftest import ROOT, qevolve_env

    try:
        data = ensure_alfworld_data()
    except QevolveError as e:
        pytest.skip(f"ALFWorld data unavailable: {e}")
    out = {}
    for cache in ("0", "32"):  # 0: textworld.start / PddlEnv as before, in a fresh process
        env = dict(qevolve_env(), QEVOLVE_ALFWORLD_GAME_CACHE=cache, ALFWORLD_DATA=str(data))
        path = tmp_path / f"trace_{cache}.json"
        p = subprocess.run([sys.executable, "-c", _TRACE_SCRIPT, str(path)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=900)
        assert path.exists(), p.stderr[-3000:]
        out[cache] = json.loads(path.read_text())
    old, new = out["0"], out["32"]
    assert new["cache"] == {"hits": 4, "misses": 3} and old["cache"] == {"hits": 0, "misses": 0}
    assert len(old["traces"]) == 7 and all(len(t) > 8 for t in old["traces"])
    for a, b in zip(old["traces"], new["traces"], strict=True):
        assert a == b
    assert old["traces"][0][-1][1:] == [1.0, True]  # the expert wins: the games really were played
    assert os.environ.get("QEVOLVE_ALFWORLD_GAME_CACHE") is None


def test_a_reset_loads_neither_the_thor_simulator_nor_torch():
    """`alfworld.agents.environment/__init__` imports the THOR env and its Mask R-CNN detector
    (torchvision, torch._dynamo): 4.5 s of a worker's first reset and ~0.7 GB of RSS, for classes a
    text rollout never uses. A fresh interpreter resets a game without them, and the package still
    imports whole afterwards."""
    import subprocess
    import sys

    from qevolve_cli.envs.alfworld import ensure_alfworld_data
    from tests.conftest import ROOT, qevolve_env

    try:
        ensure_alfworld_data()
    except QevolveError as e:
        pytest.skip(f"ALFWorld data unavailable: {e}")
    code = (
        "import sys\n"
        "from qevolve_cli.envs import list_tasks, make_env\n"
        "env = make_env('alfworld'); obs = env.reset(list_tasks('alfworld', 'train')[0])\n"
        "assert obs and env.instruction, obs\n"
        "heavy = sorted(m for m in ('torch', 'torchvision', 'alfworld.agents.environment.alfred_thor_env',"
        " 'alfworld.agents.detector.mrcnn') if m in sys.modules)\n"
        "assert 'alfworld.agents.environment' not in sys.modules\n"
        "from qevolve_cli.envs.alfworld import alfred_wrappers\n"
        "import alfworld.agents.environment as E\n"
        "assert E.AlfredTWEnv.__module__ == 'alfworld.agents.environment.alfred_tw_env'\n"
        "assert alfred_wrappers()[0] is sys.modules['alfworld.agents.environment.alfred_tw_env'].AlfredDemangler\n"
        "print(heavy)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=qevolve_env(), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "[]", p.stdout
