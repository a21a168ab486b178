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

ADVANTAGES = ("gae", "gae_aux", "td", "q_minus_v", "gigpo")  # the process-reward choices (label's ``advantage``)
CRITIC_FREE = ("gigpo",)  # the choices that need no critic values
GIGPO_NORMS = ("std", "mean")  # GiGPO's normalisation: verl-agent's mean_std_norm and mean_norm
GIGPO_EPISODE_STATS = ("trajectories", "steps")  # what GiGPO's episode mean and std are taken over
EPISODE_GROUP = ("env", "task_id", "iteration")  # one episode group: the self-play rollouts of one task in one iteration
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


def gigpo_advantages(df: pl.DataFrame, offs=None, gamma: float = 0.95, omega: float = 1.0, eps: float = 1e-6,
                     norm: str = "std", episode_stats: str = "trajectories") -> tuple[pl.DataFrame, dict[str, Any]]:
    """GiGPO's critic-free step credit (Feng et al. 2025; verl-agent ``gigpo/core_gigpo.py``; docs/policy.md,
    "GiGPO"), -> (columns ``advantage``, ``gigpo_episode``, ``gigpo_step``, ``anchor_size`` per row; statistics).

    Episode groups: the self-play trajectories (``source == "self"``, no ``error``) of one task in one
    iteration (:data:`EPISODE_GROUP`); the other rows (expert demonstrations, crashed episodes) are in no group:
    no advantage (null) and no effect on any other row's. Anchor groups: the steps of one episode group with
    the same ``observation`` (the environment's text, not the prompt's history). The maths is in the Rust
    core (``qevolve_core::gigpo``); trajectories must be contiguous and in step order.
    """
    offs = core.offsets(df) if offs is None else offs
    first = core.to_polars(offs).slice(0, max(core.to_polars(offs).len() - 1, 0))
    cols = list(EPISODE_GROUP) + ["source"] + (["error"] if "error" in df.columns else [])
    per = df.select(cols).gather(first)
    member = pl.col("source") == "self"
    if "error" in per.columns:
        member = member & pl.col("error").is_null()
    keys = per.filter(member).select(EPISODE_GROUP).unique(maintain_order=True).with_row_index("group")
    per = per.with_columns(member.alias("member")).join(keys, on=list(EPISODE_GROUP), how="left",
                                                        maintain_order="left", nulls_equal=True)
    group = per.select(pl.when(pl.col("member")).then(pl.col("group").cast(pl.Int64)).otherwise(-1)).to_series()
    out = core.gigpo(offs, group, df["reward_env"], df["observation"], gamma, omega, eps, norm, episode_stats)
    return out, gigpo_stats(out["anchor_size"], int((group >= 0).sum()), keys.height,
                            int(per.filter(pl.col("member")).group_by("group").len().filter(pl.col("len") == 1).height))


def gigpo_stats(anchor_size: pl.Series, trajectories: int, groups: int, single: int) -> dict[str, Any]:
    """How much of the table GiGPO can give step credit to: the steps in anchor groups of >= 2 steps (count and
    share of the steps in episode groups), and the steps by the size of their anchor group."""
    size = anchor_size.filter(anchor_size > 0)
    n = size.len()
    anchored = int((size >= 2).sum())
    by_size = size.value_counts().sort(size.name)
    steps_by_size: dict[str, int] = {}
    for s, c in by_size.iter_rows():
        key = str(s) if s <= 8 else "9+"
        steps_by_size[key] = steps_by_size.get(key, 0) + int(c)
    return {
        "episode_groups": groups,
        "single_trajectory_groups": single,
        "trajectories": trajectories,
        "steps": n,
        "steps_outside": anchor_size.len() - n,
        "anchored_steps": anchored,
        "anchored_share": anchored / n if n else 0.0,
        "anchor_groups": int(sum(int(c) / int(s) for s, c in by_size.iter_rows())),
        "anchor_groups_2plus": int(sum(int(c) / int(s) for s, c in by_size.iter_rows() if s >= 2)),
        "steps_by_anchor_size": steps_by_size,
    }


def gigpo_line(st: dict[str, Any]) -> str:
    """The one-line human summary of :func:`gigpo_stats`."""
    return (f"GiGPO: {st['anchored_steps']} of {st['steps']} self-play steps ({100 * st['anchored_share']:.1f} %) are in "
            f"anchor groups of >= 2 steps ({st['anchor_groups_2plus']} of {st['anchor_groups']} anchor groups; step "
            f"credit exists only there), {st['episode_groups']} episode groups ({st['single_trajectory_groups']} of "
            f"one trajectory), {st['steps_outside']} steps in no group (expert, crashed: no advantage)")
