"""Built-in text environments (pure Python, no package): ``lamps``, the CPU learning check.

``lamps`` is a house of eight rooms along a corridor from west to east (:data:`ROOMS`,
in that order), one lamp each, every lamp off at the start. The agent starts in one room
and must turn on the lamps of the rooms named in the task (``turn on the lamp in the
hallway, then in the kitchen``). It is sized so that the tiny offline model (``qevolve
init-model``: hidden 64, 2 layers) learns it on a CPU in minutes, while behaviour cloning
on a few dozen expert demonstrations stays clearly imperfect, which leaves room for the
self-evolving iterations (docs/learning_check.md).

Observations give *local* cues only: at the start and after switching a lamp, the
direction of the next target (``The next lamp to turn on is to the east.`` / ``... is
here.``); on arriving in a room, ``This is the room of the next lamp.`` when it is, and
nothing otherwise (the agent must keep its direction). An earlier design in which the
agent had to copy room names from the task (``go to <room>``) was not learnable by the
tiny model from 40-400 demonstrations (BC 0-7 % success), see docs/learning_check.md.

Commands (each a ReAct ``Action:``): ``go east``, ``go west``, ``turn on lamp``,
``turn off lamp``, ``look`` (the room and the hint; a second ``look`` is labelled a
*repeat*: the observation did not change).

Invalid actions (unknown command, walking into the corridor's end wall, switching a lamp
that already is in that state) leave the state unchanged and answer ``Nothing happens.``
(plus a reason) — matched by ``configs/labels.yaml`` (``lamps``). Turning on a lamp that
is not a target is allowed (a wasted step).

Reward: episodic and binary — 1 on the step that turns on the last target lamp (the
episode then ends), 0 otherwise (including the step limit, :data:`DEFAULT_MAX_STEPS`).
Any order that lights every target succeeds; the expert follows the task's order.

Tasks: ``lamps:<start>:<t1>[+<t2>]`` — a start room and an ordered list of 1-2 distinct
target rooms (8 x (8 + 56) = 512 tasks). Splits (deterministic, by sha1,
:func:`build_splits`): ``test_unseen`` (80) = every task whose *set* of targets is one of
:data:`N_UNSEEN_SETS` held-out pairs (never seen in training, in any order or start room);
``test_seen`` (43) = 10 % of the other tasks (their target sets appear in train with
another start room or order); ``train`` (389) = the rest. Each split is listed in a fixed
sha1 order (so ``--limit`` / ``max_tasks`` take a varied sample).

Expert: the optimal plan — for each target in order, walk to it, then ``turn on lamp``.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
from typing import Any

from qevolve_cli.envs.base import Env, Task

ROOMS = ("kitchen", "bedroom", "bathroom", "hallway", "workshop", "greenhouse", "foundry", "office")
MAX_TARGETS = 2
DEFAULT_MAX_STEPS = 16
"""Step limit: expert plans take 1-16 steps (mean about 6; 16 only for the two ends and back)."""
N_UNSEEN_SETS = 5
NOTHING = "Nothing happens."


def _h(s: str) -> int:
    return int(hashlib.sha1(s.encode()).hexdigest()[:12], 16)


def task_id_of(start: str, targets: tuple[str, ...] | list[str]) -> str:
    return f"lamps:{start}:{'+'.join(targets)}"


def parse_task_id(task_id: str) -> tuple[str, tuple[str, ...]]:
    """``lamps:<start>:<t1>+<t2>`` -> (start, targets); ValueError on a malformed id."""
    body = task_id.split(":", 1)[1] if task_id.startswith("lamps:") else task_id
    start, sep, tg = body.partition(":")
    targets = tuple(tg.split("+")) if tg else ()
    if (not sep or start not in ROOMS or not targets or len(targets) > MAX_TARGETS
            or any(t not in ROOMS for t in targets) or len(set(targets)) != len(targets)):
        raise ValueError(f"lamps: malformed task id {task_id!r} (expected lamps:<start>:<room>[+<room>...] "
                         f"with rooms from {', '.join(ROOMS)})")
    return start, targets


def instruction_of(targets: tuple[str, ...] | list[str]) -> str:
    parts = [f"turn on the lamp in the {targets[0]}"] + [f"then in the {t}" for t in targets[1:]]
    return ", ".join(parts)


@functools.cache
def build_splits() -> dict[str, tuple[str, ...]]:
    """The deterministic train / test_seen / test_unseen task ids (each in sha1 order)."""
    sets = [frozenset(c) for k in range(1, MAX_TARGETS + 1) for c in itertools.combinations(ROOMS, k)]
    ranked = sorted(sets, key=lambda s: (_h("set:" + "+".join(sorted(s))), sorted(s)))
    # held-out target sets: the first N by hash among sets of 2+ targets (single targets all seen)
    unseen_sets = {s for s in ranked if len(s) >= 2}
    unseen_sets = set(sorted(unseen_sets, key=lambda s: (_h("set:" + "+".join(sorted(s))), sorted(s)))[:N_UNSEEN_SETS])
    ids = [task_id_of(start, order) for start in ROOMS for k in range(1, MAX_TARGETS + 1)
           for order in itertools.permutations(ROOMS, k)]
    order = sorted(ids, key=lambda i: (_h("task:" + i), i))
    unseen = [i for i in order if frozenset(parse_task_id(i)[1]) in unseen_sets]
    rest = [i for i in order if frozenset(parse_task_id(i)[1]) not in unseen_sets]
    n_seen = round(0.10 * len(rest))
    return {"train": tuple(rest[n_seen:]), "test_seen": tuple(rest[:n_seen]), "test_unseen": tuple(unseen)}


def make_task(task_id: str, split: str = "") -> Task:
    start, targets = parse_task_id(task_id)
    return Task(env="lamps", task_id=task_id_of(start, targets), split=split, task_type=f"{len(targets)}_lamps",
                data={"start": start, "targets": list(targets)})


def list_lamps_tasks(split: str) -> list[Task]:
    return [make_task(i, split) for i in build_splits()[split]]


def _dir(a: str, b: str) -> str:
    return "east" if ROOMS.index(b) > ROOMS.index(a) else "west"


class LampsEnv(Env):
    name = "lamps"
    default_max_steps = DEFAULT_MAX_STEPS

    def __init__(self, max_steps: int | None = None, **_: Any):
        super().__init__(max_steps)
        self.room = ROOMS[0]
        self.targets: tuple[str, ...] = ()
        self.lamps: dict[str, bool] = {}
        self.start = ROOMS[0]

    def _reset(self, task: Task, with_expert: bool) -> tuple[str, str]:
        if task.data.get("start") and task.data.get("targets"):
            start, targets = task.data["start"], tuple(task.data["targets"])
            parse_task_id(task_id_of(start, targets))  # validates
        else:
            start, targets = parse_task_id(task.task_id)
        self.start, self.room, self.targets = start, start, targets
        self.lamps = {r: False for r in ROOMS}
        return instruction_of(targets), f"{self._here()} {self._hint()}"

    def _next(self) -> str | None:
        return next((t for t in self.targets if not self.lamps[t]), None)

    def _here(self) -> str:
        return f"You are in the {self.room}. The lamp here is {'on' if self.lamps[self.room] else 'off'}."

    def _hint(self) -> str:
        nxt = self._next()
        if nxt is None:
            return "All the lamps of the task are on."
        if nxt == self.room:
            return "The next lamp to turn on is here."
        return f"The next lamp to turn on is to the {_dir(self.room, nxt)}."

    def _step(self, command: str) -> tuple[str, float, bool]:
        cmd = " ".join(command.strip().lower().rstrip(".").split())
        if cmd in ("go east", "go west"):
            i = ROOMS.index(self.room) + (1 if cmd == "go east" else -1)
            if not 0 <= i < len(ROOMS):
                return f"{NOTHING} There is no door to the {cmd[3:]}.", 0.0, False
            self.room = ROOMS[i]
            # arriving: the room of the next lamp is announced; elsewhere the agent keeps its direction
            return self._here() + (" This is the room of the next lamp." if self._next() == self.room else ""), 0.0, False
        if cmd in ("turn on lamp", "turn on the lamp", "turn off lamp", "turn off the lamp"):
            want = " on " in f" {cmd} "
            if self.lamps[self.room] == want:
                return f"{NOTHING} The lamp is already {'on' if want else 'off'}.", 0.0, False
            self.lamps[self.room] = want
            done = all(self.lamps[t] for t in self.targets)
            return f"You turn {'on' if want else 'off'} the lamp in the {self.room}. {self._hint()}", float(done), done
        if cmd in ("look", "look around"):
            return f"{self._here()} {self._hint()}", 0.0, False
        return f"{NOTHING} Unknown command.", 0.0, False

    def _expert_plan(self) -> list[str]:
        plan, room = [], self.start
        for t in self.targets:
            step = "go east" if ROOMS.index(t) > ROOMS.index(room) else "go west"
            plan += [step] * abs(ROOMS.index(t) - ROOMS.index(room))
            room = t
            plan.append("turn on lamp")
        return plan
