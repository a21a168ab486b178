"""Trajectory tables (docs/tables.md): one Parquet table, one row per step.

The column names are fixed; tables may carry more columns (never renamed).
``read_table`` validates and names file, column and problem on failure;
``write_table`` is atomic and stamps the schema version into the Parquet
metadata.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import polars as pl

from qevolve_cli.atomic import atomic_path
from qevolve_cli.errors import TableError

SCHEMA_VERSION = "1"
META_VERSION_KEY = b"qevolve.schema_version"
META_PRODUCER_KEY = b"qevolve.producer"

# Columns every table has (what rollout / expert / import write).
BASE_COLUMNS: dict[str, pl.DataType] = {
    "traj_id": pl.String(),
    "env": pl.String(),
    "task_id": pl.String(),
    "split": pl.String(),
    "source": pl.String(),
    "iteration": pl.Int32(),
    "step": pl.Int32(),
    "instruction": pl.String(),
    "observation": pl.String(),
    "action": pl.String(),
    "command": pl.String(),  # null on format error
    "next_observation": pl.String(),
    "reward_env": pl.Float32(),
    "done": pl.Boolean(),
}
# Columns added by `qevolve label`.
LABEL_COLUMNS: dict[str, pl.DataType] = {
    "reward_aux": pl.Float32(),
    "aux_kind": pl.String(),
    "success": pl.Boolean(),
    "weight": pl.Float32(),
}
# Columns added by `qevolve label --tokenizer`.
PREFIX_COLUMNS: dict[str, pl.DataType] = {
    "pos_s": pl.Int32(),
    "pos_sa": pl.Int32(),
    "pos_next": pl.Int32(),
}
# Columns added by `qevolve label --critic` (or present in the input).
CRITIC_COLUMNS: dict[str, pl.DataType] = {
    "value": pl.Float32(),
    "next_value": pl.Float32(),
    "advantage": pl.Float32(),
}
# Optional extra columns with a fixed meaning when present.
EXTRA_COLUMNS: dict[str, pl.DataType] = {
    "error": pl.String(),  # reason a trajectory failed (worker crash, timeout); null otherwise
    "truncated": pl.Boolean(),  # context truncated for this step (oldest turns dropped)
    "task_type": pl.String(),  # environment task family (e.g. ALFWorld pick_and_place)
    "seq_len": pl.Int32(),  # tokens of the whole tokenised trajectory
    "steps_left": pl.Int32(),  # turns the episode had left before its step limit at this step (rollout, eval)
}
ALL_COLUMNS: dict[str, pl.DataType] = {
    **BASE_COLUMNS,
    **LABEL_COLUMNS,
    **PREFIX_COLUMNS,
    **CRITIC_COLUMNS,
    **EXTRA_COLUMNS,
}
NULLABLE = {"command", "error", "value", "next_value", "advantage", "task_type", "steps_left"}
FLOAT_CHECKED = ["reward_env", "reward_aux", "weight", "value", "next_value", "advantage"]
AUX_KINDS = ("none", "format", "invalid", "repeat")
SOURCES = ("expert", "self")


def _kind(dt: pl.DataType) -> str:
    if dt in (pl.String, pl.Utf8, pl.Categorical, pl.Enum) or isinstance(dt, (pl.Categorical, pl.Enum)):
        return "str"
    if dt.is_integer():
        return "int"
    if dt.is_float():
        return "float"
    if dt == pl.Boolean:
        return "bool"
    if dt == pl.Null:
        return "null"
    return str(dt)


def _expected_kind(dt: pl.DataType) -> str:
    return _kind(dt)


def conform(df: pl.DataFrame, path: str | Path | None = None, require: Iterable[str] = ()) -> pl.DataFrame:
    """Check column presence and types; cast compatible types to the canonical ones.

    Raises TableError naming the column on a missing column or a wrong type.
    """
    cols = set(df.columns)
    for name in list(BASE_COLUMNS) + list(require):
        if name not in cols:
            raise TableError(path, name, "missing column")
    casts = []
    for name, dt in ALL_COLUMNS.items():
        if name not in cols:
            continue
        have, want = _kind(df.schema[name]), _expected_kind(dt)
        if have == "null":  # all-null column of unknown type
            casts.append(pl.col(name).cast(dt))
            continue
        if have != want and not (want == "float" and have == "int"):
            raise TableError(path, name, f"wrong type: expected {want} ({dt}), got {df.schema[name]}")
        if df.schema[name] != dt:
            casts.append(pl.col(name).cast(dt, strict=True))
    if casts:
        try:
            df = df.with_columns(casts)
        except Exception as e:  # overflow on cast
            raise TableError(path, None, f"cannot cast columns to the schema: {e}") from None
    return df


def _first_unknown(s: pl.Series, allowed: Sequence[str]) -> str | None:
    """The first value of ``s`` not in ``allowed`` (None when all are known). A comparison per
    allowed value: a third of the time of ``is_in`` on 1M strings."""
    known = s == allowed[0]
    for v in allowed[1:]:
        known = known | (s == v)
    return None if known.all() else s.filter(~known)[0]


def validate(df: pl.DataFrame, path: str | Path | None = None, require: Iterable[str] = ()) -> pl.DataFrame:
    """Full validation of a step table; returns it conformed (canonical dtypes). See :func:`validate_steps`."""
    return validate_steps(df, path, require)[0]


def validate_steps(df: pl.DataFrame, path: str | Path | None = None,
                   require: Iterable[str] = ()) -> tuple[pl.DataFrame, pl.Series | None]:
    """Full validation of a step table: (the table conformed, its :func:`step_offsets`).

    Checks: columns and types, no empty table, no null/empty traj_id, no nulls
    in non-nullable base columns, finite rewards/weights/values, unique
    (traj_id, step), steps contiguous from 0 within each trajectory, done only
    on a trajectory's last step, known ``source`` and ``aux_kind`` values.
    """
    df = conform(df, path, require)
    if df.height == 0:
        raise TableError(path, None, "empty table: no trajectories")
    for name in BASE_COLUMNS:
        if name in NULLABLE:
            continue
        n = df[name].null_count()
        if n:
            raise TableError(path, name, f"{n} null values")
    if (df["traj_id"] == "").any():
        raise TableError(path, "traj_id", "empty trajectory id")
    for name in FLOAT_CHECKED:
        if name not in df.columns:
            continue
        s = df[name]
        bad = s.is_nan() | s.is_infinite()
        nbad = int(bad.sum() or 0)
        if nbad:
            first = df.filter(bad).row(0, named=True)
            raise TableError(
                path, name, f"{nbad} NaN/inf values (first at traj_id={first['traj_id']!r} step={first['step']})"
            )
        if name in ("reward_env", "reward_aux", "weight") and s.null_count():
            raise TableError(path, name, f"{s.null_count()} null values")
    bad_src = _first_unknown(df["source"], SOURCES)
    if bad_src is not None:
        raise TableError(path, "source", f"unknown value {bad_src!r} (expected one of {SOURCES})")
    if "aux_kind" in df.columns:
        bad_kind = _first_unknown(df["aux_kind"], AUX_KINDS)
        if bad_kind is not None:
            raise TableError(path, "aux_kind", f"unknown value {bad_kind!r}")
    if (df["step"] < 0).any():
        raise TableError(path, "step", "negative step")
    offs = step_offsets(df)
    if offs is not None:
        # every trajectory's rows adjacent with steps 0..n-1 (all tables qevolve writes): unique and
        # contiguous steps hold; only `done` before the last step remains to check, without a group-by
        done, last_rows = df["done"], offs.slice(1) - 1
        # every done row is a last row when the last rows hold all of them (two sums, no search)
        if done.sum() != done.gather(last_rows).sum():
            done_rows = done.arg_true().cast(pl.Int64)  # sorted: each must be one of last_rows
            hit = last_rows.gather(last_rows.search_sorted(done_rows).clip(0, last_rows.len() - 1))
            early = done_rows.filter(hit != done_rows)
            if early.len():
                raise TableError(path, "done", f"done=true before the last step in trajectory "
                                 f"{df['traj_id'][early[0]]!r}")
        return df, offs
    stats = df.group_by("traj_id").agg(
        pl.len().alias("n"),
        pl.col("step").n_unique().alias("nu"),
        pl.col("step").min().alias("lo"),
        pl.col("step").max().alias("hi"),
        (pl.col("done") & (pl.col("step") != pl.col("step").max())).any().alias("early_done"),
    )
    dup = stats.filter(pl.col("nu") != pl.col("n"))
    if dup.height:
        raise TableError(path, "step", f"duplicate (traj_id, step) in trajectory {dup['traj_id'][0]!r}")
    gap = stats.filter((pl.col("lo") != 0) | (pl.col("hi") != pl.col("n") - 1))
    if gap.height:
        r = gap.row(0, named=True)
        raise TableError(
            path,
            "step",
            f"non-contiguous steps in trajectory {r['traj_id']!r}: {r['n']} rows with steps {r['lo']}..{r['hi']}"
            " (expected 0..n-1)",
        )
    early = stats.filter(pl.col("early_done"))
    if early.height:
        raise TableError(path, "done", f"done=true before the last step in trajectory {early['traj_id'][0]!r}")
    return df, None


def read_table(path: str | Path, require: Iterable[str] = (), validate_rows: bool = True) -> pl.DataFrame:
    """Read and validate a trajectory table."""
    return read_steps(path, require, validate_rows)[0]


def read_steps(path: str | Path, require: Iterable[str] = (),
               validate_rows: bool = True) -> tuple[pl.DataFrame, pl.Series | None]:
    """Read and validate a trajectory table: (table, its step_offsets, None when not in step order
    or when the rows were not validated)."""
    path = Path(path)
    if not path.exists():
        raise TableError(path, None, "no such file")
    if path.is_dir():
        raise TableError(path, None, "is a directory, expected a Parquet file")
    try:
        df = pl.read_parquet(path)
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TableError(path, None, f"not a readable Parquet file ({msg})") from None
    ver = schema_version(path)
    if ver is not None and ver != SCHEMA_VERSION:
        raise TableError(path, None, f"schema version {ver} is not supported (this qevolve reads {SCHEMA_VERSION})")
    return validate_steps(df, path, require) if validate_rows else (conform(df, path, require), None)


def schema_version(path: str | Path) -> str | None:
    return parquet_metadata(path).get(META_VERSION_KEY.decode())


def parquet_metadata(path: str | Path) -> dict[str, str]:
    """The key-value metadata of a Parquet file ({} when unreadable); no pyarrow.parquet import."""
    try:
        return dict(pl.read_parquet_metadata(path))
    except Exception:
        return {}


def order_columns(df: pl.DataFrame) -> pl.DataFrame:
    known = [c for c in ALL_COLUMNS if c in df.columns]
    rest = [c for c in df.columns if c not in ALL_COLUMNS]
    # already in order (what `label` produces): no select, which costs ~0.07 s per million rows
    return df if df.columns == known + rest else df.select(known + rest)


def write_table(df: pl.DataFrame, path: str | Path, producer: str = "qevolve", validate_rows: bool = True) -> Path:
    """Validate and write atomically (temp file + fsync + rename), stamping the schema version."""
    path = Path(path)
    if validate_rows:
        df = validate(df, path)
    else:
        df = conform(df, path)
    df = order_columns(df)
    md = {META_VERSION_KEY.decode(): SCHEMA_VERSION, META_PRODUCER_KEY.decode(): producer}
    # the version goes into the Parquet key-value metadata and into the Arrow schema stored in
    # the file (what pyarrow.parquet.read_schema(...).metadata and pandas show). Strings are
    # declared as Polars' own string views (pyarrow >= 16 reads them): declaring large strings
    # makes Polars convert every string column first (1.3 s -> 0.7 s on 1M SciWorld-shaped steps).
    # The schema comes from Polars' own export and gets its metadata in the Rust core (pyarrow's
    # `to_arrow` would import pyarrow and numpy: 0.1-0.2 s, a fifth of a short `label` run).
    from qevolve_cli import _core

    arrow_schema = _core.schema_with_metadata(df.schema, md)
    with atomic_path(path, suffix=".parquet") as tmp:
        # Polars' own writer: multi-threaded, and no conversion of its string views to Arrow
        # large strings first (about 5x faster than pyarrow.parquet on 1M steps of short strings)
        df.write_parquet(tmp, compression="zstd", metadata=md, arrow_schema=arrow_schema)
    return path


def empty_frame(columns: Sequence[str] | None = None) -> pl.DataFrame:
    cols = columns or list(BASE_COLUMNS)
    return pl.DataFrame(schema={c: ALL_COLUMNS[c] for c in cols})


def step_offsets(df: pl.DataFrame) -> pl.Series | None:
    """Trajectory offsets (int64, n_traj + 1) when the table is in step order, else None.

    Step order (what qevolve writes): every trajectory's rows adjacent, steps 0, 1, 2, ... .
    One pass in the Rust core (~5 ms per million steps; the Polars expressions took ~30).
    """
    if df.height == 0:
        return pl.Series("offsets", [0], dtype=pl.Int64)
    tid, step = df["traj_id"], df["step"]
    if tid.null_count() or step.null_count() or not tid.dtype == pl.String:
        return None
    if step.dtype != pl.Int32:
        try:
            step = step.cast(pl.Int32, strict=True)
        except Exception:  # out of int32 range, or not integers: not a step column qevolve wrote
            return None
    from qevolve_cli import _core, core

    out = _core.step_order_offsets(tid, core.arrow(step))  # the ids in their chunks as read
    return None if out is None else core.series("offsets", out)


def is_step_sorted(df: pl.DataFrame) -> bool:
    """True when every trajectory's rows are adjacent and in step order 0, 1, 2, ... (what qevolve writes)."""
    return step_offsets(df) is not None


def sort_steps(df: pl.DataFrame) -> pl.DataFrame:
    """Rows of each trajectory adjacent and in step order (stable in trajectory order of first appearance).

    A table already in that order (every table qevolve writes) is returned as is, without the
    join and sort (a third of a second per million steps).
    """
    if is_step_sorted(df):
        return df
    first = df.select("traj_id").with_row_index("_r").group_by("traj_id").agg(pl.col("_r").min().alias("_first"))
    return df.join(first, on="traj_id", how="left").sort(["_first", "step"]).drop("_first")


def drop_failed(df: pl.DataFrame) -> pl.DataFrame:
    """Drop trajectories recorded as failed (non-null ``error``), e.g. before training."""
    if "error" not in df.columns:
        return df
    bad = df.filter(pl.col("error").is_not_null())["traj_id"].unique()
    return df.filter(~pl.col("traj_id").is_in(bad.implode())) if bad.len() else df


def finite(x: float) -> bool:
    return math.isfinite(x)
