"""Validation selection of training settings (``--select-on-validation``; docs/compare.md, "Fair selection").

Every trained arm gets the same number of candidate settings. A candidate is a set of multipliers of
the arm's own PolicyConfig: ``{}`` is the arm's setting itself, ``{"lr": 0.2}`` its lr x 0.2,
``{"epochs": 2}`` twice its epochs. Each candidate is trained, then played greedily on the
**validation tasks**: the last ``n`` tasks of the *train* split (never a test split). They are carved out
before anything trains: the expert demonstrations, the rollouts (their first ``expert_limit`` /
``max_tasks`` are taken from the train tasks before the validation ones) and an external ``expert_data``
table (its rows of validation tasks are dropped) never contain them, so validation is disjoint from
every training table by construction (:func:`training_tasks`, :func:`drop_validation_rows`,
:func:`check_disjoint`). The candidate with the highest average final reward wins; ties go to the earlier
candidate, so the arm's own setting (listed first) wins a tie.

Work goes to ``<prefix>/cand_<tag>/policy`` (training) and ``<prefix>/cand_<tag>/val.parquet``
(validation), each a resumable stage of the run's manifest.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from qevolve_cli.errors import ConfigError

SCALABLE = ("lr", "epochs", "dpo_beta", "dpo_nll_weight", "awr_beta")
"""PolicyConfig fields a candidate may scale."""

DEFAULT_BC_CANDIDATES: list[dict[str, float]] = [{}, {"epochs": 0.5}, {"epochs": 2.0}]
DEFAULT_POLICY_CANDIDATES: list[dict[str, float]] = [{}, {"lr": 0.2}, {"epochs": 2.0}]
DEFAULT_ETO_CANDIDATES: list[dict[str, float]] = [{}, {"lr": 5.0}, {"dpo_beta": 5.0}]


def check_grid(grid: Sequence[dict[str, Any]], source: Any, where: str) -> None:
    """One-line ConfigError for an empty grid, an unknown field or a multiplier that is not > 0."""
    if not grid:
        raise ConfigError(source, where, "no candidate (give at least one, e.g. [{}])")
    tags = set()
    for i, cand in enumerate(grid):
        if not isinstance(cand, dict):
            raise ConfigError(source, f"{where}[{i}]", f"expected a mapping of field: multiplier, got {cand!r}")
        for k, v in cand.items():
            if k not in SCALABLE:
                raise ConfigError(source, f"{where}[{i}].{k}", f"cannot be scaled (choose from {', '.join(SCALABLE)})")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(source, f"{where}[{i}].{k}", f"multiplier must be a number > 0, got {v!r}")
        tag = candidate_tag(cand)
        if tag in tags:
            raise ConfigError(source, f"{where}[{i}]", f"candidate {tag!r} listed twice")
        tags.add(tag)


def candidate_tag(cand: dict[str, Any]) -> str:
    """``{}`` -> ``base``; ``{"lr": 0.2, "epochs": 2}`` -> ``epochs2-lr0.2`` (sorted, directory-safe)."""
    return "-".join(f"{k}{float(v):g}" for k, v in sorted(cand.items())) or "base"


def apply_candidate(cfg, cand: dict[str, Any]):
    """``cfg`` (a PolicyConfig) with the candidate's multipliers applied; epochs rounded, at least 1."""
    changes: dict[str, Any] = {}
    for k, v in cand.items():
        if k == "epochs":
            changes[k] = max(1, int(round(cfg.epochs * float(v))))
        else:
            changes[k] = getattr(cfg, k) * float(v)
    return cfg.replace(**changes) if changes else cfg


def setting_of(cfg) -> dict[str, Any]:
    """The fields a reader needs to see a candidate's budget: objective, epochs, lr (and DPO's beta / alpha,
    AWR's temperature)."""
    d = {"objective": cfg.objective, "epochs": cfg.epochs, "lr": cfg.lr}
    if cfg.objective == "dpo":
        d.update(dpo_beta=cfg.dpo_beta, dpo_nll_weight=cfg.dpo_nll_weight)
    if cfg.objective == "awr":
        d.update(awr_beta=cfg.awr_beta)
    return d


def pick_best(scores: Sequence[float | None]) -> int | None:
    """Index of the highest score (ties: the earliest; ``None`` = not scored, never chosen); None if none."""
    best, best_v = None, None
    for i, v in enumerate(scores):
        if v is not None and (best_v is None or v > best_v):
            best, best_v = i, v
    return best


def validation_tasks(env: str, n: int) -> list[Any]:
    """The last ``n`` tasks of ``env``'s train split: the validation tasks. A one-line ConfigError (field
    ``validation_tasks``) when they would leave no train task to train on."""
    return carve(env, n)[0]


def carve(env: str, n: int) -> tuple[list[Any], list[Any]]:
    """(validation, training): the last ``n`` tasks of ``env``'s train split, and the train tasks before them
    (in the split's order, from which every training stage takes its first N)."""
    from qevolve_cli.envs.splits import list_tasks

    train = list_tasks(env, "train")
    total = len(train)
    if n >= total:
        raise ConfigError(None, "validation_tasks", f"{n} validation tasks leave none of the {total} tasks of the "
                          f"{env} train split to train on (validation is carved out of it; give fewer)")
    return train[total - n:], train[:total - n]


def training_tasks(env: str, n_val: int, limit: int) -> tuple[list[Any], int]:
    """The train tasks of a stage that takes the first ``limit`` (0 = all: expert_limit, max_tasks) while the
    last ``n_val`` are held out for validation, and how many validation tasks the first ``limit`` of the whole
    split holds (those the stage took before validation was carved out: 0 = the same tasks as without)."""
    val, rest = carve(env, n_val)
    total = len(val) + len(rest)
    used = min(limit, total) if limit else total
    return (rest[:limit] if limit else rest), max(0, used - len(rest))


def held_out_hash(config_hash: str, n_val: int, held_out: int) -> str:
    """A training stage's config hash once validation is carved out of its tasks: unchanged where that leaves
    its tasks as they were (``held_out`` 0), else a new one, so a run made before does not resume with other
    data."""
    if not held_out:
        return config_hash
    return hashlib.sha256(repr((config_hash, "validation held out", n_val)).encode()).hexdigest()[:16]


def drop_validation_rows(df, val_ids: set[str]):
    """(``df`` without the rows of validation tasks, rows dropped, tasks dropped)."""
    import polars as pl

    hit = pl.col("task_id").is_in(sorted(val_ids))
    dropped = df.filter(hit)
    return df.filter(~hit), dropped.height, dropped["task_id"].n_unique()


def check_disjoint(tables: Sequence[Any], val_ids: set[str], fix: str) -> None:
    """A one-line TableError naming the first table (a step table's path) with rows of validation tasks and its
    ``task_id`` column: ``fix`` says what to do. Reads that column only."""
    import polars as pl

    from qevolve_cli.errors import TableError

    for t in tables:
        ids = pl.read_parquet(t, columns=["task_id"])["task_id"]
        hit = ids.is_in(sorted(val_ids))
        if hit.any():
            raise TableError(t, "task_id", f"{int(hit.sum())} rows of {ids.filter(hit).n_unique()} validation "
                             f"task(s) in a training table; {fix} (docs/compare.md, \"Fair selection\")")


def select(run, prefix: str, base_cfg, grid: Sequence[dict[str, Any]], train: Callable[[Any, Path], dict[str, Any]],
           v_cfg, tasks: Sequence[Any], *, iteration: int, inputs: list[str],
           echo: Callable[[str], None]) -> dict[str, Any]:
    """Train every candidate of ``grid`` (``train(cfg, out)``), play each on ``tasks`` with ``v_cfg`` (a train-split
    RolloutConfig), pick the best. ``run`` is the RunDir whose manifest holds the stages. Returns the selection
    record: ``chosen`` (tag), ``policy`` (the chosen candidate's directory, relative to the run), ``candidates``
    (tag, multipliers, setting, validation score, in grid order), ``validation_tasks`` (count) and ``disjoint``
    (true: the callers train only on tables with the validation tasks carved out, :func:`check_disjoint`)."""
    from qevolve_cli.evolve.rundir import scalars as _scalars
    from qevolve_cli.rollout.evaluate import run_eval

    task_ids = [t.task_id for t in tasks]
    cands = []
    for cand in grid:
        tag = candidate_tag(cand)
        cfg = apply_candidate(base_cfg, cand)
        cdir = f"{prefix}/cand_{tag}"

        def tr(cfg=cfg, cdir=cdir):
            return _scalars(train(cfg, run.path / cdir / "policy"))

        run.run_stage(cdir, tr, inputs=inputs, outputs=[f"{cdir}/policy"], config_hash=cfg.hash(),
                      legacy_hash=cfg.legacy_hash(), iteration=iteration, echo=echo)

        def ev(cdir=cdir):
            m = run_eval(v_cfg, run.path / cdir / "policy", run.path / cdir / "val.parquet", resume=True, tasks=tasks)
            return {"split": "train (validation)", **_scalars(m)}

        vh = hashlib.sha256((v_cfg.hash() + "\n".join(task_ids)).encode()).hexdigest()[:16]
        m = run.run_stage(f"{cdir}/val", ev, inputs=[f"{cdir}/policy"], outputs=[f"{cdir}/val.parquet"],
                          config_hash=vh, iteration=iteration, echo=echo)
        cands.append({"tag": tag, "multipliers": dict(cand), "setting": setting_of(cfg),
                      "val_avg_reward": m.get("avg_reward"), "val_success_rate": m.get("success_rate")})
    i = pick_best([c["val_avg_reward"] for c in cands])
    if i is None and run.check_only:  # evolve --reconfigure's check: no candidate validated yet
        from qevolve_cli.evolve.rundir import Unfinished

        raise Unfinished(prefix)
    if i is None:
        from qevolve_cli.errors import QevolveError

        raise QevolveError(f"{run.path / prefix}: no candidate has a validation score")
    return {"chosen": cands[i]["tag"], "chosen_index": i, "policy": f"{prefix}/cand_{cands[i]['tag']}/policy",
            "setting": cands[i]["setting"], "candidates": cands, "validation_tasks": len(task_ids), "disjoint": True}


def below_start(arm: str, sel: dict[str, Any] | None, start: dict[str, Any] | None, grid_field: str,
                margin: float = 0.10) -> str | None:
    """A warning when every candidate of an arm that trains *from* a chosen policy (ETO from SFT) scored more than
    ``margin`` below that policy on the same validation tasks: each setting of the grid made it worse, so the arm's
    row measures that grid rather than the method (smaller steps may keep it near its start). None otherwise (or
    without scores)."""
    def chosen_val(r):
        c = r["candidates"][r["chosen_index"]] if r and r.get("candidates") else None
        return None if c is None else c.get("val_avg_reward")

    best, ref = chosen_val(sel), chosen_val(start)
    if best is None or ref is None or best >= ref - margin:
        return None
    return (f"every {arm} candidate scored below the policy it starts from on validation (best {100 * best:.1f} "
            f"vs {100 * ref:.1f}): every setting of its grid ({grid_field}) made it worse; smaller steps may keep it, e.g. "
            f"--set '{grid_field}=[{{lr: 0.04}}, {{lr: 0.008}}, {{}}]' "
            "(docs/notebook/2026-11-28-bench-compare-five-seeds.md)")


def describe(sel: dict[str, Any] | None) -> str:
    """One cell of the table: the chosen candidate and every candidate's validation score (x100)."""
    if not sel:
        return "–"

    def v(c):
        x = c.get("val_avg_reward")
        return "–" if x is None else f"{100 * x:.1f}"

    cands = ", ".join(f"{c['tag']} {v(c)}" for c in sel["candidates"])
    return f"**{sel['chosen']}** of {len(sel['candidates'])} ({cands})"
