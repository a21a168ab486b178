"""ScienceWorld adapter (the ``scienceworld`` package; a JVM per environment instance).

* Tasks: the ETO splits (``splits/sciworld``): ``[task_name, variation]`` pairs,
  ``task_id = "sciworld:<task_name>:<variation>"``, ``task_type = task_name``.
* Loaded with the ``easy`` simplification (teleport, open doors/containers, self-watering
  pots; no electrical simplification for electrical tasks), matching the paper's prompt
  ("You can teleport to any room", "All containers ... have already been opened").
* Step cost: we call the Java server directly (``step``/``getScore``/``getCompleted``)
  instead of ``ScienceWorldEnv.step``, which also fetches the full valid-action list, the
  look and inventory text on every step (the slow part).
* Ambiguous input (``Ambiguous request: Please enter the number ...``): answered
  deterministically with option ``0`` in the same turn; ``info["ambiguous"]`` records it
  and the observation is the outcome of option 0.
* Invalid actions: ScienceWorld answers ``No known action matches that input.`` or
  ``Unknown action. ...`` — both matched by ``configs/labels.yaml`` (sciworld).
* Reward: final score/100 clipped to [0, 1] on the last step (score < 0 = task failed).
* Expert: the gold action sequence (``load(..., generateGoldPath=True)``), without the bare
  numeric answers to ambiguity prompts (the adapter answers those itself).
"""
from __future__ import annotations

from typing import Any

from qevolve_cli.envs.base import Env, Task

DEFAULT_MAX_STEPS = 24  # paper Table "Hyperparameters": maximum episode length on SciWorld
SIMPLIFICATION = "easy"
AMBIGUOUS_PREFIX = "Ambiguous request"


class SciWorldEnv(Env):
    name = "sciworld"
    default_max_steps = DEFAULT_MAX_STEPS

    def __init__(self, max_steps: int | None = None, simplification: str = SIMPLIFICATION, **_: Any):
        super().__init__(max_steps)
        from scienceworld import ScienceWorldEnv

        self.simplification = simplification
        self._sw = ScienceWorldEnv("", envStepLimit=10_000)
        self._server = self._sw.server
        self._gold: list[str] = []

    def _reset(self, task: Task, with_expert: bool) -> tuple[str, str]:
        name = task.data.get("task_name")
        var = task.data.get("variation")
        if name is None or var is None:
            _, name, var = task.task_id.split(":")
        self._sw.load(name, int(var), self.simplification, generateGoldPath=with_expert)
        self._gold = [a for a in self._sw.get_gold_action_sequence() if not a.strip().isdigit()] if with_expert else []
        self._server.reset()
        obs = str(self._server.step("look around"))
        desc = str(self._server.freeActionTaskDesc())
        desc = desc.replace("Task Description:", "", 1).strip()
        return desc, obs.strip()

    def _step(self, command: str) -> tuple[str, float, bool]:
        obs = str(self._server.step(command))
        self._last_ambiguous = obs.startswith(AMBIGUOUS_PREFIX)
        if self._last_ambiguous:
            obs = str(self._server.step("0"))
        raw = float(self._server.getScore())
        done = bool(self._server.getCompleted()) or raw < 0
        return obs.strip(), raw, done

    def step(self, command: str):
        obs, reward, done, info = super().step(command)
        info["ambiguous"] = bool(getattr(self, "_last_ambiguous", False))
        return obs, reward, done, info

    def _expert_plan(self) -> list[str]:
        return list(self._gold)

    def close(self) -> None:
        try:
            self._sw.close()
        except Exception:
            pass


def task_id(task_name: str, variation: int) -> str:
    return f"sciworld:{task_name}:{int(variation)}"
