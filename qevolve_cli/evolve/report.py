"""`qevolve report RUN_DIR`: scores per split and iteration, environment steps, learning-curve plots, the
choices made on validation, and the wall time of the stages (and which are not finished).

Reads only the run directory (manifest, metrics, tables); writes
``RUN/report/report.json``, ``scores.md`` and PNG plots (``scores.png``,
``critic_losses.png``, ``advantages.png``, ``critic_diagnostics.png``: per iteration the
held-out critic curves, V along the steps of successful vs failed trajectories and the
calibration of V against the return).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qevolve_cli.atomic import atomic_path, write_json, write_text
from qevolve_cli.critic.diagnostics import verdict_text, verdict_word
from qevolve_cli.errors import QevolveError


def _save(fig, out: Path) -> None:
    """Write a matplotlib figure as PNG atomically and free it."""
    import matplotlib.pyplot as plt

    with atomic_path(out, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def _manifest(run: Path) -> dict[str, Any]:
    p = run / "manifest.json"
    if not run.is_dir():
        raise QevolveError(f"{run}: no such run directory")
    if not p.exists():
        raise QevolveError(f"{p}: no manifest (not a qevolve evolve run directory)")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise QevolveError(f"{p}: corrupt manifest ({e})") from None


def score_rows(run: Path) -> tuple[list[dict[str, Any]], list[str]]:
    stages = _manifest(run).get("stages", {})
    iters = sorted({int(st.get("iteration", 0)) for st in stages.values()})
    splits: list[str] = []
    rows = []
    cum = 0
    for k in iters:
        row: dict[str, Any] = {"iteration": k, "name": "BC" if k == 0 else f"iter {k}"}
        ro = stages.get(f"iter_{k}/rollout", {})
        steps = int(ro.get("metrics", {}).get("env_steps", 0)) if ro.get("status") == "done" else 0
        cum += steps
        row["env_steps"], row["cumulative_env_steps"] = steps, cum
        for name, st in sorted(stages.items()):
            if name.startswith(f"iter_{k}/eval_") and st.get("status") == "done":
                split = name.split("eval_", 1)[1]
                m = st.get("metrics", {})
                row[split] = {"avg_reward": m.get("avg_reward"), "success_rate": m.get("success_rate"), "n": m.get("n")}
                if split not in splits:
                    splits.append(split)
        rows.append(row)
    rows = [r for r in rows if any(s in r for s in splits) or r["env_steps"]]
    return rows, splits


def _count_text(ns: list[Any], what: str) -> str:
    """``"36 tasks"``, or ``"36-40 tasks"`` when the iterations differ, or ``""`` when no count is recorded."""
    ns = sorted({int(n) for n in ns if n is not None})
    if not ns:
        return ""
    return f"{ns[0]} {what}" if len(ns) == 1 else f"{ns[0]}-{ns[-1]} {what}"


def _integer_axis(axis) -> None:
    """Ticks at whole numbers only (iterations, epochs, steps: no 0.25 or 2.5 on a count axis)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def scores_figure(run: Path, rows, splits):
    """``scores.png``: one panel per evaluation split, titled with the split and its number of tasks, with the
    average reward and the success rate (%) per iteration; the x ticks are the iterations (0 = BC)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(splits), figsize=(5 * len(splits), 4), squeeze=False, sharey=True)
    iters = [r["iteration"] for r in rows]
    for ax, s in zip(axes[0], splits, strict=True):
        have = [r for r in rows if s in r]
        xs = [r["iteration"] for r in have]
        ax.plot(xs, [100 * (r[s]["avg_reward"] or 0) for r in have], marker="o", label="average reward")
        ax.plot(xs, [100 * (r[s]["success_rate"] or 0) for r in have], marker="s", label="success rate")
        n = _count_text([r[s].get("n") for r in have], "tasks")
        ax.set_title(f"{s}" + (f" ({n})" if n else ""))
        ax.set_xticks(iters, [("0 (BC)" if k == 0 else str(k)) for k in iters])
        ax.set_xlim(min(iters) - 0.3, max(iters) + 0.3)
        ax.set_xlabel("iteration (0 = BC)")
        ax.grid(alpha=0.3)
        _legend(ax, "no evaluations", fontsize=9)
    axes[0][0].set_ylabel("% of the split's tasks (reward: average final reward)")
    fig.suptitle(f"{run.name}: held-out evaluation per iteration")
    fig.tight_layout()
    return fig


def _plot_scores(run: Path, rows, splits, out: Path) -> None:
    _save(scores_figure(run, rows, splits), out)


DIAG_KEYS = ("bellman_q", "bellman_v", "ev_return", "auc_v", "auc_v0", "v_std", "failed_self_pos_adv")


def critic_diagnostics(run: Path) -> dict[int, dict[str, Any]]:
    """Per iteration: the final held-out diagnostics of its critic (``iter_k/critic/diagnostics.json``)."""
    out: dict[int, dict[str, Any]] = {}
    for p in sorted(run.glob("iter_*/critic/diagnostics.json")):
        try:
            k = int(p.parent.parent.name.split("_")[1])
            out[k] = json.loads(p.read_text())
        except (ValueError, json.JSONDecodeError):
            continue
    return out


def _heldout_curves(run: Path) -> dict[int, dict[str, list[float | None]]]:
    curves: dict[int, dict[str, list[float | None]]] = {}
    for mp in sorted(run.glob("iter_*/critic/metrics.jsonl")):
        k = int(mp.parent.parent.name.split("_")[1])
        c: dict[str, list[float | None]] = {}
        for line in mp.read_text().splitlines():
            try:
                h = json.loads(line).get("heldout") or {}
            except json.JSONDecodeError:
                continue
            for key in DIAG_KEYS:
                c.setdefault(key, []).append(h.get(key))
        if c and any(v is not None for vs in c.values() for v in vs):
            curves[k] = c
    return curves


def _legend(ax, empty: str, fontsize: int = 7) -> None:
    """The axes' legend, or ``empty`` written across them when nothing was drawn (matplotlib warns on an empty
    legend: a run without held-out trajectories is no reason to print a library warning)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=fontsize)
    else:
        ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center", fontsize=8, color="grey")


def _critic_data_text(d: dict[str, Any]) -> str:
    """What the critic's diagnostics were computed on and how many trajectories: ``"24 held-out trajectories
    (train split; 8 succeeded, 16 failed)"``, or the training data when nothing was held out."""
    n, ns, nf = d.get("trajectories"), d.get("n_success"), d.get("n_failed")
    held = d.get("on", "heldout") == "heldout"
    text = ("" if n is None else f"{n} ") + ("held-out" if held else "training") + " trajectories"
    detail = ("train split" if held else "train split, nothing held out") + (
        f"; {ns} succeeded, {nf} failed" if ns is not None and nf is not None else "")
    return f"{text} ({detail})"


def diagnostics_figure(diags: dict[int, dict[str, Any]], curves):
    """``critic_diagnostics.png``, one row per iteration: the held-out curves per epoch, V along the steps
    (successful vs failed trajectories) and V against the discounted return per V decile; every title names
    the data (held-out trajectories of the train split) and their number; epochs and steps get integer ticks.
    None when no iteration has diagnostics."""
    if not diags:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted(diags)
    fig, axes = plt.subplots(len(ks), 3, figsize=(16, 4.0 * len(ks)), squeeze=False)
    for row, k in zip(axes, ks, strict=True):
        d, c = diags[k], curves.get(k, {})
        data = _critic_data_text(d)
        ax = row[0]
        for key in ("ev_return", "auc_v", "bellman_q"):
            ys = c.get(key, [])
            if any(y is not None for y in ys):
                ax.plot(range(1, len(ys) + 1), [float("nan") if y is None else y for y in ys], marker=".", label=key)
        ax.set_title(f"iteration {k}: critic per epoch\non {data}", fontsize=9)
        ax.set_xlabel("epoch")
        _integer_axis(ax.xaxis)
        ax.grid(alpha=0.3)
        _legend(ax, "no held-out trajectories")
        ax = row[1]
        for name, count in (("success", d.get("n_success")), ("failed", d.get("n_failed"))):
            ys = (d.get("v_by_step") or {}).get(name, [])
            label = f"{name} trajectories" + (f" ({count})" if count is not None else "")
            ax.plot(range(len(ys)), [float("nan") if y is None else y for y in ys], marker=".", label=label)
        ax.set_title(f"iteration {k}: mean V(s_t) at step t\non {data}", fontsize=9)
        ax.set_xlabel("step t")
        _integer_axis(ax.xaxis)
        ax.grid(alpha=0.3)
        _legend(ax, "no trajectories")
        ax = row[2]
        cal = d.get("calibration") or []
        if cal:
            vs, rets = [b["v"] for b in cal], [b["ret"] for b in cal]
            ax.plot(rets, vs, marker="o", label="one point per V decile (mean return, mean V)")
            lo, hi = min(vs + rets), max(vs + rets)
            ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--", label="V = return (calibrated)")
        steps = d.get("steps")
        ax.set_title(f"iteration {k}: V vs. discounted return: above the diagonal = V overestimates\n"
                     f"on {data}" + (f", {steps} steps" if steps is not None else ""), fontsize=9)
        ax.set_xlabel("discounted return (mean per V decile)")
        ax.set_ylabel("V(s_t) (mean per V decile)")
        ax.grid(alpha=0.3)
        _legend(ax, "no calibration bins")
    fig.tight_layout()
    return fig


def _plot_diagnostics(diags: dict[int, dict[str, Any]], curves, out: Path) -> bool:
    fig = diagnostics_figure(diags, curves)
    if fig is None:
        return False
    _save(fig, out)
    return True


def diagnostics_markdown(diags: dict[int, dict[str, Any]]) -> str:
    if not diags:
        return ""
    lines = ["| iteration | on | Bellman Q | expl. var. V | AUC V | AUC V(s_0) | V sd | failed self A>0 | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt="{:.3f}"):
        return "" if x is None else fmt.format(x)

    for k, d in sorted(diags.items()):
        verdict = verdict_text(d)
        lines.append(f"| {k} | {d.get('on', '')} | {f(d.get('bellman_q'), '{:.4f}')} | {f(d.get('ev_return'), '{:.2f}')} | "
                     f"{f(d.get('auc_v'), '{:.2f}')} | {f(d.get('auc_v0'), '{:.2f}')} | {f(d.get('v_std'))} | "
                     f"{f(None if d.get('failed_self_pos_adv') is None else 100 * d['failed_self_pos_adv'], '{:.0f} %')} | "
                     f"{verdict} |")
    return "\n".join(lines) + "\n"


def _critic_curves(run: Path) -> dict[int, dict[str, list[float]]]:
    curves: dict[int, dict[str, list[float]]] = {}
    for mp in sorted(run.glob("iter_*/critic/metrics.jsonl")):
        k = int(mp.parent.parent.name.split("_")[1])
        c: dict[str, list[float]] = {}
        for line in mp.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            for key, v in rec.items():
                if "loss" in key and isinstance(v, (int, float)):
                    c.setdefault(key, []).append(float(v))
        if c:
            curves[k] = c
    return curves


def _plot_critic(curves, out: Path) -> bool:
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.6), squeeze=False)
    for ax, (k, c) in zip(axes[0], sorted(curves.items()), strict=True):
        for key, ys in c.items():
            ax.plot(range(1, len(ys) + 1), ys, marker=".", label=key)
        ax.set_title(f"critic losses, iteration {k} (training data)")
        ax.set_xlabel("log record (epoch)")
        _integer_axis(ax.xaxis)
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.grid(alpha=0.3)
        _legend(ax, "no losses logged")
    fig.tight_layout()
    _save(fig, out)
    return True


def _plot_advantages(run: Path, out: Path) -> dict[str, Any]:
    import polars as pl

    tables = sorted(run.glob("iter_*/advantages.parquet"))
    if not tables:
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats: dict[str, Any] = {}
    fig, axes = plt.subplots(1, len(tables), figsize=(5 * len(tables), 3.6), squeeze=False)
    for ax, t in zip(axes[0], tables, strict=True):
        df = pl.read_parquet(t, columns=["source", "advantage"])
        k = t.parent.name
        stats[k] = {}
        for src in ("expert", "self"):
            # (label --advantage gigpo gives the expert rows none: null, left out)
            a = df.filter((pl.col("source") == src) & pl.col("advantage").is_not_null())["advantage"].to_numpy()
            if len(a):
                ax.hist(a, bins=40, alpha=0.55, label=f"{src} (mean {a.mean():+.3f})", density=True)
                stats[k][src] = {"mean": float(a.mean()), "positive_share": float((a > 0).mean()), "n": int(len(a))}
        ax.set_title(f"advantage by source, {k}")
        _legend(ax, "no advantages", fontsize=8)
    fig.tight_layout()
    _save(fig, out)
    return stats


def markdown_table(rows, splits) -> str:
    head = "| iteration | " + " | ".join(f"{s} reward | {s} success" for s in splits) + " | env steps | cumulative |"
    sep = "|---" * (1 + 2 * len(splits) + 2) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for s in splits:
            if s in r:
                cells += [f"{100 * (r[s]['avg_reward'] or 0):.1f}", f"{100 * (r[s]['success_rate'] or 0):.1f}"]
            else:
                cells += ["", ""]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + f" | {r['env_steps']} | {r['cumulative_env_steps']} |")
    return "\n".join(lines) + "\n"


STAGE_KINDS = ("setup", "rollout", "label", "critic", "advantage", "train", "validation", "eval")


def stage_kind(name: str) -> str:
    """What a manifest stage does, for the time table: one of STAGE_KINDS. ``bc/cand_base/val`` is validation,
    ``iter_2/eval_test_seen`` and compare's ``eval/rft_test_seen`` are eval, every candidate or arm that trains
    a policy (``bc``, ``iter_1/cand_epochs2``, ``rft/cand_base``, ``iter_1/policy``) is train."""
    parts = name.split("/")
    if parts[-1] == "val":
        return "validation"
    if parts[0] == "eval" or parts[-1].startswith("eval_"):
        return "eval"
    if name in ("base_model", "expert"):
        return "setup"
    if parts[-1] in ("rollout", "label", "critic", "advantage"):
        return parts[-1]
    return "train"


def _time_row(name: str) -> str:
    head = name.split("/")[0]
    if head.startswith("iter_") and head[5:].isdigit() and int(head[5:]) > 0:
        return f"iter {int(head[5:])}"
    return "BC"


def stage_times(run: Path, now: float | None = None) -> dict[str, Any]:
    """Wall seconds of the run's finished stages per row (BC, iter k, and compare when `qevolve compare` ran in
    it) and kind (STAGE_KINDS), from the manifests, every attempt counted (a killed one to its last heartbeat;
    runs made before 2026-11-28 recorded the last attempt only); the stages that took more than one attempt;
    and those not finished, with their seconds so far: running now (the run directory's lock is held), stopped
    (a killed process: ``--resume`` continues), failed or interrupted, with their error."""
    import time

    from qevolve_cli.evolve.rundir import attempt_seconds, heartbeat_path, read_json
    from qevolve_cli.lock import RUN_DIR_LOCK, is_locked

    now = time.time() if now is None else now
    live = is_locked(run / RUN_DIR_LOCK)
    rows: dict[str, dict[str, float]] = {}
    resumed: list[str] = []
    unfinished: list[dict[str, Any]] = []
    for where, man in (("", run / "manifest.json"), ("compare/", run / "compare" / "manifest.json")):
        if not man.is_file():
            continue
        try:
            stages = json.loads(man.read_text()).get("stages", {})
        except json.JSONDecodeError as e:
            raise QevolveError(f"{man}: corrupt manifest ({e})") from None
        for name, st in stages.items():
            attempts = int(st.get("attempts", 1))
            if attempts > 1:
                resumed.append(where + name)
            status = st.get("status")
            if status == "done":  # every attempt (seconds_total), or the last one in runs made before it
                row = rows.setdefault("compare" if where else _time_row(name), {})
                kind = stage_kind(name)
                row[kind] = row.get(kind, 0.0) + float(st.get("seconds_total", st.get("seconds")) or 0.0)
                continue
            u: dict[str, Any] = {"stage": where + name, "status": status, "attempt": attempts}
            before = float(st.get("seconds_before") or 0.0)
            if status == "running" and live:  # all attempts so far, this one to now
                u["seconds"] = round(before + max(0.0, now - float(st.get("started", now))), 1)
            elif status == "running":  # its process died: to its last heartbeat
                u["status"] = "stopped"
                hb = read_json(heartbeat_path(man.parent, name))
                u["seconds"] = round(before + attempt_seconds(st, hb), 1)
            else:
                u["seconds"] = st.get("seconds_total", st.get("seconds"))
                u["error"] = st.get("error")
            unfinished.append(u)
    order = ["BC"] + sorted((r for r in rows if r.startswith("iter ")), key=lambda r: int(r.split()[1])) + ["compare"]
    out_rows = []
    for r in order:
        if r in rows:
            cells = {k: round(rows[r].get(k, 0.0), 1) for k in STAGE_KINDS}
            out_rows.append({"name": r, **cells, "total": round(sum(cells.values()), 1)})
    return {"rows": out_rows, "total_s": round(sum(r["total"] for r in out_rows), 1), "resumed": resumed,
            "unfinished": unfinished}


def _minutes(x: float) -> str:
    return "" if not x else f"{x / 60:.1f}"


def stage_times_markdown(times: dict[str, Any]) -> str:
    kinds = [k for k in STAGE_KINDS if any(r[k] for r in times["rows"])]
    if not kinds:
        return ""
    lines = ["| | " + " | ".join(kinds) + " | total |", "|---" * (len(kinds) + 2) + "|"]
    for r in times["rows"]:
        lines.append(f"| {r['name']} | " + " | ".join(_minutes(r[k]) for k in kinds) + f" | {_minutes(r['total'])} |")
    return "\n".join(lines) + "\n"


def _unfinished_text(u: dict[str, Any]) -> str:
    what = f"{u['stage']}: {u['status']} (attempt {u['attempt']}"
    if u.get("seconds"):
        what += f", {u['seconds'] / 60:.1f} min so far"
    what += ")"
    if u["status"] == "stopped":
        what += ": its process ended mid-stage; rerun the same command with --resume"
    elif u.get("error"):
        what += f": {u['error']}"
    return what


def selections(run: Path) -> list[dict[str, Any]]:
    """The choices made on validation (``--select-on-validation``): BC's and each iteration's policy step, with
    every candidate's setting and validation score (the manifest's ``selection`` metrics)."""
    stages = _manifest(run).get("stages", {})
    out = []
    for name, st in stages.items():
        sel = (st.get("metrics") or {}).get("selection") if st.get("status") == "done" else None
        if sel:
            out.append({"where": "BC" if name == "bc" else _time_row(name), "stage": name, **sel})
    return out


def build_report(run_dir: str | Path, plots: bool = True) -> dict[str, Any]:
    run = Path(run_dir)
    rows, splits = score_rows(run)
    out = run / "report"
    out.mkdir(exist_ok=True)
    files = []
    adv_stats: dict[str, Any] = {}
    if plots:
        if rows and splits:
            _plot_scores(run, rows, splits, out / "scores.png")
            files.append("report/scores.png")
        if _plot_critic(_critic_curves(run), out / "critic_losses.png"):
            files.append("report/critic_losses.png")
        adv_stats = _plot_advantages(run, out / "advantages.png")
        if adv_stats:
            files.append("report/advantages.png")
    diags = critic_diagnostics(run)
    if plots and _plot_diagnostics(diags, _heldout_curves(run), out / "critic_diagnostics.png"):
        files.append("report/critic_diagnostics.png")
    times, sels = stage_times(run), selections(run)
    md = markdown_table(rows, splits)
    if diags:
        md += "\nCritic diagnostics (docs/critic.md#diagnostics):\n\n" + diagnostics_markdown(diags)
        from qevolve_cli.critic.ladder import ladder_line

        md += "".join(f"\n- iteration {k}, {ladder_line(d['fit_ladder'])}" for k, d in sorted(diags.items())
                      if d.get("fit_ladder"))
        md += "\n" if any(d.get("fit_ladder") for d in diags.values()) else ""
    if sels:
        from qevolve_cli.evolve.select import describe

        md += "\nChosen on validation (candidates: validation average reward x100):\n\n" + "".join(
            f"- {s['where']}: {describe(s)}\n" for s in sels)
    if t_md := stage_times_markdown(times):
        md += "\nWall time of the finished stages (minutes):\n\n" + t_md
    md += "".join(f"\n- {_unfinished_text(u)}" for u in times["unfinished"]) + ("\n" if times["unfinished"] else "")
    write_text(out / "scores.md", md)
    critic = {str(k): {key: d.get(key) for key in ("on", "trajectories", "steps", "n_success", "n_failed", *DIAG_KEYS,
                                                   "auc_v_ci", "problems", "fit_ladder")}
              for k, d in sorted(diags.items())}
    rep = {"run": str(run), "splits": splits, "rows": rows, "advantages": adv_stats, "critic": critic,
           "selection": sels, "stages": times, "files": files + ["report/scores.md"]}
    write_json(out / "report.json", rep)
    return rep


SHORT = {"test_seen": "seen", "test_unseen": "unseen", "test": "test", "train": "train"}


def print_table(rep: dict[str, Any]) -> None:
    """The score table (average reward % and success % per split) on stdout."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"qevolve report: {rep['run']}", caption="reward = average final reward (%), "
              "success = tasks completed (%), env steps = environment steps of the iteration's rollout")
    t.add_column("iteration", no_wrap=True)
    for s in rep["splits"]:
        name = SHORT.get(s, s)
        t.add_column(f"{name} reward", justify="right")
        t.add_column(f"{name} success", justify="right")
    t.add_column("env steps", justify="right")
    t.add_column("total steps", justify="right")
    for r in rep["rows"]:
        cells = []
        for s in rep["splits"]:
            cells += ([f"{100 * (r[s]['avg_reward'] or 0):.1f}", f"{100 * (r[s]['success_rate'] or 0):.1f}"] if s in r else ["", ""])
        t.add_row(r["name"], *cells, str(r["env_steps"]), str(r["cumulative_env_steps"]))
    con = Console(width=max(100, Console().width))  # not narrower than the tables, in a pipe too
    con.print(t)
    if rep.get("critic"):
        c = Table(title="critic diagnostics (docs/critic.md#diagnostics)", caption="explained variance of V against "
                  "the discounted return, AUC of V for success, share of failed self steps with A > 0")
        for col in ("iteration", "on", "Bellman Q", "expl. var.", "AUC V", "AUC V0", "V sd", "failed A>0", "verdict"):
            c.add_column(col, justify="left" if col in ("on", "verdict") else "right")

        def f(x, fmt="{:.3f}"):
            return "" if x is None else fmt.format(x)

        for k, d in rep["critic"].items():
            fp = d.get("failed_self_pos_adv")
            c.add_row(k, str(d.get("on") or ""), f(d.get("bellman_q"), "{:.4f}"), f(d.get("ev_return"), "{:.2f}"),
                      f(d.get("auc_v"), "{:.2f}"), f(d.get("auc_v0"), "{:.2f}"), f(d.get("v_std")),
                      "" if fp is None else f"{100 * fp:.0f} %", verdict_word(d))
        con.print(c)
        from qevolve_cli.critic.ladder import ladder_line

        for k, d in rep["critic"].items():  # the reasons, one line each: the column stays narrow
            if d.get("fit_ladder"):
                con.print(f"critic of iteration {k}, {ladder_line(d['fit_ladder'])}", highlight=False)
            if verdict_word(d) == "not learned":
                con.print(f"critic of iteration {k}: {verdict_text(d)}", highlight=False)
    if rep.get("selection"):
        from qevolve_cli.evolve.select import describe

        con.print(
            "chosen on validation (candidates: validation average reward x100):\n" + "\n".join(
                f"  {s['where']}: " + describe(s).replace("**", "") for s in rep["selection"]), highlight=False)
    times = rep.get("stages") or {}
    kinds = [k for k in STAGE_KINDS if any(r[k] for r in times.get("rows", []))]
    if kinds:
        tt = Table(title="wall time of the finished stages (minutes)")
        tt.add_column("", no_wrap=True)
        for k in [*kinds, "total"]:
            tt.add_column(k, justify="right")
        for r in times["rows"]:
            tt.add_row(r["name"], *(_minutes(r[k]) for k in kinds), _minutes(r["total"]))
        con.print(tt)
    for u in times.get("unfinished", []):
        con.print(_unfinished_text(u), highlight=False)
    files = rep.get("files", [])
    if files:
        Console(stderr=True).print("written: " + ", ".join(str(Path(rep["run"]) / f) for f in files))


def pooled_success(row: dict[str, Any], splits: list[str]) -> tuple[float | None, int]:
    """(success over every task of ``splits`` pooled, each task once; the number of tasks) of one score row."""
    have = [(row[s]["success_rate"], row[s]["n"]) for s in splits if s in row and row[s].get("n")]
    n = sum(int(k) for _, k in have)
    return (sum(float(sr or 0) * int(k) for sr, k in have) / n if n else None), n


NEXT_COMMANDS = (
    ("make demo-smol", "the same loop with the pretrained SmolLM2-135M-Instruct (LoRA; hours on 2 cores)"),
    ("qevolve plan --env alfworld --model HuggingFaceTB/SmolLM2-1.7B-Instruct --gpus 8 --gpu h100-80gb",
     "what a run of your own model costs on a GPU node"),
    ("qevolve evolve --env alfworld --model HuggingFaceTB/SmolLM2-1.7B-Instruct --iters 2 --run-dir runs/alf",
     "your own model by Hub id on a GPU node (docs/cluster.md)"),
)


def summary_lines(rep: dict[str, Any]) -> list[str]:
    """One screen: held-out success of BC and each iteration (pooled over the held-out splits, with their sizes),
    each critic's verdict and fit ladder, where the plots are, and the next commands (``qevolve report
    --summary``; the end of ``make demo``)."""
    from qevolve_cli.critic.diagnostics import verdict_text
    from qevolve_cli.critic.ladder import ladder_line

    run = Path(rep["run"])
    cfg_p = run / "config.yaml"
    env = preset = ""
    if cfg_p.is_file():
        import yaml

        c = yaml.safe_load(cfg_p.read_text()) or {}
        env, preset = str(c.get("env", "")), str(c.get("preset", ""))
    held = [s for s in rep["splits"] if s.startswith("test")] or list(rep["splits"])
    sizes = " + ".join(f"{s} {next((r[s]['n'] for r in rep['rows'] if s in r and r[s].get('n')), '?')}" for s in held)
    lines = [f"qevolve: {run}" + (f" ({env}, --preset {preset})" if env else ""), "",
             f"held-out success, every task counted once ({sizes} tasks):"]
    base = None
    for r in rep["rows"]:
        sr, n = pooled_success(r, held)
        if sr is None:
            continue
        per = ", ".join(f"{SHORT.get(s, s)} {100 * (r[s]['success_rate'] or 0):.1f}" for s in held if s in r)
        name = "BC (behaviour cloning)" if r["iteration"] == 0 else f"Q-Evolve iteration {r['iteration']}"
        delta = "" if base is None else f"   {100 * (sr - base):+.1f} points over BC"
        lines.append(f"  {name:<24} {100 * sr:5.1f} %  ({per}){delta}")
        if r["iteration"] == 0:
            base = sr
    for k, d in rep.get("critic", {}).items():
        held_txt = (f"held-out AUC of V {d['auc_v']:.2f}, explained variance {d['ev_return']:.2f}"
                    if d.get("auc_v") is not None and d.get("ev_return") is not None else "")
        lines.append(f"critic of iteration {k}: {verdict_text(d)}" + (f" ({held_txt})" if held_txt else ""))
        if d.get("fit_ladder"):
            lines.append(f"  {ladder_line(d['fit_ladder'])}")
    pngs = [f for f in rep.get("files", []) if f.endswith(".png")]
    if pngs:
        lines.append(f"plots: {run / 'report'}/ ({', '.join(Path(f).name for f in pngs)})")
    lines += ["", "next:"] + [f"  {cmd}\n      {why}" for cmd, why in NEXT_COMMANDS]
    return lines
