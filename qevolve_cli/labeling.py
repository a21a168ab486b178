"""`qevolve label`: retrospective labels, step weights, positions and advantages.

Reads one or more step tables (the hybrid buffer D = D_expert ∪ D_self),
validates them, and writes ONE table with ``reward_aux``, ``aux_kind``,
``success``, ``weight``; with a tokenizer the prefix positions; with a critic
(or when ``value``/``next_value`` are already present) the process reward
``advantage``. Inputs are never modified. The heavy lifting is in the Rust
core; torch is imported only for ``--critic``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from qevolve_cli import core, schema
from qevolve_cli.config import ConfigBase, configs_dir, field, load_yaml
from qevolve_cli.errors import ConfigError, QevolveError, TableError
from qevolve_cli.rewards import (
    ADVANTAGES,
    GIGPO_EPISODE_STATS,
    GIGPO_NORMS,
    gigpo_advantages,
    process_rewards,
)
from qevolve_cli.tokenizer import load_tokenizer


@dataclass
class LabelConfig(ConfigBase):
    HASH_OMIT_AT_DEFAULT = ("step_limit", "window_context",  # added 2026-11-28/29: older runs resume
                            "gigpo_gamma", "gigpo_omega", "gigpo_eps", "gigpo_norm", "gigpo_episode_stats")
    rules: str | None = field(None, help="YAML file of per-environment labelling rules (default: configs/labels.yaml).")
    retrospective: bool = field(True, help="Assign retrospective auxiliary rewards; false = ablation 'w/o RR' (all zero).")
    weight_temporal: bool = field(True, help="Keep the temporal term t/T of the step weight w_t.")
    weight_success: bool = field(True, help="Keep the success term d of the step weight w_t.")
    gamma: float = field(0.95, help="Discount factor gamma of GAE.", ge=0.0, le=1.0)
    lam: float = field(0.95, help="GAE lambda.", ge=0.0, le=1.0)
    advantage: str = field(
        "gae",
        help="Process reward: gae (r_env only, the paper), gae_aux (r_env + r_aux), td (r + gamma V' - V), "
        "q_minus_v (needs a critic), gigpo (GiGPO's anchor-state credit: no critic; the gigpo_* fields; "
        "docs/policy.md, 'GiGPO').",
        choices=ADVANTAGES,
    )
    gigpo_gamma: float = field(0.95, help="gigpo: discount gamma of the step returns G_t = sum_k gamma^k r_env,t+k "
                                          "compared within an anchor group (verl-agent's default 0.95).", ge=0.0, le=1.0)
    gigpo_omega: float = field(1.0, help="gigpo: weight omega of the step term, A = A^E + omega A^S (verl-agent's "
                                         "step_advantage_w, default 1).", ge=0.0)
    gigpo_eps: float = field(1e-6, help="gigpo: eps of (x - mean) / (std + eps) (verl-agent's epsilon, 1e-6).",
                             ge=0.0)
    gigpo_norm: str = field("std", help="gigpo: std divides by the group's std + eps (verl-agent's mean_std_norm; "
                                        "std is the unbiased one, torch.std's), mean by 1 (mean_norm).",
                            choices=GIGPO_NORMS)
    gigpo_episode_stats: str = field("trajectories", help="gigpo: the episode group's mean and std over its "
                                                          "trajectories (the paper's Eq. 3, the default) or over its "
                                                          "steps, each counting its trajectory's return (verl-agent's "
                                                          "code).", choices=GIGPO_EPISODE_STATS)
    max_length: int | None = field(None, help="Token budget for prefix indexing (None: no budget, whole "
                                                "trajectories; the critic windows longer ones with its own "
                                                "max_length).", gt=0)
    window_context: float = field(0.5, help="With max_length: share of max_length (after the head) a new window "
                                            "of a long trajectory starts with as context, the critic's rule "
                                            "(CriticConfig.window_context, default 0.5: give the critic's value "
                                            "so that it trains in these windows; 1 = the rollout's contexts).",
                                  gt=0, le=1)
    value_source: str = field(
        "critic",
        help="Where value/next_value come from: critic (--critic DIR, or the input's columns), oracle (the "
        "environment's exact solver: V* = gamma^(d-1), lamps, lamps-hard, lamps-habit), tabular_iql (exact weighted IQL "
        "on the table's own transitions with the solver's states: a perfect critic's values).",
        choices=("critic", "oracle", "tabular_iql"),
    )
    fit_reward: str = field("env_aux", help="tabular_iql: the reward V is fit on: env_aux (r_env + r_aux, the "
                                            "paper's critic) or env (r_env only).", choices=("env_aux", "env"))
    expectile: float = field(0.7, help="tabular_iql: expectile m of V (the critic's default).", gt=0, lt=1)
    oracle_max_steps: int | None = field(None, help="oracle / tabular_iql: the self-play episodes' step limit (expert rows use the expert's; default: "
                                                    "the environment's).", gt=0)
    step_limit: int | None = field(None, help="Fill steps_left (step_limit - step) on the rows without one (expert "
                                              "demonstrations, tables of older versions), for a critic with "
                                              "time_input steps_left: the self-play episodes' step limit "
                                              "(docs/critic.md, \"Time input\"). Default: leave them null.", gt=0)


def load_rules(path: str | Path | None, envs: list[str]) -> list[dict[str, Any]]:
    """Rules for each env in ``envs`` (same order), from the YAML rules file."""
    path = Path(path) if path else configs_dir() / "labels.yaml"
    data = load_yaml(path)
    out = []
    allowed = {"r_fmt", "r_inv", "r_repeat", "invalid_patterns", "repeat_enabled", "repeat_exempt_commands"}
    for env in envs:
        if env not in data:
            raise ConfigError(path, env, f"no labelling rules for environment {env!r} (have: {', '.join(sorted(data))})")
        spec = data[env]
        if not isinstance(spec, dict):
            raise ConfigError(path, env, "expected a mapping")
        unknown = sorted(set(spec) - allowed)
        if unknown:
            raise ConfigError(path, f"{env}.{unknown[0]}", f"unknown key (known: {', '.join(sorted(allowed))})")
        out.append({"env": env, **spec})
    return out


def read_inputs(paths: list[Path]) -> tuple[pl.DataFrame, pl.Series | None]:
    """The union of the input tables, validated; with its trajectory offsets when it is one table
    in step order (what qevolve writes), else None."""
    if len(paths) == 1:
        return schema.read_steps(paths[0])
    frames = [schema.read_table(p) for p in paths]
    # validation of the union catches a trajectory id used in two inputs
    seen: dict[str, Path] = {}
    for p, f in zip(paths, frames, strict=True):
        for tid in f["traj_id"].unique().to_list():
            if tid in seen:
                raise TableError(p, "traj_id", f"trajectory {tid!r} also appears in {seen[tid]}")
            seen[tid] = p
    return pl.concat(frames, how="diagonal_relaxed"), None


def label_frame(
    df: pl.DataFrame,
    cfg: LabelConfig,
    tokenizer: Any = None,
    critic: str | Path | None = None,
    source: str | Path | None = None,
    require_advantage: bool = False,
    offsets: pl.Series | None = None,
) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Label a validated frame; returns the labelled frame (trajectories contiguous) and timings.

    ``advantage`` is added when the frame has critic values (or ``critic`` is given); without
    them ``require_advantage`` makes that an error instead of a table without advantages.
    ``offsets``: the frame's :func:`schema.step_offsets` when the caller has them already.
    """
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    # a table in step order (what qevolve writes) is not re-sorted
    offs = schema.step_offsets(df) if offsets is None else offsets
    if offs is None:
        df = schema.sort_steps(df)
        offs = core.offsets(df)
    timings["sort"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    env = df["env"]
    # one environment (the usual table): a comparison, not a hash of a million strings
    envs = [env[0]] if df.height and (env == env[0]).all() else sorted(env.unique().to_list())
    if cfg.retrospective:
        rules = load_rules(cfg.rules, envs)
        code = (pl.zeros(df.height, pl.UInt32, eager=True) if len(envs) == 1
                else df["env"].replace_strict({e: i for i, e in enumerate(envs)}, return_dtype=pl.UInt32))
        reward_aux, aux_kind = core.label_steps(df, rules, code)
    else:
        reward_aux = pl.zeros(df.height, pl.Float32, eager=True).alias("reward_aux")
        aux_kind = pl.repeat("none", df.height, dtype=pl.String, eager=True).alias("aux_kind")
    timings["labels"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    success = core.trajectory_success(offs, df["reward_env"])
    weight = core.step_weights(offs, success, df.height, cfg.weight_temporal, cfg.weight_success)
    df = df.with_columns(reward_aux, aux_kind, core.broadcast(offs, success, "success"), weight)
    if cfg.step_limit is not None:
        df = fill_steps_left(df, cfg.step_limit)
    timings["weights"] = time.perf_counter() - t0

    if tokenizer is not None:
        t0 = time.perf_counter()
        from qevolve_cli.prefix import add_prefix_positions

        pstats: dict[str, Any] = {}
        df = add_prefix_positions(df, tokenizer, max_length=cfg.max_length, window_context=cfg.window_context,
                                  stats=pstats)
        timings["prefix"] = time.perf_counter() - t0
        timings["prefix_stats"] = pstats  # fallbacks to the slow path, truncated / overlong steps

    if cfg.advantage == "gigpo" and (critic is not None or cfg.value_source != "critic"):
        what = "--critic" if critic is not None else f"value_source={cfg.value_source}"
        raise QevolveError(f"label config: field 'advantage': gigpo needs no values, but {what} gives them: drop one")
    if cfg.value_source != "critic":
        if critic is not None:
            raise QevolveError(f"--critic and value_source={cfg.value_source} both give values: choose one")
        t0 = time.perf_counter()
        from qevolve_cli.envs import oracle

        if cfg.value_source == "oracle":
            df = oracle.oracle_values(df, cfg.gamma, source=source, max_steps=cfg.oracle_max_steps)
        else:
            df = oracle.tabular_iql_values(df, cfg.gamma, cfg.expectile, cfg.fit_reward, source=source,
                                           max_steps=cfg.oracle_max_steps)
        timings["values"] = time.perf_counter() - t0

    if critic is not None:
        t0 = time.perf_counter()
        from qevolve_cli.critic.score import score_table

        # a feature critic reads the features its critic stage cached beside the same table (keyed on content)
        cache = Path(source).parent / "features" if isinstance(source, (str, Path)) else None
        df = score_table(df, critic, tokenizer=tokenizer, feature_cache=cache)
        timings["critic"] = time.perf_counter() - t0

    if cfg.advantage == "gigpo":  # critic-free: the table's own returns (values, if any, are not used)
        t0 = time.perf_counter()
        adv, stats = gigpo_advantages(df, offs, cfg.gigpo_gamma, cfg.gigpo_omega, cfg.gigpo_eps, cfg.gigpo_norm,
                                      cfg.gigpo_episode_stats)
        df = df.with_columns(adv["advantage"])
        timings["advantage"] = time.perf_counter() - t0
        timings["gigpo_stats"] = stats
    elif "value" in df.columns and "next_value" in df.columns:
        t0 = time.perf_counter()
        df = with_advantage(df, offs, cfg, source)
        timings["advantage"] = time.perf_counter() - t0
    elif require_advantage:
        raise QevolveError(f"advantage={cfg.advantage!r} needs critic values: pass --critic DIR "
                           "(or inputs with value/next_value)")
    return df, timings


def fill_steps_left(df: pl.DataFrame, limit: int) -> pl.DataFrame:
    """``steps_left`` = L - ``step`` where the table has none (the column added when missing), L the episode's
    limit under the run limit ``limit`` (:func:`qevolve_cli.envs.registry.episode_limit`: the task's own budget
    where it is tighter, as a rollout's episode has); the values a rollout wrote are kept."""
    from qevolve_cli.envs.registry import episode_limit

    has = "steps_left" in df.columns
    need = df.filter(pl.col("steps_left").is_null()) if has else df
    key = pl.concat_str([pl.col("env"), pl.col("task_id")], separator="\x00")
    limits = {f"{e}\x00{t}": episode_limit(e, t, limit)
              for e, t in need.select("env", "task_id").unique().iter_rows()}
    lim = (pl.lit(limit, pl.Int32) if all(v == limit for v in limits.values())
           else key.replace_strict(limits, default=limit, return_dtype=pl.Int32))
    fill = (lim - pl.col("step")).cast(pl.Int32)
    return df.with_columns((pl.coalesce(pl.col("steps_left"), fill) if has else fill).alias("steps_left"))


def with_advantage(df: pl.DataFrame, offs, cfg: LabelConfig, source: Any = None) -> pl.DataFrame:
    """Set ``next_value`` to 0 after terminal steps (V(terminal) = 0) and add ``advantage``."""
    adv = process_rewards(df, cfg.advantage, cfg.gamma, cfg.lam, offs=offs, source=source)
    return df.with_columns(
        pl.when(pl.col("done")).then(0.0).otherwise(pl.col("next_value")).cast(pl.Float32).alias("next_value"), adv
    )


def label_tables(
    inputs: list[str | Path],
    out: str | Path,
    cfg: LabelConfig | None = None,
    tokenizer: str | Path | None = None,
    critic: str | Path | None = None,
    require_advantage: bool = False,
) -> dict[str, Any]:
    """Library entry point of `qevolve label`; returns a summary (also what --json prints)."""
    cfg = cfg or LabelConfig()
    paths = [Path(p) for p in inputs]
    out = Path(out)
    if not paths:
        raise QevolveError("label: no input tables given")
    for p in paths:
        if p.resolve() == out.resolve():
            raise QevolveError(f"{out}: the output would overwrite an input table (inputs are never modified)")
    t_all = time.perf_counter()
    t0 = time.perf_counter()
    df, in_offsets = read_inputs(paths)
    t_read = time.perf_counter() - t0
    tok = None
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    elif critic is not None:
        tok = load_tokenizer(critic)
    df, timings = label_frame(df, cfg, tokenizer=tok, critic=critic, source=paths[0] if len(paths) == 1 else None,
                              require_advantage=require_advantage, offsets=in_offsets)
    t0 = time.perf_counter()
    check_finite(df, out)
    schema.write_table(df, out, producer="qevolve label", validate_rows=False)
    timings["write"] = time.perf_counter() - t0
    timings["read"] = t_read
    timings["total"] = time.perf_counter() - t_all
    kind = df["aux_kind"]
    # a comparison per known kind: a third of the time of a value_counts hash of a million strings
    kinds = {k: n for k in sorted(schema.AUX_KINDS) if (n := int((kind == k).sum()))}
    # trajectories are contiguous here: one row per trajectory at its offset (no group-by over the ids)
    # (the input's own offsets when label_frame did not have to sort it)
    offs = in_offsets if in_offsets is not None and critic is None else core.offsets(df)
    per_traj_success = df["success"].gather(offs.head(offs.len() - 1)) if df.height else df["success"]
    summary: dict[str, Any] = {
        "out": str(out),
        "inputs": [str(p) for p in paths],
        "trajectories": per_traj_success.len(),
        "steps": df.height,
        "success_rate": float(per_traj_success.cast(pl.Float64).mean() or 0.0),
        "aux_kind": kinds,
        "mean_weight": float(df["weight"].mean()),
        "columns": df.columns,
        "seconds": {k: round(v, 4) for k, v in timings.items() if isinstance(v, float)},
    }
    if "prefix_stats" in timings:
        summary["prefix"] = timings["prefix_stats"]
    if "gigpo_stats" in timings:
        summary["gigpo"] = timings["gigpo_stats"]
    if "advantage" in df.columns:
        summary["advantage_mean"] = float(df["advantage"].mean())
    return summary


def check_finite(df: pl.DataFrame, path: Path) -> None:
    # reward_aux and weight need no check: the core makes them from finite rule values (checked when
    # the rules compile) and weights in [0.5, 1]; critic values and advantages come from a model
    for c in ("value", "next_value", "advantage"):
        if c in df.columns and df[c].dtype.is_float():
            s = df[c]
            if (s.is_nan() | s.is_infinite()).any():
                raise TableError(path, c, "computed NaN/inf values (check the inputs); nothing was written")
