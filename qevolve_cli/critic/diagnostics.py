"""Did the critic learn? Held-out diagnostics of a weighted IQL critic.

Pure functions over numpy arrays / a scored Polars frame, used by ``qevolve critic``
(after every epoch, on trajectories held out by ``traj_id``), ``qevolve inspect``
(tables with ``value``/``advantage``), ``qevolve report`` and ``qevolve evolve``.

Metrics (docs/critic.md, "Diagnostics"):

* ``bellman_q``   mean over steps of 1/2 [(Q1 - y)^2 + (Q2 - y)^2], y = r + gamma (1 - d) V(s')
  (the critic's own TD regression, unweighted, on data it did not train on);
* ``bellman_v``   mean over steps of L2^m(min(Qbar1, Qbar2) - V(s)) (its expectile regression);
* ``td_v``        mean over steps of (r + gamma (1 - d) V(s') - V(s))^2;
* ``ev_return``   explained variance of V(s_t) against the discounted Monte-Carlo return
  G_t = sum_k gamma^k r_{t+k} of the same (shaped) reward the critic is trained on:
  1 - Var(G - V) / Var(G) (1 = perfect, 0 = no better than a constant, < 0 worse);
* ``auc_v``       AUC of V(s_t) over all steps for "the trajectory succeeds", ``auc_v0`` the same
  for V(s_0) only (0.5 = chance);
* ``v_std``       standard deviation of V(s_t) over the steps (a flat critic has ~0);
* ``advantage``   mean advantage by source x success x aux_kind, and ``failed_self_pos_adv``:
  the share of steps of failed self trajectories with A > 0;
* ``n_success``, ``n_failed``  trajectories of each outcome, and ``auc_v_ci``, ``ev_return_ci``:
  95 % intervals of ``auc_v`` and ``ev_return`` from resampling whole trajectories (within each
  outcome), so a reader sees how much a held-out slice of a few trajectories can say.

:func:`verdict` turns them into the problems that make ``qevolve critic`` warn (thresholds in
:data:`THRESHOLDS`); the outcome-dependent ones (explained variance, AUC, failed steps with A > 0) are
only judged when the slice holds ``min_per_outcome`` trajectories of each outcome, and :func:`caveats`
says so when it does not.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np

# A critic that has learned something should clear all of these on held-out trajectories
# (docs/critic.md "Diagnostics"). They are deliberately loose: failing one is a clear sign.
THRESHOLDS = {
    "ev_return": 0.10,  # explained variance of V against the discounted return: at least
    "auc_v": 0.60,  # AUC of V(s_t) for success: at least (when both outcomes are held out)
    "v_std": 1e-2,  # spread of V over held-out steps: at least
    "failed_self_pos_adv": 0.50,  # share of failed self steps with A > 0: below
    # The three outcome-dependent checks (explained variance, AUC, failed steps with A > 0) need this many
    # trajectories of each outcome in the slice: with 2 failures held out, one trajectory decides them and a
    # resampling interval has only 3 distinct draws of the failures (docs/critic.md "Too few held-out
    # trajectories").
    "min_per_outcome": 3,
}
BOOTSTRAP_REPLICATES = 1000


# ---------------------------------------------------------------- pure metrics

def _masked(x: Any, mask: Any) -> np.ndarray:
    x = np.asarray(x, np.float64).reshape(-1)
    if mask is None:
        return x
    return x[np.asarray(mask, bool).reshape(-1)]


def explained_variance(pred: Any, target: Any, mask: Any = None) -> float | None:
    """1 - Var(target - pred) / Var(target) over the (masked) entries; None if Var(target) = 0 or < 2 entries.

    pred, target: arrays of the same shape; mask: bool array of that shape (True = counted).
    """
    p, y = _masked(pred, mask), _masked(target, mask)
    if y.size < 2:
        return None
    var_y = float(np.var(y))
    if var_y <= 1e-12:
        return None
    return float(1.0 - np.var(y - p) / var_y)


def auc(scores: Any, labels: Any, mask: Any = None) -> float | None:
    """Area under the ROC curve: P(score of a random positive > score of a random negative), ties 1/2.

    Computed from average ranks (Mann-Whitney U). None when one class is empty.
    """
    s = _masked(scores, mask)
    y = _masked(labels, mask).astype(bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    _, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - counts + (counts + 1) / 2.0)[inv]  # average 1-based ranks over ties
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def discounted_returns(reward: Any, offsets: Any, gamma: float) -> np.ndarray:
    """G_t = r_t + gamma G_{t+1} within each trajectory (G after its last step = 0).

    reward: (N,) per-step rewards r_{t+1} of contiguous trajectories; offsets: (n_traj + 1,)
    row offsets (trajectory i = rows offsets[i]:offsets[i+1]).
    """
    r = np.asarray(reward, np.float64)
    off = np.asarray(offsets, np.int64)
    g = np.zeros_like(r)
    for a, b in zip(off[:-1], off[1:], strict=True):
        acc = 0.0
        for t in range(b - 1, a - 1, -1):
            acc = r[t] + gamma * acc
            g[t] = acc
    return g


def trajectory_bootstrap_ci(stat: Any, offsets: Any, success: Any, n_boot: int = BOOTSTRAP_REPLICATES,
                            level: float = 0.95, seed: int = 0,
                            min_per_outcome: int = THRESHOLDS["min_per_outcome"]) -> list[float] | None:
    """Percentile interval of ``stat(rows)`` over replicates that resample whole trajectories with replacement,
    within each outcome (so every replicate keeps the slice's numbers of successes and failures).

    ``stat``: a function of an int array of row indices returning a float or None (replicates giving None are
    dropped); ``offsets``: (n_traj + 1,) row offsets; ``success``: (n_traj,) bool. Deterministic for a given
    ``seed``. Large tables get fewer replicates (at least 100), and none over 200 k steps, so that
    ``qevolve inspect`` stays quick. None when an outcome has fewer than ``min_per_outcome`` trajectories
    (2 trajectories have 3 distinct resamples: no interval to speak of) or fewer than half of the
    replicates give a value.
    """
    off = np.asarray(offsets, np.int64)
    ok = np.asarray(success, bool)
    if min(int(ok.sum()), int((~ok).sum())) < max(1, int(min_per_outcome)):
        return None
    starts, lens = off[:-1], np.diff(off)
    budget = 20_000_000 // max(1, int(off[-1]))  # rows drawn in all: a few seconds
    if budget < min(n_boot, 100):  # over 200 k steps (qevolve inspect of a whole buffer): narrow, and slow
        return None
    n_boot = int(min(n_boot, budget))
    strata = [np.flatnonzero(ok), np.flatnonzero(~ok)]
    rng = np.random.default_rng(seed)
    vals = []
    for _ in range(n_boot):
        pick = np.concatenate([rng.choice(s, size=len(s), replace=True) for s in strata])
        ln = lens[pick]
        first_out = np.cumsum(ln) - ln  # where each picked trajectory starts in the replicate
        rows = np.arange(int(ln.sum())) + np.repeat(starts[pick] - first_out, ln)
        x = stat(rows)
        if x is not None and np.isfinite(x):
            vals.append(x)
    if len(vals) < n_boot / 2:
        return None
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(np.asarray(vals), [a, 1.0 - a])
    return [float(lo), float(hi)]


def expectile_loss(diff: Any, m: float) -> np.ndarray:
    """L2^m(x) = |m - 1(x < 0)| x^2, elementwise."""
    x = np.asarray(diff, np.float64)
    return np.abs(m - (x < 0).astype(np.float64)) * x * x


def bellman_errors(q1: Any, q2: Any, qbar: Any, v: Any, v_next: Any, reward: Any, done: Any,
                   gamma: float, expectile: float, mask: Any = None) -> dict[str, float | None]:
    """Held-out Bellman errors; all inputs of one shape (steps), ``mask`` True = counted.

    ``bellman_q`` = mean 1/2[(Q1 - y)^2 + (Q2 - y)^2] with y = r + gamma (1 - d) V(s');
    ``bellman_v`` = mean L2^m(Qbar - V); ``td_v`` = mean (y - V)^2. Unweighted means.
    """
    y = _masked(reward, mask) + gamma * (1.0 - _masked(done, mask)) * _masked(v_next, mask)
    if y.size == 0:
        return {"bellman_q": None, "bellman_v": None, "td_v": None}
    a, b, vv = _masked(q1, mask), _masked(q2, mask), _masked(v, mask)
    out: dict[str, float | None] = {
        "bellman_q": float(np.mean(0.5 * ((a - y) ** 2 + (b - y) ** 2))),
        "bellman_v": float(np.mean(expectile_loss(_masked(qbar, mask) - vv, expectile))),
        "td_v": float(np.mean((y - vv) ** 2)),
    }
    return out


def heldout_mask(traj_ids: list[str], success: list[bool], fraction: float, salt: str = "qevolve-heldout") -> np.ndarray:
    """Deterministic held-out choice of trajectories, stratified by outcome: bool per trajectory.

    Within each outcome (success / failure) the trajectories are ordered by sha1(salt + traj_id)
    and the first round(fraction * n) are held out (at least one when the stratum has >= 4
    trajectories, at most n - 1), so the same trajectory ids are held out whatever the order of
    the table or the other data, and both outcomes appear on each side when possible.
    """
    ids = list(traj_ids)
    out = np.zeros(len(ids), bool)
    if fraction <= 0 or not ids:
        return out
    succ = np.asarray(success, bool)
    for flag in (True, False):
        idx = np.flatnonzero(succ == flag)
        n = len(idx)
        if n == 0:
            continue
        k = int(math.floor(fraction * n + 0.5))
        if k == 0 and n >= 4:
            k = 1
        k = min(k, n - 1)
        if k <= 0:
            continue
        keyed = sorted(idx, key=lambda i: hashlib.sha1((salt + ids[i]).encode()).hexdigest())
        out[keyed[:k]] = True
    return out


# ---------------------------------------------------------------- on a scored frame

def _offsets(traj: np.ndarray) -> np.ndarray:
    change = np.flatnonzero(traj[1:] != traj[:-1]) + 1
    return np.concatenate([[0], change, [len(traj)]]).astype(np.int64)


def diagnose(df: Any, gamma: float = 0.95, expectile: float = 0.7, shaping: bool = True,
             intervals: bool = True) -> dict[str, Any]:
    """Every metric of the module docstring that the frame's columns allow.

    ``df``: a Polars frame, one row per step, trajectories contiguous in step order (as written by
    ``qevolve label``), with traj_id, step, reward_env, done, value and, when present, reward_aux,
    success, source, aux_kind, next_value, q1/q2/q_value (Bellman errors), advantage.
    ``shaping``: the return and the Bellman target use r_env + r_aux (as the critic does). ``intervals``: the
    bootstrap intervals ``auc_v_ci`` / ``ev_return_ci`` (None without; the per-epoch metrics skip them).
    """
    import polars as pl

    need = [c for c in ("traj_id", "step", "reward_env", "done", "value") if c not in df.columns]
    if need:
        return {}
    df = df.sort(["traj_id", "step"], maintain_order=True)
    traj = df["traj_id"].to_numpy()
    off = _offsets(traj) if df.height else np.zeros(1, np.int64)
    r = df["reward_env"].to_numpy().astype(np.float64)
    if shaping and "reward_aux" in df.columns:
        r = r + df["reward_aux"].to_numpy().astype(np.float64)
    done = df["done"].to_numpy().astype(np.float64)
    v = df["value"].to_numpy().astype(np.float64)
    if "success" in df.columns:
        success = df["success"].to_numpy().astype(bool)
    else:
        tot = np.add.reduceat(df["reward_env"].to_numpy().astype(np.float64), off[:-1]) if df.height else np.zeros(0)
        success = np.repeat(tot != 0, np.diff(off))
    first = np.zeros(df.height, bool)
    first[off[:-1]] = True
    g = discounted_returns(r, off, gamma)
    traj_ok = success[first]
    out: dict[str, Any] = {
        "trajectories": int(len(off) - 1), "steps": int(df.height),
        "success_rate": float(traj_ok.mean()) if df.height else None,
        "n_success": int(traj_ok.sum()), "n_failed": int((~traj_ok).sum()),
        "ev_return": explained_variance(v, g),
        "ev_return_ci": trajectory_bootstrap_ci(lambda i: explained_variance(v[i], g[i]), off, traj_ok)
        if intervals else None,
        "auc_v": auc(v, success), "auc_v0": auc(v[first], success[first]),
        "auc_v_ci": trajectory_bootstrap_ci(lambda i: auc(v[i], success[i]), off, traj_ok) if intervals else None,
        "v_mean": float(v.mean()) if df.height else None, "v_std": float(v.std()) if df.height else None,
        "v0_success": float(v[first & success].mean()) if (first & success).any() else None,
        "v0_failed": float(v[first & ~success].mean()) if (first & ~success).any() else None,
        "return_mean": float(g.mean()) if df.height else None,
    }
    if "next_value" in df.columns:
        vn = np.where(done > 0, 0.0, df["next_value"].to_numpy().astype(np.float64))
        if {"q1", "q2", "q_value"} <= set(df.columns):
            q1, q2, qbar = (df[c].to_numpy().astype(np.float64) for c in ("q1", "q2", "q_value"))
        elif "q_value" in df.columns:
            q1 = q2 = qbar = df["q_value"].to_numpy().astype(np.float64)
        else:
            q1 = q2 = qbar = None
        if q1 is not None:
            out.update(bellman_errors(q1, q2, qbar, v, vn, r, done, gamma, expectile))
        else:
            y = r + gamma * (1 - done) * vn
            out["td_v"] = float(np.mean((y - v) ** 2)) if df.height else None
    if "advantage" in df.columns:
        out.update(advantage_breakdown(df))
    out["calibration"] = calibration(v, g)
    if "step" in df.columns:
        out["v_by_step"] = v_by_step(df.with_columns(pl.Series("_success", success)), v)
    return out


def advantage_breakdown(df: Any) -> dict[str, Any]:
    """Mean advantage by source x success x aux_kind, and the share of failed self steps with A > 0."""
    import polars as pl

    keys = [c for c in ("source", "success", "aux_kind") if c in df.columns]
    out: dict[str, Any] = {"adv_mean": float(df["advantage"].mean()) if df.height else None}
    if keys:
        g = (df.group_by(keys).agg(pl.col("advantage").mean().alias("mean"), pl.len().alias("steps"),
                                   (pl.col("advantage") > 0).mean().alias("pos_share"))
             .sort(keys))
        out["adv_by_group"] = [
            {**{k: (bool(row[k]) if k == "success" else row[k]) for k in keys},
             "mean": float(row["mean"]), "steps": int(row["steps"]), "pos_share": float(row["pos_share"])}
            for row in g.to_dicts()
        ]
    if {"source", "success"} <= set(df.columns):
        f = df.filter((pl.col("source") == "self") & ~pl.col("success"))
        s = df.filter((pl.col("source") == "self") & pl.col("success"))
        out["failed_self_pos_adv"] = float((f["advantage"] > 0).mean()) if f.height else None
        out["success_self_pos_adv"] = float((s["advantage"] > 0).mean()) if s.height else None
        out["failed_self_steps"] = int(f.height)
    return out


def calibration(v: np.ndarray, g: np.ndarray, bins: int = 10) -> list[dict[str, float]]:
    """Mean return per decile of V (for the report's calibration plot): [{v, ret, n}]."""
    if len(v) < 2:
        return []
    qs = np.unique(np.quantile(v, np.linspace(0, 1, bins + 1)))
    if len(qs) < 2:
        return [{"v": float(v.mean()), "ret": float(g.mean()), "n": int(len(v))}]
    idx = np.clip(np.searchsorted(qs, v, side="right") - 1, 0, len(qs) - 2)
    out = []
    for b in range(len(qs) - 1):
        m = idx == b
        if m.any():
            out.append({"v": float(v[m].mean()), "ret": float(g[m].mean()), "n": int(m.sum())})
    return out


def v_by_step(df: Any, v: np.ndarray, max_steps: int = 64) -> dict[str, list[float | None]]:
    """Mean V(s_t) per step index t for successful and failed trajectories (report plot)."""
    steps = df["step"].to_numpy()
    succ = df["_success"].to_numpy().astype(bool)
    n = int(min(steps.max() + 1 if len(steps) else 0, max_steps))
    out: dict[str, list[float | None]] = {"success": [], "failed": []}
    for t in range(n):
        at = steps == t
        for name, m in (("success", at & succ), ("failed", at & ~succ)):
            out[name].append(float(v[m].mean()) if m.any() else None)
    return out


# ---------------------------------------------------------------- verdict

def too_few(d: dict[str, Any], thresholds: dict[str, float] | None = None) -> bool:
    """True when the diagnostics name their outcome counts and one outcome has fewer than ``min_per_outcome``
    trajectories (diagnostics written before the counts existed are judged as they were)."""
    th = {**THRESHOLDS, **(thresholds or {})}
    ns, nf = d.get("n_success"), d.get("n_failed")
    return ns is not None and nf is not None and min(ns, nf) < th["min_per_outcome"]


def _below(x: float, thr: float) -> str:
    """``x`` with 2 decimals, or as many more as it takes to read below ``thr`` (0.0996 < 0.10, not 0.10 < 0.10)."""
    for nd in (2, 3, 4, 5, 6):
        if float(txt := f"{x:.{nd}f}") < thr:
            return txt
    return repr(x)


def verdict(d: dict[str, Any], thresholds: dict[str, float] | None = None) -> list[str]:
    """The reasons (short phrases) why the diagnostics say the critic has not learned; [] = fine (or not
    judged: see :func:`caveats`)."""
    from qevolve_cli.critic.ladder import ladder_problems

    return ladder_problems(d.get("fit_ladder")) + heldout_verdict(d, thresholds)


def heldout_verdict(d: dict[str, Any], thresholds: dict[str, float] | None = None) -> list[str]:
    """The reasons of :func:`verdict` that come from the held-out figures alone (the fit ladder's apart)."""
    th = {**THRESHOLDS, **(thresholds or {})}
    judge_outcomes = not too_few(d, th)
    bad: list[str] = []
    ev = d.get("ev_return")
    if judge_outcomes and ev is not None and ev < th["ev_return"]:
        bad.append(f"explained variance of V {_below(ev, th['ev_return'])} < {th['ev_return']:.2f}")
    a = d.get("auc_v")
    if judge_outcomes and a is not None and a < th["auc_v"]:
        bad.append(f"AUC of V for success {_below(a, th['auc_v'])} < {th['auc_v']:.2f}")
    sd = d.get("v_std")
    if sd is not None and sd < th["v_std"]:
        bad.append(f"V is flat (sd {sd:.4f})")
    fp = d.get("failed_self_pos_adv")
    if judge_outcomes and fp is not None and fp >= th["failed_self_pos_adv"]:
        bad.append(f"{100 * fp:.0f}% of failed self steps get A > 0")
    return bad


def _scarcer_outcome(d: dict[str, Any]) -> tuple[int, str]:
    """(count, "failed" | "successful") of the outcome with fewer trajectories (failed on a tie)."""
    ns, nf = int(d["n_success"]), int(d["n_failed"])
    return (nf, "failed") if nf <= ns else (ns, "successful")


def caveats(d: dict[str, Any], thresholds: dict[str, float] | None = None) -> list[str]:
    """What the diagnostics could not judge, as short phrases: [] when every check was made."""
    th = {**THRESHOLDS, **(thresholds or {})}
    if not too_few(d, th):
        return []
    n, kind = _scarcer_outcome(d)
    auc_txt = f"; AUC of V {d['auc_v']:.2f}" if d.get("auc_v") is not None else ""
    return [f"only {n} {kind} of {int(d['n_success']) + int(d['n_failed'])} trajectories (fewer than {th['min_per_outcome']:.0f} of an outcome{auc_txt}): "
            "explained variance, AUC and failed-step advantages not judged"]


def verdict_word(d: dict[str, Any]) -> str:
    """The verdict alone, for a narrow column: "not learned" (the reasons: :func:`verdict_text`), "not judged
    (N failed held out)" or "learned"."""
    bad = d.get("problems")
    if bad is None:
        bad = verdict(d)
    return "not learned" if bad else verdict_text(d)


def verdict_text(d: dict[str, Any]) -> str:
    """The verdict in a few words, for tables: the problems, what could not be judged, or "learned"."""
    bad = d.get("problems")
    if bad is None:
        bad = verdict(d)
    if bad:
        return "; ".join(bad)
    if too_few(d):
        n, kind = _scarcer_outcome(d)
        return f"not judged ({n} {kind} held out)"
    return "learned"


def warning_line(d: dict[str, Any], where: str = "held-out", thresholds: dict[str, float] | None = None,
                 extra: list[str] | None = None) -> str | None:
    """One line for stderr when the critic has not learned, or when the slice was too small to tell (None
    when it looks fine). ``extra``: the failing rungs of the fit ladder on the training data
    (:func:`qevolve_cli.critic.ladder.ladder_problems`), named first: a critic that does not fit its own
    data is not to be tuned on its held-out figures."""
    from qevolve_cli.critic.ladder import ladder_problems

    bad, notes = heldout_verdict(d, thresholds), caveats(d, thresholds)
    extra = ladder_problems(d.get("fit_ladder")) if extra is None else extra
    if extra:
        held = f"; {where}: {'; '.join(bad)}" if bad else ""
        return (f"warning: the critic has not learned (training data: {'; '.join(extra)}{held}): train longer "
                "(--epochs) or raise --lr, or change what it reads (--set kind=features, context_turns, time_input); "
                "see docs/critic.md#the-fit-ladder")
    if bad:
        also = f"; {notes[0]}" if notes else ""
        return (f"warning: the critic has not learned ({where}: {'; '.join(bad)}{also}): train longer (--epochs, "
                "with --set early_stop_patience=... to stop at convergence) or raise --lr; see "
                "docs/critic.md#diagnostics")
    if notes:
        return (f"note: cannot tell whether the critic learned ({where}: {notes[0]}): hold out more trajectories "
                "(the critic's heldout_fraction) or collect more rollouts; see docs/critic.md#diagnostics")
    return None


def summary_line(d: dict[str, Any]) -> str:
    """Compact text of the main numbers (for progress lines and the report)."""
    def f(k: str, fmt: str = "{:.3f}") -> str:
        x = d.get(k)
        return "n/a" if x is None else fmt.format(x)

    ci = d.get("auc_v_ci")
    auc_ci = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
    counts = (f" ({d['n_success']} successful / {d['n_failed']} failed)"
              if d.get("n_success") is not None and d.get("n_failed") is not None else "")
    return (f"bellman_q {f('bellman_q', '{:.4f}')} ev {f('ev_return', '{:.2f}')} auc {f('auc_v', '{:.2f}')}{auc_ci} "
            f"auc0 {f('auc_v0', '{:.2f}')} v_sd {f('v_std', '{:.3f}')}{counts}")
