"""`qevolve inspect`: summary statistics of a step table."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from qevolve_cli.commands.common import JsonOpt, emit_json, run_command

HELP = """Summarise a trajectory table: trajectories, steps, success, counts, value/advantage stats.

On a table scored by a critic (`qevolve label --critic`: value, next_value, advantage)
it adds the critic diagnostics (docs/critic.md#diagnostics): explained variance of V
against the discounted return, AUC of V for success, Bellman/TD errors, mean advantage
by source x success x aux_kind and the share of failed self steps with A > 0.

\b
Examples:
  qevolve inspect labeled.parquet
  qevolve inspect labeled.parquet --json | jq .success_rate
"""


def table_stats(path: Path) -> dict[str, Any]:
    import polars as pl

    from qevolve_cli import schema

    df = schema.read_table(path)
    per_traj = df.group_by("traj_id").agg(
        pl.len().alias("steps"),
        pl.col("reward_env").sum().alias("reward"),
        (pl.col("success").first() if "success" in df.columns else (pl.col("reward_env").sum() != 0)).alias("success"),
    )
    out: dict[str, Any] = {
        "file": str(path),
        "schema_version": schema.schema_version(path),
        "trajectories": per_traj.height,
        "steps": df.height,
        "mean_steps": float(per_traj["steps"].mean()),
        "max_steps": int(per_traj["steps"].max()),
        "mean_reward": float(per_traj["reward"].mean()),
        "success_rate": float(per_traj["success"].cast(pl.Float64).mean()),
        "columns": df.columns,
    }
    firsts = df.group_by("traj_id").agg(pl.col(c).first() for c in ("env", "split", "source", "iteration"))
    for c in ("env", "split", "source", "iteration"):
        vc = firsts[c].value_counts().sort(c)
        out[f"trajectories_by_{c}"] = {str(k): int(v) for k, v in zip(vc[c].to_list(), vc["count"].to_list(), strict=True)}
    if "aux_kind" in df.columns:
        vc = df["aux_kind"].value_counts().sort("aux_kind")
        out["steps_by_aux_kind"] = dict(zip(vc["aux_kind"].to_list(), vc["count"].to_list(), strict=True))
    if "error" in df.columns:
        out["failed_trajectories"] = int(df.filter(pl.col("error").is_not_null())["traj_id"].n_unique())
    for c in ("weight", "value", "next_value", "advantage"):
        if c in df.columns and df[c].null_count() < df.height:
            s = df[c].drop_nulls()
            out[f"{c}_stats"] = {
                "mean": float(s.mean()), "std": float(s.std() or 0.0), "min": float(s.min()),
                "p50": float(s.quantile(0.5)), "max": float(s.max()),
            }
    if "advantage" in df.columns:
        by = df.group_by("source").agg(pl.col("advantage").mean().alias("m"), (pl.col("advantage") > 0).mean().alias("pos"))
        out["advantage_by_source"] = {r["source"]: {"mean": r["m"], "positive_share": r["pos"]} for r in by.iter_rows(named=True)}
    if "value" in df.columns and df["value"].null_count() == 0:
        from qevolve_cli.critic.diagnostics import diagnose, verdict

        d = diagnose(df)  # on every trajectory of the table (gamma 0.95, m 0.7, shaped return)
        d.pop("v_by_step", None)
        d["problems"] = verdict(d)
        out["critic_diagnostics"] = d
    return out


def register(app: typer.Typer) -> None:
    @app.command("inspect", help=HELP)
    def inspect(
        file: Annotated[Path, typer.Argument(help="Step table (Parquet).", show_default=False)],
        json_out: JsonOpt = False,
    ) -> None:
        def body() -> None:
            stats = table_stats(file)
            if json_out:
                emit_json(stats)
                return
            from rich.console import Console
            from rich.table import Table

            t = Table(title=str(file), show_header=False)
            for k in ("trajectories", "steps", "mean_steps", "max_steps", "mean_reward", "success_rate", "failed_trajectories"):
                if k in stats:
                    v = stats[k]
                    t.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
            for k, v in stats.items():
                if k.startswith(("trajectories_by_", "steps_by_")):
                    t.add_row(k, ", ".join(f"{a}={b}" for a, b in v.items()))
                elif k.endswith("_stats"):
                    t.add_row(k, ", ".join(f"{a}={b:.4f}" for a, b in v.items()))
            d = stats.get("critic_diagnostics")
            if d:
                from qevolve_cli.critic.diagnostics import summary_line

                t.add_row("critic", summary_line(d))
                if d.get("failed_self_pos_adv") is not None:
                    t.add_row("failed self steps with A > 0", f"{100 * d['failed_self_pos_adv']:.1f} %")
                for g in d.get("adv_by_group", []):
                    key = " ".join(f"{k}={g[k]}" for k in ("source", "success", "aux_kind") if k in g)
                    t.add_row(f"advantage {key}", f"mean {g['mean']:+.4f}, A>0 {100 * g['pos_share']:.0f} %, "
                              f"{g['steps']} steps")
            Console().print(t)
            if d and d.get("problems"):
                typer.echo(f"qevolve inspect: warning: the values look unlearned ({'; '.join(d['problems'])}); "
                           "see docs/critic.md#diagnostics", err=True)

        run_command(body)
