"""`qevolve report`'s time table and choices on validation, from hand-made run manifests (evolve's and compare's):
where the hours of a run went, which stages were resumed, which one runs now or was stopped mid-way, and what
``--select-on-validation`` chose. The score table itself is checked against real runs in test_evolve.py."""
from __future__ import annotations

import json

import pytest

from qevolve_cli.evolve.report import build_report, selections, stage_kind, stage_times, stage_times_markdown
from qevolve_cli.lock import RUN_DIR_LOCK, exclusive
from tests.conftest import run_qevolve


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
    assert t["unfinished"] == [  # killed before its first heartbeat: no seconds known
        {"stage": "iter_2/rollout", "status": "stopped", "attempt": 3, "seconds": 0.0},
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
    assert "- iter_2/label: failed (attempt 1, 0.0 min so far): bad table" in md
    assert json.loads((run / "report" / "report.json").read_text())["stages"] == rep["stages"]


def test_attempt_seconds_of_a_failed_a_killed_and_a_finished_attempt():
    from qevolve_cli.evolve.rundir import attempt_seconds

    assert attempt_seconds({"status": "failed", "seconds": 12.5}, None) == 12.5
    assert attempt_seconds({"status": "interrupted", "seconds": 3.0}, {"attempt": 1, "time": 999.0}) == 3.0
    killed = {"status": "running", "started": 100.0, "attempts": 2}
    assert attempt_seconds(killed, {"attempt": 2, "time": 160.0}) == 60.0
    assert attempt_seconds(killed, {"attempt": 1, "time": 160.0}) == 0.0  # an older attempt's heartbeat
    assert attempt_seconds(killed, None) == 0.0  # killed before its first heartbeat
    assert attempt_seconds({"status": "done", "seconds": 5.0}, None) == 0.0


HOLD_STAGE = """
import sys, time
from qevolve_cli.evolve import rundir
rundir.HEARTBEAT_S = 0.05
r = rundir.RunDir(sys.argv[1])
r.run_stage("iter_1/critic", lambda: (print("started", flush=True), time.sleep(600)), inputs=[], outputs=[],
            config_hash="h", iteration=1, echo=lambda m: None)
"""


def test_a_stage_killed_with_its_process_counts_to_its_last_heartbeat(tmp_path):
    """SIGKILL a process mid-stage: the report calls the stage stopped, with its minutes to the last heartbeat;
    a failed attempt records its own; the attempt that finishes the stage adds both (``seconds_total``), and
    the time table counts the total."""
    import signal
    import subprocess
    import sys
    import time

    from qevolve_cli.evolve import rundir
    from tests.conftest import ROOT, qevolve_env

    run = tmp_path / "run"
    run.mkdir()
    p = subprocess.Popen([sys.executable, "-c", HOLD_STAGE, str(run)], cwd=ROOT, env=qevolve_env(),
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "started"
        t0 = time.monotonic()
        time.sleep(1.0)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    ran = time.monotonic() - t0  # how long the stage ran at least (the kill came after this)
    st = json.loads((run / "manifest.json").read_text())["stages"]["iter_1/critic"]
    assert st["status"] == "running" and "seconds" not in st
    stopped = stage_times(run)["unfinished"]
    assert [(u["stage"], u["status"], u["attempt"]) for u in stopped] == [("iter_1/critic", "stopped", 1)]
    assert 0.5 <= stopped[0]["seconds"] <= ran + 0.5  # to the last heartbeat (0.05 s apart, if not starved)

    r = rundir.RunDir(run)

    def fail():
        time.sleep(0.2)
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        r.run_stage("iter_1/critic", fail, inputs=[], outputs=[], config_hash="h", iteration=1, echo=lambda m: None)
    st = r.stages["iter_1/critic"]
    assert st["status"] == "failed" and st["attempts"] == 2 and st["seconds_before"] == pytest.approx(stopped[0]["seconds"], abs=0.06)
    assert st["seconds_total"] == pytest.approx(st["seconds_before"] + st["seconds"], abs=1e-9)
    r.run_stage("iter_1/critic", lambda: time.sleep(0.1), inputs=[], outputs=[], config_hash="h", iteration=1,
                echo=lambda m: None)
    st = json.loads((run / "manifest.json").read_text())["stages"]["iter_1/critic"]
    assert st["status"] == "done" and st["attempts"] == 3 and 0.1 <= st["seconds"] < 0.5
    # the parts are rounded to ms as written and the total is their sum (a reader adding them gets it exactly)
    assert st["seconds_before"] >= stopped[0]["seconds"] + 0.15 and st["seconds_total"] == pytest.approx(st["seconds_before"] + st["seconds"],
                                                                                abs=1e-9)
    assert not list((run / rundir.HEARTBEATS).iterdir())  # the finished stage's heartbeat is gone
    t = stage_times(run)
    assert t["rows"][0]["name"] == "iter 1" and t["rows"][0]["critic"] == pytest.approx(st["seconds_total"], abs=0.1)
    assert t["unfinished"] == [] and t["resumed"] == ["iter_1/critic"]


# --------------------------------------------------------------------------- plots


def _plot_run(tmp_path):
    """A run of BC and two iterations, evaluated on two splits (36 and 59 tasks), with each iteration's critic
    diagnostics on 24 held-out trajectories and 7 epochs of held-out curves: few points, where matplotlib's own
    locator puts ticks at 0.25 or 2.5."""
    run = tmp_path / "plotrun"
    done = {"status": "done", "attempts": 1, "seconds": 1.0}
    stages = {}
    for k in range(3):
        for split, n in (("test_seen", 36), ("test_unseen", 59)):
            stages[f"iter_{k}/eval_{split}"] = {**done, "iteration": k, "metrics": {
                "avg_reward": 0.1 * (k + 1), "success_rate": 0.05 * (k + 1), "n": n}}
        if k:
            stages[f"iter_{k}/rollout"] = {**done, "iteration": k, "metrics": {"env_steps": 100 * k}}
    _write(run / "manifest.json", stages)
    for k in (1, 2):
        crit = run / f"iter_{k}" / "critic"
        crit.mkdir(parents=True)
        diag = {"on": "heldout", "trajectories": 24, "steps": 310, "n_success": 8, "n_failed": 16,
                "bellman_q": 0.01, "ev_return": 0.3, "auc_v": 0.8, "auc_v0": 0.7, "v_std": 0.1,
                "v_by_step": {"success": [0.5, 0.6, 0.7, None], "failed": [0.4, 0.35, 0.3, 0.2]},
                "calibration": [{"v": 0.2 + 0.1 * i, "ret": 0.05 * i, "n": 31} for i in range(10)]}
        (crit / "diagnostics.json").write_text(json.dumps(diag))
        (crit / "metrics.jsonl").write_text("".join(
            json.dumps({"epoch": e, "loss_q": 1.0 / e, "heldout": {"ev_return": 0.05 * e, "auc_v": 0.6 + 0.02 * e,
                                                                   "bellman_q": 0.1 / e}}) + "\n"
            for e in range(1, 8)))
    return run


def _whole(ticks) -> bool:
    return all(float(t) == int(t) for t in ticks)


def test_plots_have_whole_number_count_axes_and_say_what_they_show(tmp_path):
    import matplotlib.pyplot as plt

    from qevolve_cli.evolve.report import (
        _heldout_curves,
        critic_diagnostics,
        diagnostics_figure,
        score_rows,
        scores_figure,
    )

    run = _plot_run(tmp_path)
    rows, splits = score_rows(run)
    fig = scores_figure(run, rows, splits)
    try:
        axes = fig.axes
        assert [a.get_title() for a in axes] == ["test_seen (36 tasks)", "test_unseen (59 tasks)"]
        for a in axes:
            assert list(a.get_xticks()) == [0, 1, 2]
            assert [t.get_text() for t in a.get_xticklabels()] == ["0 (BC)", "1", "2"]
            assert a.get_xlabel() == "iteration (0 = BC)"
            assert [t.get_text() for t in a.get_legend().get_texts()] == ["average reward", "success rate"]
    finally:
        plt.close(fig)

    fig = diagnostics_figure(critic_diagnostics(run), _heldout_curves(run))
    try:
        fig.canvas.draw()  # the locators place their ticks at draw time
        axes = fig.axes
        assert len(axes) == 6  # two iterations x (per epoch, along the steps, calibration)
        data = "on 24 held-out trajectories (train split; 8 succeeded, 16 failed)"
        for row, k in ((axes[0:3], 1), (axes[3:6], 2)):
            epochs, steps, cal = row
            assert epochs.get_title() == f"iteration {k}: critic per epoch\n{data}"
            assert steps.get_title() == f"iteration {k}: mean V(s_t) at step t\n{data}"
            assert cal.get_title() == (f"iteration {k}: V vs. discounted return: above the diagonal = V overestimates\n"
                                       f"{data}, 310 steps")
            assert (epochs.get_xlabel(), steps.get_xlabel()) == ("epoch", "step t")
            for a in (epochs, steps):
                lo, hi = a.get_xlim()
                shown = [t for t in a.get_xticks() if lo <= t <= hi]
                assert len(shown) >= 2 and _whole(shown), (a.get_title(), shown)
            assert [t.get_text() for t in steps.get_legend().get_texts()] == ["success trajectories (8)",
                                                                              "failed trajectories (16)"]
            # V on the y axis, the return on the x axis: the decile points lie above the diagonal here
            assert cal.get_ylabel().startswith("V(s_t)") and cal.get_xlabel().startswith("discounted return")
            x, y = cal.get_lines()[0].get_data()
            assert all(v > r for r, v in zip(x, y, strict=True))
    finally:
        plt.close(fig)

    rep = build_report(run)
    assert {"report/scores.png", "report/critic_diagnostics.png", "report/critic_losses.png"} <= set(rep["files"])
    assert (run / "report" / "critic_diagnostics.png").read_bytes()[:4] == b"\x89PNG"


def test_summary_pools_the_held_out_tasks_and_names_the_verdict_and_next_steps(tmp_path):
    """`qevolve report --summary`: success over every held-out task counted once (36 + 59 tasks), the gain over BC,
    the critic's verdict with its fit ladder, the plots and the next commands (the end of make demo)."""
    run = _plot_run(tmp_path)
    (run / "config.yaml").write_text("env: lamps-habit\npreset: cpu\n")
    d = json.loads((run / "iter_1" / "critic" / "diagnostics.json").read_text())
    d["fit_ladder"] = {"terminal": {"successful": {"n": 8, "mae": 0.04}, "failed": {"n": 16, "mae": 0.62}},
                       "td_q_mae": 0.05, "qbar_minus_v": -0.01, "failed_v": {"corr_step": 0.4}}
    (run / "iter_1" / "critic" / "diagnostics.json").write_text(json.dumps(d))
    proc = run_qevolve("report", run, "--summary", check=True)
    out = proc.stdout
    assert "test_seen 36 + test_unseen 59 tasks" in out
    # BC: 5 % of both splits; iteration 2: 15 % of both -> pooled the same; the gain +10.0 points
    lines = {" ".join(ln.split()[:3]): ln.split() for ln in out.splitlines() if "%" in ln}
    assert lines["BC (behaviour cloning)"][3:5] == ["5.0", "%"]
    assert lines["Q-Evolve iteration 2"][3:5] == ["15.0", "%"] and "+10.0 points over BC" in out
    # the failing rung of iteration 1's ladder is its verdict; iteration 2's critic learned
    assert ("critic of iteration 1: does not fit its own terminal transitions: mean |Q - r| 0.62 over 16 failed "
            "endings") in out
    assert "critic of iteration 2: learned" in out and "fit ladder (train): terminal |Q-r| ok 0.04 failed 0.62" in out
    assert "scores.png" in out and "make demo-smol" in out and "qevolve plan" in out and "--model" in out


def test_pooled_success_weights_each_task_once():
    from qevolve_cli.evolve.report import pooled_success

    row = {"test_seen": {"success_rate": 0.5, "n": 48}, "test_unseen": {"success_rate": 0.75, "n": 96}}
    sr, n = pooled_success(row, ["test_seen", "test_unseen"])
    assert n == 144 and sr == pytest.approx((24 + 72) / 144)  # 66.7 %, not the split means' 62.5 %
