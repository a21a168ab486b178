"""Options every command shares: each command that reports progress takes the one `--quiet` of
commands/common.py (QuietOpt), and a quiet run says nothing on stderr."""
from __future__ import annotations

import importlib
import inspect

import typer
from conftest import run_qevolve

from qevolve_cli import schema
from qevolve_cli.cli import COMMANDS, build_app
from qevolve_cli.commands.common import QuietOpt
from qevolve_cli.synthetic import synthetic_table

# commands that print their result on stdout and report no progress (checked below against their source);
# every other command takes --quiet, also the stages with nothing to report yet (import): a script passes
# --quiet to every stage
NO_PROGRESS = {
    "inspect": "statistics of one table on stdout (one warning line at most)",
    "report": "the score table of a finished run on stdout",
    "plan": "memory and time estimates on stdout, nothing is run",
}
# what reporting progress looks like in a command module
PROGRESS_MARKERS = ("progress(", "stderr_console(", "ProgressView(")


def test_every_command_that_reports_progress_takes_the_shared_quiet() -> None:
    shared = QuietOpt.__metadata__[0]  # the typer.Option of commands/common.py
    commands = typer.main.get_command(build_app()).commands
    assert set(commands) == set(COMMANDS)
    for name, cmd in commands.items():
        src = inspect.getsource(importlib.import_module(f"qevolve_cli.commands.{COMMANDS[name]}"))
        quiet = [p for p in cmd.params if "--quiet" in p.opts]
        if name in NO_PROGRESS:
            markers = [m for m in PROGRESS_MARKERS if m in src]
            assert not markers, f"{name} reports progress ({markers}): give it QuietOpt and drop it from NO_PROGRESS"
            continue
        assert quiet, f"qevolve {name} reports progress but has no --quiet (commands/common.py QuietOpt)"
        (q,) = quiet
        assert (sorted(q.opts), q.help, q.is_flag, q.default) == (
            ["--quiet", "-q"], shared.help, True, False), name


def test_label_and_import_quiet_say_nothing_on_stderr(tmp_path) -> None:
    table = tmp_path / "expert.parquet"
    schema.write_table(synthetic_table(3, mean_steps=4, seed=1, source="expert", iteration=0, p_success=1.0), table)
    loud = run_qevolve("label", table, "--out", tmp_path / "l1.parquet", check=True)
    assert "wrote" in loud.stderr  # the summary line --quiet silences
    quiet = run_qevolve("label", table, "--out", tmp_path / "l2.parquet", "--quiet", check=True, fresh=True)
    assert quiet.stderr == "" and quiet.stdout == ""
    assert (tmp_path / "l2.parquet").exists()
    js = run_qevolve("label", table, "--out", tmp_path / "l3.parquet", "-q", "--json", check=True, fresh=True)
    assert js.stderr == "" and '"steps"' in js.stdout  # --json still prints its object on stdout

    src = tmp_path / "sft.json"
    src.write_text('[{"id": "t0", "conversations": [{"from": "human", "value": "Your task is to: put a lamp."}, '
                   '{"from": "gpt", "value": "Thought: go.\\nAction: go to desk 1"}]}]')
    imp = run_qevolve("import", src, "--env", "alfworld", "--out", tmp_path / "i.parquet", "--quiet", check=True,
                      fresh=True)
    assert imp.stderr == "" and (tmp_path / "i.parquet").exists()
