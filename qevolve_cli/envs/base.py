"""The one environment interface (docs/environments.md).

* :class:`Task` — one task of a split, with a stable ``task_id`` (see ``splits.py``).
* :class:`Env` — ``reset(task) -> observation`` (the task description is then in
  ``env.instruction``), ``step(command) -> (observation, reward, done, info)``,
  ``expert_plan()``, ``close()``, ``max_steps``.
* :func:`act` — one agent turn from a raw model output: parses the ReAct ``Action:``
  line; on a format error the environment is *not* stepped and the observation is
  :data:`qevolve_cli.react.FORMAT_ERROR_OBSERVATION` (the turn still counts
  towards ``max_steps``).

Rewards are episodic: 0 on every step except the last (``done=True``), where the
reward is the final score in [0, 1] (success, failure, or the step limit; ``info
["truncated"]`` marks the step limit). ``info`` always has ``score`` (the current
score in [0, 1]), ``won`` and ``truncated``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qevolve_cli import react


@dataclass(frozen=True)
class Task:
    """One task. ``data`` holds what the adapter needs to load it (picklable)."""

    env: str
    task_id: str
    split: str
    task_type: str | None = None
    data: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass
class StepResult:
    """Outcome of one agent turn (see :func:`act`). ``command`` is None on a format error."""

    command: str | None
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Env:
    """Base class of the adapters: step counting, step limit, episodic reward.

    Subclasses implement ``_reset(task, with_expert) -> (instruction, observation)``,
    ``_step(command) -> (observation, score, finished)`` with ``score`` the *current*
    task score in [0, 1] and ``finished`` whether the environment ended the episode,
    ``_expert_plan() -> list[str]`` and optionally ``close()``.
    """

    name: str = "env"
    default_max_steps: int = 30

    def __init__(self, max_steps: int | None = None):
        self.max_steps = int(max_steps or self.default_max_steps)
        self._episode_max_steps = self.max_steps
        self.task: Task | None = None
        self.instruction: str = ""
        self.steps = 0
        self.score = 0.0
        self.done = True

    # -- public API -------------------------------------------------------------------------
    def reset(self, task: Task, with_expert: bool = False, max_steps: int | None = None) -> str:
        """Start ``task``; returns the first observation (``self.instruction`` is set).

        ``max_steps`` overrides the limit for this episode only (expert replay uses a
        longer one so gold paths are not cut).
        """
        self.task = task
        self.steps = 0
        self.score = 0.0
        self.done = False
        self._episode_max_steps = int(max_steps or self.max_steps)
        instruction, obs = self._reset(task, with_expert)
        self.instruction = instruction
        return obs

    def step(self, command: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.done:
            raise RuntimeError("step() after the episode ended; call reset()")
        obs, score, finished = self._step(command)
        return self._turn(obs, score, finished)

    def skip_turn(self, observation: str) -> tuple[str, float, bool, dict[str, Any]]:
        """A turn that does not reach the environment (format error): counts towards the limit."""
        if self.done:
            raise RuntimeError("turn after the episode ended; call reset()")
        return self._turn(observation, self.score, False)

    def expert_plan(self) -> list[str]:
        """The expert's commands for the current task (valid right after ``reset``)."""
        return list(self._expert_plan())

    def close(self) -> None:  # pragma: no cover - adapters override when needed
        pass

    # -- helpers ------------------------------------------------------------------------------
    def _turn(self, obs: str, score: float, finished: bool) -> tuple[str, float, bool, dict[str, Any]]:
        self.steps += 1
        self.score = min(1.0, max(0.0, float(score)))
        truncated = (not finished) and self.steps >= self._episode_max_steps
        done = bool(finished or truncated)
        self.done = done
        reward = self.score if done else 0.0
        info = {"score": self.score, "won": bool(finished and self.score >= 1.0), "truncated": truncated,
                "steps": self.steps}
        return obs, reward, done, info

    def _reset(self, task: Task, with_expert: bool) -> tuple[str, str]:
        raise NotImplementedError

    def _step(self, command: str) -> tuple[str, float, bool]:
        raise NotImplementedError

    def _expert_plan(self) -> list[str]:
        raise NotImplementedError(f"{self.name}: no expert available")


def act(env: Env, model_output: str) -> StepResult:
    """One agent turn: parse the model output and step the environment with its command.

    A format error (no parsable ``Action:``) does not step the environment: the
    observation is ``react.FORMAT_ERROR_OBSERVATION`` and the turn counts.
    """
    command = react.parse_action(model_output)
    if command is None:
        obs, reward, done, info = env.skip_turn(react.FORMAT_ERROR_OBSERVATION)
        info["format_error"] = True
        return StepResult(None, obs, reward, done, info)
    obs, reward, done, info = env.step(command)
    return StepResult(command, obs, reward, done, info)
