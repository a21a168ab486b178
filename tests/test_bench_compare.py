"""benchmarks/bench_compare.py --keep-tables: a finished seed's table, kept as a small file, is read back in place of
its run directory, for the same configuration only (the arm list, which follows the run's base model, aside)."""
from __future__ import annotations

import json

import pytest

from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def bc():
    return load_benchmark("bench_compare")


def test_kept_table_is_read_back_for_the_same_configuration_only(bc, tmp_path):
    run = tmp_path / "lamps-habit-cpu-s0"  # never created: the run directory is gone
    cfg = bc.evolve_config("lamps-habit", "cpu", 0, 2, True, 0)
    ccfg = bc.compare_config("lamps-habit", 6, True, run)
    table = {"columns": ["lamps-habit/test_seen"], "rows": [{"arm": "sft", "per_task": {"lamps-habit/test_seen": {"t1": 1.0}}}]}
    kept = tmp_path / "tables" / "lamps-habit-cpu-s0.json"
    assert bc.kept_table(kept, cfg, ccfg) is None  # nothing kept yet
    finished_with = ccfg.replace(arms=[a for a in ccfg.arms if a != "zero_shot"])  # as the run's tiny base gave
    bc.keep_table(kept, cfg, finished_with, table, {"evolve_s": 1.0})
    assert json.loads(kept.read_text())["arms"] == list(finished_with.arms)
    assert not list(kept.parent.glob("*.tmp"))
    assert bc.kept_table(kept, cfg, ccfg) == table  # read although the arm lists differ
    assert bc.kept_table(kept, bc.evolve_config("lamps-habit", "cpu", 1, 2, True, 0), ccfg) is None  # another seed
    assert bc.kept_table(kept, bc.evolve_config("lamps-habit", "cpu", 0, 1, True, 0), ccfg) is None  # one iteration
    assert bc.kept_table(kept, cfg, bc.compare_config("lamps-habit", 4, True, run)) is None  # Best-of-4
    # --add-arms rft_2: the kept table lacks the row, so the seed runs again; once kept with it, both read it
    with_rft2 = bc.compare_config("lamps-habit", 6, True, run, ("rft_2",))
    assert with_rft2.arms.index("rft_2") == with_rft2.arms.index("rft") + 1  # in the table's order
    assert bc.kept_table(kept, cfg, with_rft2) is None
    bc.keep_table(kept, cfg, with_rft2.replace(arms=[*finished_with.arms[:2], "rft_2", *finished_with.arms[2:]]),
                  table, {"evolve_s": 1.0})
    assert bc.kept_table(kept, cfg, with_rft2) == table and bc.kept_table(kept, cfg, ccfg) == table
    # made with other checkpoint frequencies: the same work, read back; anything else with them is not
    ckpt = cfg.replace(critic={**cfg.critic, "checkpoint_every_steps": 9})
    assert ckpt.hash() != cfg.hash() and bc.kept_table(kept, ckpt, ccfg) == table
    assert bc.kept_table(kept, ckpt.replace(critic={**ckpt.critic, "epochs": 2}), ccfg) is None
    # a table kept before the work hash was stored: read by its exact hash, and the work hash added to it
    old = {k: v for k, v in json.loads(kept.read_text()).items() if k != "evolve_work_hash"}
    kept.write_text(json.dumps(old))
    assert bc.kept_table(kept, ckpt, ccfg) is None and bc.kept_table(kept, cfg, ccfg) == table
    assert json.loads(kept.read_text()) == {**old, "evolve_work_hash": cfg.work_hash()}
    assert bc.kept_table(kept, ckpt, ccfg) == table


def test_finished_table_needs_every_row_of_the_comparison(bc, tmp_path):
    """A run directory's table is a finished seed only when made with this configuration and holding every row
    asked for: a table from before --add-arms rft_2 (compare.yaml already naming the row: a comparison stopped by
    compare from before 2026-11-28) is not."""
    from qevolve_cli.config import dump_yaml

    run = tmp_path / "lamps-habit-cpu-s0"
    (run / "compare").mkdir(parents=True)
    cfg = bc.evolve_config("lamps-habit", "cpu", 0, 2, True, 0)
    ccfg = bc.compare_config("lamps-habit", 6, True, run, ("rft_2",))
    dump_yaml(cfg, run / "config.yaml")
    dump_yaml(ccfg, run / "compare" / "compare.yaml")
    rows = [{"arm": a} for a in ccfg.arms if a != "rft_2"]
    (run / "compare" / "table.json").write_text(json.dumps({"rows": rows}))
    assert bc.finished_table(run, cfg, ccfg) is None  # the rft_2 row is missing
    assert bc.finished_table(run, cfg, bc.compare_config("lamps-habit", 6, True, run)) is None  # other arms: hash
    rows.append({"arm": "rft_2"})
    (run / "compare" / "table.json").write_text(json.dumps({"rows": rows}))
    assert bc.finished_table(run, cfg, ccfg) == {"rows": rows}
    assert bc.finished_table(run, bc.evolve_config("lamps-habit", "cpu", 1, 2, True, 0), ccfg) is None  # seed
    # a run made with other checkpoint frequencies did the same work: its table is this configuration's
    ckpt = cfg.replace(bc={**cfg.bc, "checkpoint_every_steps": 7}, critic={**cfg.critic, "checkpoint": False})
    assert ckpt.hash() != cfg.hash() and bc.finished_table(run, ckpt, ccfg) == {"rows": rows}
    assert bc.finished_table(run, cfg.replace(bc={**cfg.bc, "checkpoint_every_steps": 7, "epochs": 1}), ccfg) is None


def test_summary_pairs_every_arm_with_rft_2_where_every_seed_has_it(bc):
    """Paired differences against RFT, SFT and, where every seed has the row, RFT with two rounds (hand cases: two
    seeds of two tasks); a row only some seeds have is left out of the summary."""
    def row(arm, r1, r2):
        return {"arm": arm, "method": arm.upper(), "oracle": False, "self_play_steps": 0, "eval_steps": 0,
                "per_task": {"e/test": {"a": r1, "b": r2}}}

    t0 = {"columns": ["e/test"], "rows": [row("sft", 0, 0), row("rft", 1, 0), row("rft_2", 1, 1), row("qevolve", 1, 1)]}
    t1 = {"columns": ["e/test"], "rows": [row("sft", 0, 1), row("rft", 0, 1), row("rft_2", 0, 0), row("qevolve", 1, 1)]}
    s = bc.summarize([t0, t1], n_boot=200)
    q = s["qevolve"]["columns"]["e/test"]
    assert q["minus_rft"]["mean"] == pytest.approx(0.5) and q["minus_sft"]["mean"] == pytest.approx(0.75)
    assert q["minus_rft_2"]["mean"] == pytest.approx(0.5)  # (0 + 0 + 1 + 1) / 4
    assert "minus_rft_2" not in s["rft_2"]["columns"]["e/test"]
    md = bc.markdown("e", [0, 1], s, ["e/test"])
    assert "| e/test − RFT (2 rounds) |" in md and "| QEVOLVE | " in md
    t1["rows"] = [r for r in t1["rows"] if r["arm"] != "rft_2"]  # a seed without the row
    s = bc.summarize([t0, t1], n_boot=200)
    assert "rft_2" not in s and "minus_rft_2" not in s["qevolve"]["columns"]["e/test"]
    assert "RFT (2 rounds)" not in bc.markdown("e", [0, 1], s, ["e/test"])


def test_budget_cell_names_every_stage_and_its_candidates(bc):
    """The budget table of docs/compare.md: each training stage as epochs x lr x data; each selection's candidates'
    validation scores after the stage it chose, the chosen one bold; Q-Evolve's selections are its iteration
    stages (its BC is SFT's), an arm without one says why."""
    def sel(vals, chosen):
        return {"candidates": [{"val_avg_reward": v} for v in vals], "chosen_index": chosen}

    bc_stage = {"stage": "BC", "epochs": 48, "lr": 2e-3, "data": 64, "unit": "traj"}
    sft = {"budget": [bc_stage], "selection": sel([0.525, 0.425, 0.725], 2)}
    assert bc.budget_cell(sft) == "BC 48 ep x lr 2e-03 x 64 traj [52.5/42.5/**72.5**]"
    qe = {"budget": [bc_stage, {"stage": "it 1", "epochs": 24, "lr": 2e-3, "data": 214, "unit": "traj"},
                     {"stage": "it 2", "epochs": 12.0, "lr": 2e-3, "data": 214, "unit": "traj"}],
          "selection": [sel([0.775, 0.625, 0.75], 0), sel([0.725, 0.75, 0.675], 1)]}
    assert bc.budget_cell(qe) == ("BC 48 ep x lr 2e-03 x 64 traj; it 1 24 ep x lr 2e-03 x 214 traj [**77.5**/62.5/75.0]; "
                                  "it 2 12 ep x lr 2e-03 x 214 traj [72.5/**75.0**/67.5]")
    eto = {"budget": [{"stage": "ETO", "epochs": 3, "lr": 1e-4, "data": 2, "unit": "pairs", "dpo_beta": 0.1}],
           "selection": sel([0.825, 0.525, 0.825], 0)}
    assert bc.budget_cell(eto) == "ETO 3 ep x lr 1e-04 x 2 pairs β 0.1 [**82.5**/52.5/82.5]"
    bon = {"budget": [bc_stage], "selection": None, "selection_note": "BC as chosen for SFT"}
    assert bc.budget_cell(bon) == "BC 48 ep x lr 2e-03 x 64 traj; (BC as chosen for SFT)"
    md = bc.budget_markdown("lamps", [3], [{"rows": [{"arm": "sft", "method": "SFT", **sft}]}])
    assert md.splitlines()[-1] == "| SFT | BC 48 ep x lr 2e-03 x 64 traj [52.5/42.5/**72.5**] |"


def test_stage_seconds_sum_the_finished_stages_of_both_manifests(bc, tmp_path):
    """A seed's cost survives resumes: it is summed from the run manifests (evolve's and compare's), finished
    stages only, and a kept table made before it was recorded gets it added, its other fields untouched."""
    run = tmp_path / "lamps-habit-cpu-s0"
    (run / "compare").mkdir(parents=True)
    assert bc.stage_seconds(run) is None  # no manifest yet

    def manifest(path, stages):
        path.write_text(json.dumps({"version": 1, "stages": stages}))

    manifest(run / "manifest.json", {
        "bc": {"status": "done", "seconds": 100.0, "attempts": 1},
        "iter_1/critic": {"status": "done", "seconds": 30.5, "attempts": 2},  # resumed after a kill
        "iter_1/policy": {"status": "running", "started": 1.0, "attempts": 1},  # killed: no seconds
        "iter_1/rollout": {"status": "failed", "seconds": 7.0, "attempts": 1},  # its time is not the seed's result
    })
    assert bc.stage_seconds(run) is None  # compare's manifest missing
    manifest(run / "compare" / "manifest.json", {"rft/cand_base": {"status": "done", "seconds": 60.0, "attempts": 3},
                                                 "eval/rft_test_seen": {"status": "done", "seconds": 9.25}})
    assert bc.stage_seconds(run) == {"evolve_stage_s": 130.5, "compare_stage_s": 69.2, "resumed_stages": 2}

    kept = tmp_path / "tables" / "lamps-habit-cpu-s0.json"
    cfg = bc.evolve_config("lamps-habit", "cpu", 0, 2, True, 0)
    ccfg = bc.compare_config("lamps-habit", 6, True, run)
    table = {"columns": ["c"], "rows": []}
    bc.keep_table(kept, cfg, ccfg, table, {"evolve_s": 5.0, "compare_s": 2.0})
    before = json.loads(kept.read_text())
    merged = bc.add_kept_times(kept, bc.stage_seconds(run))
    assert merged == {"evolve_s": 5.0, "compare_s": 2.0, "evolve_stage_s": 130.5, "compare_stage_s": 69.2,
                      "resumed_stages": 2}
    after = json.loads(kept.read_text())
    assert after["times"] == merged and {k: v for k, v in after.items() if k != "times"} == \
        {k: v for k, v in before.items() if k != "times"}
    assert bc.kept_table(kept, cfg, ccfg) == table
    assert bc.add_kept_times(kept, {"evolve_stage_s": 1.0}) == merged  # what is kept wins
    md = bc.cost_markdown("lamps-habit", [0, 1], {0: merged, 1: {"evolve_s": 3.0}})
    assert md.strip() == "**lamps-habit**, cost summed over the stages of each seed: seed 0: evolve 2 + compare 1 min"


def test_tables_are_summarized_from_files_of_every_shape(bc, tmp_path, capsys):
    """--tables: a run's compare/table.json, a kept table and a file of several seeds' tables are read into one
    summary per environment, the seeds in order, the rows every seed has; a bad file stops with one line naming
    it and the field (hand case: three seeds of two tasks)."""
    def table(env, seed, sft, rft, extra=()):
        rows = [{"arm": a, "method": a.upper(), "oracle": False, "self_play_steps": 0, "eval_steps": 0, "budget": [],
                 "per_task": {f"{env}/test": {"a": r1, "b": r2}}} for a, (r1, r2) in (("sft", sft), ("rft", rft),
                                                                                       *extra)]
        return {"env": env, "seed": seed, "columns": [f"{env}/test"], "rows": rows}

    s0 = table("e", 0, (0, 0), (1, 0), [("eto", (1, 1))])  # the only seed with an ETO row: left out
    (tmp_path / "table.json").write_text(json.dumps(s0))
    (tmp_path / "kept.json").write_text(json.dumps({"arms": ["sft", "rft"], "table": table("e", 2, (0, 1), (1, 1))}))
    (tmp_path / "seeds.json").write_text(json.dumps({"what": "x", "seeds": {"1": table("e", 1, (1, 0), (1, 1)),
                                                                            "0": table("f", 0, (0, 0), (0, 0))}}))
    got = bc.read_tables([tmp_path / "seeds.json", tmp_path / "kept.json", tmp_path / "table.json"])
    assert sorted(got) == ["e", "f"] and [t["seed"] for t in got["e"]] == [0, 1, 2] and len(got["f"]) == 1
    bc.summarize_files([tmp_path / "table.json", tmp_path / "seeds.json", tmp_path / "kept.json"], 200, md=True)
    out, err = capsys.readouterr()
    e = json.loads(out)["envs"]["e"]
    assert e["seeds"] == [0, 1, 2] and list(e["summary"]) == ["sft", "rft"]
    r = e["summary"]["rft"]["columns"]["e/test"]
    assert r["per_seed"] == [0.5, 1.0, 1.0] and r["minus_sft"]["mean"] == pytest.approx(0.5)  # (1+0+0+1+1+0)/6
    assert "**e**, seeds 0, 1, 2" in err and "**f**, seeds 0" in err
    # the same seed twice, other columns, a file that is not a table: one line naming the file
    (tmp_path / "other.json").write_text(json.dumps({"seeds": {"0": s0, "5": {**table("e", 5, (0, 0), (0, 0)),
                                                                           "columns": ["e/x"]}}}))
    (tmp_path / "bad.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "none.json").write_text(json.dumps({"seeds": {}}))
    for files, words in (([tmp_path / "table.json", tmp_path / "table.json"], "e seed 0 is also in"),
                         ([tmp_path / "other.json"], "field 'columns' of e seed 5"),
                         ([tmp_path / "bad.json"], "not a comparison table"),
                         ([tmp_path / "none.json"], "field 'seeds' is empty"),
                         ([tmp_path / "gone.json"], "not a readable JSON file")):
        with pytest.raises(SystemExit) as ex:
            bc.read_tables(files)
        msg = str(ex.value)
        assert words in msg and str(files[-1]) in msg and "\n" not in msg


def test_add_run_row_pairs_a_new_run_with_the_kept_rows_on_the_same_tasks(tmp_path):
    """benchmarks/add_run_row.py: a new evolve run's BC and iteration-1 rows join a kept seed table, task by task;
    bench_compare --tables then sets them beside the kept RFT and SFT rows; a run missing a task is refused."""
    import subprocess
    import sys

    import polars as pl

    from tests.conftest import ROOT

    cols = ["lamps-habit/test_seen", "lamps-habit/test_unseen"]
    tasks = {c: [f"{c.split('/')[1]}-{i}" for i in range(6)] for c in cols}

    def row(arm, won):
        return {"arm": arm, "method": arm.upper(), "oracle": False, "budget": [],
                "per_task": {c: {t: float(t in won) for t in tasks[c]} for c in cols}, "scores": {},
                "selection": None, "selection_note": "", "eval_steps": 0, "expert_steps": 0, "self_play_steps": 0}

    first = {t for c in cols for t in tasks[c][:2]}
    table = {"env": "lamps-habit", "seed": 0, "columns": cols, "splits": ["test_seen", "test_unseen"],
             "rows": [row("sft", first), row("rft", first | {tasks[cols[1]][2]})]}
    kept = tmp_path / "kept.json"
    kept.write_text(json.dumps({"what": "w", "seeds": {"0": table}}))
    run = tmp_path / "run"
    won = {0: first, 1: first | {t for c in cols for t in tasks[c][2:5]}}  # iteration 1 wins 3 more per split
    for it in (0, 1):
        (run / f"iter_{it}").mkdir(parents=True)
        for c, split in zip(cols, table["splits"], strict=True):
            ts = tasks[c]
            pl.DataFrame({"traj_id": [f"{t}#0" for t in ts for _ in (0, 1)], "task_id": [t for t in ts for _ in (0, 1)],
                          "reward_env": [x for t in ts for x in (0.0, float(t in won[it]))]}
                         ).write_parquet(run / f"iter_{it}" / f"eval_{split}.parquet")
    out = tmp_path / "new.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "add_run_row.py"), "--tables", str(kept), "--seed", "0",
           "--run", str(run), "--arm", "qf", "--method", "Q-Evolve (features)", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rep = json.loads(res.stdout)["0"]
    assert rep["qf_sft"] == round(100 * 4 / 12, 1) and rep["qf"] == round(100 * 10 / 12, 1)
    assert rep["bc_same_outcome_as_sft_row"] == "12/12"
    got = json.loads(out.read_text())["seeds"]["0"]
    assert [r["arm"] for r in got["rows"]] == ["sft", "rft", "qf_sft", "qf"]
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_compare.py"), "--tables", str(out)],
                         capture_output=True, text=True, check=True)
    summary = json.loads(res.stdout)["envs"]["lamps-habit"]["summary"]
    held = summary["qf"]["columns"]["held-out"]
    assert held["mean"] == pytest.approx(10 / 12, abs=1e-4)
    assert held["minus_rft"]["mean"] == pytest.approx((10 - 5) / 12, abs=1e-4)  # paired on the same 12 tasks
    assert held["minus_sft"]["mean"] == pytest.approx((10 - 4) / 12, abs=1e-4) and held["minus_rft"]["tasks"] == 12
    # a run whose evaluation lacks a task of the table: refused with one line naming the file
    pl.read_parquet(run / "iter_1" / "eval_test_seen.parquet").filter(pl.col("task_id") != tasks[cols[0]][0]).write_parquet(
        run / "iter_1" / "eval_test_seen.parquet")
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode != 0 and "eval_test_seen.parquet: task_id: 1 tasks differ" in res.stderr
    assert json.loads(out.read_text())["seeds"]["0"]["rows"][-1]["arm"] == "qf"  # the earlier output is intact
