"""`qevolve eval`: greedy evaluation of the tiny model (subprocess CLI runs) and the metrics."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import polars as pl
import pytest

from tests.conftest import run_qevolve
from tests.test_rollout import _react_model

FAST = ["--max-new-tokens", "24", "--workers", "2", "--envs-per-worker", "2", "-q"]


@pytest.fixture(scope="session")
def react_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    return _react_model(tmp_path_factory, tiny_model_dir)


def test_eval_textcraft_json(react_model_dir: Path, tmp_path: Path) -> None:
    from qevolve_cli import schema

    out = tmp_path / "ev.parquet"
    res = run_qevolve("eval", "--env", "textcraft", "--policy", react_model_dir, "--split", "test_seen",
                      "--max-tasks", "3", "--max-steps", "3", "--out", out, "--json", *FAST, check=True)
    m = json.loads(res.stdout)
    assert m["env"] == "textcraft" and m["split"] == "test_seen" and m["temperature"] == 0.0
    assert m["n"] == 3 and m["n_tasks"] == 3 and m["failed"] == 0
    df = schema.read_table(out)
    assert set(df["split"]) == {"test_seen"} and df["traj_id"].n_unique() == 3
    final = df.group_by("traj_id").agg(pl.col("reward_env").sum())["reward_env"]
    assert m["avg_reward"] == pytest.approx(float(final.mean()), abs=1e-6)
    assert m["success_rate"] == pytest.approx(float((final >= 1).mean()), abs=1e-6)
    assert sum(d["n"] for d in m["by_task_type"].values()) == 3
    assert json.loads((tmp_path / "ev.parquet.metrics.json").read_text())["avg_reward"] == m["avg_reward"]
    # greedy: a second evaluation plays exactly the same trajectories
    out2 = tmp_path / "ev2.parquet"
    run_qevolve("eval", "--env", "textcraft", "--policy", react_model_dir, "--split", "test_seen",
                "--max-tasks", "3", "--max-steps", "3", "--out", out2, "--seed", "99", *FAST, check=True)
    a, b = (pl.read_parquet(p).sort(["traj_id", "step"]) for p in (out, out2))
    assert a["action"].to_list() == b["action"].to_list()


def test_eval_shards_merge_to_the_unsharded_eval(react_model_dir: Path, tmp_path: Path, monkeypatch, one_thread) -> None:
    """`eval --best-of 2 --shard I/2`: each shard plays whole tasks (both samples), with the unsharded run's
    trajectory ids and seeds; its metrics are its own, and the shards' tables give the unsharded metrics.
    Shard 1 through the CLI (CliRunner, default output name), shard 0 and the whole run through run_eval
    on one backend and pool, all on one thread (threads: 1) so that the sampled tokens can be compared."""
    from typer.testing import CliRunner

    from qevolve_cli.cli import app
    from qevolve_cli.envs.pool import EnvPool
    from qevolve_cli.rollout.backends import HFBackend
    from qevolve_cli.rollout.config import RolloutConfig
    from qevolve_cli.rollout.evaluate import best_of_n, run_eval, summarize

    knobs = {"env": "textcraft", "split": "test_seen", "max_tasks": 3, "max_steps": 3, "max_new_tokens": 24,
             "temperature": 1.0, "seed": 5, "workers": 1, "envs_per_worker": 2, "threads": 1}
    (tmp_path / "ev.yaml").write_text("".join(f"{k}: {v}\n" for k, v in knobs.items()))
    monkeypatch.chdir(tmp_path)
    sigterm = signal.getsignal(signal.SIGTERM)  # the command maps SIGTERM to Ctrl-C in its process: restore it
    try:
        r = CliRunner().invoke(app, ["eval", "--env", "textcraft", "--policy", str(react_model_dir), "--split",
                                     "test_seen", "--config", "ev.yaml", "--best-of", "2", "--shard", "1/2", "--json",
                                     "-q"])
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert r.exit_code == 0, r.output
    m1 = json.loads(r.output.strip().splitlines()[-1])
    assert m1["shard"] == "1/2" and m1["n"] == 1 and m1["env_steps"] > 0 and m1["oracle"]
    shard1 = pl.read_parquet(tmp_path / "eval_textcraft_test_seen_1of2.parquet")  # the default name of a shard
    assert json.loads((tmp_path / "eval_textcraft_test_seen_1of2.parquet.metrics.json").read_text())["n"] == 1

    cfg = RolloutConfig(**knobs)
    be = HFBackend(react_model_dir, max_new_tokens=24, threads=1)
    try:
        with EnvPool("textcraft", workers=1, envs_per_worker=2) as pool:
            full = run_eval(cfg, react_model_dir, tmp_path / "full.parquet", best_of=2, backend=be, pool=pool)
            m0 = run_eval(cfg.replace(shard="0/2"), react_model_dir, tmp_path / "s0.parquet", best_of=2, backend=be,
                          pool=pool)
    finally:
        be.close()
    assert m0["shard"] == "0/2" and m0["n"] == 2 and full["shard"] is None and full["n"] == 3
    whole, shard0 = pl.read_parquet(tmp_path / "full.parquet"), pl.read_parquet(tmp_path / "s0.parquet")
    tasks0, tasks1 = set(shard0["task_id"]), set(shard1["task_id"])
    assert len(tasks0) == 2 and len(tasks1) == 1 and not tasks0 & tasks1, "whole tasks, disjoint"
    assert (shard0.group_by("task_id").agg(pl.col("sample").n_unique())["sample"] == 2).all()
    key = ["traj_id", "step"]
    assert pl.concat([shard0, shard1]).sort(key).equals(whole.sort(key)), "same ids, seeds, actions, rewards"
    merged = summarize(best_of_n(pl.concat([shard0, shard1])))
    assert merged == {k: full[k] for k in merged}, "the shards' tables give the unsharded metrics"


def test_eval_sciworld_table(react_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "sw.parquet"
    res = run_qevolve("eval", "--env", "sciworld", "--policy", react_model_dir, "--split", "test_unseen",
                      "--max-tasks", "2", "--max-steps", "2", "--out", out, *FAST, check=True)
    text = res.stdout
    assert "sciworld / test_unseen" in text and "overall" in text and "avg reward" in text
    df = pl.read_parquet(out)
    assert df["traj_id"].n_unique() == 2 and set(df["split"]) == {"test_unseen"}
    for tt in df["task_type"].unique():  # one table row per task type
        assert tt in text


def test_summarize_metrics() -> None:
    from qevolve_cli.rollout.evaluate import summarize

    rows = []

    def traj(tid, tt, rewards, error=None):
        for i, r in enumerate(rewards):
            rows.append({"traj_id": tid, "task_type": tt, "step": i, "reward_env": r,
                         "error": error})

    traj("a", "boil", [0.0, 1.0])
    traj("b", "boil", [0.0, 0.0, 0.5])
    traj("c", "melt", [0.0])
    traj("d", "melt", [0.0, 1.0], error="worker crashed")  # failed: counts as 0
    m = summarize(pl.DataFrame(rows))
    assert m["n"] == 4 and m["failed"] == 1
    assert m["avg_reward"] == pytest.approx(1.5 / 4)
    assert m["success_rate"] == pytest.approx(1 / 4)
    assert m["nonzero_rate"] == pytest.approx(2 / 4)
    assert m["by_task_type"]["boil"]["avg_reward"] == pytest.approx(0.75)
    assert m["by_task_type"]["melt"] == {"n": 2, "avg_reward": 0.0, "success_rate": 0.0, "nonzero_rate": 0.0,
                                         "avg_steps": 1.5, "failed": 1}


def test_eval_critic_needs_candidates(react_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "critic").mkdir()
    res = run_qevolve("eval", "--env", "textcraft", "--policy", react_model_dir, "--split", "test_seen",
                      "--max-tasks", "1", "--critic", tmp_path / "critic", "--out", tmp_path / "e.parquet", "-q")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ["error: --critic: needs --candidates N with N >= 2"]
    assert not (tmp_path / "e.parquet").exists()


def test_best_of_n_keeps_the_highest_final_reward_per_task() -> None:
    from qevolve_cli.rollout.evaluate import best_of_n, summarize

    def traj(task, sample, rewards, error=None):
        return [dict(traj_id=f"s{sample}/{task}", task_id=task, sample=sample, step=t, reward_env=float(r),
                     task_type="all", error=error) for t, r in enumerate(rewards)]

    rows = (traj("a", 0, [0, 0]) + traj("a", 1, [0, 1]) + traj("a", 2, [1])  # tie 1 = 1: lowest sample wins
            + traj("b", 0, [0, 0.5]) + traj("b", 1, [1], error="worker crashed")  # a failed episode counts 0
            + traj("c", 1, [0]) + traj("c", 0, [0, 0, 0]))  # all 0: sample 0
    sel = best_of_n(pl.DataFrame(rows))
    assert sorted(sel["traj_id"].unique().to_list()) == ["s0/b", "s0/c", "s1/a"]
    m = summarize(sel)
    assert m["n"] == 3 and m["avg_reward"] == pytest.approx(0.5) and m["success_rate"] == pytest.approx(1 / 3)


@pytest.mark.slow
def test_eval_best_of_n_on_lamps_is_marked_oracle(tiny_model_dir: Path, tmp_path: Path, tmp_path_factory) -> None:
    from qevolve_cli.rollout.evaluate import trajectory_outcomes
    from qevolve_cli.rollout.warm import react_tune

    model = react_tune(tiny_model_dir, tmp_path / "react_lamps", ["lamps"])
    out = tmp_path / "bon.parquet"
    res = run_qevolve("eval", "--env", "lamps", "--policy", model, "--split", "test_seen", "--max-tasks", "5",
                      "--max-steps", "4", "--best-of", "3", "--temperature", "1.0", "--out", out, "--json", *FAST,
                      check=True)
    m = json.loads(res.stdout)
    assert m["best_of"] == 3 and m["oracle"] is True and m["temperature"] == 1.0
    df = pl.read_parquet(out)  # all N trajectories per task are kept in the table
    per = trajectory_outcomes(df)
    assert per.height == 15 and per.group_by("task_id").len()["len"].to_list() == [3] * 5
    assert m["n"] == 5 and m["env_steps"] == df.height
    best = per.group_by("task_id").agg(pl.col("reward").max())["reward"]
    assert m["avg_reward"] == pytest.approx(float(best.mean()), abs=1e-6)
    # never worse than any single sample index (what one sampled trajectory per task would score)
    for s in range(3):
        assert m["avg_reward"] >= float(per.filter(pl.col("sample") == s)["reward"].mean()) - 1e-9
    assert len(set(df["action"].to_list())) > 1  # sampled, not one greedy action
    text = run_qevolve("eval", "--env", "lamps", "--policy", model, "--split", "test_seen", "--max-tasks", "5",
                       "--max-steps", "4", "--best-of", "3", "--temperature", "1.0", "--out", out, "--resume",
                       *FAST, check=True).stdout
    assert "best-of-3 by env reward (oracle upper bound)" in " ".join(text.split())  # rich may wrap the title
    bad = run_qevolve("eval", "--env", "lamps", "--policy", model, "--split", "test_seen", "--best-of", "2",
                      "--critic", tmp_path, "--candidates", "2", "--out", tmp_path / "x.parquet", *FAST)
    assert bad.returncode == 2 and "cannot be combined with --critic" in bad.stderr


def test_eval_of_a_lora_policy_directory_is_its_base_plus_the_adapter(react_model_dir: Path, tmp_path: Path) -> None:
    """A LoRA policy (what `policy --lora` and `--preset cpu-smol` write: adapter_config.json, no config.json) is
    evaluated as its base model plus the adapter, exactly as `--policy BASE --adapter DIR`; an adapter that does
    not name its base is one line naming the file and field."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(react_model_dir))
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                           init_lora_weights=False))  # random B: the adapter changes the outputs
    ad = tmp_path / "lora_policy"
    lora.save_pretrained(str(ad))
    AutoTokenizer.from_pretrained(str(react_model_dir)).save_pretrained(str(ad))
    assert (ad / "adapter_config.json").is_file() and not (ad / "config.json").exists()
    assert json.loads((ad / "adapter_config.json").read_text())["base_model_name_or_path"] == str(react_model_dir)

    def actions(*policy_args: str | Path) -> list[str]:
        out = tmp_path / f"ev{len(list(tmp_path.glob('ev*.parquet')))}.parquet"
        run_qevolve("eval", "--env", "textcraft", *policy_args, "--split", "test_seen", "--max-tasks", "2",
                    "--max-steps", "3", "--out", out, *FAST, check=True)
        return pl.read_parquet(out).sort(["traj_id", "step"])["action"].to_list()

    own = actions("--policy", ad)
    assert own == actions("--policy", react_model_dir, "--adapter", ad)
    assert own != actions("--policy", react_model_dir)  # the adapter was applied, not dropped
    cfg = json.loads((ad / "adapter_config.json").read_text())
    (ad / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": None}))
    res = run_qevolve("eval", "--env", "textcraft", "--policy", ad, "--split", "test_seen", "--max-tasks", "1",
                      "--out", tmp_path / "bad.parquet", *FAST)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"error: {ad / 'adapter_config.json'}: field 'base_model_name_or_path' is empty: the adapter does not say its "
        f"base model; pass it as --policy BASE --adapter {ad}"]
    assert not (tmp_path / "bad.parquet").exists()
