"""GiGPO's anchor-state step credit (`label --advantage gigpo`, issue 69): the Rust core against the plain loop of
tests/reference.py, hand-computed cases, the label command, and the policy step's treatment of expert rows."""
from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
import pytest
from reference import ref_gigpo
from typer.testing import CliRunner

from qevolve_cli import schema
from qevolve_cli.cli import app
from qevolve_cli.rewards import gigpo_advantages
from qevolve_cli.synthetic import synthetic_table

runner = CliRunner()


def table(trajs) -> pl.DataFrame:
    """A step table from ``(traj_id, observations, rewards, source, task, iteration, error)`` tuples."""
    rows = []
    for tid, obs, rew, source, task, it, err in trajs:
        for i, (o, r) in enumerate(zip(obs, rew, strict=True)):
            rows.append({"traj_id": tid, "env": "lamps", "task_id": task, "iteration": it, "source": source, "step": i,
                         "observation": o, "reward_env": float(r), "done": i == len(obs) - 1, "error": err,
                         "split": "train", "instruction": "do it", "action": "Thought: go.\nAction: look",
                         "command": "look", "next_observation": "x"})
    return pl.DataFrame(rows, schema_overrides={"reward_env": pl.Float32, "iteration": pl.Int32, "step": pl.Int32,
                                                "error": pl.String})


def self_traj(tid, obs, rew, task="t1", it=1):
    return (tid, obs, rew, "self", task, it, None)


THREE = [self_traj("A", ["s", "u", "t"], [0, 0, 1]), self_traj("B", ["s", "t"], [0, 1]),
         self_traj("C", ["s", "t"], [0, 0])]


def gigpo(df, **kw):
    kw = {"gamma": 0.5, "omega": 1.0, "eps": 0.0, **kw}
    return gigpo_advantages(df, None, **kw)


def test_two_anchor_states_shared_by_three_trajectories():
    """Hand-computed (gamma 0.5, eps 0): R = (1, 1, 0): mean 2/3, unbiased std 1/sqrt(3), A^E = (1/sqrt(3),
    1/sqrt(3), -2/sqrt(3)). Anchor s: G = (0.25, 0.5, 0), mean 0.25, std 0.25 -> A^S = (0, 1, -1); anchor t:
    G = (1, 1, 0) -> A^S = (1/sqrt(3), 1/sqrt(3), -2/sqrt(3)); u is alone -> A^S = 0."""
    out, st = gigpo(table(THREE))
    r3 = 1 / math.sqrt(3)
    want_e = [r3, r3, r3, r3, r3, -2 * r3, -2 * r3]
    want_s = [0, 0, r3, 1, r3, -1, -2 * r3]
    assert out["gigpo_episode"].to_list() == pytest.approx(want_e, abs=1e-6)
    assert out["gigpo_step"].to_list() == pytest.approx(want_s, abs=1e-6)
    assert out["advantage"].to_list() == pytest.approx([e + s for e, s in zip(want_e, want_s, strict=True)], abs=1e-6)
    assert out["anchor_size"].to_list() == [3, 1, 3, 3, 3, 3, 3]
    assert st["anchored_steps"] == 6 and st["steps"] == 7 and st["anchored_share"] == pytest.approx(6 / 7)
    assert st["anchor_groups"] == 3 and st["anchor_groups_2plus"] == 2 and st["steps_by_anchor_size"] == {"1": 1, "3": 6}
    # omega weighs the step term; mean norm divides by 1: A^E = R - 2/3, A^S = G - mean
    out2, _ = gigpo(table(THREE), omega=0.5, norm="mean")
    want_e2 = [1 / 3] * 5 + [-2 / 3] * 2
    want_s2 = [0, 0, 1 / 3, 0.25, 1 / 3, -0.25, -2 / 3]
    assert out2["advantage"].to_list() == pytest.approx([e + 0.5 * s for e, s in zip(want_e2, want_s2, strict=True)],
                                                        abs=1e-6)


def test_singleton_groups_and_equal_returns():
    # one trajectory in its group (verl-agent: mean 0, std 1, so A^E = R); its distinct states are singleton
    # anchor groups (A^S = 0), while a state it visits twice is an anchor group of two (G 0.5 and 1)
    out, st = gigpo(table([self_traj("A", ["s", "t", "s2"], [0, 0, 1]), self_traj("B", ["x", "x"], [0, 1], task="t2")]))
    assert out["gigpo_episode"].to_list() == pytest.approx([1, 1, 1, 1, 1])
    assert out["gigpo_step"].to_list()[:3] == [0, 0, 0]
    d = 0.25 / math.sqrt(0.125)  # (G - 0.75) / std(0.5, 1), the unbiased std sqrt(0.125)
    assert out["gigpo_step"].to_list()[3:] == pytest.approx([-d, d], abs=1e-6)
    assert out["anchor_size"].to_list() == [1, 1, 1, 2, 2]
    assert st["episode_groups"] == 2 and st["single_trajectory_groups"] == 2 and st["anchored_steps"] == 2
    # all returns equal: no credit at all (std 0: (x - mean) / (0 + eps) = 0)
    eq = table([self_traj(t, ["s", "t"], [0, 1]) for t in "ABC"])
    out, _ = gigpo(eq, eps=1e-6)
    assert out["advantage"].to_list() == [0.0] * 6 and out["anchor_size"].to_list() == [3] * 6


def test_rows_outside_an_episode_group_have_no_effect():
    """Expert demonstrations, crashed episodes and other tasks / iterations do not change a group's advantages
    (even in the same observations) and get none themselves."""
    base, _ = gigpo(table(THREE))
    noise = [("E1", ["s", "t"], [0, 5], "expert", "t1", 0, None),                 # a demonstration of the same task
             ("X", ["s", "t"], [0, 3], "self", "t1", 1, "worker crashed"),        # a crashed episode
             self_traj("O", ["s", "t"], [7, 0], task="t2"),                        # another task
             self_traj("I2", ["s", "t"], [0, 9], it=2),                            # the same task, iteration 2
             self_traj("I2b", ["s", "u"], [0, 0], it=2)]
    df = table(noise[:2] + THREE[:1] + noise[2:] + THREE[1:])
    out, st = gigpo(df)
    mine = df.with_columns(out).filter(pl.col("traj_id").is_in(["A", "B", "C"]))
    assert mine["advantage"].to_list() == base["advantage"].to_list()
    assert mine["anchor_size"].to_list() == base["anchor_size"].to_list()
    outside = df.with_columns(out).filter(pl.col("traj_id").is_in(["E1", "X"]))
    assert outside["advantage"].null_count() == outside.height == 4 and (outside["anchor_size"] == 0).all()
    assert st["steps_outside"] == 4 and st["episode_groups"] == 3


def random_table(n_steps: int, seed: int) -> pl.DataFrame:
    """About ``n_steps`` steps: 40 tasks over 2 iterations, observations from a small pool per task (so that states
    repeat), float rewards on random steps, 15 % expert trajectories and 5 % crashed ones."""
    df = synthetic_table(n_steps // 10, mean_steps=10, seed=seed, env="lamps")
    rng = np.random.default_rng(seed)
    lengths = df.group_by("traj_id", maintain_order=True).len()["len"].to_numpy().astype(np.int64)
    n_traj = len(lengths)
    task = rng.integers(0, 40, n_traj)
    per_row = np.repeat(np.arange(n_traj), lengths)
    obs = np.array([f"state {task[t]}-{k}" for t, k in zip(per_row, rng.integers(0, 6, df.height), strict=True)])
    reward = np.where(rng.random(df.height) < 0.3, rng.normal(size=df.height), 0.0).astype(np.float32)
    source = np.where(rng.random(n_traj) < 0.15, "expert", "self")
    error = np.where(rng.random(n_traj) < 0.05, "timeout", None)
    return df.with_columns(pl.Series("task_id", [f"task-{t}" for t in task[per_row]]),
                           pl.Series("iteration", rng.integers(1, 3, n_traj)[per_row], dtype=pl.Int32),
                           pl.Series("observation", obs), pl.Series("reward_env", reward),
                           pl.Series("source", source[per_row]),
                           pl.Series("error", error[per_row].tolist(), dtype=pl.String))


def reference_of(df: pl.DataFrame, **kw):
    trajs = []
    for g in df.partition_by("traj_id", maintain_order=True):
        r = g.row(0, named=True)
        key = (r["env"], r["task_id"], r["iteration"]) if r["source"] == "self" and r["error"] is None else None
        trajs.append((key, list(zip(g["observation"].to_list(), g["reward_env"].to_list(), strict=True))))
    return ref_gigpo(trajs, **kw)


@pytest.mark.parametrize("kw", [{}, {"norm": "mean", "omega": 0.5, "gamma": 0.9},
                                {"episode_stats": "steps", "eps": 0.1, "gamma": 1.0}])
def test_label_gigpo_matches_the_reference_loop_on_10k_steps(tmp_path, kw):
    df = random_table(10_000, seed=len(kw))
    assert df.height >= 9_000
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    schema.write_table(df, src)
    cfg = tmp_path / "label.yaml"
    cfg.write_text("label:\n" + "".join(f"  gigpo_{k}: {v}\n" for k, v in kw.items()))
    r = runner.invoke(app, ["label", str(src), "--out", str(out), "--advantage", "gigpo", "--json"]
                      + (["--config", str(cfg)] if kw else []))
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    got = schema.read_table(out)
    assert got["traj_id"].to_list() == df["traj_id"].to_list()
    want, size = reference_of(df, **{"gamma": 0.95, "omega": 1.0, "eps": 1e-6, **kw})
    inside = [a is not None for a in want]
    adv = got["advantage"].to_list()
    assert [a is not None for a in adv] == inside
    diff = max(abs(a - w) for a, w in zip(adv, want, strict=True) if w is not None)
    print(f"max abs diff vs the reference loop ({kw or 'defaults'}): {diff:.3g} over {sum(inside)} steps")
    assert diff <= 1e-6
    st = summary["gigpo"]
    assert st["steps"] == sum(inside) and st["steps_outside"] == df.height - sum(inside)
    assert st["anchored_steps"] == sum(s >= 2 for s in size) > 0
    assert st["anchored_share"] == pytest.approx(st["anchored_steps"] / st["steps"])
    assert summary["advantage_mean"] == pytest.approx(float(np.mean([w for w in want if w is not None])), abs=1e-5)


def test_label_gigpo_human_summary_and_errors(tmp_path):
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    schema.write_table(table(THREE + [("E1", ["s", "t"], [0, 1], "expert", "t1", 0, None)]), src)
    r = runner.invoke(app, ["label", str(src), "--out", str(out), "--advantage", "gigpo", "--no-retrospective"])
    assert r.exit_code == 0, r.output
    assert ("GiGPO: 6 of 7 self-play steps (85.7 %) are in anchor groups of >= 2 steps (2 of 3 anchor groups" in r.output
            and "2 steps in no group" in r.output)
    assert schema.read_table(out).filter(pl.col("source") == "expert")["advantage"].null_count() == 2
    # a critic's values and GiGPO's credit are two advantages: one line, nothing written
    out2 = tmp_path / "x.parquet"
    r = runner.invoke(app, ["label", str(src), "--out", str(out2), "--advantage", "gigpo", "--value-source", "oracle"])
    assert r.exit_code == 2 and not out2.exists()
    assert "field 'advantage': gigpo needs no values, but value_source=oracle gives them" in r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("label:\n  gigpo_norm: median\n")
    r = runner.invoke(app, ["label", str(src), "--out", str(out2), "--advantage", "gigpo", "--config", str(bad)])
    assert r.exit_code == 2 and "gigpo_norm" in r.output and "median" in r.output and len(r.output.strip().splitlines()) == 1


def test_bppo_leaves_out_expert_rows_without_advantage(tmp_path):
    """GiGPO gives demonstrations no advantage: the bppo / awr policy step leaves their trajectories out (and
    counts them); a self-play row without one is still an error."""
    from qevolve_cli.errors import TableError
    from qevolve_cli.policy.config import PolicyConfig
    from qevolve_cli.policy.data import load_policy_table

    df = table(THREE + [("E1", ["s", "t"], [0, 1], "expert", "t1", 0, None)])
    out, _ = gigpo(df)
    df = df.with_columns(out["advantage"])
    p = tmp_path / "adv.parquet"
    schema.write_table(df, p)
    for objective in ("bppo", "awr"):
        rows, info = load_policy_table(PolicyConfig(objective=objective), p)
        assert sorted(rows["traj_id"].unique().to_list()) == ["A", "B", "C"] and info["expert_without_advantage"] == 1
    bad = tmp_path / "bad.parquet"
    schema.write_table(df.with_columns(pl.when(pl.col("traj_id") == "B").then(None).otherwise(pl.col("advantage"))
                                       .alias("advantage")), bad)
    with pytest.raises(TableError, match="advantage.*2 null values"):
        load_policy_table(PolicyConfig(objective="bppo"), bad)


# ---- the evolve loop and the compare row, on real smoke-scale lamps runs (subprocesses)

ROLLOUT_3 = "rollout:\n  n_per_task: 3\n"  # 3 rollouts per task: episode groups to compare, a shared first state


def evolve(tmp_path, name: str, config: str, *extra: str) -> tuple:
    from conftest import run_qevolve

    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(config)
    run = tmp_path / name
    r = run_qevolve("evolve", "--env", "lamps", "--preset", "smoke", "--iters", "1", "--config", cfg, "--run-dir", run,
                    "--quiet", "--json", *extra, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return run, json.loads((run / "manifest.json").read_text())["stages"]


@pytest.mark.slow
def test_evolve_with_gigpo_advantages_trains_no_critic(tmp_path):
    run, man = evolve(tmp_path, "run", ROLLOUT_3 + "label:\n  advantage: gigpo\n")
    assert "iter_1/critic" not in man and not (run / "iter_1" / "critic").exists()
    assert man["iter_1/advantage"]["status"] == "done" and man["iter_1/policy"]["status"] == "done"
    plan = (run / "plan.sh").read_text()
    assert "qevolve critic" not in plan and "--critic" not in plan
    adv = schema.read_table(run / "iter_1" / "advantages.parquet")
    want, _ = gigpo_advantages(schema.read_table(run / "iter_1" / "labeled.parquet"))  # label's defaults
    assert adv["advantage"].to_list() == want["advantage"].to_list()
    assert man["iter_1/advantage"]["metrics"]["gigpo"]["anchored_steps"] > 0  # the 3 rollouts share a first state
    n_expert = schema.read_table(run / "expert.parquet")["traj_id"].n_unique()
    p1 = json.loads((run / "iter_1" / "policy" / "train_summary.json").read_text())
    assert p1["objective"] == "bppo" and p1["expert_without_advantage"] == n_expert
    assert p1["trajectories"] == schema.read_table(run / "iter_1" / "rollout.parquet")["traj_id"].n_unique()


@pytest.mark.slow
def test_compare_gigpo_row(tmp_path):
    """The GiGPO row: the run's iteration-1 labels relabelled by `label --advantage gigpo`, the run's own BPPO step
    from BC on them (no critic), evaluated like every row; with --select-on-validation chosen among as many
    candidates as Q-Evolve's policy step."""
    from conftest import run_qevolve

    run, man = evolve(tmp_path, "run", ROLLOUT_3)
    r = run_qevolve("compare", "--run-dir", run, "--set", "arms=[sft, qevolve, gigpo]", "--json", "--quiet",
                    timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    t = json.loads(r.stdout)
    rows = {x["arm"]: x for x in t["rows"]}
    g = rows["gigpo"]
    assert list(rows) == ["sft", "qevolve", "gigpo"] and g["method"] == "GiGPO (anchor-state credit)"
    assert not g["oracle"] and g["self_play_steps"] == rows["qevolve"]["self_play_steps"] > 0
    assert [b["stage"] for b in g["budget"]] == ["BC", "it 1 (GiGPO)"]
    for col in t["columns"]:  # the same tasks as every row: paired statistics
        assert set(g["per_task"][col]) == set(rows["sft"]["per_task"][col]) and g["scores"][col]["n"] > 0
    cdir = run / "compare"
    adv = schema.read_table(cdir / "gigpo" / "advantages.parquet")
    labeled = schema.read_table(run / "iter_1" / "labeled.parquet")
    want, stats = gigpo_advantages(labeled)
    assert adv["traj_id"].to_list() == labeled["traj_id"].to_list()
    assert adv["advantage"].to_list() == want["advantage"].to_list()
    assert g["anchor_groups"] == json.loads(json.dumps(stats)) and stats["anchored_steps"] > 0
    assert not list(cdir.rglob("critic"))  # no critic trained
    gs = json.loads((cdir / "gigpo" / "policy" / "train_summary.json").read_text())
    p1 = json.loads((run / "iter_1" / "policy" / "train_summary.json").read_text())
    assert gs["objective"] == p1["objective"] == "bppo" and gs["ref"] == p1["ref"] == str(run / "bc" / "policy")
    assert gs["epochs"] == p1["epochs"] and gs["expert_without_advantage"] == labeled.filter(
        pl.col("source") == "expert")["traj_id"].n_unique()
    md = (cdir / "table.md").read_text()
    assert "| GiGPO (anchor-state credit) |" in md and f"({100 * stats['anchored_share']:.1f} %)" in md

    # --select-on-validation: the same candidates as the run's policy step, on the same validation tasks
    sel_cfg = (ROLLOUT_3 + "select_on_validation: true\nvalidation_tasks: 2\nbc_candidates: [{}, {epochs: 2}]\n"
               "policy_candidates: [{}, {lr: 0.5}]\n")
    srun, sman = evolve(tmp_path, "srun", sel_cfg)
    r = run_qevolve("compare", "--run-dir", srun, "--select-on-validation", "--set", "arms=[sft, qevolve, gigpo]",
                    "--json", "--quiet", timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = {x["arm"]: x for x in json.loads(r.stdout)["rows"]}
    gsel, qsel = rows["gigpo"]["selection"], sman["iter_1/policy"]["metrics"]["selection"]
    assert [c["tag"] for c in gsel["candidates"]] == [c["tag"] for c in qsel["candidates"]] == ["base", "lr0.5"]
    assert gsel["validation_tasks"] == qsel["validation_tasks"] == 2 and gsel["disjoint"] is True
    from qevolve_cli.evolve.select import validation_tasks

    val_ids = {t.task_id for t in validation_tasks("lamps", 2)}  # GiGPO trains on none of them either
    assert not set(pl.read_parquet(srun / "compare" / "gigpo" / "advantages.parquet")["task_id"]) & val_ids
    assert gsel["policy"] == f"gigpo/cand_{gsel['chosen']}/policy"
    assert json.loads((srun / "compare" / "selection.json").read_text())["gigpo"] == gsel
