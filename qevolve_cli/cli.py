"""The ``qevolve`` command line (Typer). Each command lives in ``qevolve_cli/commands/``.

Commands are imported on start-up, but none imports torch at module level, so
light commands (``label``, ``inspect``) start fast.
"""
from __future__ import annotations

import importlib

import typer

HELP = """Q-Evolve: self-evolving LLM agents for long-horizon text environments.

\b
The loop (docs/evolve.md): BC warm-up, then K times: rollout, label, critic, label --critic, policy (bppo).
\b
Examples:
  qevolve evolve --env textcraft --preset cpu --iters 1 --run-dir runs/demo
  qevolve expert --env textcraft --split train --out expert.parquet
  qevolve label expert.parquet self.parquet --out labeled.parquet
  qevolve inspect labeled.parquet --json
"""

app = typer.Typer(
    name="qevolve",
    help=HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# (module under qevolve_cli.commands, command name). A module defines
# `register(app)` that adds its command(s).
COMMAND_MODULES = [
    "rollout",
    "eval_cmd",
    "label",
    "critic",
    "policy",
    "evolve",
    "compare",
    "expert",
    "import_cmd",
    "init_model",
    "inspect_cmd",
    "report",
    "doctor",
]

for _mod in COMMAND_MODULES:
    try:
        _m = importlib.import_module(f"qevolve_cli.commands.{_mod}")
    except ModuleNotFoundError as _e:  # a command not built yet
        if _e.name != f"qevolve_cli.commands.{_mod}":
            raise
        continue
    _m.register(app)


def _print_version(value: bool) -> None:
    # an eager option callback runs while the arguments are parsed, before Click asks for a command
    if value:
        from qevolve_cli import __version__

        typer.echo(f"qevolve {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True,
                                 callback=_print_version, expose_value=True),
) -> None:
    del version  # handled by _print_version


def main() -> None:
    app()
