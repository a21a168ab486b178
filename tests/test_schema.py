"""Trajectory-table schema: validation messages name file, column and problem; writes are atomic."""
from __future__ import annotations

import os

import polars as pl
import pyarrow.parquet as pq
import pytest

from qevolve_cli import schema
from qevolve_cli.errors import TableError
from qevolve_cli.synthetic import synthetic_table


@pytest.fixture
def df():
    return synthetic_table(6, mean_steps=4, seed=1)


def test_roundtrip_and_version(tmp_path, df):
    p = schema.write_table(df, tmp_path / "t.parquet")
    assert pq.read_schema(p).metadata[b"qevolve.schema_version"] == schema.SCHEMA_VERSION.encode()
    back = schema.read_table(p)
    assert back.equals(schema.validate(df))
    # readable by pyarrow and polars lazily too
    assert pl.scan_parquet(p).select(pl.len()).collect().item() == df.height


@pytest.mark.parametrize(
    "mutate,column,problem",
    [
        (lambda d: d.drop("reward_env"), "reward_env", "missing column"),
        (lambda d: d.with_columns(pl.col("step").cast(pl.String)), "step", "wrong type"),
        (lambda d: d.with_columns(pl.when(pl.int_range(pl.len()) == 3).then(float("nan")).otherwise(pl.col("reward_env")).alias("reward_env")), "reward_env", "NaN/inf"),
        (lambda d: d.with_columns(pl.when(pl.int_range(pl.len()) == 2).then(float("inf")).otherwise(pl.col("reward_env")).alias("reward_env")), "reward_env", "NaN/inf"),
        (lambda d: d.with_columns(pl.when(pl.col("step") == 1).then(100).otherwise(pl.col("step")).alias("step")), "step", "non-contiguous"),
        (lambda d: pl.concat([d, d.head(1)]), "step", "duplicate"),
        (lambda d: d.with_columns(pl.lit("").alias("traj_id")), "traj_id", "empty trajectory id"),
        (lambda d: d.with_columns(pl.lit("robot").alias("source")), "source", "unknown value"),
        (lambda d: d.with_columns(pl.lit(True).alias("done")), "done", "before the last step"),
        (lambda d: d.with_columns(pl.lit(None, dtype=pl.String).alias("observation")), "observation", "null values"),
    ],
)
def test_validation_errors_name_column(tmp_path, df, mutate, column, problem):
    bad = mutate(df)
    p = tmp_path / "bad.parquet"
    bad.write_parquet(p)
    with pytest.raises(TableError) as ei:
        schema.read_table(p)
    msg = str(ei.value)
    assert str(p) in msg and f"column '{column}'" in msg and problem in msg
    assert "\n" not in msg


def test_empty_table_and_not_parquet(tmp_path, df):
    p = tmp_path / "empty.parquet"
    df.head(0).write_parquet(p)
    with pytest.raises(TableError, match="empty table"):
        schema.read_table(p)
    q = tmp_path / "junk.parquet"
    q.write_text("not parquet at all")
    with pytest.raises(TableError, match="not a readable Parquet file"):
        schema.read_table(q)
    with pytest.raises(TableError, match="no such file"):
        schema.read_table(tmp_path / "missing.parquet")


def test_future_schema_version_rejected(tmp_path, df):
    t = df.to_arrow().replace_schema_metadata({b"qevolve.schema_version": b"99"})
    p = tmp_path / "v99.parquet"
    pq.write_table(t, p)
    with pytest.raises(TableError, match="schema version 99"):
        schema.read_table(p)


def test_int64_columns_conformed(tmp_path, df):
    p = tmp_path / "i64.parquet"
    df.with_columns(pl.col("step").cast(pl.Int64), pl.col("reward_env").cast(pl.Float64)).write_parquet(p)
    back = schema.read_table(p)
    assert back.schema["step"] == pl.Int32 and back.schema["reward_env"] == pl.Float32


def test_failed_write_keeps_previous_file(tmp_path, df):
    p = schema.write_table(df, tmp_path / "t.parquet")
    before = p.read_bytes()
    bad = df.with_columns(pl.lit(float("nan")).cast(pl.Float32).alias("reward_env"))
    with pytest.raises(TableError):
        schema.write_table(bad, p)
    assert p.read_bytes() == before
    assert [f for f in os.listdir(tmp_path) if f.endswith(".tmp")] == []


def test_interrupted_write_leaves_no_partial_file(tmp_path, df, monkeypatch):
    def boom(self, where, **kw):
        with open(where, "wb") as f:
            f.write(b"PAR1 half")
        raise KeyboardInterrupt

    monkeypatch.setattr(pl.DataFrame, "write_parquet", boom)
    with pytest.raises(KeyboardInterrupt):
        schema.write_table(df, tmp_path / "new.parquet")
    assert list(tmp_path.iterdir()) == []


def test_sort_steps_makes_trajectories_contiguous(df):
    shuffled = df.sample(fraction=1.0, shuffle=True, seed=3)
    s = schema.sort_steps(shuffled)
    ids = s["traj_id"].to_list()
    # each id forms one run, steps ascending inside it
    runs = [ids[0]] + [b for a, b in zip(ids, ids[1:], strict=False) if a != b]
    assert len(runs) == len(set(runs)) == df["traj_id"].n_unique()
    for _, g in s.group_by("traj_id", maintain_order=True):
        assert g["step"].to_list() == list(range(g.height))


def test_drop_failed():
    d = synthetic_table(3, mean_steps=2, seed=2)
    first = d["traj_id"][0]
    d = d.with_columns(pl.when(pl.col("traj_id") == first).then(pl.lit("worker crashed")).otherwise(None).alias("error"))
    kept = schema.drop_failed(d)
    assert first not in kept["traj_id"].to_list() and kept["traj_id"].n_unique() == 2


def test_written_files_get_normal_permissions(tmp_path, df):
    import stat

    p = schema.write_table(df, tmp_path / "t.parquet")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask


def test_is_step_sorted_cases():
    def t(ids, steps):
        return pl.DataFrame({"traj_id": ids, "step": pl.Series(steps, dtype=pl.Int32)})

    assert schema.is_step_sorted(t(["a", "a", "b", "c", "c"], [0, 1, 0, 0, 1]))
    assert not schema.is_step_sorted(t(["a", "a", "b", "a"], [0, 1, 0, 2]))  # a split in two runs
    assert not schema.is_step_sorted(t(["a", "a", "b", "a"], [0, 1, 0, 0]))  # a starts twice
    assert not schema.is_step_sorted(t(["a", "a", "b"], [1, 0, 0]))  # steps out of order
    assert not schema.is_step_sorted(t(["a", "a", "b"], [0, 2, 0]))  # a gap
    assert not schema.is_step_sorted(t(["a", "a", "b"], [0, 1, 1]))  # does not start at 0
    assert not schema.is_step_sorted(t(["a", "a", "b"], [0, 0, 0]))  # duplicate step
    assert not schema.is_step_sorted(t(["a", None, "b"], [0, 1, 0]))
    assert schema.is_step_sorted(t([], []))


def _reference_step_order(ids, steps):
    """Plain definition of step order: each id one run of adjacent rows, with steps 0..n-1."""
    runs = []
    for i, tid in enumerate(ids):
        if tid is None:
            return None
        if i == 0 or tid != ids[i - 1]:
            runs.append([tid, i])
    if len({r[0] for r in runs}) != len(runs):
        return None
    bounds = [r[1] for r in runs] + [len(ids)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        if list(steps[a:b]) != list(range(b - a)):
            return None
    return bounds if ids else [0]


def test_step_offsets_equal_the_reference_on_random_tables():
    import random

    rng = random.Random(0)
    sorted_seen = 0
    for _ in range(400):
        n = rng.randint(0, 9)
        ids = [rng.choice("abc") for _ in range(n)]
        if rng.random() < 0.5:  # mostly-sorted tables: steps counted per run, sometimes perturbed
            steps, k = [], 0
            for i in range(n):
                k = 0 if i == 0 or ids[i] != ids[i - 1] else k + 1
                steps.append(k)
            if n and rng.random() < 0.3:
                steps[rng.randrange(n)] += rng.choice([-1, 1])
        else:
            steps = [rng.randint(0, 2) for _ in range(n)]
        df = pl.DataFrame({"traj_id": pl.Series(ids, dtype=pl.String), "step": pl.Series(steps, dtype=pl.Int32)})
        got = schema.step_offsets(df)
        want = _reference_step_order(ids, steps)
        assert (None if got is None else got.to_list()) == want, (ids, steps)
        sorted_seen += want is not None
    assert sorted_seen > 50  # both outcomes exercised


def test_step_offsets_chunked_int64_and_out_of_range_steps():
    a = pl.DataFrame({"traj_id": ["a", "a"], "step": pl.Series([0, 1], dtype=pl.Int64)})
    b = pl.DataFrame({"traj_id": ["b"], "step": pl.Series([0], dtype=pl.Int64)})
    two_chunks = pl.concat([a, b], rechunk=False)
    assert two_chunks["traj_id"].n_chunks() == 2
    assert schema.step_offsets(two_chunks).to_list() == [0, 2, 3]
    huge = pl.DataFrame({"traj_id": ["a"], "step": pl.Series([2**40], dtype=pl.Int64)})
    assert schema.step_offsets(huge) is None


def test_early_done_found_in_every_position(df):
    """The sorted path's `done` check (offsets + binary search) flags an early done in the first,
    a middle and the last trajectory, and accepts done on last steps only."""
    d = schema.sort_steps(df)
    offs = schema.step_offsets(d).to_list()
    assert len(offs) >= 4
    schema.validate(d)  # as generated: done only on last steps
    for t in (0, len(offs) // 2 - 1, len(offs) - 2):
        start, end = offs[t], offs[t + 1]
        if end - start < 2:
            continue
        row = start + (end - start) // 2 if end - start > 2 else start
        bad = d.with_columns(pl.when(pl.int_range(pl.len()) == row).then(True).otherwise(pl.col("done")).alias("done"))
        with pytest.raises(TableError, match=f"done=true before the last step in trajectory '{d['traj_id'][start]}'"):
            schema.validate(bad)


def test_validate_same_errors_sorted_or_not(df):
    """validate() skips its group-by on sorted tables: the errors are the same either way."""
    d = schema.sort_steps(df)
    first, second = d["traj_id"].unique(maintain_order=True).to_list()[:2]
    early = d.with_columns(pl.when((pl.col("traj_id") == first) & (pl.col("step") == 0)).then(True)
                           .otherwise(pl.col("done")).alias("done"))
    assert schema.is_step_sorted(early)
    with pytest.raises(TableError, match=f"done=true before the last step in trajectory '{first}'"):
        schema.validate(early)
    shuffled = early.sample(fraction=1.0, shuffle=True, seed=1)
    assert not schema.is_step_sorted(shuffled)
    with pytest.raises(TableError, match=f"done=true before the last step in trajectory '{first}'"):
        schema.validate(shuffled)
    # a duplicated step: not sorted, so the group-by path reports it
    dup = pl.concat([d, d.filter((pl.col("traj_id") == second) & (pl.col("step") == 0))])
    with pytest.raises(TableError, match="duplicate"):
        schema.validate(dup)
    assert schema.sort_steps(d) is d  # already in order: returned as is
