"""--select-on-validation (evolve/select.py): the pure parts against plain loops, then a smoke-scale `lamps` run
whose split-access log proves that no test split is read while candidates are chosen."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qevolve_cli.errors import ConfigError, QevolveError
from qevolve_cli.evolve import select as S
from qevolve_cli.evolve.config import resolve
from qevolve_cli.evolve.loop import check_reconfigure
from tests.conftest import run_qevolve


def ref_pick(scores):
    """Plain loop: the first index holding the maximum of the non-None scores."""
    vals = [v for v in scores if v is not None]
    if not vals:
        return None
    top = max(vals)
    for i, v in enumerate(scores):
        if v == top:
            return i


@pytest.mark.parametrize("scores", [[0.5, 0.7, 0.7], [None, 0.0, 0.0], [0.2], [None, None], [], [0.9, None, 0.1],
                                    [0.1, 0.3, 0.2, 0.3, 0.05]])
def test_pick_best_matches_a_plain_loop_and_ties_go_to_the_earlier(scores):
    assert S.pick_best(scores) == ref_pick(scores)


def test_candidates_tags_and_scaling():
    from qevolve_cli.policy.config import PolicyConfig

    assert S.candidate_tag({}) == "base"
    assert S.candidate_tag({"lr": 0.2, "epochs": 2}) == "epochs2-lr0.2"
    base = PolicyConfig(objective="dpo", lr=1e-4, epochs=3, dpo_beta=0.1)
    assert S.apply_candidate(base, {}) == base
    c = S.apply_candidate(base, {"lr": 5, "epochs": 0.5, "dpo_beta": 5})
    assert (c.lr, c.epochs, c.dpo_beta) == (pytest.approx(5e-4), 2, pytest.approx(0.5))  # 1.5 epochs round to 2
    assert S.apply_candidate(base, {"epochs": 0.1}).epochs == 1  # at least one epoch
    assert S.setting_of(c) == {"objective": "dpo", "epochs": 2, "lr": c.lr, "dpo_beta": c.dpo_beta,
                               "dpo_nll_weight": 0.0}
    awr = S.apply_candidate(PolicyConfig(objective="awr", lr=2e-3, epochs=24, awr_beta=1.0), {"awr_beta": 0.25})
    assert S.setting_of(awr) == {"objective": "awr", "epochs": 24, "lr": 2e-3, "awr_beta": 0.25}
    for bad, needle in (([], "no candidate"), ([{"warmup_ratio": 2}], "cannot be scaled"),
                        ([{"lr": 0}], "must be a number > 0"), ([{}, {}], "listed twice")):
        with pytest.raises(ConfigError, match=needle):
            S.check_grid(bad, "x.yaml", "grid")


def test_validation_tasks_are_the_last_train_tasks():
    from qevolve_cli.envs.splits import list_tasks

    train = [t.task_id for t in list_tasks("lamps", "train")]
    assert [t.task_id for t in S.validation_tasks("lamps", 40)] == train[-40:]
    val, rest = S.carve("lamps", 40)
    assert [t.task_id for t in rest] == train[:-40] and [t.task_id for t in val] == train[-40:]
    # a first N is taken from the tasks before the validation ones; the count says how many validation tasks the
    # first N of the whole split held (the tasks left out: 0 = the same tasks as without validation)
    assert ([t.task_id for t in S.training_tasks("lamps", 40, 60)[0]], S.training_tasks("lamps", 40, 60)[1]) == \
        (train[:60], 0)
    assert S.training_tasks("lamps", 40, len(train) - 39)[1] == 1
    tasks, held = S.training_tasks("lamps", 40, 0)  # 0 = every train task
    assert [t.task_id for t in tasks] == train[:-40] and held == 40
    assert S.training_tasks("lamps", 40, len(train) + 5) == (rest, 40)
    for n in (len(train), len(train) + 1):  # nothing left to train on
        with pytest.raises(ConfigError, match="validation_tasks"):
            S.validation_tasks("lamps", n)
    assert S.held_out_hash("abc", 40, 0) == "abc" != S.held_out_hash("abc", 40, 1) != S.held_out_hash("abc", 41, 1)


ENV_PRESETS = [(e, p) for e in ("lamps", "lamps-hard", "lamps-habit", "textcraft", "alfworld", "sciworld", "webshop")
               for p in ("paper", "smoke", "cpu", "cpu-smol")]


@pytest.mark.parametrize("env,preset", ENV_PRESETS)
def test_validation_is_disjoint_from_the_training_tasks_on_every_env_and_preset(env, preset):
    """With --select-on-validation the tasks the expert stage demonstrates and every iteration's rollouts play hold
    no validation task, on every environment and preset; the held-out counts are what the first N held before
    (TextCraft cpu and every paper preset: all 40, the expert data using every train task). The stage hashes
    change exactly where the tasks do; without selection the tasks and hashes are as before."""
    from qevolve_cli.envs.splits import list_tasks, task_order_tag
    from qevolve_cli.evolve.loop import _expert_hash, _h, expert_tasks, rollout_tasks, validation_of

    base = {"model": "some/model"} if preset == "paper" else {}
    cfg = resolve(env, preset, None, {**base, "select_on_validation": True})
    val, disjoint = validation_of(cfg)
    val_ids = {t.task_id for t in val}
    assert len(val_ids) == cfg.validation_tasks == 40 and disjoint is True
    train = list_tasks(env, "train")
    assert {t.task_id for t in train[-40:]} == val_ids  # the last train tasks, never a test split's

    def ids(ts):
        return [t.task_id for t in ts]

    plain = cfg.replace(select_on_validation=False)
    for limit, (tasks, held), (old, old_held) in (
            [(cfg.expert_limit, expert_tasks(cfg), expert_tasks(plain))]
            + [(cfg.stage("rollout", k).max_tasks, rollout_tasks(cfg, k), rollout_tasks(plain, k))
               for k in range(1, cfg.iters + 1)]):
        assert not val_ids & set(ids(tasks)), (env, preset, limit)
        assert old_held == 0 and ids(old) == ids(train[:limit] if limit else train)  # without selection: as before
        assert held == len(val_ids & set(ids(old)))  # the validation tasks the old first N held
        assert ids(tasks) == (ids(old) if not held else [i for i in ids(train) if i not in val_ids][:limit or None])
    if (env, preset) == ("textcraft", "cpu") or preset == "paper":  # the expert data used every train task
        assert expert_tasks(cfg)[1] == 40 and val_ids <= set(ids(expert_tasks(plain)[0]))
    # hashes: without selection the old formula; with it, a new one only where the expert tasks changed
    tag = task_order_tag(env, cfg.expert_limit)
    old_hash = _h(env, cfg.expert_limit, *([tag] if tag else []))
    assert _expert_hash(plain) == old_hash
    assert (_expert_hash(cfg, expert_tasks(cfg)[1]) == old_hash) == (expert_tasks(cfg)[1] == 0)


def test_a_configuration_that_cannot_be_disjoint_is_refused(tmp_path):
    """Validation tasks that would leave no train task, or an expert_data table made only of validation tasks, are
    refused with one line naming the field (the CLI exits 2)."""
    from qevolve_cli.envs.splits import list_tasks

    n = len(list_tasks("lamps", "train"))
    with pytest.raises(ConfigError, match=rf"^--validation-tasks: {n} validation tasks leave none of the {n} "):
        resolve("lamps", "smoke", None, {"select_on_validation": True, "validation_tasks": n})
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"select_on_validation: true\nvalidation_tasks: {n}\n")
    with pytest.raises(ConfigError, match=rf"bad.yaml: field 'validation_tasks': {n} validation tasks leave none"):
        resolve("lamps", "smoke", bad, {})
    resolve("lamps", "smoke", None, {"validation_tasks": n})  # without selection the field is not used
    r = run_qevolve("evolve", "--env", "lamps", "--preset", "smoke", "--config", bad, "--run-dir", tmp_path / "r",
                    "--quiet", timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "validation_tasks" in r.stderr, r.stderr
    # an expert table of validation tasks only: nothing left to train on
    import polars as pl

    from qevolve_cli.errors import TableError
    from qevolve_cli.evolve.loop import _expert_without_validation
    from qevolve_cli.evolve.rundir import RunDir

    cfg = resolve("lamps", "smoke", None, {"select_on_validation": True, "validation_tasks": 2})
    val = {t.task_id for t in S.validation_tasks("lamps", 2)}
    df = pl.DataFrame({"task_id": sorted(val) * 2, "step": [0, 0, 1, 1]})
    with pytest.raises(ConfigError, match="x.parquet: field 'task_id': every row"):
        _expert_without_validation(cfg, RunDir(tmp_path), Path("x.parquet"), df, val, lambda m: None)
    kept, rows, tasks = S.drop_validation_rows(df.vstack(pl.DataFrame({"task_id": ["lamps:other"], "step": [0]})), val)
    assert (kept["task_id"].to_list(), rows, tasks) == (["lamps:other"], 4, 2)
    # a training table with a validation task is named with its column
    (tmp_path / "ok.parquet").write_bytes(b"")
    kept.write_parquet(tmp_path / "ok.parquet")
    df.write_parquet(tmp_path / "bad.parquet")
    S.check_disjoint([tmp_path / "ok.parquet"], val, "fix it")
    with pytest.raises(TableError, match=r"bad.parquet: column 'task_id': 4 rows of 2 validation task\(s\) in a "
                       "training table; fix it"):
        S.check_disjoint([tmp_path / "ok.parquet", tmp_path / "bad.parquet"], val, "fix it")


def test_evolve_and_compare_configs_check_the_grids():
    from qevolve_cli.evolve.compare import CompareConfig
    from qevolve_cli.evolve.config import resolve

    with pytest.raises(ConfigError, match=r"policy.candidates: 1 candidates but bc_candidates has 3: every arm gets the same number"):
        resolve("lamps", "smoke", None, {"select_on_validation": True, "policy_candidates": [{}]})
    with pytest.raises(ConfigError, match=r"eto_candidates\[1\].foo"):
        CompareConfig.from_dict({"eto_candidates": [{}, {"foo": 2}]})
    # without selection the new fields do not enter the hash (runs made before them still resume)
    a = resolve("lamps", "smoke", None, {})
    assert a.hash() == a.replace(policy_candidates=[{}]).hash() != a.replace(select_on_validation=True).hash()


def split_log(path: Path) -> list[tuple[str, str, str]]:
    return [tuple(ln.split("\t")) for ln in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_selection_reads_no_test_split(tmp_path):
    """A real evolve + compare with selection in subprocesses, every list_tasks call logged with its stage
    (QEVOLVE_SPLIT_LOG): candidates, validation and choice read only the train split; test splits are read by
    the evaluation stages alone; compare --select-only reads none."""
    cfg = tmp_path / "sel.yaml"
    cfg.write_text("select_on_validation: true\nvalidation_tasks: 2\nbc_candidates: [{}, {epochs: 2}]\n"
                   "policy_candidates: [{}, {lr: 0.5}]\n")
    run, log = tmp_path / "run", tmp_path / "splits.log"
    env = {"QEVOLVE_SPLIT_LOG": str(log)}
    r = run_qevolve("evolve", "--env", "lamps", "--preset", "smoke", "--iters", "2", "--config", cfg, "--run-dir", run,
                    "--quiet", "--json", timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = split_log(log)
    assert lines and all(split == "train" for stage, _e, split in lines if "/eval_" not in stage), lines
    assert {split for stage, _e, split in lines if "/eval_" in stage} == {"test_seen", "test_unseen"}
    man = json.loads((run / "manifest.json").read_text())["stages"]
    for stage, prefix in (("bc", "bc"), ("iter_1/policy", "iter_1"), ("iter_2/policy", "iter_2")):
        sel = man[stage]["metrics"]["selection"]
        assert [c["tag"] for c in sel["candidates"]] == (["base", "epochs2"] if stage == "bc" else ["base", "lr0.5"])
        assert sel["validation_tasks"] == 2 and sel["disjoint"] is True
        # the adopted policy is the chosen candidate's (hard links of the same files)
        assert sel["policy"] == f"{prefix}/cand_{sel['chosen']}/policy"
        adopted = run / ("bc/policy" if stage == "bc" else stage)
        files = [f for f in (run / sel["policy"]).iterdir() if f.is_file()]
        assert files and all(os.path.samefile(f, adopted / f.name) for f in files)
        # the validation games are the last train tasks
        import polars as pl

        ids = pl.read_parquet(run / prefix / "cand_base" / "val.parquet")["task_id"].unique().to_list()
        assert sorted(ids) == sorted(t.task_id for t in S.validation_tasks("lamps", 2))
    val_ids = {t.task_id for t in S.validation_tasks("lamps", 2)}  # in no training table
    for t in ["expert.parquet"] + [f"iter_{k}/{n}.parquet" for k in (1, 2) for n in ("rollout", "labeled", "advantages")]:
        assert not set(pl.read_parquet(run / t, columns=["task_id"])["task_id"]) & val_ids, t
    log.unlink()
    sets = ["--set", "rft_candidates=[{}, {epochs: 2}]", "--set", "eto_candidates=[{}, {lr: 5}]",
            "--set", "arms=[sft, rft, eto, qevolve, qevolve_oracle_v]"]
    r = run_qevolve("compare", "--run-dir", run, "--select-on-validation", "--select-only", *sets, "--quiet",
                    timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {split for _s, _e, split in split_log(log)} == {"train"}, split_log(log)
    sel = json.loads(r.stdout)["selection"]
    arms = ("sft", "rft", "eto", "qevolve", "qevolve_oracle_v")
    assert {a: len(sel[a]["candidates"]) for a in arms} == dict.fromkeys(arms, 2)
    assert json.loads((run / "compare" / "selection.json").read_text()) == sel
    # the full comparison (resumed): the selection is reused, the test splits are read by evaluations only
    r = run_qevolve("compare", "--run-dir", run, "--select-on-validation", "--resume", *sets, "--json", "--quiet",
                    timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(split == "train" for stage, _e, split in split_log(log) if not stage.startswith("eval/"))
    t = json.loads(r.stdout)
    rows = {row["arm"]: row for row in t["rows"]}
    # two iterations: iteration 1 is a row too (the run's own evaluation, reused), iteration 2 started from it
    assert [row["arm"] for row in t["rows"]] == ["sft", "rft", "eto", "qevolve_iter1", "qevolve", "qevolve_oracle_v"]
    assert [b["stage"] for b in rows["qevolve_oracle_v"]["budget"]] == ["BC", "it 1 (V*)"]
    assert rows["qevolve"]["method"] == "Q-Evolve (iter 2)" and rows["qevolve_iter1"]["method"] == "Q-Evolve (iter 1)"
    for split in ("test_seen", "test_unseen"):
        assert rows["qevolve_iter1"]["scores"][f"lamps/{split}"]["avg_reward"] == \
            man[f"iter_1/eval_{split}"]["metrics"]["avg_reward"]
    assert rows["qevolve_iter1"]["self_play_steps"] < rows["qevolve"]["self_play_steps"]
    assert rows["rft"]["selection"] == sel["rft"] and rows["qevolve"]["selection"][-1] == sel["qevolve"]
    assert len(rows["qevolve"]["selection"]) == 2 and len(rows["qevolve_iter1"]["selection"]) == 1
    assert [b["stage"] for b in rows["qevolve"]["budget"]] == ["BC", "it 1", "it 2"]
    assert set(rows["rft"]["per_task"]["lamps/test_seen"]) == set(rows["sft"]["per_task"]["lamps/test_seen"])
    eto_b = rows["eto"]["budget"][0]
    assert eto_b["unit"] == "pairs" and eto_b["dpo_nll_weight"] == 1.0
    md = (run / "compare" / "table.md").read_text()
    assert "trained on (epochs x lr x data)" in md and f"**{sel['eto']['chosen']}** of 2" in md
    # evolve --reconfigure's check walks the selections: a third iteration keeps every finished stage and stops
    # at its own candidates (no validation score to choose from yet); another grid would change the choice
    kept, to_run, stale = check_reconfigure(resolve("lamps", "smoke", cfg, {"iters": 3}), run)
    assert set(kept) == set(man) and kept[0] == "base_model"
    assert to_run == ["iter_3/rollout", "iter_3/label", "iter_3/critic", "iter_3/advantage", "iter_3/cand_base",
                      "iter_3/cand_base/val", "iter_3/cand_lr0.5", "iter_3/cand_lr0.5/val",
                      "iter_3 (and the stages after it)"] and stale == []
    grid3 = tmp_path / "sel3.yaml"
    grid3.write_text(cfg.read_text().replace("policy_candidates: [{}, {lr: 0.5}]",
                                             "policy_candidates: [{}, {lr: 0.5}, {lr: 2}]")
                     .replace("[{}, {epochs: 2}]", "[{}, {epochs: 2}, {epochs: 3}]"))
    with pytest.raises(QevolveError, match="finished stage 'bc' was done with another configuration"):
        check_reconfigure(resolve("lamps", "smoke", grid3, {"iters": 2}), run)
    # a selection finished before checkpoint intervals left the hash (BC's candidates and its adoption recorded
    # with bc.checkpoint_every_steps 5 in their hashes) is still this configuration's
    from qevolve_cli.evolve.loop import _h

    cfg5 = resolve("lamps", "smoke", cfg, {"iters": 2, "bc": {"checkpoint_every_steps": 5}})
    b5, m = cfg5.stage("bc", 0), json.loads((run / "manifest.json").read_text())
    bsel = m["stages"]["bc"]["metrics"]["selection"]["candidates"]
    m["stages"]["bc"]["config_hash"] = _h(b5.legacy_hash(), [c["tag"] for c in bsel], [c["val_avg_reward"] for c in bsel])
    for cand in cfg5.bc_candidates:
        m["stages"][f"bc/cand_{S.candidate_tag(cand)}"]["config_hash"] = S.apply_candidate(b5, cand).legacy_hash()
    (run / "manifest.json").write_text(json.dumps(m))
    kept, to_run, _ = check_reconfigure(cfg5, run)
    assert set(kept) == set(man) and to_run == []
    # candidate lists of another length than the run's are refused, naming the field
    r = run_qevolve("compare", "--run-dir", run, "--select-on-validation", "--set", "rft_candidates=[{}]",
                    "--out", tmp_path / "c2", "--quiet", timeout=300, env=env)
    assert r.returncode == 2 and "rft_candidates': 1 candidates but the run chose" in r.stderr


@pytest.mark.slow
def test_no_validation_task_in_any_training_table(tmp_path):
    """A real evolve (tiny model, lamps) with selection on an external expert table that holds the validation tasks
    (as every paper preset's expert data does, and TextCraft cpu's): their rows are dropped, said in the output and
    the manifest, and no training table (expert, rollouts, labels, advantages) holds a validation task; every
    selection record, the run's and compare's, says disjoint. A comparison of a run whose tables hold them, and a
    resume of a run that trained on them, are refused with one line."""
    import polars as pl

    from qevolve_cli import schema
    from qevolve_cli.envs.expert import collect_expert
    from qevolve_cli.envs.splits import list_tasks

    val_ids = {t.task_id for t in S.validation_tasks("lamps", 2)}
    train = list_tasks("lamps", "train")
    ext = tmp_path / "expert_all.parquet"
    schema.write_table(collect_expert("lamps", "train", tasks=train[:3] + train[-2:]), ext, producer="test")
    ext_df = pl.read_parquet(ext)
    val_rows = ext_df.filter(pl.col("task_id").is_in(sorted(val_ids))).height
    assert val_rows and set(ext_df["task_id"]) >= val_ids
    cfg = tmp_path / "sel.yaml"
    cfg.write_text("select_on_validation: true\nvalidation_tasks: 2\nbc_candidates: [{}, {epochs: 2}]\n"
                   "policy_candidates: [{}, {lr: 0.5}]\n")
    run = tmp_path / "run"
    args = ("evolve", "--env", "lamps", "--preset", "smoke", "--iters", "1", "--config", cfg, "--expert", ext,
            "--run-dir", run, "--quiet")
    r = run_qevolve(*args, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"[select] expert: {val_rows} rows of 2 validation tasks dropped from {ext}" in r.stderr, r.stderr[-3000:]
    assert "[select] iter_1/rollout: 0 validation tasks left out of the first 2 train tasks (2 played; validation: " \
        "the last 2 train tasks)" in r.stderr
    man = json.loads((run / "manifest.json").read_text())["stages"]
    assert man["expert"]["metrics"]["validation_rows_dropped"] == val_rows
    assert man["expert"]["metrics"]["validation_tasks_dropped"] == 2
    assert man["iter_1/rollout"]["metrics"]["validation_tasks_held_out"] == 0  # its first 2 tasks: none of them
    tables = ["expert.parquet", "iter_1/rollout.parquet", "iter_1/labeled.parquet", "iter_1/advantages.parquet"]
    for t in tables:
        ids = set(pl.read_parquet(run / t, columns=["task_id"])["task_id"])
        assert ids and not ids & val_ids, t
    assert pl.read_parquet(run / "expert.parquet").height == ext_df.height - val_rows
    for stage in ("bc", "iter_1/policy"):
        sel = man[stage]["metrics"]["selection"]
        assert sel["disjoint"] is True and sel["validation_tasks"] == 2
    # compare: every selection record says disjoint
    sets = ["--set", "rft_candidates=[{}, {epochs: 2}]", "--set", "arms=[sft, rft, qevolve]"]
    r = run_qevolve("compare", "--run-dir", run, "--select-on-validation", "--select-only", *sets, "--quiet",
                    timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    sel = json.loads(r.stdout)["selection"]
    assert all(sel[a]["disjoint"] is True for a in ("sft", "rft", "qevolve"))
    assert all(s["disjoint"] is True for s in sel["qevolve_iterations"])
    # a run whose expert table holds validation tasks (made before they were carved out): compare refuses it
    kept = run / "expert.kept.parquet"
    os.replace(run / "expert.parquet", kept)
    (run / "expert.parquet").write_bytes(ext.read_bytes())
    r = run_qevolve("compare", "--run-dir", run, "--select-on-validation", "--select-only", *sets, "--out",
                    tmp_path / "c2", "--quiet", timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"expert.parquet: column 'task_id': {val_rows} rows of 2 validation task(s) in a training table" in r.stderr
    os.replace(kept, run / "expert.parquet")
    # a run whose BC trained on the external table as it was (no stage dropped its rows): resume refused
    m = json.loads((run / "manifest.json").read_text())
    del m["stages"]["expert"]
    (run / "manifest.json").write_text(json.dumps(m))
    r = run_qevolve(*args, "--resume", timeout=300)
    err = r.stderr.strip().splitlines()[-1]  # after the [skip] of the base model
    assert r.returncode == 2 and err.startswith("error: ") and r.stderr.count("error") == 1, r.stderr
    assert f"stage 'bc' was done on {ext} with its {val_rows} rows of validation tasks" in err


def test_below_start_warns_when_every_step_from_the_start_lost_on_validation():
    """ETO trains from the SFT policy: when its best candidate scores more than 10 points under SFT on the same
    validation tasks (lamps-habit seed 2: 40.0 against 77.5), every setting of the grid made it worse and compare says so."""
    from qevolve_cli.evolve.select import below_start

    def sel(vals, chosen):
        return {"candidates": [{"tag": f"c{i}", "val_avg_reward": v} for i, v in enumerate(vals)], "chosen_index": chosen}

    sft = sel([0.575, 0.775, 0.725], 1)
    msg = below_start("ETO", sel([0.075, 0.40, 0.375], 1), sft, "eto_candidates")
    assert msg.startswith("every ETO candidate scored below the policy it starts from on validation (best 40.0 vs "
                          "77.5): every setting of its grid (eto_candidates) made it worse") and "--set 'eto_candidates=[" in msg
    assert below_start("ETO", sel([0.825, 0.525, 0.825], 0), sft, "eto_candidates") is None  # ETO above SFT
    assert below_start("ETO", sel([0.676], 0), sft, "eto_candidates") is None  # within 10 points
    assert below_start("ETO", sel([0.674], 0), sft, "eto_candidates") is not None
    assert below_start("ETO", sel([None], 0), sft, "eto_candidates") is None  # nothing scored
    assert below_start("ETO", sel([0.1], 0), None, "eto_candidates") is None  # the run chose no SFT
