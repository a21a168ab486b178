"""Top-level CLI behaviour: --version, flag names in range errors, --quiet, help texts citing docs/."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from qevolve_cli import __version__
from qevolve_cli.cli import COMMAND_MODULES, COMMANDS, app, build_app
from tests.conftest import ROOT, run_qevolve

runner = CliRunner()


def test_version_cli_runner_and_subprocess():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"qevolve {__version__}"
    proc = run_qevolve("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"qevolve {__version__}", proc.stderr
    assert "Missing command" not in proc.stderr


@pytest.mark.parametrize("args,flag", [
    (["policy", "--data", "d.parquet", "--model", "m", "--out", "o", "--lr", "-1"], "--lr"),
    (["policy", "--data", "d.parquet", "--model", "m", "--out", "o", "--set", "lr=-1"], "--set lr"),
    (["critic", "--data", "d.parquet", "--model", "m", "--out", "o", "--epochs", "0"], "--epochs"),
    (["rollout", "--env", "textcraft", "--policy", "m", "--out", "o.parquet", "--n-per-task", "0"], "--n-per-task"),
    (["eval", "--env", "textcraft", "--policy", "m", "--split", "test_seen", "--temperature", "-1"], "--temperature"),
    (["evolve", "--env", "textcraft", "--preset", "cpu", "--iters", "-1", "--run-dir", "r"], "--iters"),
    (["label", "x.parquet", "--out", "y.parquet", "--advantage", "foo"], "--advantage"),
])
def test_out_of_range_flag_is_named(args, flag, tmp_path):
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert line.startswith(f"error: {flag}: must be ") and "\n" not in line, line
    assert "defaults" not in line and "field" not in line
    assert not (tmp_path / "o").exists()


def test_bad_value_from_config_file_still_names_the_file(tmp_path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("lr: -2\n")
    r = runner.invoke(app, ["policy", "--data", "d", "--model", "m", "--out", "o", "--config", str(cfg)])
    assert r.exit_code == 2 and r.output.strip() == f"error: {cfg}: field 'lr': must be > 0, got -2.0"
    # the flag overrides the file: a good --lr fixes it, a bad one is blamed on the flag
    r = runner.invoke(app, ["policy", "--data", "d", "--model", "m", "--out", "o", "--config", str(cfg),
                            "--lr", "0"])
    assert r.output.strip() == "error: --lr: must be > 0, got 0.0"


@pytest.mark.parametrize("mod", COMMAND_MODULES)
def test_help_cites_docs_not_the_spec(mod):
    name = {"eval_cmd": "eval", "import_cmd": "import", "inspect_cmd": "inspect", "init_model": "init-model"}.get(mod, mod)
    r = runner.invoke(app, [name, "--help"])
    assert r.exit_code == 0, r.output
    assert "SPEC" not in r.output and "§" not in r.output
    top = runner.invoke(app, ["--help"]).output
    assert "SPEC" not in top and "docs/" in top


def test_reflow_joins_prose_and_keeps_lists():
    from qevolve_cli.cli import reflow

    text = "First line\nof the first.\n\nA prose\nparagraph.\n\b\nExamples:\n  qevolve a\n  qevolve b"
    assert reflow(text) == "First line of the first.\n\nA prose paragraph.\n\n\b\nExamples:\n  qevolve a\n  qevolve b"
    assert reflow("x\n\n\b\nkept\n  as is") == "x\n\n\b\nkept\n  as is"  # no third newline before \b


def test_help_reads_in_an_80_column_terminal():
    """Prose paragraphs are joined (the terminal wraps them); the lines kept as written (\\b blocks: lists,
    examples) fit 80 columns, example commands excepted. A help line that rich had to break mid-sentence fails."""
    import re

    fixed = [(info.name, line) for info in build_app().registered_commands for para in info.help.split("\n\n")
             if para.startswith("\b") for line in para.split("\n")[1:]]
    assert len(fixed) > 50  # the examples and lists of every command
    too_long = [(n, line) for n, line in fixed
                if len(line) > 78 and not re.match(r"\s+(qevolve|python|for |nice|make|~)", line)]
    assert too_long == []
    r = run_qevolve("evolve", "--help", env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    lines = [ln.strip(" │") for ln in r.stdout.splitlines()]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Presets:"))
    para = lines[start : start + next(k for k, ln in enumerate(lines[start:]) if not ln.strip())]
    assert len(para) >= 3 and all(len(ln) >= 60 for ln in para[:-1]), para  # filled lines, no ragged source breaks


def test_docs_exist_that_user_text_cites():
    import re

    texts = [(ROOT / "README.md").read_text()] + [p.read_text() for p in (ROOT / "qevolve_cli").rglob("*.py")]
    cited = set()
    for t in texts:
        cited |= set(re.findall(r"docs/([a-z_]+\.md)", t))
    assert cited and all((ROOT / "docs" / c).is_file() for c in cited), cited


def test_init_model_quiet(tmp_path):
    loud = run_qevolve("init-model", "--out", tmp_path / "a", check=True)
    assert "init-model:" in loud.stderr and loud.stdout.startswith("wrote llama/tiny model")
    quiet = run_qevolve("init-model", "--out", tmp_path / "b", "--quiet", check=True, fresh=True)  # a whole process
    assert quiet.stderr == "" and quiet.stdout.startswith("wrote llama/tiny model")
    assert (tmp_path / "b" / "model.safetensors").is_file()


def test_command_map_matches_what_the_modules_register():
    """`qevolve NAME` registers only NAME's module: the map must name every command, each module
    must register exactly its command, and a one-command app gives the same help as the full one."""
    import typer.main

    assert sorted(typer.main.get_command(app).commands) == sorted(COMMANDS)
    for name in COMMANDS:
        one = build_app(name)
        assert list(typer.main.get_command(one).commands) == [name]
        assert runner.invoke(one, [name, "--help"]).output == runner.invoke(app, [name, "--help"]).output


def test_a_command_imports_only_its_own_module():
    import subprocess
    import sys

    from tests.conftest import qevolve_env

    code = ("import sys; from qevolve_cli.cli import main\n"
            "sys.argv = ['qevolve', 'label', '--help']\n"
            "try: main()\n"
            "except SystemExit as e: assert e.code in (0, None), e.code\n"
            "print(sorted(m for m in sys.modules if m.startswith('qevolve_cli.commands.')))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=qevolve_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "qevolve label" in p.stdout
    assert p.stdout.strip().splitlines()[-1] == "['qevolve_cli.commands.common', 'qevolve_cli.commands.label']"
    # no command or an unknown one: every command is there to list or to suggest
    top = run_qevolve("--help")
    assert top.returncode == 0 and all(name in top.stdout for name in COMMANDS)
    bad = run_qevolve("lable")
    assert bad.returncode == 2 and "No such command" in bad.stderr


def test_start_up_gc_is_turned_back_on_for_command_bodies():
    """The entry point runs the start-up imports without the cyclic collector; run_command turns it
    back on before a body, unless a short command asks to finish without it. Library callers (no
    entry point) are never affected."""
    import subprocess
    import sys

    from tests.conftest import qevolve_env

    code = ("import gc\n"
            "from qevolve_cli.commands.common import run_command\n"
            "print(gc.isenabled(), run_command(gc.isenabled))\n"  # no entry point: on, untouched
            "import qevolve_cli.__main__ as entry\n"  # imported only (a spawned worker): still on
            "print(gc.isenabled())\n"
            "entry.startup_without_gc()\n"  # what main() does first
            "print(gc.isenabled(), run_command(gc.isenabled, keep_gc_off=True), run_command(gc.isenabled),\n"
            "      run_command(gc.isenabled, keep_gc_off=True))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=qevolve_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:3] == ["True True", "True", "False False True True"]


def test_every_command_body_runs_through_run_command():
    """run_command maps errors to one line and turns the collector back on: every command uses it."""
    import ast

    for name, mod in COMMANDS.items():
        tree = ast.parse((ROOT / "qevolve_cli" / "commands" / f"{mod}.py").read_text())
        cmds = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                and any(isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "command" for d in f.decorator_list)]
        assert cmds, name
        for f in cmds:
            calls = {getattr(c.func, "id", "") for c in ast.walk(f) if isinstance(c, ast.Call)}
            assert "run_command" in calls, f"{mod}.{f.name}"
