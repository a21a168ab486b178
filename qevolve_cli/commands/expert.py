"""``qevolve expert``: expert trajectories of a split as a step table (source=expert, iteration=0)."""
from __future__ import annotations

from typing import Annotated

import typer

from qevolve_cli.commands.common import (
    EnvOpt,
    JsonOpt,
    OutOpt,
    QuietOpt,
    ShardOpt,
    SplitOpt,
    WorkersOpt,
    check_choice,
    emit_json,
    progress,
    run_command,
)

HELP = """Replay each task's expert plan through the real environment and write the trajectories.

Experts: SciWorld gold action sequences, ALFWorld gt_traj.json (train) or the PDDL
planner, TextCraft a plan from its crafting tree. Actions are ReAct text with a short
template thought ("Thought: The next step towards the goal is to <cmd>.\\nAction: <cmd>").
Only successful replays are written unless --keep-failed. Prints the success rate.

\b
Examples:
  qevolve expert --env textcraft --split train --out expert.parquet
  qevolve expert --env sciworld --split train --limit 200 --workers 2 --out sci_expert.parquet --json
  for i in 0 1 2 3; do qevolve expert --env alfworld --shard $i/4 --out alf_$i.parquet --json; done
"""


def register(app: typer.Typer) -> None:
    @app.command("expert", help=HELP)
    def expert(
        env: EnvOpt,
        out: OutOpt,
        split: SplitOpt = "train",
        limit: Annotated[int | None, typer.Option("--limit", "-n", help="Only the first N tasks of the split.")] = None,
        shard: ShardOpt = None,
        workers: WorkersOpt = 1,
        keep_failed: Annotated[bool, typer.Option("--keep-failed", help="Also write replays that did not succeed.")] = False,
        timeout_s: Annotated[float, typer.Option("--timeout", help="Seconds an env step may take before its worker is restarted.")] = 120.0,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        def body():
            from qevolve_cli.envs.expert import collect_expert
            from qevolve_cli.envs.registry import ENV_NAMES, list_tasks
            from qevolve_cli.errors import QevolveError
            from qevolve_cli.schema import write_table
            from qevolve_cli.shard import select_shard

            check_choice(env, ENV_NAMES, "--env")
            if workers < 1:
                raise QevolveError(f"--workers must be >= 1, got {workers}")
            tasks = list_tasks(env, split, limit)
            if shard is not None:
                tasks = select_shard(tasks, shard)
            if not tasks:
                raise QevolveError(f"{env}/{split}: no tasks selected (--limit {limit}, --shard {shard})")
            stats: dict = {}
            with progress(quiet) as prog:
                bar = prog.add_task(f"expert {env}/{split}", total=len(tasks), info="")
                df = collect_expert(env, split, tasks=tasks, workers=workers, keep_failed=keep_failed,
                                    timeout_s=timeout_s, stats=stats,
                                    on_progress=lambda d, n, s: prog.update(bar, completed=d, info=f"ok {s}/{d}"))
            write_table(df, out, producer="qevolve expert")
            summary = {"env": env, "split": split, "shard": shard, "out": str(out), "tasks": stats["tasks"],
                       "succeeded": stats["succeeded"], "failed": stats["failed"], "errors": stats["errors"],
                       "success_rate": round(stats["success_rate"], 4), "trajectories": df["traj_id"].n_unique(),
                       "steps": df.height}
            if json_out:
                emit_json(summary)
            else:
                typer.echo(f"{env}/{split}: {stats['succeeded']}/{stats['tasks']} expert replays succeeded "
                           f"({100 * stats['success_rate']:.1f}%), {df.height} steps -> {out}")

        run_command(body)
