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
* One JVM per process (``shared_jvm=True``, the default): every environment of a process is its
  own ``PythonInterface`` simulator object inside one JVM (the instances share no state; a test
  checks that interleaved episodes equal separate ones). A worker holding 4 live episodes runs one
  JVM, not 4: a quarter of the memory, and the JIT warms up once for all of them. A JVM that
  died is started again by the next environment created in the process.
"""
from __future__ import annotations

from typing import Any

from qevolve_cli.envs.base import Env, Task

DEFAULT_MAX_STEPS = 24  # paper Table "Hyperparameters": maximum episode length on SciWorld
SIMPLIFICATION = "easy"
AMBIGUOUS_PREFIX = "Ambiguous request"


_SHARED_JVM: Any = None  # the process's ScienceWorldEnv whose JVM hosts every shared-JVM environment


def _jvm_alive(sw: Any) -> bool:
    proc = getattr(getattr(sw, "_gateway", None), "java_process", None)
    return proc is not None and proc.poll() is None


def process_jvm() -> Any:
    """The process's JVM host (a ``ScienceWorldEnv``), started on first use and again if it died."""
    global _SHARED_JVM
    from scienceworld import ScienceWorldEnv

    if _SHARED_JVM is None or not _jvm_alive(_SHARED_JVM):
        if _SHARED_JVM is not None:
            try:
                _SHARED_JVM.close()
            except Exception:
                pass
        _SHARED_JVM = ScienceWorldEnv("", envStepLimit=10_000)
    return _SHARED_JVM


class SciWorldEnv(Env):
    name = "sciworld"
    default_max_steps = DEFAULT_MAX_STEPS

    def __init__(self, max_steps: int | None = None, simplification: str = SIMPLIFICATION, shared_jvm: bool = True,
                 **_: Any):
        super().__init__(max_steps)
        from scienceworld import ScienceWorldEnv

        self.simplification = simplification
        self.shared_jvm = bool(shared_jvm)
        if self.shared_jvm:
            self._host = process_jvm()
            self._own: Any = None
            self._server = self._host._gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()
        else:
            self._own = self._host = ScienceWorldEnv("", envStepLimit=10_000)
            self._server = self._own.server
        self._gold: list[str] = []

    @property
    def java_pid(self) -> int | None:
        """Process id of the JVM this environment runs in."""
        proc = getattr(self._host._gateway, "java_process", None)
        return getattr(proc, "pid", None)

    def _reset(self, task: Task, with_expert: bool) -> tuple[str, str]:
        from scienceworld.utils import infer_task

        name = task.data.get("task_name")
        var = task.data.get("variation")
        if name is None or var is None:
            _, name, var = task.task_id.split(":")
        name = infer_task(name)
        if name not in set(self._host.get_task_names()):
            raise ValueError(f"unknown ScienceWorld task {name!r}")
        self._server.load(name, int(var), self.simplification, bool(with_expert))
        self._gold = ([a for a in self._server.getGoldActionSequence() if not str(a).strip().isdigit()]
                      if with_expert else [])
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
        """Drop this simulator (the shared JVM stays for the process's other environments)."""
        self._server = None
        if self._own is not None:
            try:
                self._own.close()
            except Exception:
                pass
            self._own = None


def task_id(task_name: str, variation: int) -> str:
    return f"sciworld:{task_name}:{int(variation)}"
