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


def test_submitted_requests_overlap_and_are_answered_in_order(tasks):
    """Two tickets in flight on one worker: answered in order, each with its own results."""
    with EnvPool("textcraft", workers=1, envs_per_worker=3, timeout_s=20) as pool:
        t1 = pool.submit(resets=[("a", tasks[0]), ("b", tasks[1])], with_expert=True)
        t2 = pool.submit(resets=[("c", tasks[2])], with_expert=True)  # queued behind t1 on the same worker
        assert not t1.done and not t2.done  # submit does not wait
        r2 = pool.wait(t2)  # waiting for the later ticket also takes in the earlier one's answers
        assert t1.done and set(t1.results) == {"a", "b"} and set(r2) == {"c"}
        plans = {k: r.info["expert_plan"] for k, r in {**t1.results, **r2}.items()}
        # one request can free, restart and step episodes at once: release c, reset c again, step a and b
        t3 = pool.submit(releases=["c"], resets=[("c", tasks[3])],
                         acts=[("a", expert_output(plans["a"][0])), ("b", "Thought: x\nAction: inventory")])
        t4 = pool.submit(acts=[("a", "Thought: x\nAction: inventory")])
        r4, r3 = pool.wait(t4), pool.wait(t3)
        assert isinstance(r3["c"], ResetResult) and tasks[3].data["goal"].replace("_", " ") in r3["c"].instruction
        assert r3["b"].observation == "Inventory: You are not carrying anything."
        assert r3["a"].command == plans["a"][0]
        assert r4["a"].observation.startswith("Inventory: [")  # after t3's "get ..." of a: order kept
        assert pool.stats["busy_step_s"] > 0 and pool.stats["busy_reset_s"] > 0
        assert sorted(map(str, pool.live_keys)) == ["a", "b", "c"]


def test_worker_killed_with_two_tickets_in_flight_fails_both(tasks):
    with EnvPool("textcraft", workers=1, envs_per_worker=2, timeout_s=20) as pool:
        pool.reset_many([("a", tasks[0]), ("b", tasks[1])])
        pid = pool.pid_of("a")
        os.kill(pid, signal.SIGSTOP)  # the worker cannot answer until it is killed
        t1 = pool.submit(acts=[("a", "Action: inventory")])
        t2 = pool.submit(acts=[("b", "Action: inventory")])
        os.kill(pid, signal.SIGKILL)
        r1, r2 = pool.wait(t1), pool.wait(t2)
        assert isinstance(r1["a"], Failure) and r1["a"].error.startswith("worker crashed")
        assert isinstance(r2["b"], Failure) and r2["b"].error.startswith("worker crashed")
        assert pool.live_keys == [] and pool.stats["restarts"] == 1
        assert isinstance(pool.reset_many([("a", tasks[0])])["a"], ResetResult)


def test_answers_left_unread_past_the_timeout_are_not_a_timeout(tasks):
    """While the caller generates for another lane, finished answers may sit unread in the pipe."""
    with EnvPool("textcraft", workers=1, envs_per_worker=1, timeout_s=1.0) as pool:
        pool.reset_many([("a", tasks[0])])
        t = pool.submit(acts=[("a", "Thought: x\nAction: inventory")])
        time.sleep(2.5)  # the caller is busy for longer than the timeout
        res = pool.wait(t)
        assert not isinstance(res["a"], Failure) and pool.stats["restarts"] == 0


def test_a_task_goes_back_to_the_worker_that_played_it(tasks):
    """Affinity: a new key of a task already played goes to that task's worker when it has a free
    slot (ALFWorld keeps the game loaded there), else to the least loaded worker."""
    a, b = tasks[0], tasks[1]
    with EnvPool("textcraft", workers=2, envs_per_worker=2, timeout_s=20) as pool:
        pool.reset_many([((a.task_id, 0), a), ((b.task_id, 0), b)])
        w_a, w_b = pool.pid_of((a.task_id, 0)), pool.pid_of((b.task_id, 0))
        assert w_a != w_b  # least loaded: one each
        pool.release([(a.task_id, 0)])
        # least-loaded alone would pick a's (now empty) worker; b's worker still has a free slot
        pool.reset_many([((b.task_id, 1), b)])
        assert pool.pid_of((b.task_id, 1)) == w_b
        pool.reset_many([((b.task_id, 2), b)])  # b's worker is full now: the other one takes it
        assert pool.pid_of((b.task_id, 2)) == w_a
