"""The critic's fit ladder: how well it fits its *own* training transitions, rung by rung.

The held-out diagnostics (:mod:`qevolve_cli.critic.diagnostics`) say whether the critic generalises; the
ladder says where a critic that does not learn fails first (docs/critic.md, "The fit ladder"):

1. **terminal fit** — at a done step the TD target is the reward alone: mean |Q − r| over the training
   terminals, split into successful and failed endings (a critic that cannot fit these fits nothing);
2. **TD residual** — mean |Q(s, a) − (r + γ(1 − d) V(s'))| over the training steps, and the **expectile
   residual** of V: mean L2^m(Q̄ − V) and the mean gap Q̄ − V;
3. **V along failed episodes** — the correlation of V with the step index inside failed self-play episodes
   (V should fall as the budget runs out; a V that rises reads the transcript's length);
4. on environments with an exact solver (the lamps family): the correlation of V with the **exact tabular
   weighted-IQL fixed point** of the same transitions (the solver's state: room, lamps lit, steps left),
   and the **credit**: the within-trajectory correlation of the critic's GAE advantages with the exact
   ones (GAE over V*), next to the tabular fixed point's own credit (what a perfect critic of this data
   reaches).

A critic that memorises its trajectories passes rungs 1-2 and gives every step the same advantage: rung 4
(credit), not the fit, is what the policy step uses. All figures are weighted by the step weights w_t where
the losses are.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

# what a rung must reach not to be named in the critic's warning
LADDER_THRESHOLDS = {"terminal_mae": 0.1, "credit": 0.1, "tabular_corr": 0.5}


def _wmean(x: np.ndarray, w: np.ndarray) -> float | None:
    return float(np.sum(w * x) / np.sum(w)) if len(x) and np.sum(w) > 0 else None


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


def terminal_fit(q: np.ndarray, reward: np.ndarray, done: np.ndarray, success: np.ndarray) -> dict[str, Any]:
    """Mean |Q − r| over the done steps, all and by the trajectory's outcome."""
    out: dict[str, Any] = {}
    for name, m in (("all", done), ("successful", done & success), ("failed", done & ~success)):
        err = np.abs(q[m] - reward[m])
        out[name] = {"n": int(m.sum()), "mae": _r(err.mean()) if m.any() else None}
    return out


def td_residuals(q: np.ndarray, qbar: np.ndarray, v: np.ndarray, v_next: np.ndarray, reward: np.ndarray,
                 done: np.ndarray, weight: np.ndarray, gamma: float, m: float) -> dict[str, Any]:
    """Weighted mean |Q − y| (y = r + γ(1 − d) V(s')), mean L2^m(Q̄ − V) and mean Q̄ − V."""
    y = reward + gamma * (1.0 - done.astype(np.float64)) * np.where(done, 0.0, v_next)
    gap = qbar - v
    ex = np.where(gap < 0, 1.0 - m, m) * gap ** 2
    return {"td_q_mae": _r(_wmean(np.abs(q - y), weight)), "expectile_v": _r(_wmean(ex, weight), 5),
            "qbar_minus_v": _r(_wmean(gap, weight))}


def failed_trend(traj: np.ndarray, step: np.ndarray, v: np.ndarray, failed_self: np.ndarray) -> dict[str, Any]:
    """corr(V, step) inside failed self-play trajectories, and V's mean per quarter of those episodes."""
    if failed_self.sum() < 3:
        return {"trajectories": int(len(np.unique(traj[failed_self]))), "corr_step": None, "by_quarter": None}
    f = pl.DataFrame({"t": traj[failed_self], "step": step[failed_self].astype(np.float64),
                      "v": v[failed_self].astype(np.float64)})
    c = f.select(pl.corr("v", "step")).item()
    f = f.with_columns((pl.col("step") * 4 // (pl.col("step").max().over("t") + 1)).alias("quarter"))
    g = f.group_by("quarter").agg(pl.col("v").mean()).sort("quarter")
    return {"trajectories": int(f["t"].n_unique()), "corr_step": None if c is None or c != c else round(float(c), 3),
            "by_quarter": [round(float(x), 3) for x in g["v"].to_list()]}


def fit_ladder(df: pl.DataFrame, cols: dict[str, np.ndarray], train_rows: np.ndarray, reward: np.ndarray,
               weight: np.ndarray, cfg: Any, source: Any = None, solver: bool | None = None,
               max_steps: int | None = None) -> dict[str, Any]:
    """The ladder of the module docstring on the rows ``train_rows`` of ``df`` (whole trajectories).

    ``cols``: the critic's value, next_value, q1, q2, q_value over all rows of ``df``; ``reward``: the reward
    the critic fits (r_env [+ r_aux]) and ``weight`` its step weights, per row. ``solver``: compute rung 4
    (default: when every row's environment has an exact solver)."""
    from qevolve_cli.envs.oracle import has_solver

    rows = np.sort(np.asarray(train_rows, np.int64))
    sub = df[rows].with_row_index("_k")
    sub = sub.sort(["traj_id", "step"], maintain_order=True)
    k = rows[sub["_k"].to_numpy()]
    done = sub["done"].to_numpy().astype(bool)
    if "success" in sub.columns:
        success = sub["success"].to_numpy().astype(bool)
    else:
        tot = sub.group_by("traj_id").agg(pl.col("reward_env").sum())
        ok = dict(zip(tot["traj_id"].to_list(), (tot["reward_env"] != 0).to_list(), strict=True))
        success = np.array([ok[t] for t in sub["traj_id"].to_list()], bool)
    v, vn, qbar = (cols[c][k].astype(np.float64) for c in ("value", "next_value", "q_value"))
    q = 0.5 * (cols["q1"][k] + cols["q2"][k]).astype(np.float64) if "q1" in cols else qbar
    r, w = reward[k].astype(np.float64), weight[k].astype(np.float64)
    src = sub["source"].to_numpy() if "source" in sub.columns else np.full(sub.height, "self")
    traj = sub["traj_id"].to_numpy()
    out: dict[str, Any] = {"on": "train", "trajectories": int(sub["traj_id"].n_unique()), "steps": int(sub.height),
                           "terminal": terminal_fit(q, r, done, success),
                           **td_residuals(q, qbar, v, vn, r, done, w, cfg.gamma, cfg.expectile),
                           "failed_v": failed_trend(traj, sub["step"].to_numpy(), v, (src == "self") & ~success)}
    envs = sub["env"].unique().to_list() if "env" in sub.columns else []
    if solver is None:
        solver = bool(envs) and all(has_solver(e) for e in envs)
    if solver:
        out["solver"] = _solver_rungs(sub, v, np.where(done, 0.0, vn), r, w, cfg, source, max_steps)
    return out


def _solver_rungs(sub: pl.DataFrame, v: np.ndarray, vn: np.ndarray, r: np.ndarray, w: np.ndarray, cfg: Any,
                  source: Any, max_steps: int | None) -> dict[str, Any]:
    from qevolve_cli.critic.credit import credit, exact_references, with_values
    from qevolve_cli.errors import QevolveError

    lam = float(getattr(cfg, "diag_lambda", 0.95))
    try:
        ref = exact_references(sub, cfg.gamma, lam, cfg.expectile, r, w if cfg.weighted else None, max_steps, source)
    except QevolveError as e:  # a table that does not replay (another version, another step limit)
        return {"error": str(e).splitlines()[0]}
    a = with_values(sub, v, vn, cfg.gamma, lam)
    tab_corr = np.corrcoef(v, ref["v_tab"])[0, 1] if v.std() > 0 and ref["v_tab"].std() > 0 else None
    mine = credit(sub, a, ref["a_exact"], ref["optimal"], ref["reachable"])
    tab = credit(sub, ref["a_tab"], ref["a_exact"], ref["optimal"], ref["reachable"])
    return {"v_corr_tabular": None if tab_corr is None else round(float(tab_corr), 3),
            "v_mae_tabular": round(float(np.mean(np.abs(v - ref["v_tab"]))), 4),
            "credit": mine["within_traj_corr"], "credit_tabular": tab["within_traj_corr"],
            "auc_optimal_failed": mine["failed"]["auc_optimal"],
            "auc_optimal_failed_tabular": tab["failed"]["auc_optimal"]}


def ladder_problems(ladder: dict[str, Any] | None, thresholds: dict[str, float] | None = None) -> list[str]:
    """The rungs that fail, in ladder order, as short phrases for the critic's warning ([]: none)."""
    if not ladder:
        return []
    th = {**LADDER_THRESHOLDS, **(thresholds or {})}
    bad: list[str] = []
    missed = []  # one problem for the terminals, the failed endings first
    for kind in ("failed", "successful"):
        t = ladder.get("terminal", {}).get(kind, {})
        if t.get("mae") is not None and t["mae"] > th["terminal_mae"]:
            missed.append(f"{t['mae']:.2f} over {t['n']} {kind} endings")
    if missed:
        bad.append("does not fit its own terminal transitions: mean |Q - r| " + " and ".join(missed))
    s = ladder.get("solver") or {}
    if s.get("v_corr_tabular") is not None and s["v_corr_tabular"] < th["tabular_corr"]:
        bad.append(f"V is far from the exact tabular fixed point of its data: corr {s['v_corr_tabular']:+.2f}")
    if "credit" in s and (s["credit"] is None or s["credit"] < th["credit"]):
        c = "none (constant)" if s["credit"] is None else f"{s['credit']:+.2f}"
        ref = f" (the exact tabular critic of the same data: {s['credit_tabular']:+.2f})" \
            if s.get("credit_tabular") is not None else ""
        bad.append(f"no step credit: within-trajectory correlation with the exact advantages {c}{ref}")
    return bad


def ladder_line(ladder: dict[str, Any] | None) -> str:
    """The ladder in one line (``qevolve critic`` and ``qevolve report``)."""
    if not ladder:
        return "fit ladder: n/a"
    t = ladder.get("terminal", {})

    def f(x: Any, fmt: str = "{:.3f}") -> str:
        return "n/a" if x is None else fmt.format(x)

    parts = [f"terminal |Q-r| ok {f(t.get('successful', {}).get('mae'), '{:.2f}')} "
             f"failed {f(t.get('failed', {}).get('mae'), '{:.2f}')}",
             f"TD |Q-y| {f(ladder.get('td_q_mae'))}", f"Qbar-V {f(ladder.get('qbar_minus_v'), '{:+.3f}')}",
             f"V~step on failures {f(ladder.get('failed_v', {}).get('corr_step'), '{:+.2f}')}"]
    s = ladder.get("solver")
    if s and "error" not in s:
        parts.append(f"corr(V, tabular) {f(s.get('v_corr_tabular'), '{:+.2f}')}")
        parts.append(f"credit {f(s.get('credit'), '{:+.2f}')} (tabular {f(s.get('credit_tabular'), '{:+.2f}')})")
    return "fit ladder (train): " + "; ".join(parts)
