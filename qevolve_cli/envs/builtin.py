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

``lamps-hard`` (:data:`HARD`) is the testbed with headroom (docs/environments.md): the same house
and commands, but every task has **three** targets **in order** (a target's lamp stays off —
``Nothing happens.`` — until the targets before it are on, so the expert's plan is optimal and the
hints never mislead) and a **tight step budget**: the expert's plan
length plus :data:`HARD_SLACK` steps, stated in the instruction (``... in at most 14 steps``); the
episode ends with reward 0 when the budget is spent. One wrong turn costs two steps (there and
back), so a policy that errs twice on a task fails it, while its failed trajectory still holds
the lamps it lit: the partial progress that filtered imitation (RFT) throws away and an offline
critic can credit. Tasks: ``lamps-hard:<start>:<t1>+<t2>+<t3>``; ``test_unseen`` = every task of
:data:`HARD_UNSEEN_SETS` held-out target sets, ``test_seen`` = :data:`HARD_N_SEEN` tasks of the
other sets, ``train`` the rest.

``lamps-habit`` (:data:`HABIT`) is the testbed where imitation cannot reach the goal
(docs/environments.md): lamps-hard's tasks (three ordered targets, a stated step budget), but the
demonstrations come from a *hesitant* expert: after each lamp it turns on, with more to go, it stops to
``look`` with probability :data:`HABIT_LOOK` (decided per task and lamp by sha1, so nothing in the
observation predicts it) before walking on; the look costs a step and tells nothing new. Each task's
budget is the optimal plan plus :data:`HABIT_TIGHT_SLACK` steps or, for a fixed sha1 half of the tasks,
plus :data:`HABIT_LOOSE_SLACK`. The demonstrations are played under the same budgets, and those that
run out of steps (two looks on a tight task) are dropped like any failed expert replay, so what BC
learns from is successful and still looks after about 74 % of the lamps. A policy that keeps the habit
(two looks per task) passes the loose half and fails the tight half. Its successful rollouts mostly keep the habit too
(on the loose half it costs nothing), so filtering by success (RFT) keeps imitating it, while every
trajectory shows a step-level critic that a look costs a step (the exact ``A*`` of a look is < 0, of
the optimal command 0). Tasks: ``lamps-habit:<start>:<t1>+<t2>+<t3>``, split as lamps-hard's.

All three variants are solvable exactly (:func:`optimal_steps`): the oracle value source of ``qevolve
label --value-source oracle`` (``qevolve_cli/envs/oracle.py``).
"""
from __future__ import annotations

import functools
import hashlib
import itertools
from dataclasses import dataclass
from typing import Any

from qevolve_cli.envs.base import Env, Task

ROOMS = ("kitchen", "bedroom", "bathroom", "hallway", "workshop", "greenhouse", "foundry", "office")
MAX_TARGETS = 2
DEFAULT_MAX_STEPS = 16
"""Step limit: expert plans take 1-16 steps (mean about 6; 16 only for the two ends and back)."""
N_UNSEEN_SETS = 5
NOTHING = "Nothing happens."
HARD_SLACK = 2
"""lamps-hard: steps allowed beyond the expert's plan."""
HARD_UNSEEN_SETS = 2
HARD_N_SEEN = 48
HABIT_LOOK = 0.85
"""lamps-habit: the expert's chance of a ``look`` after a lamp it turns on, with more to go (among the
demonstrations that succeed, about 0.74 of these lamps are followed by a look)."""
HABIT_TIGHT_SLACK = 1
HABIT_LOOSE_SLACK = 3


@dataclass(frozen=True)
class Variant:
    """One task family of the lamps house: its name, target counts, step budget and split sizes."""

    name: str
    n_targets: tuple[int, ...]
    slack: int | None            # None: no per-task budget (the env's step limit only)
    ordered: bool                # targets must be lit in the task's order
    n_unseen_sets: int
    n_seen: int | float          # a count, or a fraction of the seen-set tasks
    max_steps: int
    loose_slack: int | None = None   # the budget of a sha1 half of the tasks (None: every task has ``slack``)
    habit: float = 0.0               # the expert's chance of a ``look`` after each lamp but the last


LAMPS = Variant("lamps", (1, 2), None, False, N_UNSEEN_SETS, 0.10, DEFAULT_MAX_STEPS)
HARD = Variant("lamps-hard", (3,), HARD_SLACK, True, HARD_UNSEEN_SETS, HARD_N_SEEN, 25)  # budgets: 7-25, mean 13.6
HABIT = Variant("lamps-habit", (3,), HABIT_TIGHT_SLACK, True, HARD_UNSEEN_SETS, HARD_N_SEEN, 26,
                loose_slack=HABIT_LOOSE_SLACK, habit=HABIT_LOOK)  # budgets: 6-26
VARIANTS = {v.name: v for v in (LAMPS, HARD, HABIT)}


def _h(s: str) -> int:
    return int(hashlib.sha1(s.encode()).hexdigest()[:12], 16)


def task_id_of(start: str, targets: tuple[str, ...] | list[str], env: str = "lamps") -> str:
    return f"{env}:{start}:{'+'.join(targets)}"


def parse_task_id(task_id: str, env: str = "lamps") -> tuple[str, tuple[str, ...]]:
    """``<env>:<start>:<t1>+<t2>...`` -> (start, targets); ValueError on a malformed id."""
    v = VARIANTS[env]
    body = task_id.split(":", 1)[1] if task_id.startswith(env + ":") else task_id
    start, sep, tg = body.partition(":")
    targets = tuple(tg.split("+")) if tg else ()
    if (not sep or start not in ROOMS or len(targets) not in v.n_targets
            or any(t not in ROOMS for t in targets) or len(set(targets)) != len(targets)):
        counts = " or ".join(str(n) for n in v.n_targets)
        raise ValueError(f"{env}: malformed task id {task_id!r} (expected {env}:<start>:<room>+<room>... with "
                         f"{counts} distinct rooms from {', '.join(ROOMS)})")
    return start, targets


def plan_of(start: str, targets: tuple[str, ...] | list[str]) -> list[str]:
    """The expert's commands: for each target in the task's order, walk to it, then turn its lamp on."""
    plan, room = [], start
    for t in targets:
        step = "go east" if ROOMS.index(t) > ROOMS.index(room) else "go west"
        plan += [step] * abs(ROOMS.index(t) - ROOMS.index(room))
        room = t
        plan.append("turn on lamp")
    return plan


def habit_plan_of(start: str, targets: tuple[str, ...] | list[str], env: str) -> list[str]:
    """The expert's commands of ``env``: :func:`plan_of`, with a ``look`` after each lamp but the last
    where the task's sha1 draw for that lamp falls under the variant's ``habit`` (lamps-habit)."""
    plan, p = plan_of(start, targets), VARIANTS[env].habit
    if not p:
        return plan
    out, lamp, tid = [], 0, task_id_of(start, targets, env)
    for cmd in plan:
        out.append(cmd)
        if cmd == "turn on lamp":
            lamp += 1
            if lamp < len(targets) and _h(f"habit:{tid}:{lamp}") % 1000 < p * 1000:
                out.append("look")
    return out


def budget_of(start: str, targets: tuple[str, ...] | list[str], env: str = "lamps") -> int | None:
    """The task's step budget (None: the environment's step limit only): the optimal plan's length plus
    the variant's slack (its ``loose_slack`` for the sha1 half of the tasks that has one)."""
    v = VARIANTS[env]
    if v.slack is None:
        return None
    loose = v.loose_slack is not None and _h("slack:" + task_id_of(start, targets, env)) % 2 == 1
    return len(plan_of(start, targets)) + (v.loose_slack if loose else v.slack)


def instruction_of(targets: tuple[str, ...] | list[str], budget: int | None = None) -> str:
    parts = [f"turn on the lamp in the {targets[0]}"] + [f"then in the {t}" for t in targets[1:]]
    return ", ".join(parts) + ("" if budget is None else f", in at most {budget} steps")


@functools.cache
def build_splits(env: str = "lamps") -> dict[str, tuple[str, ...]]:
    """The deterministic train / test_seen / test_unseen task ids of ``env`` (each in sha1 order)."""
    v = VARIANTS[env]
    sets = [frozenset(c) for k in v.n_targets for c in itertools.combinations(ROOMS, k)]
    # held-out target sets: the first N by hash among sets of 2+ targets (single targets all seen)
    multi = [s for s in sets if len(s) >= 2]
    unseen_sets = set(sorted(multi, key=lambda s: (_h("set:" + "+".join(sorted(s))), sorted(s)))[:v.n_unseen_sets])
    ids = [task_id_of(start, order, env) for start in ROOMS for k in v.n_targets
           for order in itertools.permutations(ROOMS, k)]
    # lamps keeps the ids' hash order of its first release (its ids have no env prefix in the hash)
    order = sorted(ids, key=lambda i: (_h("task:" + (i if env == "lamps" else "hard:" + i)), i))
    unseen = [i for i in order if frozenset(parse_task_id(i, env)[1]) in unseen_sets]
    rest = [i for i in order if frozenset(parse_task_id(i, env)[1]) not in unseen_sets]
    n_seen = round(v.n_seen * len(rest)) if isinstance(v.n_seen, float) else v.n_seen
    return {"train": tuple(rest[n_seen:]), "test_seen": tuple(rest[:n_seen]), "test_unseen": tuple(unseen)}


def make_task(task_id: str, split: str = "", env: str = "lamps") -> Task:
    start, targets = parse_task_id(task_id, env)
    return Task(env=env, task_id=task_id_of(start, targets, env), split=split, task_type=f"{len(targets)}_lamps",
                data={"start": start, "targets": list(targets)})


def list_lamps_tasks(split: str, env: str = "lamps") -> list[Task]:
    return [make_task(i, split, env) for i in build_splits(env)[split]]


def _dir(a: str, b: str) -> str:
    return "east" if ROOMS.index(b) > ROOMS.index(a) else "west"


State = tuple[int, int]
"""A lamps state for the solver: (room index, bit mask of the lamps that are on)."""


def may_turn_on(room: int, mask: int, targets: tuple[int, ...], ordered: bool) -> bool:
    """Whether the lamp of ``room`` can be turned on with the lamps of ``mask`` on (``ordered``: a
    target's lamp waits for the targets before it)."""
    if not ordered or room not in targets:
        return True
    return all(mask >> t & 1 for t in targets[:targets.index(room)])


@functools.cache
def _distances(targets: tuple[int, ...], ordered: bool) -> dict[State, int]:
    """Fewest commands from every state to one where every target lamp is on (breadth-first search
    backwards from the goal states over the four state-changing commands; look and invalid commands
    never help). States from which the goal is unreachable are absent (none are, in this house)."""
    n = len(ROOMS)
    targets_mask = sum(1 << t for t in targets)
    states = [(r, m) for r in range(n) for m in range(1 << n)]

    def succ(s: State) -> list[State]:
        r, m = s
        out = [(r + 1, m)] if r + 1 < n else []
        out += [(r - 1, m)] if r > 0 else []
        if m >> r & 1 or may_turn_on(r, m, targets, ordered):
            out.append((r, m ^ (1 << r)))  # turn off (if on) or on (if off and allowed)
        return out

    pred: dict[State, list[State]] = {s: [] for s in states}
    for s in states:
        for t in succ(s):
            pred[t].append(s)
    dist = {s: 0 for s in states if s[1] & targets_mask == targets_mask}
    frontier = list(dist)
    while frontier:
        nxt = []
        for t in frontier:
            for s in pred[t]:
                if s not in dist and s[1] & targets_mask != targets_mask:
                    dist[s] = dist[t] + 1
                    nxt.append(s)
        frontier = nxt
    return dist


def optimal_steps(room: str, lit: set[str] | frozenset[str], targets: tuple[str, ...] | list[str],
                  ordered: bool = False) -> int:
    """The fewest commands that light every target from the state (room, lamps that are on): the
    exact solver behind the oracle value V*(s) = gamma^(d - 1) (0 when d = 0: nothing left to do)."""
    idx = tuple(ROOMS.index(t) for t in targets)
    state = (ROOMS.index(room), sum(1 << ROOMS.index(r) for r in lit))
    return _distances(idx if ordered else tuple(sorted(idx)), ordered)[state]


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
            parse_task_id(task_id_of(start, targets, self.name), self.name)  # validates
        else:
            start, targets = parse_task_id(task.task_id, self.name)
        self.start, self.room, self.targets = start, start, targets
        self.lamps = {r: False for r in ROOMS}
        budget = budget_of(start, targets, self.name)
        if budget is not None:  # the task's own budget, when tighter than the episode's limit
            self._episode_max_steps = min(self._episode_max_steps, budget)
        return instruction_of(targets, budget), f"{self._here()} {self._hint()}"

    @property
    def ordered(self) -> bool:
        return VARIANTS[self.name].ordered

    def state(self) -> tuple[str, frozenset[str]]:
        """(room, lamps that are on): what the exact solver needs (:func:`optimal_steps`)."""
        return self.room, frozenset(r for r, on in self.lamps.items() if on)

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
            if want and self.room in self.targets and VARIANTS[self.name].ordered and not all(
                    self.lamps[t] for t in self.targets[:self.targets.index(self.room)]):
                return f"{NOTHING} This lamp waits for the lamps before it in your task.", 0.0, False
            self.lamps[self.room] = want
            done = all(self.lamps[t] for t in self.targets)
            return f"You turn {'on' if want else 'off'} the lamp in the {self.room}. {self._hint()}", float(done), done
        if cmd in ("look", "look around"):
            return f"{self._here()} {self._hint()}", 0.0, False
        return f"{NOTHING} Unknown command.", 0.0, False

    def _expert_plan(self) -> list[str]:
        return habit_plan_of(self.start, self.targets, self.name)


class LampsHardEnv(LampsEnv):
    """``lamps-hard``: three targets and a tight per-task step budget (module docstring)."""

    name = "lamps-hard"
    default_max_steps = HARD.max_steps


class LampsHabitEnv(LampsEnv):
    """``lamps-habit``: lamps-hard's tasks, a hesitant expert and tight or loose budgets (module docstring)."""

    name = "lamps-habit"
    default_max_steps = HABIT.max_steps
