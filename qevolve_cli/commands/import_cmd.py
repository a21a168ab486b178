"""``qevolve import``: ETO / ShareGPT SFT JSON -> step table (thoughts kept)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qevolve_cli.commands.common import (
    EnvOpt,
    JsonOpt,
    OutOpt,
    QuietOpt,
    SplitOpt,
    check_choice,
    emit_json,
    run_command,
)

HELP = """Convert ETO / ShareGPT-style SFT JSON into a step table (source=expert, iteration=0).

Records: [{"id", "conversations": [{"from": "human"|"gpt", "value"}]}] or the
{"role", "content"} variant (also JSON Lines). Assistant turns become steps with the
full text (thought kept) as `action` and the parsed `Action:` as `command`; turns before
the first action (prompt, in-context examples) are dropped.

\b
Examples:
  qevolve import --format eto sft_alfworld.json --env alfworld --out alfworld_expert.parquet
  qevolve import --format eto webshop_sft.json --env webshop --out webshop_expert.parquet --json
"""


def register(app: typer.Typer) -> None:
    @app.command("import", help=HELP)
    def import_(
        file: Annotated[Path, typer.Argument(help="ETO / ShareGPT JSON file.")],
        env: EnvOpt,
        out: OutOpt,
        fmt: Annotated[str, typer.Option("--format", help="Input format: eto (ETO / ShareGPT conversations).")] = "eto",
        split: SplitOpt = "train",
        reward: Annotated[float, typer.Option("--reward", help="Final reward when a record has no 'reward' (ETO SFT data: successful experts).")] = 1.0,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,  # noqa: ARG001 - nothing to report on stderr: accepted like every stage's
    ) -> None:
        def body():
            from qevolve_cli.envs.eto import import_eto
            from qevolve_cli.envs.registry import ENV_NAMES
            from qevolve_cli.schema import write_table

            check_choice(fmt, ("eto",), "--format")
            check_choice(env, ENV_NAMES, "--env")
            df = import_eto(file, env, split=split, default_reward=reward)
            write_table(df, out, producer="qevolve import")
            n = df["traj_id"].n_unique()
            fmt_err = int(df["command"].null_count())
            if json_out:
                emit_json({"file": str(file), "env": env, "out": str(out), "trajectories": n, "steps": df.height,
                           "format_errors": fmt_err})
            else:
                typer.echo(f"{file}: {n} trajectories, {df.height} steps ({fmt_err} without an action) -> {out}")

        run_command(body)
