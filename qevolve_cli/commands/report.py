"""`qevolve report`: scores per split and iteration, environment steps and plots of a run directory."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qevolve_cli.commands.common import JsonOpt, emit_json, run_command

HELP = """Table of scores per split and iteration (BC, iter 1, ...) with the environment steps each used, the
critic's diagnostics, the choices made on validation, the wall time of the finished stages per iteration and
the stages not finished (running now, or stopped: rerun with --resume), and PNG plots (scores, critic
losses, advantage histograms by source) written into RUN_DIR/report/. It writes nothing else, so it can
watch a run in progress (docs/evolve.md, "Report").

\b
Examples:
  qevolve report runs/demo
  qevolve report runs/demo --summary      # one screen: BC vs each iteration, the critic's verdict, next steps
  qevolve report runs/sw --json | jq '.rows[-1]'
  qevolve report runs/sw --no-plots --json | jq '.stages.unfinished'
"""


def register(app: typer.Typer) -> None:
    @app.command("report", help=HELP)
    def report(
        run_dir: Annotated[Path, typer.Argument(help="Run directory of `qevolve evolve`.", show_default=False)],
        no_plots: Annotated[bool, typer.Option("--no-plots", help="Only the table.")] = False,
        summary: Annotated[bool, typer.Option("--summary", help="One screen instead of the tables: held-out success "
                                              "of BC and each iteration (every held-out task counted once), the "
                                              "critic's verdict and fit ladder, the plots, the next commands.")] = False,
        json_out: JsonOpt = False,
    ) -> None:
        def body() -> None:
            from qevolve_cli.evolve.report import build_report, print_table

            rep = build_report(run_dir, plots=not no_plots)
            if json_out:
                emit_json(rep)
            elif summary:
                from qevolve_cli.evolve.report import summary_lines

                typer.echo("\n".join(summary_lines(rep)))
            else:
                print_table(rep)

        run_command(body)
