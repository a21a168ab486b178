"""Top-level CLI behaviour: --version, flag names in range errors, --quiet, help texts citing docs/."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from qevolve_cli import __version__
from qevolve_cli.cli import COMMAND_MODULES, app
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
    quiet = run_qevolve("init-model", "--out", tmp_path / "b", "--quiet", check=True)
    assert quiet.stderr == "" and quiet.stdout.startswith("wrote llama/tiny model")
    assert (tmp_path / "b" / "model.safetensors").is_file()
