"""Worker pool: parallel episodes in processes; a killed or hung worker fails only its episodes."""
from __future__ import annotations

import os
import signal
import time

import pytest

from qevolve_cli.envs import list_tasks
from qevolve_cli.envs.expert import expert_output
from qevolve_cli.envs.pool import EnvPool, Failure, ResetResult
from qevolve_cli.errors import QevolveError


@pytest.fixture
def tasks():
    return list_tasks("textcraft", "train", limit=4)


def _first_steps(res):
    return {k: expert_output(r.info["expert_plan"][0]) for k, r in res.items()}


def test_killed_worker_mid_episode_fails_its_episodes_only_and_is_restarted(tasks):
    with EnvPool("textcraft", workers=2, envs_per_worker=2, timeout_s=20) as pool:
        res = pool.reset_many([(t.task_id, t) for t in tasks], with_expert=True)
        assert all(isinstance(r, ResetResult) for r in res.values())
        assert len(set(pool.worker_pids())) == 2
        outputs = _first_steps(res)
        first = pool.act_many(list(outputs.items()))  # every episode is mid-way now
        assert not any(isinstance(r, Failure) for r in first.values())
        victim = tasks[0].task_id
        dead_pid = pool.pid_of(victim)
        same = {k for k in outputs if pool.pid_of(k) == dead_pid}
        os.kill(dead_pid, signal.SIGKILL)
        second = pool.act_many([(k, "Thought: check.\nAction: inventory") for k in outputs])
        for k, r in second.items():
            if k in same:
                assert isinstance(r, Failure) and r.error.startswith("worker crashed") and "exit code -9" in r.error
            else:  # the other worker's episodes go on with their state intact
                assert not isinstance(r, Failure) and r.observation.startswith("Inventory: [")
        assert pool.stats["restarts"] == 1 and dead_pid not in pool.worker_pids()
        # the restarted worker serves new episodes
        again = pool.reset_many([(victim, tasks[0])])
        assert isinstance(again[victim], ResetResult)


def test_hung_worker_times_out_and_is_replaced(tasks):
    with EnvPool("textcraft", workers=2, envs_per_worker=1, timeout_s=2) as pool:
        pool.reset_many([(t.task_id, t) for t in tasks[:2]])
        hung = pool.pid_of(tasks[0].task_id)
        os.kill(hung, signal.SIGSTOP)
        t0 = time.monotonic()
        out = pool.act_many([(t.task_id, "Action: inventory") for t in tasks[:2]])
        assert time.monotonic() - t0 < 10
        assert isinstance(out[tasks[0].task_id], Failure) and out[tasks[0].task_id].error.startswith("timeout")
        assert not isinstance(out[tasks[1].task_id], Failure)
        assert hung not in pool.worker_pids()


def test_env_error_fails_one_key_and_capacity_is_enforced(tasks):
    from qevolve_cli.envs.base import Task

    with EnvPool("textcraft", workers=1, envs_per_worker=2, timeout_s=20) as pool:
        bogus = Task("textcraft", "textcraft:no_such_item", "train", data={"goal": "no_such_item"})
        res = pool.reset_many([("bad", bogus), ("good", tasks[0])])
        assert isinstance(res["bad"], Failure) and "unknown goal item" in res["bad"].error
        assert isinstance(res["good"], ResetResult)
        assert pool.stats["restarts"] == 0
        with pytest.raises(QevolveError, match="capacity"):
            pool.reset_many([("a", tasks[1]), ("b", tasks[2])])
        out = pool.act_many([("never-reset", "Action: inventory")])
        assert isinstance(out["never-reset"], Failure)


def test_workers_step_in_parallel(tasks):
    """Two workers hung for the same time answer together: wall time ~ one timeout, not two."""
    with EnvPool("textcraft", workers=2, envs_per_worker=1, timeout_s=1.5) as pool:
        pool.reset_many([(t.task_id, t) for t in tasks[:2]])
        for t in tasks[:2]:
            os.kill(pool.pid_of(t.task_id), signal.SIGSTOP)
        t0 = time.monotonic()
        out = pool.act_many([(t.task_id, "Action: inventory") for t in tasks[:2]])
        assert all(isinstance(r, Failure) for r in out.values())
        assert time.monotonic() - t0 < 2.8
