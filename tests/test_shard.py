"""`--shard I/N`: the pure slicing of tasks and (task, sample) pairs, its config field and its errors.
The runs themselves (shards merged = the unsharded run) are in test_rollout.py and test_eval.py."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from qevolve_cli.shard import block, parse_shard, shard_pairs


def _reference_pairs(tasks, n_per_task):
    """The unsharded table's order, as run_rollout lists it: every task's sample 0, then sample 1, ..."""
    out = []
    for s in range(n_per_task):
        for t in tasks:
            out.append((t, s))
    return out


@pytest.mark.parametrize("n_tasks, n_per_task", [(0, 3), (1, 1), (3, 2), (7, 3), (10, 1), (13, 4)])
def test_shard_pairs_partition_the_unsharded_pairs(n_tasks: int, n_per_task: int) -> None:
    tasks = [f"t{k}" for k in range(n_tasks)]
    full = _reference_pairs(tasks, n_per_task)
    assert shard_pairs(tasks, n_per_task) == full and shard_pairs(tasks, n_per_task, "") == full
    assert shard_pairs(tasks, n_per_task, "0/1") == full  # N = 1 is the identity
    for n in (2, 3, 5, 8):
        parts = [shard_pairs(tasks, n_per_task, f"{i}/{n}") for i in range(n)]
        assert sum(parts, []) == full, "shards concatenated in shard order = the unsharded order"
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        again = [shard_pairs(list(tasks), n_per_task, f"{i}/{n}") for i in range(n)]
        assert again == parts, "deterministic"
        # whole tasks (eval --best-of): disjoint, complete, every sample of a task in one shard
        whole = [shard_pairs(tasks, n_per_task, f"{i}/{n}", whole_tasks=True) for i in range(n)]
        assert sorted(sum(whole, [])) == sorted(full) and len(sum(whole, [])) == len(full)
        owner = {}
        for i, part in enumerate(whole):
            assert part == _reference_pairs([t for t in tasks if (t, 0) in part], n_per_task)
            for t, _ in part:
                assert owner.setdefault(t, i) == i


def test_shard_blocks_cross_sample_boundaries_in_table_order() -> None:
    tasks = ["a", "b", "c"]
    assert [shard_pairs(tasks, 2, f"{i}/3") for i in range(3)] == [
        [("a", 0), ("b", 0)], [("c", 0), ("a", 1)], [("b", 1), ("c", 1)]]
    assert [shard_pairs(tasks, 2, f"{i}/2", whole_tasks=True) for i in range(2)] == [
        [("a", 0), ("b", 0), ("a", 1), ("b", 1)], [("c", 0), ("c", 1)]]
    assert [block(list(range(5)), i, 3) for i in range(3)] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("bad", ["2/2", "-1/2", "0/0", "1", "a/b", "1/2/3", "", "1/-2"])
def test_parse_shard_rejects_bad_values(bad: str) -> None:
    with pytest.raises(ValueError, match=r"I/N|0 <= I < N"):
        parse_shard(bad)
    assert parse_shard("3/4") == (3, 4) and parse_shard("0/1") == (0, 1)


def test_rollout_config_shard_is_validated_and_evolve_refuses_it() -> None:
    from qevolve_cli.errors import ConfigError
    from qevolve_cli.evolve.config import EvolveConfig
    from qevolve_cli.rollout.config import RolloutConfig

    assert RolloutConfig.from_dict({"shard": "1/4"}).shard == "1/4"
    with pytest.raises(ConfigError, match=r"field 'shard': need N >= 1 and 0 <= I < N, got '4/4'"):
        RolloutConfig.from_dict({"shard": "4/4"})
    with pytest.raises(ConfigError, match=r"rollout \(iteration 0\).*field 'shard': evolve plays"):
        EvolveConfig.from_dict({"model": "m", "iters": 1, "rollout": {"shard": "0/2"}})


@pytest.mark.parametrize("cmd", ["rollout", "eval"])
@pytest.mark.parametrize("bad, needle", [("2/2", "need N >= 1 and 0 <= I < N, got '2/2'"),
                                         ("half", "expected I/N (e.g. 0/4), got 'half'")])
def test_cli_bad_shard_is_one_line_exit_2(cmd: str, bad: str, needle: str, tmp_path) -> None:
    from qevolve_cli.cli import app

    out = tmp_path / "o.parquet"  # the shard is checked before the model (here: none) is touched
    args = [cmd, "--env", "textcraft", "--policy", str(tmp_path / "model"), "--split", "test_seen", "--max-tasks", "2",
            "--shard", bad, "--out", str(out), "-q"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert lines == [f"error: --shard: {needle}"]
    assert not out.exists() and not (tmp_path / "o.parquet.partial").exists()


def test_cli_empty_shard_is_one_line_exit_2(tmp_path) -> None:
    from qevolve_cli.cli import app

    out = tmp_path / "o.parquet"
    r = CliRunner().invoke(app, ["eval", "--env", "textcraft", "--policy", str(tmp_path / "model"), "--split", "test_seen",
                                 "--max-tasks", "1", "--shard", "1/2", "--out", str(out), "-q"])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [
        "error: textcraft/test_seen: shard 1/2 of 1 tasks x 1 samples is empty (fewer pairs than shards)"]
    assert not out.exists() and not (tmp_path / "o.parquet.partial").exists()
