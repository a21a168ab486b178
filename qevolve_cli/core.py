"""Polars-facing wrappers of the Rust data core (``qevolve_cli._core``).

Columns travel to the core as one-chunk Polars Series through the Arrow
PyCapsule stream protocol (zero-copy; strings in Polars' own ``string_view``
layout, which the core reads directly); results come back through
``__arrow_c_array__`` into Polars Series. No per-row Python objects, and no
pyarrow: importing it (with numpy) costs 0.1-0.2 s, a fifth of a short
`qevolve label` run. The core also accepts pyarrow arrays (the tests use them).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import polars as pl

from qevolve_cli import _core

Column = Any  # a pl.Series, or any object with __arrow_c_array__ (a pyarrow.Array)


def arrow(s: Column) -> Column:
    """What the core imports: a Series as one chunk (the core refuses several); others unchanged."""
    return s.rechunk() if isinstance(s, pl.Series) else s


def series(name: str, exported: Any) -> pl.Series:
    """A core result (consumed once) as a Polars Series."""
    return pl.Series(exported).alias(name)


def offsets(df: pl.DataFrame) -> pl.Series:
    """Trajectory offsets (int64, n_traj + 1) of a table whose trajectories are contiguous."""
    return series("offsets", _core.offsets_from_ids(df["traj_id"]))  # the core reads the chunks as they are


def trajectory_success(offs: Column, reward_env: pl.Series) -> pl.Series:
    """One bool per trajectory: its summed env reward is positive."""
    return series("success", _core.trajectory_success(arrow(offs), arrow(reward_env.cast(pl.Float32))))


def step_weights(offs: Column, success: Column, n_rows: int, temporal: bool = True,
                 success_term: bool = True) -> pl.Series:
    return series("weight", _core.step_weights(arrow(offs), arrow(success), n_rows, temporal, success_term))


def to_polars(a: Column, name: str = "") -> pl.Series:
    return (a if isinstance(a, pl.Series) else pl.Series(a)).alias(name)


def broadcast(offs: Column, per_traj: Column, name: str) -> pl.Series:
    """Repeat one value per trajectory over its rows (bool in the Rust core, other types in Polars)."""
    vals = to_polars(per_traj, name)
    if vals.dtype == pl.Boolean and not vals.null_count():
        return series(name, _core.broadcast_bool(arrow(to_polars(offs)), arrow(vals)))
    lengths = to_polars(offs).diff().slice(1)
    idx = pl.int_range(0, lengths.len(), dtype=pl.UInt32, eager=True).repeat_by(lengths).explode()
    return vals.gather(idx)


def label_steps(df: pl.DataFrame, rules: Sequence[dict[str, Any]], env_code: pl.Series) -> tuple[pl.Series, pl.Series]:
    """(reward_aux, aux_kind) of every row, in the core, one call per block of rows.

    The blocks follow the chunks of the observation column (a table read from Parquet comes in one
    chunk per row group, the same for every column), so the string columns go in without being
    copied into one chunk first (three columns of 1M steps: 15-20 ms in a fresh process).
    """
    cols = [df["action"], df["observation"], df["next_observation"], env_code.cast(pl.UInt32)]
    rewards, kinds, start = [], [], 0
    for length in df["observation"].chunk_lengths() or [0]:
        r, k = _core.label_steps(*(arrow(c.slice(start, length)) for c in cols), list(rules))
        rewards.append(series("reward_aux", r))
        kinds.append(series("aux_kind", k))
        start += length
    if len(rewards) == 1:
        return rewards[0], kinds[0]
    return pl.concat(rewards, rechunk=False), pl.concat(kinds, rechunk=False)


def gae(offs: Column, reward: pl.Series, value: pl.Series, next_value: pl.Series, done: pl.Series,
        gamma: float, lam: float, reward_aux: pl.Series | None = None) -> pl.Series:
    f32 = lambda s: arrow(s.cast(pl.Float32))  # noqa: E731
    return series(
        "advantage",
        _core.gae_advantages(
            arrow(offs), f32(reward), f32(value), f32(next_value), arrow(done.cast(pl.Boolean)), gamma, lam,
            None if reward_aux is None else f32(reward_aux),
        ),
    )


def gigpo(offs: Column, group: pl.Series, reward: pl.Series, observation: pl.Series, gamma: float, omega: float,
          eps: float, norm: str = "std", episode_stats: str = "trajectories") -> pl.DataFrame:
    """GiGPO's advantages (``qevolve_cli.rewards.gigpo_advantages``): one row per step, columns ``advantage``
    (null outside every episode group), ``gigpo_episode``, ``gigpo_step`` (its two terms, 0 outside) and
    ``anchor_size`` (the step's anchor group size, 0 outside). ``group``: one int64 per trajectory, < 0 = none."""
    out = _core.gigpo_advantages(arrow(to_polars(offs)), arrow(group.cast(pl.Int64)), arrow(reward.cast(pl.Float32)),
                                 observation, gamma, omega, eps, norm, episode_stats)  # observation: as read, chunked
    return pl.DataFrame([series(n, x) for n, x in zip(("advantage", "gigpo_episode", "gigpo_step", "anchor_size"),
                                                       out, strict=True)])
