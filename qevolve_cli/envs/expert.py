"""Expert trajectories (docs/environments.md): replay each task's expert plan through the real environment.

Experts: SciWorld gold action sequences, ALFWorld ``gt_traj.json`` (or the PDDL planner),
TextCraft a plan from its crafting tree. Every expert command becomes a ReAct output with a
short template thought (:data:`THOUGHT_TEMPLATE`), so BC trains on the same format the policy
must produce. Expert episodes run with a long step limit (:data:`EXPERT_MAX_STEPS`) so gold
paths longer than the rollout limit are not cut.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import polars as pl

from qevolve_cli.envs.base import Task
from qevolve_cli.errors import QevolveError
from qevolve_cli.react import format_react

THOUGHT_TEMPLATE = "The next step towards the goal is to {command}."
EXPERT_MAX_STEPS = 1000


def expert_thought(command: str) -> str:
    return THOUGHT_TEMPLATE.format(command=command)


def expert_output(command: str) -> str:
    """The ReAct text of one expert step: ``Thought: <template>\\nAction: <command>``."""
    return format_react(expert_thought(command), command)


def _rows(task: Task, iteration: int, instruction: str, obs0: str, steps: list[tuple[str, str, Any]]) -> list[dict]:
    rows = []
    obs = obs0
    for t, (output, command, res) in enumerate(steps):
        rows.append({
            "traj_id": f"expert:{task.task_id}", "env": task.env, "task_id": task.task_id, "split": task.split,
            "source": "expert", "iteration": iteration, "step": t, "instruction": instruction,
            "observation": obs, "action": output, "command": command, "next_observation": res.observation,
            "reward_env": float(res.reward), "done": bool(res.done), "task_type": task.task_type, "error": None,
        })
        obs = res.observation
    return rows


def _no_expert_message(env: str, split: str, stats: dict) -> str:
    """The one-line reason why ``collect_expert`` collected no trajectory (its ``stats``), first error named."""
    first = next(iter(stats["error_reasons"].items()), None)
    why = f"; first error, {first[0]}: {first[1]}" if first else ""
    return f"{env}/{split}: no successful expert trajectory ({stats['failed']} failed, {stats['errors']} errors{why})"


def collect_expert(env: str, split: str = "train", limit: int | None = None, workers: int = 1,
                   tasks: list[Task] | None = None, keep_failed: bool = False, timeout_s: float = 120.0,
                   stats: dict | None = None, on_progress: Callable[[int, int, int], None] | None = None,
                   envs_per_worker: int = 1) -> pl.DataFrame:
    """Expert trajectories of ``split`` as a step table (docs/tables.md) (source=expert, iteration=0).

    Only successful replays (final reward > 0) are kept unless ``keep_failed``; ``stats``
    (when given) receives ``tasks``, ``succeeded``, ``failed`` (replay did not succeed),
    ``errors`` (worker/env failures, with reasons) and ``success_rate``.
    """
    from qevolve_cli.envs.pool import EnvPool, Failure
    from qevolve_cli.envs.registry import list_tasks
    from qevolve_cli.schema import BASE_COLUMNS, EXTRA_COLUMNS

    if tasks is None:
        tasks = list_tasks(env, split, limit)
    queue = list(tasks)
    total = len(queue)
    rows: list[dict] = []
    st = {"tasks": total, "succeeded": 0, "failed": 0, "errors": 0, "error_reasons": {}, "steps": 0}
    live: dict[str, dict] = {}
    done_n = 0

    def finish(key: str, ok: bool, error: str | None = None) -> None:
        nonlocal done_n
        ep = live.pop(key)
        done_n += 1
        if error is not None:
            st["errors"] += 1
            st["error_reasons"][ep["task"].task_id] = error
        elif ok:
            st["succeeded"] += 1
        else:
            st["failed"] += 1
        if error is None and (ok or keep_failed) and ep["steps"]:
            rows.extend(_rows(ep["task"], 0, ep["instruction"], ep["obs0"], ep["steps"]))
        if on_progress:
            on_progress(done_n, total, st["succeeded"])

    with EnvPool(env, workers=workers, envs_per_worker=envs_per_worker, timeout_s=timeout_s) as pool:
        while queue or live:
            free = pool.capacity - len(live)
            if queue and free > 0:
                batch, queue = queue[:free], queue[free:]
                res = pool.reset_many([(t.task_id, t) for t in batch], with_expert=True, max_steps=EXPERT_MAX_STEPS)
                for t in batch:
                    r = res[t.task_id]
                    live[t.task_id] = {"task": t, "steps": [], "plan": [], "i": 0}
                    if isinstance(r, Failure):
                        finish(t.task_id, False, r.error)
                        continue
                    plan = list(r.info.get("expert_plan") or [])
                    live[t.task_id].update(instruction=r.instruction, obs0=r.observation, plan=plan)
                    if not plan:
                        pool.release([t.task_id])
                        finish(t.task_id, False)
            if not live:
                continue
            items = []
            for key, ep in live.items():
                items.append((key, expert_output(ep["plan"][ep["i"]])))
            out = pool.act_many(items)
            for key, output in items:
                r = out[key]
                ep = live[key]
                if isinstance(r, Failure):
                    finish(key, False, r.error)
                    continue
                ep["steps"].append((output, r.command, r))
                ep["i"] += 1
                st["steps"] += 1
                if r.done:
                    finish(key, r.reward > 0)
                elif ep["i"] >= len(ep["plan"]):
                    pool.release([key])
                    finish(key, False)
    st["success_rate"] = st["succeeded"] / total if total else 0.0
    if stats is not None:
        stats.update(st)
    if not rows:  # e.g. the environment's package missing: say why, not hand on an empty table
        raise QevolveError(_no_expert_message(env, split, st))
    schema = {**BASE_COLUMNS, "task_type": EXTRA_COLUMNS["task_type"], "error": EXTRA_COLUMNS["error"]}
    return pl.DataFrame(rows, schema=schema)
