"""Environment registry: ``make_env``, ``list_tasks`` and the per-environment step limits.

Step limits: ``qevolve_cli/env_names.py``.
"""
from __future__ import annotations

import importlib
from typing import Any

from qevolve_cli.env_names import ENV_NAMES, MAX_STEPS  # noqa: F401 - re-exported
from qevolve_cli.envs.base import Env, Task
from qevolve_cli.envs.splits import SPLITS_BY_ENV, task_from_id
from qevolve_cli.envs.splits import list_tasks as _list_tasks
from qevolve_cli.errors import QevolveError

_CLASSES = {
    "textcraft": ("qevolve_cli.envs.textcraft", "TextCraftEnv"),
    "sciworld": ("qevolve_cli.envs.sciworld", "SciWorldEnv"),
    "alfworld": ("qevolve_cli.envs.alfworld", "AlfWorldEnv"),
    "webshop": ("qevolve_cli.envs.webshop", "WebShopEnv"),
    "lamps": ("qevolve_cli.envs.builtin", "LampsEnv"),
    "lamps-hard": ("qevolve_cli.envs.builtin", "LampsHardEnv"),
    "lamps-habit": ("qevolve_cli.envs.builtin", "LampsHabitEnv"),
}


def check_env(env_name: str) -> str:
    if env_name not in _CLASSES:
        raise QevolveError(f"unknown environment {env_name!r} (known: {', '.join(ENV_NAMES)})")
    return env_name


def make_env(env_name: str, **kwargs: Any) -> Env:
    """A fresh environment instance (``max_steps`` defaults to :data:`MAX_STEPS`)."""
    mod, cls = _CLASSES[check_env(env_name)]
    kwargs.setdefault("max_steps", MAX_STEPS[env_name])
    return getattr(importlib.import_module(mod), cls)(**kwargs)


def list_tasks(env: str, split: str, limit: int | None = None) -> list[Task]:
    return _list_tasks(check_env(env), split, limit)


def episode_limit(env: str, task_id: str, max_steps: int) -> int:
    """The step limit an episode of ``task_id`` plays under when the run's limit is ``max_steps``: the task's own
    budget where the environment has one and it is tighter (lamps-hard, lamps-habit), else ``max_steps``. What a
    rollout's reset reports; ``qevolve label --step-limit`` gives the expert rows the same."""
    from qevolve_cli.envs import builtin

    if env in builtin.VARIANTS:
        try:
            start, targets = builtin.parse_task_id(task_id, env)
        except ValueError as e:
            raise QevolveError(f"{env} task {task_id!r}: {e}") from None
        budget = builtin.budget_of(start, targets, env)
        if budget is not None:
            return min(max_steps, budget)
    return max_steps


__all__ = ["MAX_STEPS", "ENV_NAMES", "SPLITS_BY_ENV", "make_env", "list_tasks", "task_from_id", "check_env",
           "episode_limit"]
