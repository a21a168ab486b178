"""Evaluation: greedy play of one trajectory per task, metrics per split and task type.

Metrics (every number names its env and split):

* ``avg_reward`` — the paper's metric: the mean final episodic reward (score in
  [0, 1]; SciWorld partial scores count) over the trajectories of the split;
* ``success_rate`` — share of trajectories that *completed* the task (final
  reward >= 1). (The tables' ``success`` column of ``qevolve label`` is the
  looser "non-zero reward" of the step weights.)
* ``failed`` — trajectories lost to a worker crash / timeout; they count as 0.

Critic reranking (``critic=DIR, candidates=N``): at every step N candidates are
sampled and the one with the highest Q - V under the critic is played; the
chooser comes from :func:`load_chooser` (``qevolve_cli.critic.rerank``).

Best-of-N (``best_of=N``, the paper's baseline row, set up as in QLASS): N
complete trajectories per task are sampled (``cfg.temperature``), and the one
with the highest *final environment reward* is kept (:func:`best_of_n`) —
QLASS's ``calc_results.py`` counts a task as solved when any of its N
trajectories is. The selection reads the environment's outcome, so this is an
**oracle upper bound**, not a deployable method; the metrics say so
(``oracle: true``) and count the env steps of all N trajectories.
"""
from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl

from qevolve_cli.errors import QevolveError
from qevolve_cli.rollout.backends import Backend
from qevolve_cli.rollout.config import RolloutConfig
from qevolve_cli.rollout.loop import Chooser, ProgressFn, run_rollout


def load_chooser(critic: str | Path, policy: str | Path, cfg: RolloutConfig) -> Chooser:
    """The critic reranker: ``chooser(requests, candidates) -> [index per request]``.

    Hook for ``qevolve_cli/critic/rerank.py``: it must provide
    ``make_chooser(critic_dir, *, policy, env, device) -> Chooser`` where a
    chooser scores each request's candidates by Q(s, a) - V(s) and returns the
    index of the best per request.
    """
    if not Path(critic).is_dir():
        raise QevolveError(f"--critic {critic}: no such directory")
    try:
        from qevolve_cli.critic import rerank
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("qevolve_cli.critic"):
            raise QevolveError("--critic: critic reranking is not available in this build "
                               "(qevolve_cli/critic/rerank.py is missing)") from None
        raise
    if not hasattr(rerank, "make_chooser"):
        raise QevolveError("--critic: qevolve_cli.critic.rerank has no make_chooser(critic_dir, ...)")
    return rerank.make_chooser(str(critic), policy=str(policy), env=cfg.env, device=cfg.device)


def summarize(table: pl.DataFrame) -> dict[str, Any]:
    """Per-trajectory final reward -> avg reward / success rate, overall and per task type."""
    per = (
        table.sort(["traj_id", "step"])
        .group_by("traj_id", maintain_order=True)
        .agg(
            pl.col("reward_env").sum().alias("reward"),
            pl.len().alias("steps"),
            pl.col("task_type").first().fill_null("all").alias("task_type"),
            (pl.col("error").is_not_null().any() if "error" in table.columns else pl.lit(False)).alias("failed"),
        )
        .with_columns(pl.when(pl.col("failed")).then(0.0).otherwise(pl.col("reward")).alias("reward"))
        .with_columns((pl.col("reward") >= 1.0 - 1e-6).alias("completed"))
    )

    def agg(df: pl.DataFrame) -> dict[str, Any]:
        n = df.height
        return {
            "n": n,
            "avg_reward": round(float(df["reward"].mean()), 6) if n else 0.0,
            "success_rate": round(float(df["completed"].mean()), 6) if n else 0.0,
            "nonzero_rate": round(float((df["reward"] > 0).mean()), 6) if n else 0.0,
            "avg_steps": round(float(df["steps"].mean()), 3) if n else 0.0,
            "failed": int(df["failed"].sum()),
        }

    by_type = {}
    for tt in sorted(per["task_type"].unique().to_list()):
        by_type[tt] = agg(per.filter(pl.col("task_type") == tt))
    return {**agg(per), "by_task_type": by_type}


def trajectory_outcomes(table: pl.DataFrame) -> pl.DataFrame:
    """One row per trajectory: ``traj_id, task_id, sample, reward, failed, steps`` (failed -> reward 0)."""
    has_err = "error" in table.columns
    has_sample = "sample" in table.columns
    return (
        table.sort(["traj_id", "step"])
        .group_by("traj_id", maintain_order=True)
        .agg(
            pl.col("task_id").first(),
            (pl.col("sample").first() if has_sample else pl.lit(0)).alias("sample"),
            pl.col("reward_env").sum().cast(pl.Float64).alias("reward"),
            (pl.col("error").is_not_null().any() if has_err else pl.lit(False)).alias("failed"),
            pl.len().alias("steps"),
        )
        .with_columns(pl.when(pl.col("failed")).then(0.0).otherwise(pl.col("reward")).alias("reward"))
    )


def best_of_n(table: pl.DataFrame) -> pl.DataFrame:
    """Best-of-N selection with the oracle rule: per task, the rows of the trajectory with the highest final
    environment reward (a failed trajectory counts 0); ties go to the lowest ``sample`` index (then traj_id)."""
    per = trajectory_outcomes(table)
    best = (per.sort(["task_id", "reward", "sample", "traj_id"], descending=[False, True, False, False])
            .group_by("task_id", maintain_order=True).first())
    return table.filter(pl.col("traj_id").is_in(best["traj_id"].implode()))


def run_eval(
    cfg: RolloutConfig,
    policy: str | Path,
    out: str | Path | None = None,
    *,
    adapter: str | Path | None = None,
    critic: str | Path | None = None,
    candidates: int | None = None,
    best_of: int = 1,
    resume: bool = False,
    backend: Backend | None = None,
    chooser: Chooser | None = None,
    on_progress: ProgressFn | None = None,
    tasks: Sequence[Any] | None = None,
    pool: Any = None,
) -> dict[str, Any]:
    """Evaluate ``policy`` (greedy, one trajectory per task) on ``cfg.split``; returns the metrics dict.

    ``cfg.shard = "I/N"``: only that shard's block of the tasks (with ``best_of``: every sample of each of
    its tasks), metrics of those tasks; :func:`summarize` of the shards' tables concatenated gives the
    unsharded metrics (docs/rollout.md).

    ``best_of=N > 1``: N sampled trajectories per task (``cfg.temperature``), the best by final
    environment reward kept (:func:`best_of_n`, an oracle). The trajectories (all N per task) go to
    ``out`` (a temporary file, deleted, when None).
    """
    if best_of < 1:
        raise QevolveError(f"--best-of: must be >= 1, got {best_of}")
    if best_of > 1 and (critic is not None or chooser is not None):
        raise QevolveError("--best-of: cannot be combined with --critic reranking")
    cfg = cfg.replace(n_per_task=best_of, candidates=candidates or cfg.candidates)
    if critic is not None and chooser is None:
        if cfg.candidates < 2:
            raise QevolveError("--critic: needs --candidates N with N >= 2")
        chooser = load_chooser(critic, policy, cfg)
    tmp = None
    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="qevolve-eval-")
        out = Path(tmp.name) / "eval.parquet"
    try:
        temperature = cfg.temperature if best_of > 1 else cfg.eval_temperature
        res = run_rollout(cfg, policy, out, adapter=adapter, resume=resume, temperature=temperature,
                          backend=backend, chooser=chooser, on_progress=on_progress, tasks=tasks,
                          producer="qevolve eval", pool=pool, shard_whole_tasks=best_of > 1)
        scored = best_of_n(res.table) if best_of > 1 else res.table
        metrics = {
            "env": cfg.env,
            "split": cfg.split,
            "shard": cfg.shard or None,  # the metrics of this shard's tasks only (docs/rollout.md: merging shards)
            "policy": str(policy),
            "adapter": str(adapter) if adapter else None,
            "critic": str(critic) if critic else None,
            "candidates": cfg.candidates if (critic or chooser) else 1,
            "temperature": temperature,
            "best_of": best_of,
            "oracle": best_of > 1,  # best-of-N selects by the environment's final reward
            "n_tasks": res.table["task_id"].n_unique(),
            "env_steps": res.table.height,  # all trajectories played (N per task with best_of)
            **summarize(scored),
            "out": None if tmp else str(out),
            "stats": res.stats.to_dict(),
        }
    finally:
        if tmp is not None:
            tmp.cleanup()
    return metrics
