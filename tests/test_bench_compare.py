"""benchmarks/bench_compare.py --keep-tables: a finished seed's table, kept as a small file, is read back in place of
its run directory, for the same configuration only (the arm list, which follows the run's base model, aside)."""
from __future__ import annotations

import json

import pytest

from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def bc():
    return load_benchmark("bench_compare")


def test_kept_table_is_read_back_for_the_same_configuration_only(bc, tmp_path):
    run = tmp_path / "lamps-habit-cpu-s0"  # never created: the run directory is gone
    cfg = bc.evolve_config("lamps-habit", "cpu", 0, 2, True, 0)
    ccfg = bc.compare_config("lamps-habit", 6, True, run)
    table = {"columns": ["lamps-habit/test_seen"], "rows": [{"arm": "sft", "per_task": {"lamps-habit/test_seen": {"t1": 1.0}}}]}
    kept = tmp_path / "tables" / "lamps-habit-cpu-s0.json"
    assert bc.kept_table(kept, cfg, ccfg) is None  # nothing kept yet
    finished_with = ccfg.replace(arms=[a for a in ccfg.arms if a != "zero_shot"])  # as the run's tiny base gave
    bc.keep_table(kept, cfg, finished_with, table, {"evolve_s": 1.0})
    assert json.loads(kept.read_text())["arms"] == list(finished_with.arms)
    assert not list(kept.parent.glob("*.tmp"))
    assert bc.kept_table(kept, cfg, ccfg) == table  # read although the arm lists differ
    assert bc.kept_table(kept, bc.evolve_config("lamps-habit", "cpu", 1, 2, True, 0), ccfg) is None  # another seed
    assert bc.kept_table(kept, bc.evolve_config("lamps-habit", "cpu", 0, 1, True, 0), ccfg) is None  # one iteration
    assert bc.kept_table(kept, cfg, bc.compare_config("lamps-habit", 4, True, run)) is None  # Best-of-4
