"""`qevolve compare`: baselines on a real (smoke-scale) `lamps` evolve run, subprocess and CliRunner."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from tests.conftest import ROOT, qevolve_env, run_qevolve

pytestmark = pytest.mark.slow


def per_traj(path: Path) -> pl.DataFrame:
    df = pl.read_parquet(path)
    return df.group_by("traj_id", maintain_order=True).agg(pl.col("task_id").first(), pl.col("source").first(),
                                                         pl.col("reward_env").sum().alias("reward"))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("cmp") / "run"
    r = run_qevolve("evolve", "--env", "lamps", "--preset", "smoke", "--iters", "1", "--run-dir", run, "--quiet",
                    "--json", timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return run


@pytest.fixture(scope="module")
def compared(run) -> dict:
    r = run_qevolve("compare", "--run-dir", run, "--json", "--quiet", timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)


def test_compare_table_rows_data_and_reuse(run, compared):
    t = compared
    assert [r["arm"] for r in t["rows"]] == ["sft", "rft", "eto", "best_of_n", "qevolve", "qevolve_oracle_v", "gigpo"]
    assert [r["oracle"] for r in t["rows"]] == [False, False, False, True, False, True, False]
    assert t["columns"] == ["lamps/test_seen", "lamps/test_unseen"]
    rows = {r["arm"]: r for r in t["rows"]}
    man = json.loads((run / "manifest.json").read_text())["stages"]
    cman = json.loads((run / "compare" / "manifest.json").read_text())["stages"]
    # SFT (= the BC policy) and Q-Evolve are the run's own evaluations, reused, not repeated
    for arm, k in (("sft", 0), ("qevolve", 1)):
        for split in ("test_seen", "test_unseen"):
            s = rows[arm]["scores"][f"lamps/{split}"]
            assert s["avg_reward"] == man[f"iter_{k}/eval_{split}"]["metrics"]["avg_reward"]
            assert s["source"].endswith(f"iter_{k}/eval_{split}")
    assert not [n for n in cman if n.startswith(("eval/sft", "eval/qevolve_test"))]
    # the training data of the arms, counted independently from the run's tables
    expert, rollout = per_traj(run / "expert.parquet"), per_traj(run / "iter_1" / "rollout.parquet")
    rft = json.loads((run / "compare" / "rft" / "policy" / "train_summary.json").read_text())
    assert rft["objective"] == "rft"
    assert rft["trajectories"] == expert.height + rollout.filter(pl.col("reward") >= 1).height
    eto = json.loads((run / "compare" / "eto" / "policy" / "train_summary.json").read_text())
    assert eto["objective"] == "dpo" and eto["ref"] == str(run / "bc" / "policy")
    exp_r = dict(zip(expert["task_id"], expert["reward"], strict=True))
    n_pairs = sum(1 for task, r in zip(rollout["task_id"], rollout["reward"], strict=True)
                  if task in exp_r and r != exp_r[task])
    assert n_pairs > 0 and eto["dpo_pairs"] == n_pairs
    # Best-of-N: N sampled trajectories per task, the best final reward kept
    for split in ("test_seen", "test_unseen"):
        bon = per_traj(run / "compare" / "eval" / f"best_of_n_{split}.parquet")
        n_tasks = bon["task_id"].n_unique()
        assert bon.height == 6 * n_tasks and rows["best_of_n"]["scores"][f"lamps/{split}"]["n"] == n_tasks
        best = bon.group_by("task_id").agg(pl.col("reward").max())["reward"].mean()
        assert rows["best_of_n"]["scores"][f"lamps/{split}"]["avg_reward"] == pytest.approx(best)
    # env steps: self-play rollouts used for training, and env steps at evaluation
    steps = pl.read_parquet(run / "iter_1" / "rollout.parquet").height
    assert [rows[a]["self_play_steps"] for a in ("sft", "rft", "eto", "best_of_n", "qevolve", "qevolve_oracle_v",
                                                  "gigpo")] == [0, steps, steps, 0, steps, steps, steps]
    # Q-Evolve (oracle V): the iteration-1 labels with V* (gamma^(d-1)): 1 before every finishing step, the
    # advantages of the same GAE; BPPO from BC with the run's policy_1 config
    assert rows["qevolve_oracle_v"]["method"] == "Q-Evolve (oracle V)"
    adv = pl.read_parquet(run / "compare" / "oracle_v" / "advantages.parquet")
    lab = pl.read_parquet(run / "iter_1" / "labeled.parquet")
    assert adv.height == lab.height and adv["traj_id"].to_list() == lab["traj_id"].to_list()
    finishing = adv.filter(pl.col("done") & (pl.col("reward_env") >= 1))
    assert finishing.height > 0 and finishing["value"].to_list() == [1.0] * finishing.height
    assert finishing["next_value"].to_list() == [0.0] * finishing.height
    assert (adv["value"] <= 1.0).all() and (adv["value"] >= 0.0).all() and adv["advantage"].is_finite().all()
    ov = json.loads((run / "compare" / "oracle_v" / "policy" / "train_summary.json").read_text())
    p1 = json.loads((run / "iter_1" / "policy" / "train_summary.json").read_text())
    assert ov["objective"] == p1["objective"] == "bppo" and ov["ref"] == str(run / "bc" / "policy")
    bon_steps = sum(pl.read_parquet(run / "compare" / "eval" / f"best_of_n_{s}.parquet").height
                    for s in ("test_seen", "test_unseen"))
    assert rows["best_of_n"]["eval_steps"] == bon_steps
    md = (run / "compare" / "table.md").read_text()
    assert md.startswith("| method | lamps/test_seen | lamps/test_unseen |") and "oracle upper bound" in md
    assert "| Q-Evolve (oracle V) |" in md and "the critic's ceiling" in md
    assert json.loads((run / "compare" / "table.json").read_text()) == t


def test_zero_shot_row_is_the_base_model_untrained(run, compared, tmp_path):
    """The zero-shot row evaluates the run's base model with the same eval config, trained on nothing; it is
    left out of the default rows only for a base initialised at random (the run's tiny model) and runs when
    named."""
    from qevolve_cli.evolve.compare import DEFAULT_ARMS as ARMS  # rft_2 is a row only when named
    from qevolve_cli.evolve.compare import default_arms
    from qevolve_cli.models import random_init

    assert random_init(run / "base_model") and "zero_shot" not in [r["arm"] for r in compared["rows"]]
    assert default_arms("lamps", run / "base_model") == [a for a in ARMS if a != "zero_shot"]
    # the same real model without qevolve's marker of a random init (a user's own model) gets the row
    own = tmp_path / "own"
    shutil.copytree(run / "base_model", own)
    (own / "qevolve_model.json").unlink()
    assert not random_init(own) and default_arms("lamps", own) == list(ARMS)
    assert default_arms("textcraft", own) == [a for a in ARMS if a != "qevolve_oracle_v"]  # no exact solver
    meta = json.loads((run / "base_model" / "qevolve_model.json").read_text())
    (own / "qevolve_model.json").write_text(json.dumps({**meta, "source": "smollm2-135m-instruct"}))
    assert not random_init(own)  # converted pretrained models name their source

    out = tmp_path / "cmp0"
    r = run_qevolve("compare", "--run-dir", run, "--out", out, "--set", "arms=[zero_shot, sft]", "--json",
                    "--quiet", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    t = json.loads(r.stdout)
    rows = {x["arm"]: x for x in t["rows"]}
    assert list(rows) == ["zero_shot", "sft"] and rows["zero_shot"]["method"] == "Zero-shot (base model)"
    z = rows["zero_shot"]
    assert z["expert_steps"] == 0 and z["self_play_steps"] == 0 and z["budget"] == [] and not z["oracle"]
    assert rows["sft"]["expert_steps"] > 0 and rows["sft"]["scores"] == {
        c: s for c, s in {x["arm"]: x for x in compared["rows"]}["sft"]["scores"].items()}
    for split in ("test_seen", "test_unseen"):
        ev = per_traj(out / "eval" / f"zero_shot_{split}.parquet")
        sft = per_traj(run / "iter_0" / f"eval_{split}.parquet")
        assert sorted(ev["task_id"]) == sorted(sft["task_id"])  # the same tasks as every other row
        assert z["scores"][f"lamps/{split}"]["avg_reward"] == pytest.approx(ev["reward"].mean())
        assert z["per_task"][f"lamps/{split}"] == dict(zip(ev["task_id"], ev["reward"], strict=True))
        assert z["eval_steps"] > 0
    md = (out / "table.md").read_text()
    assert "| Zero-shot (base model) |" in md and "no training" in md and "before any training" in md


def test_compare_resumes_and_refuses_to_overwrite(run, compared):
    r = run_qevolve("compare", "--run-dir", run, "--quiet", timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: {run / 'compare'}: a comparison already exists here; pass --resume to continue it or choose "
        "another --out"]
    # an evaluation lost (e.g. interrupted): --resume re-runs only that stage
    (run / "compare" / "eval" / "eto_test_seen.parquet").unlink()
    r = run_qevolve("compare", "--run-dir", run, "--resume", "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ran = [ln for ln in r.stderr.splitlines() if ln.startswith("[run]")]
    assert ran == ["[run]  eval/eto_test_seen (attempt 2, resuming)"] or ran == ["[run]  eval/eto_test_seen"], ran
    assert "[skip] rft (done)" in r.stderr and "[skip] eto (done)" in r.stderr and "[skip] oracle_v (done)" in r.stderr
    again = json.loads(r.stdout)
    assert again["rows"] == compared["rows"]  # greedy evaluation: the same score again
    # how a training arm runs may change on resume (its finished stages kept, the old compare.yaml archived);
    # what it makes may not
    r = run_qevolve("compare", "--run-dir", run, "--resume", "--set", "rft.checkpoint_every_steps=7", "--json",
                    timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    cc = run / "compare" / "compare.yaml"
    assert (f"compare: {cc}: only how the stages run changed (rft.checkpoint_every_steps default -> 7); every "
            "finished stage and checkpoint is kept (the earlier configuration kept as compare.prev-1.yaml)") in r.stderr
    assert "[skip] rft (done)" in r.stderr and not [ln for ln in r.stderr.splitlines() if ln.startswith("[run]")]
    assert "checkpoint_every_steps: 7" in cc.read_text()
    assert "checkpoint_every_steps" not in (run / "compare" / "compare.prev-1.yaml").read_text()
    assert json.loads(r.stdout)["rows"] == compared["rows"]
    # a bad value is refused before anything is written: compare.yaml stays as it was, nothing archived
    before = cc.read_text()
    r = run_qevolve("compare", "--run-dir", run, "--resume", "--set", "rft.checkpoint_every_steps=-3", "--quiet",
                    timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: compare config: rft: field 'checkpoint_every_steps': must be >= 0, got -3"], r.stderr
    assert cc.read_text() == before and not (run / "compare" / "compare.prev-2.yaml").exists()
    r = run_qevolve("compare", "--run-dir", run, "--resume", "--set", "rft.checkpoint_every_steps=7",
                    "--set", "rft.lr=0.001", "--quiet", timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        f"error: {cc}: the comparison was started with another configuration (hash "), r.stderr


def test_rft_2_rows_added_on_resume_are_rft_on_its_own_rollouts(run, compared, tmp_path):
    """`rft_2` (named, not a default row): the RFT policy plays the train tasks with the run's iteration-2 rollout
    config, then RFT from the base model on the expert table plus those rollouts' successes. Asked for on
    --resume, the finished stages of the other rows are kept and compare.yaml records the new rows; rft_2
    without rft is a one-line error."""
    cp = tmp_path / "run"
    shutil.copytree(run, cp)
    r = run_qevolve("compare", "--run-dir", cp, "--resume", "--set", "arms=[sft, rft_2]", "--quiet", timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --set arms: rft_2 starts from the rft arm's policy: name rft too"], r.stderr
    # stopped as soon as compare.yaml names the new rows: the old table (without them) is gone with it, so
    # nothing reads the stopped run as a finished comparison of these rows
    cmd = [sys.executable, "-m", "qevolve_cli", "compare", "--run-dir", str(cp), "--resume", "--set",
           "arms=[sft, rft, rft_2]", "--json"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=qevolve_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    cc, deadline = cp / "compare" / "compare.yaml", time.monotonic() + 300
    while "rft_2" not in cc.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    running = proc.poll() is None
    proc.kill()
    _, err = proc.communicate()
    assert running, err[-3000:]
    assert "compare: rows sft, rft, eto, best_of_n, qevolve, qevolve_oracle_v, gigpo -> sft, rft, rft_2" in err
    assert not (cp / "compare" / "table.json").exists() and not (cp / "compare" / "table.md").exists()
    r = run_qevolve("compare", "--run-dir", cp, "--resume", "--set", "arms=[sft, rft, rft_2]", "--json", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[skip] rft (done)" in r.stderr and "rft_2/rollout" in r.stderr
    t = json.loads(r.stdout)
    rows = {x["arm"]: x for x in t["rows"]}
    assert list(rows) == ["sft", "rft", "rft_2"] and rows["rft_2"]["method"] == "RFT (2 rounds)"
    assert rows["rft"]["scores"] == {x["arm"]: x for x in compared["rows"]}["rft"]["scores"]  # kept, not re-run
    roll = per_traj(cp / "compare" / "rft_2" / "rollout.parquet")
    man = json.loads((cp / "compare" / "manifest.json").read_text())["stages"]
    assert man["rft_2/rollout"]["inputs"] == [str(cp / "compare" / "rft" / "policy")]
    n_tasks = per_traj(cp / "iter_1" / "rollout.parquet")["task_id"].n_unique()
    assert roll["task_id"].n_unique() == n_tasks  # the train tasks of the run's rollouts
    summary = json.loads((cp / "compare" / "rft_2" / "policy" / "train_summary.json").read_text())
    expert = per_traj(cp / "expert.parquet")
    assert summary["objective"] == "rft" and summary["model"] == str(cp / "base_model")
    assert summary["data"] == f"{cp / 'expert.parquet'}, {cp / 'compare' / 'rft_2' / 'rollout.parquet'}"
    assert summary["trajectories"] == expert.height + roll.filter(pl.col("reward") >= 1).height
    steps = pl.read_parquet(cp / "iter_1" / "rollout.parquet").height
    assert rows["rft_2"]["self_play_steps"] == steps + pl.read_parquet(cp / "compare" / "rft_2" / "rollout.parquet").height
    import yaml

    assert yaml.safe_load((cp / "compare" / "compare.yaml").read_text())["arms"] == ["sft", "rft", "rft_2"]


def test_compare_bad_inputs_one_line_errors(run, tmp_path):
    from qevolve_cli.cli import app

    runner = CliRunner()
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(run / "config.yaml", partial / "config.yaml")
    shutil.copy(run / "expert.parquet", partial / "expert.parquet")
    shutil.copytree(run / "bc", partial / "bc")
    r = runner.invoke(app, ["compare", "--run-dir", str(partial), "--quiet"])
    assert r.exit_code == 2
    assert "no iteration-1 rollouts" in r.output and "qevolve evolve --iters 1" in r.output
    r = runner.invoke(app, ["compare", "--run-dir", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "not a qevolve evolve run directory" in r.output
    r = runner.invoke(app, ["compare", "--run-dir", str(run), "--set", "arms=[sft,ppo]", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and r.output.startswith("error: --set arms: unknown arm 'ppo'")  # the layer that set it
    r = runner.invoke(app, ["compare", "--run-dir", str(run), "--set", "arms=rft", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and r.output.strip() == ("error: --set arms: expected a list, got 'rft' "
                                                     "(write --set 'arms=[rft]')")
    assert not (tmp_path / "o").exists()
    # the oracle row needs an exact solver: named for an env without one, one line; by default it is dropped
    other = tmp_path / "textcraft_run"
    other.mkdir()
    (other / "config.yaml").write_text((run / "config.yaml").read_text().replace("env: lamps", "env: textcraft"))
    r = runner.invoke(app, ["compare", "--run-dir", str(other), "--set", "arms=[sft,qevolve_oracle_v]"])
    assert r.exit_code == 2 and "qevolve_oracle_v needs an exact solver, and 'textcraft' has none" in r.output
    r = runner.invoke(app, ["compare", "--run-dir", str(other)])
    assert r.exit_code == 2 and "no expert table" in r.output and "solver" not in r.output


def test_compare_refuses_a_run_directory_in_use(run, tmp_path):
    """compare takes the run directory's lock, as evolve does: while another process holds it (an evolve
    --resume rewriting the policies compare trains from, or a second compare) it stops with one line and
    writes nothing; once the holder is gone it goes on (here to the next problem of this bare directory)."""
    import signal
    import subprocess
    import sys

    from qevolve_cli.cli import app
    from qevolve_cli.lock import run_dir_lock
    from tests.conftest import ROOT, qevolve_env

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(run / "config.yaml", bare / "config.yaml")
    hold = subprocess.Popen([sys.executable, "-c", "import sys, time; from qevolve_cli.lock import acquire; "
                             "acquire(sys.argv[1], 'run'); print('held', flush=True); time.sleep(600)",
                             str(run_dir_lock(bare))], cwd=ROOT, env=qevolve_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert hold.stdout.readline().strip() == "held"
        r = CliRunner().invoke(app, ["compare", "--run-dir", str(bare), "--quiet"])
        assert r.exit_code == 2 and r.output.startswith(f"error: {bare}: in use by another qevolve process "
                                                        f"(pid {hold.pid};"), r.output
        assert len(r.output.strip().splitlines()) == 1 and not (bare / "compare").exists()
    finally:
        hold.send_signal(signal.SIGKILL)
        hold.wait(timeout=30)
    r = CliRunner().invoke(app, ["compare", "--run-dir", str(bare), "--quiet"])
    assert r.exit_code == 2 and "no expert table" in r.output


def test_compare_yaml_mirrors_the_config_defaults():
    from qevolve_cli.config import load_config
    from qevolve_cli.evolve.compare import CompareConfig
    from tests.conftest import ROOT

    assert load_config(CompareConfig, ROOT / "configs" / "compare.yaml") == CompareConfig()


def test_mean_se_hand_computed_and_against_statistics():
    import math
    import statistics

    from qevolve_cli.evolve.compare import mean_se

    assert mean_se([1.0, 3.0]) == (2.0, 1.0)  # sd sqrt(2), / sqrt(2)
    assert mean_se([5.0]) == (5.0, 0.0)
    assert all(math.isnan(x) for x in mean_se([]))
    xs = [0.525, 0.975, 0.6, 0.1]
    m, se = mean_se(xs)
    assert m == pytest.approx(statistics.fmean(xs)) and se == pytest.approx(statistics.stdev(xs) / 2)


def test_table_notes_name_the_rounds_of_self_play_and_the_rft_2_control(capsys):
    """After two iterations the table says that Q-Evolve had more rounds of self-play than RFT and how to add the
    control; with the control present it says what that row is; after one iteration neither (hand tables)."""
    from qevolve_cli.evolve.compare_table import table_markdown

    def table(k: int, arms: list[str]) -> str:
        rows = [{"arm": a, "method": a, "scores": {"lamps/test_seen": {"avg_reward": 0.5}}, "self_play_steps": 0,
                 "eval_steps": 0, "expert_steps": 10} for a in arms]
        return " ".join(table_markdown({"columns": ["lamps/test_seen"], "rows": rows, "env": "lamps", "seed": 0,
                                        "best_of": 6, "qevolve_iteration": k}).split())

    hint = "trained on 2 rounds of self-play, RFT on one"
    assert hint in table(2, ["sft", "rft", "qevolve"]) and "arms=[..., rft, rft_2, ...]" in table(2, ["rft", "qevolve"])
    assert "trained on 3 rounds" in table(3, ["sft", "rft", "qevolve"])
    with_control = table(2, ["sft", "rft", "rft_2", "qevolve"])
    assert hint not in with_control and "the control for the second round of self-play" in with_control
    for one in (table(1, ["sft", "rft", "qevolve"]), table(2, ["sft", "qevolve"]), table(2, ["sft", "rft"])):
        assert "rounds of self-play" not in one and "second round" not in one
    # the terminal table says it too, the arm list as written (not eaten as rich markup)
    from qevolve_cli.commands.compare import render

    rows = [{"arm": a, "method": a, "oracle": False, "scores": {}, "self_play_steps": 0, "eval_steps": 0}
            for a in ("sft", "rft", "qevolve")]
    render({"columns": ["lamps/test_seen"], "rows": rows, "env": "lamps", "seed": 0, "best_of": 6,
            "qevolve_iteration": 2})
    out = " ".join(capsys.readouterr().out.split())
    assert hint in out and "arms=[..., rft, rft_2, ...]" in out


def test_budget_of_and_text_name_each_step_and_its_temperature(tmp_path):
    """The budget column: epochs x lr x data per stage, a DPO step's beta and NLL weight, an AWR step's beta."""
    from qevolve_cli.evolve.compare_table import budget_of, budget_text

    def policy(name: str, cfg: dict, summary: dict) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.yaml").write_text(json.dumps(cfg))  # YAML reads JSON
        (d / "train_summary.json").write_text(json.dumps(summary))
        return d

    bc = policy("bc", {"objective": "bc", "epochs": 24, "lr": 2e-3}, {"trajectories": 64})
    awr = policy("awr", {"objective": "awr", "epochs": 24, "lr": 2e-3, "awr_beta": 0.25}, {"trajectories": 214})
    dpo = policy("dpo", {"objective": "dpo", "epochs": 2, "lr": 1e-4, "dpo_beta": 0.5, "dpo_nll_weight": 1.0},
                 {"dpo_pairs": 40})
    rows = [budget_of(bc, "BC"), budget_of(awr, "it 1"), budget_of(dpo, "ETO")]
    assert rows[1]["awr_beta"] == 0.25 and "awr_beta" not in rows[0]
    assert budget_text(rows) == ("BC 24 ep x 2e-03 x 64 traj; it 1 24 ep x 2e-03 x 214 traj (AWR beta 0.25); "
                                 "ETO 2 ep x 1e-04 x 40 pairs (beta 0.5, nll 1)")
    assert budget_of(tmp_path / "missing", "BC") is None


def test_compare_eto_without_preference_pairs_is_the_sft_policy(run, compared, tmp_path):
    """Every self trajectory ties with its task's expert (or has none): ETO has no pair to contrast, so its row
    is the SFT policy with a note instead of a failed comparison (a real case: a BC policy that solves all
    its rollout tasks)."""
    from qevolve_cli.evolve.compare import eto_pairs
    from qevolve_cli.policy.config import PolicyConfig

    d_cfg = PolicyConfig(objective="dpo")
    data = [str(run / "expert.parquet"), str(run / "iter_1" / "rollout.parquet")]
    assert eto_pairs(d_cfg, data)["pairs"] > 0  # the module's run has pairs: ETO trained a DPO step there
    cp = tmp_path / "run"
    shutil.copytree(run, cp, ignore=shutil.ignore_patterns("compare"))
    ro = pl.read_parquet(cp / "iter_1" / "rollout.parquet")
    last = pl.col("step") == pl.col("step").max().over("traj_id")
    ro.with_columns(pl.when(last).then(1.0).otherwise(0.0).cast(ro.schema["reward_env"]).alias("reward_env")) \
        .write_parquet(cp / "iter_1" / "rollout.parquet")
    info = eto_pairs(d_cfg, [str(cp / "expert.parquet"), str(cp / "iter_1" / "rollout.parquet")])
    assert info["pairs"] == 0 and info["tie"] > 0
    r = run_qevolve("compare", "--run-dir", cp, "--set", "arms=[sft,eto]", "--json", "--quiet", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["arm"]: row for row in json.loads(r.stdout)["rows"]}
    eto, sft = rows["eto"], rows["sft"]
    assert eto["selection_note"] == (f"no preference pair (tie {info['tie']}, without anchor {info['no_anchor']}): "
                                     "no DPO step, ETO is the SFT policy")
    assert [b["stage"] for b in eto["budget"]] == ["BC"] and eto["budget"] == sft["budget"]
    assert not (cp / "compare" / "eto").exists()  # nothing trained
    for col, s in sft["scores"].items():  # greedy evaluation of the same policy
        assert eto["scores"][col]["avg_reward"] == s["avg_reward"]
