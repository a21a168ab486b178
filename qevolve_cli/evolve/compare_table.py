"""The table of `qevolve compare` (docs/compare.md): per-task rewards, paired statistics over seeds and tasks,
each row's training budget and choice on validation, the markdown layout."""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample standard deviation / sqrt(n); 0 for one value)."""
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan")
    m = sum(xs) / n
    if n == 1:
        return m, 0.0
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var / n)


def per_task_rewards(table: str | Path) -> dict[str, float]:
    """{task_id: final reward} of an evaluation table: each trajectory's summed ``reward_env`` (0 for a crashed
    episode, as the evaluation counts it), the best trajectory of each task (Best-of-N keeps the best of its N)."""
    import polars as pl

    df = pl.read_parquet(table)
    failed = pl.col("error").is_not_null().any() if "error" in df.columns else pl.lit(False)
    per = (df.group_by("traj_id").agg(pl.col("task_id").first(), pl.col("reward_env").sum().alias("r"),
                                      failed.alias("failed"))
           .with_columns(pl.when(pl.col("failed")).then(0.0).otherwise(pl.col("r")).alias("r"))
           .group_by("task_id").agg(pl.col("r").max()).sort("task_id"))
    return {t: float(r) for t, r in zip(per["task_id"], per["r"], strict=True)}


def paired_bootstrap(diffs: Sequence[Sequence[float]], n_boot: int = 10000, seed: int = 0,
                     level: float = 0.95) -> dict[str, float]:
    """Two-level paired bootstrap of a mean difference -> ``{"mean", "lo", "hi", "seeds", "tasks"}``.

    ``diffs[s][t]`` = arm A minus arm B on task ``t`` of seed ``s`` (the same tasks for every seed: a
    rectangular S x T array). Each of ``n_boot`` replicates draws S seeds with replacement, then for each
    drawn seed T of its tasks with replacement, and takes the mean of the drawn differences; ``lo`` / ``hi``
    are the replicates' (1 - level) / 2 and (1 + level) / 2 quantiles (percentile interval). Resampling the
    seeds carries the between-seed spread into the interval (on lamps it is larger than the task noise).
    Draw order, for reproduction: ``rng = numpy.random.default_rng(seed)``; seeds ``rng.integers(0, S, (n_boot,
    S))``, then tasks ``rng.integers(0, T, (n_boot, S, T))``."""
    import numpy as np

    if not diffs or len({len(r) for r in diffs}) != 1 or not len(diffs[0]):
        raise ValueError(f"paired_bootstrap: expected seeds x tasks differences (the same tasks for every seed), got "
                         f"rows of lengths {sorted({len(r) for r in diffs})}")
    d = np.asarray(diffs, dtype=np.float64)
    n_s, n_t = d.shape
    rng = np.random.default_rng(seed)
    si = rng.integers(0, n_s, (n_boot, n_s))
    ti = rng.integers(0, n_t, (n_boot, n_s, n_t))
    reps = d[si[:, :, None], ti].mean(axis=(1, 2))
    lo, hi = np.quantile(reps, [(1 - level) / 2, (1 + level) / 2])
    return {"mean": float(d.mean()), "lo": float(lo), "hi": float(hi), "seeds": n_s, "tasks": n_t}


def budget_of(policy: Path, stage: str) -> dict[str, Any] | None:
    """What a trained policy directory was trained with: objective, epochs, lr, data (trajectories, or DPO pairs),
    from its ``config.yaml`` and ``train_summary.json``; None when it has neither."""
    import json

    import yaml

    cfg_p, sum_p = Path(policy) / "config.yaml", Path(policy) / "train_summary.json"
    if not cfg_p.is_file() or not sum_p.is_file():
        return None
    c = yaml.safe_load(cfg_p.read_text()) or {}
    m = json.loads(sum_p.read_text())
    b = {"stage": stage, "objective": c.get("objective"), "epochs": c.get("epochs"), "lr": c.get("lr")}
    if c.get("objective") == "dpo":
        b.update(data=m.get("dpo_pairs"), unit="pairs", dpo_beta=c.get("dpo_beta"),
                 dpo_nll_weight=c.get("dpo_nll_weight", 0.0))
    else:
        b.update(data=m.get("trajectories"), unit="traj")
        if c.get("objective") == "awr":
            b["awr_beta"] = c.get("awr_beta")
    return b


def budget_text(budget: list[dict[str, Any]]) -> str:
    """``BC 12 ep x 2e-03 x 60 traj; it 1 2 ep x 1e-04 x 210 traj`` (a DPO step adds beta and the NLL weight, an
    AWR step its temperature)."""
    parts = []
    for b in budget:
        t = f"{b['stage']} {b['epochs']} ep x {b['lr']:.0e} x {b['data']} {b['unit']}"
        if b.get("unit") == "pairs":
            t += f" (beta {b['dpo_beta']:g}, nll {b['dpo_nll_weight']:g})"
        elif b.get("awr_beta") is not None:
            t += f" (AWR beta {b['awr_beta']:g})"
        parts.append(t)
    return "; ".join(parts) or "–"


def selection_text(row: dict[str, Any]) -> str:
    from qevolve_cli.evolve.select import describe

    sel = row.get("selection")
    if isinstance(sel, list):  # Q-Evolve: one choice per iteration
        return "; ".join(f"it {k} {describe(s)}" for k, s in enumerate(sel, 1)) or "–"
    if sel:
        return describe(sel)
    return row.get("selection_note") or "–"


def rounds_note(table: dict[str, Any]) -> str | None:
    """When Q-Evolve's row had more rounds of self-play than RFT's (two iterations or more): say so and name the
    control, or, with the control in the table, what that row is."""
    arms, k = {r["arm"] for r in table["rows"]}, table.get("qevolve_iteration") or 1
    if k < 2 or not {"rft", "qevolve"} <= arms:
        return None
    if "rft_2" in arms:
        return ("RFT (2 rounds) is RFT again on the RFT policy's own rollouts of the train tasks: the control for "
                "the second round of self-play that Q-Evolve's later iterations get.")
    return (f"Q-Evolve (iteration {k}) trained on {k} rounds of self-play, RFT on one (self-play env steps column). "
            "For the control, add the RFT (2 rounds) row: `qevolve compare --resume --set arms=[..., rft, rft_2, "
            "...]` (docs/compare.md).")


def table_markdown(table: dict[str, Any]) -> str:
    """The paper's layout: rows = methods, columns = env x split (average reward x100), then env steps, the
    training budget of every row and its choice on validation."""
    cols = table["columns"]
    head = ("| method | " + " | ".join(cols) + " | self-play env steps (train) | env steps at eval | "
            "trained on (epochs x lr x data) | chosen on validation (candidates: val x100) |")
    lines = [head, "|" + "---|" * (len(cols) + 5)]
    for r in table["rows"]:
        cells = []
        for c in cols:
            s = r["scores"].get(c)
            cells.append("–" if s is None or s.get("avg_reward") is None else f"{100 * s['avg_reward']:.1f}")
        lines.append(f"| {r['method']} | " + " | ".join(cells) + f" | {r['self_play_steps']} | {r['eval_steps']} | "
                     f"{budget_text(r.get('budget', []))} | {selection_text(r)} |")
    expert = max((r["expert_steps"] for r in table["rows"]), default=0)
    notes = [f"Average final reward x100 (the paper's metric); {table['env']}, seed {table['seed']}, "
             f"expert demonstrations: {expert} env steps (used by every trained arm)."]
    if any(r["arm"] == "zero_shot" for r in table["rows"]):
        notes.append("Zero-shot is the base model before any training (no demonstration, no self-play).")
    if any(r["arm"] == "qevolve_oracle_v" for r in table["rows"]):
        notes.append("Q-Evolve (oracle V) is iteration 1's policy step on the exact optimal values V* from the "
                     "environment's solver instead of the learned critic's: the critic's ceiling, not a deployable "
                     "method.")
    for r in table["rows"]:
        if r["arm"] == "gigpo":
            st = r.get("anchor_groups") or {}
            share = (f": {st['anchored_steps']} of its {st['steps']} self-play steps "
                     f"({100 * st['anchored_share']:.1f} %) share their observation with another step of the task's "
                     "rollouts (anchor groups of >= 2), the only steps with step credit" if st.get("steps") else "")
            notes.append("GiGPO (anchor-state credit) is iteration 1's policy step on GiGPO's critic-free advantages "
                         f"instead of the learned critic's (no critic trained){share}.")
    if note := rounds_note(table):
        notes.append(note)
    if any(r["arm"] == "best_of_n" for r in table["rows"]):
        notes.append(f"Best-of-N keeps, per task, the one of N={table['best_of']} sampled trajectories with the "
                     "highest final environment reward: an oracle upper bound (QLASS's rule), not a deployable "
                     "method.")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"
