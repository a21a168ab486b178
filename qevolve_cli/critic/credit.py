"""Step credit against the exact one, on environments with an exact solver (lamps, lamps-hard, lamps-habit).

Shared by the critic's fit ladder (:mod:`qevolve_cli.critic.ladder`) and ``benchmarks/bench_credit.py``.
The exact advantage of a step is GAE over V* (the solver's optimal value with the steps left,
:func:`qevolve_cli.envs.oracle.oracle_value`); a learned critic's credit is the correlation of its
advantages with those once each trajectory's mean is taken out (the outcome removed).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from qevolve_cli.rewards import process_rewards


def auc(pos: Any, neg: Any) -> float | None:
    """P(a random ``pos`` value > a random ``neg`` one), ties counted half."""
    p, n = np.asarray(pos, float), np.asarray(neg, float)
    if not len(p) or not len(n):
        return None
    return float((p[:, None] > n[None, :]).mean() + 0.5 * (p[:, None] == n[None, :]).mean())


def with_values(df: pl.DataFrame, v: Any, nv: Any, gamma: float, lam: float) -> pl.Series:
    """GAE (r_env only) of ``df``'s steps with V(s) = ``v`` and V(s') = ``nv`` (row-aligned)."""
    d = df.with_columns(pl.Series("value", np.asarray(v, np.float32), pl.Float32),
                        pl.Series("next_value", np.asarray(nv, np.float32), pl.Float32))
    return process_rewards(d, "gae", gamma, lam)


def within_traj_corr(traj_id: Any, a: Any, b: Any) -> float | None:
    """Correlation of ``a`` and ``b`` after each trajectory's mean is subtracted from each (None: constant)."""
    m = pl.DataFrame({"t": traj_id, "a": np.asarray(a, float), "b": np.asarray(b, float)})
    m = m.with_columns((pl.col("a") - pl.col("a").mean().over("t")).alias("aw"),
                       (pl.col("b") - pl.col("b").mean().over("t")).alias("bw"))
    c = m.select(pl.corr("aw", "bw")).item()
    return None if c is None or c != c else float(c)


def credit(df: pl.DataFrame, a: pl.Series, a_exact: pl.Series, opt: pl.Series, reachable: pl.Series) -> dict:
    """Credit measures of advantages ``a`` against ``a_exact`` (row-aligned with ``df``).

    ``opt``: the step's command is optimal (its exact one-step TD error r + gamma V*(s') - V*(s) is 0);
    ``reachable``: the goal can still be reached from the state (V*(s) > 0). Where it cannot, every command is
    optimal and none matters, so the AUCs count reachable steps only."""
    m = df.select("traj_id", "step", "source", "success").with_columns(
        a.alias("a"), a_exact.alias("a_x"), opt.alias("opt"), reachable.alias("reach"))
    c = within_traj_corr(m["traj_id"], m["a"], m["a_x"])
    out: dict = {"within_traj_corr": None if c is None else round(c, 3)}
    self_play = m.filter(pl.col("source") == "self")
    for name, part in (("failed", self_play.filter(~pl.col("success"))),
                       ("successful", self_play.filter(pl.col("success")))):
        r = part.filter(pl.col("reach"))
        au = auc(r.filter(pl.col("opt"))["a"], r.filter(~pl.col("opt"))["a"])
        cs = part.select(pl.corr("a", "step")).item() if part.height > 2 else None
        out[name] = {"trajectories": part["traj_id"].n_unique(), "steps": part.height,
                     "reachable_steps": r.height,
                     "optimal_share_of_reachable": round(float(r["opt"].mean()), 3) if r.height else None,
                     "auc_optimal": None if au is None else round(au, 3),
                     "corr_step": None if cs is None or cs != cs else round(float(cs), 3),
                     "mean_advantage": round(float(part["a"].mean()), 4) if part.height else None}
    return out


def exact_references(df: pl.DataFrame, gamma: float, lam: float, expectile: float, fit_reward: np.ndarray,
                     weight: np.ndarray | None, max_steps: int | None = None, source: Any = None) -> dict[str, Any]:
    """From a replay of ``df`` (step-sorted; trajectories whole): V*, the exact advantages, which steps are
    optimal and reachable, and the exact tabular weighted-IQL fixed point on the solver's state (room, lamps
    lit, steps left) of the table's own transitions with rewards ``fit_reward`` and weights ``weight``."""
    from qevolve_cli.envs.oracle import oracle_value, replay
    from qevolve_cli.tabular import tabular_iql

    recs = replay(df, source=source, max_steps=max_steps)
    done = df["done"].to_list()
    v_x = [oracle_value(r["d"], r["left"], gamma) for r in recs]
    nv_x = [0.0 if dn else oracle_value(r["next_d"], r["next_left"], gamma) for r, dn in zip(recs, done, strict=True)]
    a_x = with_values(df, v_x, nv_x, gamma, lam)
    opt = with_values(df, v_x, nv_x, gamma, 0.0) > -1e-6
    tr = [(rec["state"], rec["command"], float(ri), rec["next_state"], bool(dn))
          for rec, ri, dn in zip(recs, fit_reward, done, strict=True)]
    V, _ = tabular_iql(tr, gamma, expectile, weights=None if weight is None else [float(x) for x in weight], tol=1e-9)
    v_tab = np.array([V.get(rec["state"], 0.0) for rec in recs], np.float64)
    nv_tab = np.array([0.0 if dn else V.get(rec["next_state"], 0.0) for rec, dn in zip(recs, done, strict=True)])
    return {"v_exact": np.asarray(v_x), "a_exact": a_x, "optimal": opt, "reachable": pl.Series([x > 0 for x in v_x]),
            "v_tab": v_tab, "nv_tab": nv_tab, "a_tab": with_values(df, v_tab, nv_tab, gamma, lam)}
