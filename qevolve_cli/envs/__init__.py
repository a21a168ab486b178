"""Environments (docs/environments.md): one interface, real adapters, task splits, a worker pool.

Light imports only (adapters load their packages lazily)::

    from qevolve_cli.envs import Task, StepResult, act, make_env, list_tasks, MAX_STEPS
    from qevolve_cli.envs.pool import EnvPool, Failure, ResetResult

See ``docs/environments.md``.
"""
from qevolve_cli.envs.base import Env, StepResult, Task, act
from qevolve_cli.envs.registry import ENV_NAMES, MAX_STEPS, list_tasks, make_env, task_from_id

__all__ = ["Env", "StepResult", "Task", "act", "make_env", "list_tasks", "task_from_id", "MAX_STEPS", "ENV_NAMES"]
