"""Held-out trajectories of the critic: which ones are held out (:func:`split_heldout`) and the diagnostics of
the critic on a set of trajectories (:func:`evaluate_items`, per epoch and at the end)."""
from __future__ import annotations

from typing import Any

import numpy as np

from qevolve_cli.critic.config import CriticConfig
from qevolve_cli.critic.data import TrajItem
from qevolve_cli.rewards import process_rewards


def heldout_ids(df: Any, fraction: float, ids: list[str] | None = None) -> set[str]:
    """The trajectory ids of ``df`` the critic holds out (``ids``: only these; default every trajectory).

    The choice (:func:`qevolve_cli.critic.diagnostics.heldout_mask`) is deterministic, stratified by outcome
    (the ``success`` column of a trajectory's first row, else a non-zero summed ``reward_env``), and depends
    only on the trajectory ids and outcomes, not on the order of the table. Empty when nothing would be left
    to train on. Both critics (LoRA and feature) hold out through it."""
    import polars as pl

    from qevolve_cli.critic.diagnostics import heldout_mask

    won = pl.col("success").first() if "success" in df.columns else pl.col("reward_env").sum() != 0
    per = df.group_by("traj_id", maintain_order=True).agg(won.cast(pl.Boolean).alias("ok"))
    ok = dict(zip((str(t) for t in per["traj_id"].to_list()), per["ok"].to_list(), strict=True))
    ids = sorted(set(ok) if ids is None else set(ids))
    if fraction <= 0 or not ids:
        return set()
    held = {i for i, h in zip(ids, heldout_mask(ids, [ok[i] for i in ids], fraction), strict=True) if h}
    return set() if len(held) == len(ids) else held


def split_heldout(items: list[TrajItem], df: Any, fraction: float) -> tuple[list[TrajItem], list[TrajItem]]:
    """(train items, held-out items): whole trajectories (all their windows) held out by traj_id
    (:func:`heldout_ids`)."""
    if fraction <= 0 or not items:
        return items, []
    tid = df["traj_id"].to_numpy()
    base = [str(tid[it.rows[0]]) for it in items]
    held = heldout_ids(df, fraction, base)
    train = [it for it, b in zip(items, base, strict=True) if b not in held]
    test = [it for it, b in zip(items, base, strict=True) if b in held]
    if not train:
        return items, []
    return train, test


def evaluate_items(trainer: Any, items: list[TrajItem], df: Any, cfg: CriticConfig,
                   full: bool = False) -> dict[str, Any]:
    """Diagnostics (:func:`qevolve_cli.critic.diagnostics.diagnose`) of the critic on ``items``' trajectories
    (``trainer``: a :class:`~qevolve_cli.critic.trainer.CriticTrainer`; its ``score_items`` scores them).

    Scores every step of the items, computes the paper's GAE advantage (r_env only, ``diag_lambda``)
    from the critic's V, and returns the metrics; ``full`` keeps the per-step curves and calibration
    bins (final diagnostics), else only scalars and the advantage groups (per-epoch metrics).
    """
    if not items:
        return {}
    cols = trainer.score_items(items, df.height)
    rows = np.unique(np.concatenate([it.rows for it in items]))
    return diagnose_scored(df, cols, rows, cfg, full)


def diagnose_scored(df: Any, cols: dict[str, np.ndarray], rows: np.ndarray, cfg: CriticConfig,
                    full: bool = False) -> dict[str, Any]:
    """The diagnostics of :func:`evaluate_items` from critic outputs already computed: ``cols`` (value,
    next_value, q1, q2, q_value; arrays over all rows of ``df``) on the rows ``rows`` (whole trajectories).
    Both critics (LoRA and feature) report through it."""
    import polars as pl

    from qevolve_cli import core
    from qevolve_cli.critic.diagnostics import diagnose

    if not len(rows):
        return {}
    keep = [c for c in ("traj_id", "step", "source", "success", "aux_kind", "reward_env", "reward_aux", "done")
            if c in df.columns]
    sub = df.select(keep).with_columns([pl.Series(k, v, pl.Float32) for k, v in cols.items()])[rows]
    sub = sub.sort(["traj_id", "step"], maintain_order=True)
    sub = sub.with_columns(pl.when(pl.col("done")).then(0.0).otherwise(pl.col("next_value"))
                           .cast(pl.Float32).alias("next_value"))
    sub = sub.with_columns(process_rewards(sub, "gae", cfg.gamma, cfg.diag_lambda, offs=core.offsets(sub)))
    d = diagnose(sub, cfg.gamma, cfg.expectile, shaping=cfg.shaping, intervals=full)
    if d.get("bellman_q") is not None:
        d["bellman"] = d["bellman_q"] + d["bellman_v"]
    if not full:
        d.pop("calibration", None)
        d.pop("v_by_step", None)
    return d
