"""Task splits (packaged in ``qevolve_cli/envs/splits/``; no data folder needed).

==========  ==========================  ===============================  ===========================
env         train                       test_seen                        test_unseen / test
==========  ==========================  ===============================  ===========================
sciworld    ETO train_indices (1483)    ETO dev_indices (194)            ETO test_indices (211)
alfworld    json_2.1.1/train (3554)     json_2.1.1/valid_seen (140)      valid_unseen (134 =
                                                                         gamefile_id.txt)
webshop     ETO train_indices (1824)    —                                ``test``: test_indices (200)
textcraft   324 goals                   36 goals                         59 goals of held-out families
==========  ==========================  ===============================  ===========================

Stable task ids: ``sciworld:<task_name>:<variation>``, ``alfworld:<folder>/<game>/<trial>``
(folder = train / valid_seen / valid_unseen), ``webshop:<session_id>``,
``textcraft:<item>``. TextCraft splits are built by ``textcraft.build_splits`` (see there).

Task order: :func:`list_tasks` returns every split in a fixed order, and ``limit`` takes its first N. The ALFWorld
and TextCraft files are sorted (by task type, alphabetically), so their tasks come in a fixed *mixed* order
(:func:`mixed_order`): the first N of a split are a sample of it, not its first task type or letter.

Known properties of the published ETO files, kept as published: SciWorld train and
dev (test_seen) share 54 ``[task, variation]`` pairs; WebShop train lists 1824 ids of
which 1823 are distinct (we drop the repeat) and 21 also appear in test.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
import os

from qevolve_cli.env_names import BUILTIN_ENVS
from qevolve_cli.envs.base import Task
from qevolve_cli.errors import QevolveError

SPLITS_BY_ENV = {
    "sciworld": ("train", "test_seen", "test_unseen"),
    "alfworld": ("train", "test_seen", "test_unseen"),
    "webshop": ("train", "test"),
    "textcraft": ("train", "test_seen", "test_unseen"),
    "lamps": ("train", "test_seen", "test_unseen"),  # built in: envs/builtin.py
    "lamps-hard": ("train", "test_seen", "test_unseen"),
    "lamps-habit": ("train", "test_seen", "test_unseen"),
}
SPLIT_LOG_ENV = "QEVOLVE_SPLIT_LOG"
"""When set to a file path, every :func:`list_tasks` call appends ``<stage>\t<env>\t<split>`` to that file (the
audit that selection on validation reads no test split: tests/test_select.py)."""
STAGE_ENV = "QEVOLVE_STAGE"
"""Set by a run directory while one of its stages runs (evolve/rundir.py): the ``<stage>`` of the split log."""

_SCIWORLD_FILES = {"train": "train_indices.json", "test_seen": "dev_indices.json", "test_unseen": "test_indices.json"}
_WEBSHOP_FILES = {"train": "train_indices.json", "test": "test_indices.json"}


@functools.cache
def _load(env: str, name: str):
    path = importlib.resources.files("qevolve_cli.envs") / "splits" / env / name
    return json.loads(path.read_text())


def sciworld_max_steps() -> dict[str, int]:
    """ETO's per-task step limits (informative; the paper uses 24 for every task)."""
    return dict(_load("sciworld", "max_steps.json"))


TASK_ORDER = {"alfworld": "mixed-1", "textcraft": "mixed-1"}
"""Environments whose tasks :func:`list_tasks` reorders (:func:`mixed_order`), and the name of that order. A stage
that uses a split's first N puts the name in its configuration hash (:func:`task_order_tag`), so a run made with the
files' sorted order (before 2026-12) is not resumed with other tasks."""


def task_order_tag(env: str, limit: int | None) -> str | None:
    """The name of ``env``'s task order when the first ``limit`` tasks depend on it (else None: the whole split)."""
    return TASK_ORDER.get(env) if limit else None


def _rank(task_id: str) -> int:
    return int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:8], "big")


def mixed_order(tasks: list[Task], key=None) -> list[Task]:
    """``tasks`` in a fixed order that does not depend on the file's: within each group of ``key`` (a task's type)
    the tasks are ordered by a hash of their id, and the groups are interleaved in proportion to their sizes (the
    ``i``-th of a group of ``n`` sits at ``(i + 0.5) / n``), so every prefix holds each group at its share of the
    split, up to one task. Same on every machine and Python version (sha256, no ``hash()``)."""
    groups: dict = {}
    for t in tasks:
        groups.setdefault(key(t) if key else None, []).append(t)
    placed = []
    for g in groups.values():
        ranked = sorted(((_rank(t.task_id), t.task_id, t) for t in g), key=lambda r: r[:2])  # one sha256 a task
        placed += [((i + 0.5) / len(ranked), *r) for i, r in enumerate(ranked)]
    return [p[-1] for p in sorted(placed, key=lambda p: p[:3])]


def alfworld_task_type(game: str) -> str:
    """``train/pick_heat_then_place_in_recep-Apple-None-GarbageCan-10/trial_...`` -> ``pick_heat_then_place_in_recep``."""
    parts = game.split("/")
    folder = parts[-2] if len(parts) >= 2 else parts[0]
    return folder.split("-", 1)[0]


def list_tasks(env: str, split: str, limit: int | None = None) -> list[Task]:
    """Tasks of ``env``'s ``split`` in a fixed order (first ``limit`` when given; ALFWorld and TextCraft in
    :func:`mixed_order`, so that a first N is a sample of the split)."""
    if env not in SPLITS_BY_ENV:
        raise QevolveError(f"unknown environment {env!r} (known: {', '.join(SPLITS_BY_ENV)})")
    if split not in SPLITS_BY_ENV[env]:
        raise QevolveError(f"{env}: unknown split {split!r} (choose from {', '.join(SPLITS_BY_ENV[env])})")
    if limit is not None and limit < 0:
        raise QevolveError(f"--limit must be >= 0, got {limit}")
    log = os.environ.get(SPLIT_LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(f"{os.environ.get(STAGE_ENV, '-')}\t{env}\t{split}\n")
    tasks: list[Task]
    if env == "sciworld":
        pairs = _load("sciworld", _SCIWORLD_FILES[split])
        tasks = [Task("sciworld", f"sciworld:{n}:{int(v)}", split, n, {"task_name": n, "variation": int(v)})
                 for n, v in pairs]
    elif env == "alfworld":
        games = _load("alfworld", f"{split}.json")
        tasks = [Task("alfworld", f"alfworld:{g}", split, alfworld_task_type(g), {"game": g}) for g in games]
        tasks = mixed_order(tasks, key=lambda t: t.task_type)
    elif env == "webshop":
        ids = list(dict.fromkeys(_load("webshop", _WEBSHOP_FILES[split])))  # train lists one id twice
        tasks = [Task("webshop", f"webshop:{int(i)}", split, None, {"session": int(i)}) for i in ids]
    elif env in BUILTIN_ENVS:
        from qevolve_cli.envs.builtin import list_lamps_tasks

        tasks = list_lamps_tasks(split, env)
    else:
        from qevolve_cli.envs.textcraft import list_goal_tasks

        tasks = mixed_order(list_goal_tasks(split, list(_load("textcraft", f"{split}.json"))))
    return tasks if limit is None else tasks[:limit]


def task_from_id(env: str, task_id: str, split: str = "") -> Task:
    """Rebuild a Task from its id (e.g. from a table's ``task_id``)."""
    body = task_id.split(":", 1)[1] if task_id.startswith(env + ":") else task_id
    if env == "sciworld":
        name, _, var = body.rpartition(":")
        return Task(env, f"sciworld:{name}:{int(var)}", split, name, {"task_name": name, "variation": int(var)})
    if env == "alfworld":
        return Task(env, f"alfworld:{body}", split, alfworld_task_type(body), {"game": body})
    if env == "webshop":
        return Task(env, f"webshop:{body}", split, None, {"session": int(body) if body.isdigit() else body})
    if env == "textcraft":
        return Task(env, f"textcraft:{body}", split, body.split("_")[-1], {"goal": body})
    if env in BUILTIN_ENVS:
        from qevolve_cli.envs.builtin import make_task

        try:
            return make_task(task_id, split, env)
        except ValueError as e:
            raise QevolveError(str(e)) from None
    raise QevolveError(f"unknown environment {env!r}")
