"""Packaged task splits: counts, stable ids, the ETO files, TextCraft's deterministic split."""
from __future__ import annotations

import json

import pytest

from qevolve_cli.envs import list_tasks, task_from_id
from qevolve_cli.envs.splits import alfworld_task_type
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
        assert [t.task_id for t in list_tasks("textcraft", split)] == [f"textcraft:{n}" for n in names]
    train_fams = {n.split("_")[-1] for n in built["train"] + built["test_seen"]}
    assert not train_fams & {n.split("_")[-1] for n in built["test_unseen"]}


def test_limit_and_bad_split():
    assert [t.task_id for t in list_tasks("sciworld", "train", limit=3)] == \
        [t.task_id for t in list_tasks("sciworld", "train")[:3]]
    with pytest.raises(QevolveError, match="unknown split 'test_seen'"):
        list_tasks("webshop", "test_seen")
    with pytest.raises(QevolveError, match="unknown environment"):
        list_tasks("minecraft", "train")
