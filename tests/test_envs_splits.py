"""Packaged task splits: counts, stable ids, the ETO files, TextCraft's deterministic split."""
from __future__ import annotations

import json

import pytest

from qevolve_cli.envs import list_tasks, task_from_id
from qevolve_cli.envs.splits import TASK_ORDER, alfworld_task_type, mixed_order, task_order_tag
from qevolve_cli.errors import QevolveError

COUNTS = {
    ("sciworld", "train"): 1483, ("sciworld", "test_seen"): 194, ("sciworld", "test_unseen"): 211,
    ("alfworld", "train"): 3554, ("alfworld", "test_seen"): 140, ("alfworld", "test_unseen"): 134,
    ("webshop", "train"): 1823, ("webshop", "test"): 200,
    ("textcraft", "train"): 324, ("textcraft", "test_seen"): 36, ("textcraft", "test_unseen"): 59,
}


@pytest.mark.parametrize("env,split", sorted(COUNTS))
def test_split_sizes_and_unique_ids(env, split):
    tasks = list_tasks(env, split)
    assert len(tasks) == COUNTS[(env, split)]
    ids = [t.task_id for t in tasks]
    assert len(set(ids)) == len(ids)
    assert all(t.task_id.startswith(env + ":") and t.split == split and t.env == env for t in tasks)
    # ids round-trip to the same task
    for t in tasks[:5]:
        assert task_from_id(env, t.task_id, split) == t


def test_split_overlaps_are_exactly_the_published_ones():
    for env in ("alfworld", "textcraft"):
        sets = [set(t.task_id for t in list_tasks(env, s)) for s in ("train", "test_seen", "test_unseen")]
        assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2]), env
    sci = [set(t.task_id for t in list_tasks("sciworld", s)) for s in ("train", "test_seen", "test_unseen")]
    assert (len(sci[0] & sci[1]), len(sci[0] & sci[2]), len(sci[1] & sci[2])) == (54, 0, 0)  # as in ETO's files
    web = [set(t.task_id for t in list_tasks("webshop", s)) for s in ("train", "test")]
    assert len(web[0] & web[1]) == 21


def test_sciworld_ids_match_eto_pairs(shared_data):
    pairs = json.loads((shared_data / "splits/sciworld/dev_indices.json").read_text())
    assert [t.task_id for t in list_tasks("sciworld", "test_seen")] == [f"sciworld:{n}:{v}" for n, v in pairs]
    assert list_tasks("sciworld", "test_seen")[0].task_type == pairs[0][0]


def test_alfworld_unseen_is_gamefile_id(shared_data):
    ids = [ln.strip() for ln in (shared_data / "splits/alfworld/gamefile_id.txt").read_text().splitlines() if ln.strip()]
    assert sorted(t.task_id for t in list_tasks("alfworld", "test_unseen")) == sorted(f"alfworld:valid_unseen/{g}" for g in ids)


def test_alfworld_task_type_from_folder():
    assert alfworld_task_type("train/pick_heat_then_place_in_recep-Apple-None-GarbageCan-10/trial_T1") == \
        "pick_heat_then_place_in_recep"
    types = {t.task_type for t in list_tasks("alfworld", "train")}
    assert types == {"pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
                     "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place"}


def test_textcraft_splits_are_rebuilt_identically_and_unseen_families_are_unseen():
    from qevolve_cli.envs.textcraft import build_splits

    built = build_splits()
    for split, names in built.items():
        assert sorted(t.task_id for t in list_tasks("textcraft", split)) == [f"textcraft:{n}" for n in names]
    train_fams = {n.split("_")[-1] for n in built["train"] + built["test_seen"]}
    assert not train_fams & {n.split("_")[-1] for n in built["test_unseen"]}


def test_limit_and_bad_split():
    assert [t.task_id for t in list_tasks("sciworld", "train", limit=3)] == \
        [t.task_id for t in list_tasks("sciworld", "train")[:3]]
    with pytest.raises(QevolveError, match="unknown split 'test_seen'"):
        list_tasks("webshop", "test_seen")
    with pytest.raises(QevolveError, match="unknown environment"):
        list_tasks("minecraft", "train")


def _file_order(env: str, split: str) -> list[str]:
    from qevolve_cli.envs.splits import _load

    if env == "alfworld":
        return [f"alfworld:{g}" for g in _load("alfworld", f"{split}.json")]
    return [f"textcraft:{g}" for g in _load("textcraft", f"{split}.json")]


@pytest.mark.parametrize("env", ["alfworld", "textcraft"])
def test_sorted_split_files_come_in_a_mixed_order(env):
    """ALFWorld's files are sorted by task type and TextCraft's alphabetically: a first N taken in file order was
    one task type (the first 100 ALFWorld train games are all look_at_obj_in_light) or one stretch of the alphabet
    (TextCraft's first 60 goals run acacia_boat .. crafting_table). list_tasks mixes them, same tasks."""
    for split in ("train", "test_seen", "test_unseen"):
        ids = [t.task_id for t in list_tasks(env, split)]
        file_ids = _file_order(env, split)
        assert sorted(ids) == sorted(file_ids) and ids != file_ids
    if env == "alfworld":
        assert {alfworld_task_type(g.split(":", 1)[1]) for g in _file_order(env, "train")[:100]} == \
            {"look_at_obj_in_light"}  # the files' order, as said above
        assert len({t.task_type for t in list_tasks(env, "train", limit=12)}) == 6
    else:
        first = [t.task_id.split(":")[1] for t in list_tasks(env, "train", limit=60)]
        assert len({g[0] for g in first}) >= 12  # initials across the alphabet, not a..c
    assert list_tasks(env, "train", limit=40) == list_tasks(env, "train")[:40]


def test_mixed_order_keeps_each_task_types_share_in_every_prefix():
    from collections import Counter

    for split in ("train", "test_seen", "test_unseen"):
        tasks = list_tasks("alfworld", split)
        total, n, seen = Counter(t.task_type for t in tasks), len(tasks), Counter()
        for k, t in enumerate(tasks, 1):
            seen[t.task_type] += 1
            assert all(abs(seen[g] - k * total[g] / n) <= 1 for g in total), (split, k)


def test_mixed_order_is_fixed_and_independent_of_the_input_order():
    from qevolve_cli.envs.base import Task

    tasks = [Task("alfworld", f"alfworld:t{i}", "train", "ab"[i % 3 == 0], {}) for i in range(30)]
    out = mixed_order(tasks, key=lambda t: t.task_type)
    assert [t.task_id for t in mixed_order(tasks[::-1], key=lambda t: t.task_type)] == [t.task_id for t in out]
    assert sorted(t.task_id for t in out) == sorted(t.task_id for t in tasks)
    # pinned: the order is part of the runs' identity (a change must rename TASK_ORDER's "mixed-1")
    assert [t.task_id for t in list_tasks("textcraft", "train", limit=3)] == \
        ["textcraft:andesite", "textcraft:polished_blackstone_brick_wall", "textcraft:dark_oak_pressure_plate"]
    assert TASK_ORDER == {"alfworld": "mixed-1", "textcraft": "mixed-1"}


def test_other_environments_keep_their_files_order():
    from qevolve_cli.envs.splits import _load

    assert [t.task_id for t in list_tasks("sciworld", "train")] == \
        [f"sciworld:{n}:{int(v)}" for n, v in _load("sciworld", "train_indices.json")]
    assert task_order_tag("sciworld", 10) is None and task_order_tag("lamps", 10) is None


def test_a_first_n_of_a_mixed_split_is_part_of_the_stage_hash(monkeypatch):
    """A run made while the files' order held (another first N) must not resume as if it had these tasks; runs
    that use a whole split, and every other environment, keep their hashes."""
    from qevolve_cli.evolve.config import EvolveConfig
    from qevolve_cli.evolve.loop import _expert_hash, _h
    from qevolve_cli.rollout.config import RolloutConfig

    assert task_order_tag("textcraft", 60) == "mixed-1" and task_order_tag("textcraft", 0) is None
    cases = [(env, n) for env in ("lamps", "sciworld", "textcraft", "alfworld") for n in (0, 60)]
    hashes = {c: RolloutConfig(env=c[0], max_tasks=c[1]).hash() for c in cases}
    monkeypatch.setattr(RolloutConfig, "hash_extra", lambda self: {})  # the fields alone, as before
    for env, n in cases:
        changed = env in TASK_ORDER and n > 0
        assert (hashes[(env, n)] != RolloutConfig(env=env, max_tasks=n).hash()) == changed, (env, n)
        assert (_expert_hash(EvolveConfig(env=env, expert_limit=n)) != _h(env, n)) == changed, (env, n)
