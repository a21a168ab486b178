"""`qevolve report`'s time table and choices on validation, from hand-made run manifests (evolve's and compare's):
where the hours of a run went, which stages were resumed, which one runs now or was stopped mid-way, and what
``--select-on-validation`` chose. The score table itself is checked against real runs in test_evolve.py."""
from __future__ import annotations

import json

import pytest

from qevolve_cli.evolve.report import build_report, selections, stage_kind, stage_times, stage_times_markdown
from qevolve_cli.lock import RUN_DIR_LOCK, exclusive


def _write(path, stages):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": 1, "stages": stages}))


def _sel(chosen, vals):
    return {"chosen": chosen, "chosen_index": list(vals).index(chosen), "setting": {"epochs": 24},
            "candidates": [{"tag": t, "setting": {}, "val_avg_reward": v} for t, v in vals.items()],
            "validation_tasks": 40}


@pytest.fixture
def run(tmp_path):
    run = tmp_path / "run"
    done = {"status": "done", "attempts": 1}
    _write(run / "manifest.json", {
        "base_model": {**done, "iteration": 0, "seconds": 6.0},
        "expert": {**done, "iteration": 0, "seconds": 1.0},
        "bc/cand_base": {**done, "iteration": 0, "seconds": 120.0},
        "bc/cand_base/val": {**done, "iteration": 0, "seconds": 15.0},
        "bc/cand_epochs2": {**done, "iteration": 0, "seconds": 240.0, "attempts": 2},
        "bc/cand_epochs2/val": {**done, "iteration": 0, "seconds": 15.0},
        "bc": {**done, "iteration": 0, "seconds": 0.0, "metrics": {"selection": _sel("epochs2", {"base": 0.5, "epochs2": 0.725})}},
        "iter_0/eval_test_seen": {**done, "iteration": 0, "seconds": 12.0},
        "iter_1/rollout": {**done, "iteration": 1, "seconds": 70.0},
        "iter_1/label": {**done, "iteration": 1, "seconds": 1.5},
        "iter_1/critic": {**done, "iteration": 1, "seconds": 300.0},
        "iter_1/advantage": {**done, "iteration": 1, "seconds": 20.0},
        "iter_1/policy": {**done, "iteration": 1, "seconds": 600.0},
        "iter_1/eval_test_seen": {**done, "iteration": 1, "seconds": 18.0},
        "iter_2/rollout": {"status": "running", "iteration": 2, "started": 1000.0, "attempts": 3},
        "iter_2/label": {"status": "failed", "iteration": 2, "seconds": 2.0, "attempts": 1, "error": "bad table"},
    })
    _write(run / "compare" / "manifest.json", {
        "rft/cand_base": {**done, "seconds": 500.0},
        "rft/cand_base/val": {**done, "seconds": 10.0},
        "oracle_v/advantage": {**done, "seconds": 0.5},
        "eval/rft_test_seen": {**done, "seconds": 9.5, "attempts": 2},
    })
    return run


def test_stage_kinds():
    assert [stage_kind(n) for n in ("base_model", "expert", "bc", "bc/cand_epochs0.5", "bc/cand_base/val",
                                    "iter_0/eval_test_unseen", "iter_2/rollout", "iter_2/label", "iter_2/critic",
                                    "iter_2/advantage", "iter_2/policy", "iter_2/cand_lr5", "iter_2/cand_lr5/val",
                                    "eval/eto_test_seen", "eto/cand_dpo_beta5", "oracle_v/advantage")] == [
        "setup", "setup", "train", "train", "validation", "eval", "rollout", "label", "critic", "advantage", "train",
        "train", "validation", "eval", "train", "advantage"]


def test_stage_times_sum_finished_stages_per_iteration_and_kind(run):
    t = stage_times(run, now=1300.0)
    rows = {r["name"]: r for r in t["rows"]}
    assert list(rows) == ["BC", "iter 1", "compare"]  # iteration 2 finished nothing yet
    assert rows["BC"] == {"name": "BC", "setup": 7.0, "rollout": 0.0, "label": 0.0, "critic": 0.0, "advantage": 0.0,
                          "train": 360.0, "validation": 30.0, "eval": 12.0, "total": 409.0}
    assert (rows["iter 1"]["rollout"], rows["iter 1"]["label"], rows["iter 1"]["critic"], rows["iter 1"]["advantage"],
            rows["iter 1"]["train"], rows["iter 1"]["eval"], rows["iter 1"]["total"]) == (70.0, 1.5, 300.0, 20.0, 600.0,
                                                                                          18.0, 1009.5)
    assert (rows["compare"]["train"], rows["compare"]["validation"], rows["compare"]["advantage"],
            rows["compare"]["eval"]) == (500.0, 10.0, 0.5, 9.5)
    assert t["total_s"] == 409.0 + 1009.5 + 520.0
    assert t["resumed"] == ["bc/cand_epochs2", "iter_2/rollout", "compare/eval/rft_test_seen"]
    # nobody holds the run directory's lock: the "running" stage was killed with its process
    assert t["unfinished"] == [
        {"stage": "iter_2/rollout", "status": "stopped", "attempt": 3, "seconds": None},
        {"stage": "iter_2/label", "status": "failed", "attempt": 1, "seconds": 2.0, "error": "bad table"}]
    with exclusive(run / RUN_DIR_LOCK, run):  # a live evolve holds it: the stage runs, for 300 s so far
        assert stage_times(run, now=1300.0)["unfinished"][0] == {"stage": "iter_2/rollout", "status": "running",
                                                                 "attempt": 3, "seconds": 300.0}
    md = stage_times_markdown(t).splitlines()
    assert md[0] == "| | setup | rollout | label | critic | advantage | train | validation | eval | total |"
    assert md[2] == "| BC | 0.1 |  |  |  |  | 6.0 | 0.5 | 0.2 | 6.8 |"


def test_report_carries_times_choices_and_what_to_do(run):
    assert [(s["where"], s["chosen"]) for s in selections(run)] == [("BC", "epochs2")]
    rep = build_report(run, plots=False)
    assert rep["stages"]["total_s"] == stage_times(run)["total_s"] and rep["selection"][0]["stage"] == "bc"
    md = (run / "report" / "scores.md").read_text()
    assert "- BC: **epochs2** of 2 (base 50.0, epochs2 72.5)" in md
    assert "- iter_2/rollout: stopped (attempt 3): its process ended mid-stage; rerun the same command with --resume" in md
    assert "- iter_2/label: failed (attempt 1): bad table" in md
    assert json.loads((run / "report" / "report.json").read_text())["stages"] == rep["stages"]
