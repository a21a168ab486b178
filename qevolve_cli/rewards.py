"""The reward maths without torch: process rewards (advantages) over a step table, and the names of the
losses' options that configs validate without importing torch.

Pure functions of their inputs (GAE itself runs in the Rust core, ``qevolve_cli.core.gae``); the torch
losses are in :mod:`qevolve_cli.algos`.
"""
from __future__ import annotations

from typing import Any

import polars as pl

from qevolve_cli import core
from qevolve_cli.errors import QevolveError, TableError

ADVANTAGES = ("gae", "gae_aux", "td", "q_minus_v")  # the process-reward choices (label's ``advantage``)
CRITIC_REDUCTIONS = ("traj_sum", "sum", "mean")  # how the critic's per-step losses are reduced (algos.critic_reduce)


def process_rewards(df: pl.DataFrame, kind: str = "gae", gamma: float = 0.95, lam: float = 0.95,
                    offs=None, source: Any = None) -> pl.Series:
    """The ``advantage`` of every step for one process-reward choice (paper table "process reward").

    ``gae``: GAE over r_env (the paper); ``gae_aux``: GAE over r_env + r_aux; ``td``:
    r_env + gamma (1 - d) V' - V (= GAE with lambda = 0); ``q_minus_v``: Q - V (needs
    ``q_value`` from the critic). Trajectories must be contiguous and in step order
    (``schema.sort_steps``); V after a terminal step is 0.
    """
    if kind not in ADVANTAGES:
        raise QevolveError(f"process reward: unknown kind {kind!r} (choose from {', '.join(ADVANTAGES)})")
    for c in ("value", "next_value") + (("q_value",) if kind == "q_minus_v" else ()):
        if c not in df.columns:
            raise TableError(source, c, f"missing column: advantage={kind} needs critic values")
        n = df[c].null_count()
        if n:
            raise TableError(source, c, f"{n} null values: cannot compute advantages")
    if kind == "q_minus_v":
        return (df["q_value"] - df["value"]).cast(pl.Float32).alias("advantage")
    offs = core.offsets(df) if offs is None else offs
    next_value = df.select(pl.when(pl.col("done")).then(0.0).otherwise(pl.col("next_value")).cast(pl.Float32)).to_series()
    aux = df["reward_aux"] if kind == "gae_aux" else None
    return core.gae(offs, df["reward_env"], df["value"], next_value, df["done"], gamma,
                    0.0 if kind == "td" else lam, aux)
