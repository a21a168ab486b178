"""Polars-facing wrappers of the Rust data core (``qevolve_cli._core``).

Columns travel as Arrow arrays (zero-copy from Polars via ``to_arrow``);
results come back as Arrow arrays wrapped in Polars Series. No per-row Python
objects; the Rust side releases the GIL and uses all cores.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import polars as pl
import pyarrow as pa

from qevolve_cli import _core


def arrow(s: pl.Series) -> pa.Array:
    """A single-chunk Arrow array of a Polars Series, zero-copy when it is one chunk.

    Strings are exported as Arrow ``string_view`` (Polars' own layout; the Rust
    core reads it directly) instead of being copied into ``large_string``.
    """
    a = s.rechunk().to_arrow(compat_level=pl.CompatLevel.newest())
    if isinstance(a, pa.ChunkedArray):
        a = a.combine_chunks()
    return a


# Results of the core are imported through the Arrow PyCapsule protocol by Polars, never with
# ``pyarrow.array(...)`` or ``pyarrow.Array.to_numpy()``: both import pandas (0.4 s of start-up).
def series(name: str, exported: Any) -> pl.Series:
    return pl.Series(exported).alias(name)


def _pa(exported: Any) -> pa.Array:
    """A core result as a reusable pyarrow array (an export can be consumed only once)."""
    return arrow(pl.Series(exported))


def offsets(df: pl.DataFrame) -> pa.Array:
    """Trajectory offsets (int64, n_traj + 1) of a table whose trajectories are contiguous."""
    return _pa(_core.offsets_from_ids(arrow(df["traj_id"])))


def trajectory_success(offs: pa.Array, reward_env: pl.Series) -> pa.Array:
    return _pa(_core.trajectory_success(offs, arrow(reward_env.cast(pl.Float32))))


def step_weights(offs: pa.Array, success: pa.Array, n_rows: int, temporal: bool = True,
                 success_term: bool = True) -> pl.Series:
    return series("weight", _core.step_weights(offs, success, n_rows, temporal, success_term))


class _ArrowRef:
    """Hands a pyarrow array to Polars through the PyCapsule protocol.

    ``pl.Series(<pyarrow.Array>)`` takes another path that imports ``pyarrow.compute`` (0.2 s).
    """

    def __init__(self, a: pa.Array):
        self.a = a

    def __arrow_c_array__(self, requested_schema: Any = None) -> Any:
        return self.a.__arrow_c_array__(requested_schema)


def to_polars(a: pa.Array, name: str = "") -> pl.Series:
    return pl.Series(_ArrowRef(a)).alias(name)


def broadcast(offs: pa.Array, per_traj: pa.Array, name: str) -> pl.Series:
    """Repeat one value per trajectory over its rows (in Polars: no pandas, no pyarrow.compute)."""
    lengths = to_polars(offs).diff().slice(1)
    idx = pl.int_range(0, lengths.len(), dtype=pl.UInt32, eager=True).repeat_by(lengths).explode()
    return to_polars(per_traj, name).gather(idx)


def label_steps(df: pl.DataFrame, rules: Sequence[dict[str, Any]], env_code: pl.Series) -> tuple[pl.Series, pl.Series]:
    r, k = _core.label_steps(
        arrow(df["action"]),
        arrow(df["observation"]),
        arrow(df["next_observation"]),
        arrow(env_code.cast(pl.UInt32)),
        list(rules),
    )
    return series("reward_aux", r), series("aux_kind", k)


def gae(offs: pa.Array, reward: pl.Series, value: pl.Series, next_value: pl.Series, done: pl.Series,
        gamma: float, lam: float, reward_aux: pl.Series | None = None) -> pl.Series:
    f32 = lambda s: arrow(s.cast(pl.Float32))  # noqa: E731
    return series(
        "advantage",
        _core.gae_advantages(
            offs, f32(reward), f32(value), f32(next_value), arrow(done.cast(pl.Boolean)), gamma, lam,
            None if reward_aux is None else f32(reward_aux),
        ),
    )
