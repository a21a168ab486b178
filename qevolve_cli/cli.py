"""The ``qevolve`` command line (Typer). Each command lives in ``qevolve_cli/commands/``.

No command imports torch at module level, and ``qevolve NAME ...`` imports and
registers only the module of NAME (a light command such as ``label`` does not
pay for the other twelve); ``qevolve --help`` and ``from qevolve_cli.cli import
app`` get every command.
"""
from __future__ import annotations

import importlib
import re
import sys

import typer

HELP = """Q-Evolve: self-evolving LLM agents for long-horizon text environments.

The loop (docs/evolve.md): BC warm-up, then K times: rollout, label, critic, label --critic, policy (bppo).

\b
Examples:
  qevolve evolve --env textcraft --preset cpu --iters 1 --run-dir runs/demo
  qevolve expert --env textcraft --split train --out expert.parquet
  qevolve label expert.parquet self.parquet --out labeled.parquet
  qevolve inspect labeled.parquet --json
"""

# command name -> module under qevolve_cli.commands; a module defines `register(app)` that adds
# exactly that command (tests/test_cli_basics.py checks the map against what the modules register)
COMMANDS = {
    "rollout": "rollout",
    "eval": "eval_cmd",
    "label": "label",
    "critic": "critic",
    "policy": "policy",
    "evolve": "evolve",
    "compare": "compare",
    "expert": "expert",
    "import": "import_cmd",
    "init-model": "init_model",
    "inspect": "inspect_cmd",
    "report": "report",
    "doctor": "doctor",
    "plan": "plan",
}
COMMAND_MODULES = list(COMMANDS.values())


def build_app(only: str | None = None) -> typer.Typer:
    """The Typer app with every command, or with only the command ``only`` (a key of COMMANDS)."""
    app = typer.Typer(
        name="qevolve",
        help=reflow(HELP),
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    app.callback()(_root)
    for name, mod in COMMANDS.items():
        if only is None or name == only:
            importlib.import_module(f"qevolve_cli.commands.{mod}").register(app)
    for info in app.registered_commands:
        info.help = reflow(info.help)
    return app


def reflow(text: str | None) -> str | None:
    """A command's help for Typer's rich mode, which keeps every line break after the first paragraph: the lines
    of each prose paragraph joined into one (the terminal wraps it to its width), paragraphs that start with
    ``\\b`` (lists, formulas, examples) kept line for line. ``\\b`` also starts a paragraph without a blank
    line before it."""
    if not text:
        return text
    paras = re.sub(r"(?<!\n)\n\x08\n", "\n\n\x08\n", text).split("\n\n")
    return "\n\n".join(p if p.lstrip().startswith("\b") else " ".join(ln.strip() for ln in p.splitlines() if ln.strip())
                        for p in paras)


def _print_version(value: bool) -> None:
    # an eager option callback runs while the arguments are parsed, before Click asks for a command
    if value:
        from qevolve_cli import __version__

        typer.echo(f"qevolve {__version__}")
        raise typer.Exit()


def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True,
                                 callback=_print_version, expose_value=True),
) -> None:
    del version  # handled by _print_version


def __getattr__(name: str) -> typer.Typer:
    # `from qevolve_cli.cli import app` (tests, embedding): built on first use, every command
    if name == "app":
        globals()["app"] = built = build_app()
        return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    # the first argument names the command (options come after it; the only root options are
    # --help and --version, for which every command is registered, as for an unknown name)
    first = sys.argv[1] if len(sys.argv) > 1 else None
    build_app(first if first in COMMANDS else None)()
