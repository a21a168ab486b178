"""`qevolve critic` end to end on a real TextCraft buffer: expert -> label -> critic -> label --critic."""
from __future__ import annotations

import json
import os

import numpy as np
import polars as pl
import pytest

from qevolve_cli import schema
from tests.conftest import run_qevolve

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the subprocesses: no spinning threads on 2 shared cores


def corrupted_self_buffer(expert: pl.DataFrame) -> pl.DataFrame:
    """Self-play-like trajectories from real expert ones: a format error, an invalid action, a repeat,
    an early stop without reward, and one trajectory recorded as failed (worker crash)."""
    ids = expert["traj_id"].unique(maintain_order=True).to_list()
    parts = []
    for k, tid in enumerate(ids[:4]):
        t = expert.filter(pl.col("traj_id") == tid).sort("step")
        new = tid.replace("expert:", "self:")
        t = t.with_columns(pl.lit(new).alias("traj_id"), pl.lit("self").alias("source"),
                           pl.lit(1, pl.Int32).alias("iteration"))
        if k == 0:  # format error at step 0
            t = t.with_columns(pl.when(pl.col("step") == 0).then(pl.lit("I think I should get logs."))
                               .otherwise(pl.col("action")).alias("action"),
                               pl.when(pl.col("step") == 0).then(None).otherwise(pl.col("command")).alias("command"))
        if k == 1:  # invalid action, then stop before success
            t = t.head(2).with_columns(
                pl.when(pl.col("step") == 1).then(pl.lit("Could not find enough items to craft it."))
                .otherwise(pl.col("next_observation")).alias("next_observation"),
                pl.lit(0.0, pl.Float32).alias("reward_env"), pl.lit(False).alias("done"))
        if k == 2:  # repeat: next observation equals the observation; no reward
            t = t.head(2).with_columns(pl.col("observation").alias("next_observation"),
                                       pl.lit(0.0, pl.Float32).alias("reward_env"), pl.lit(False).alias("done"))
        t = t.with_columns(pl.lit("worker crashed" if k == 3 else None, pl.String).alias("error"))
        parts.append(t)
    return pl.concat(parts, how="diagonal_relaxed")


@pytest.fixture(scope="module")
def textcraft_buffers(tmp_path_factory):
    d = tmp_path_factory.mktemp("tc")
    proc = run_qevolve("expert", "--env", "textcraft", "--split", "train", "--limit", "6", "--workers", "1",
                       "--out", d / "expert.parquet", "--json", "--quiet")
    # textcraft is a dependency of the package (pyproject.toml): a failure here is an install error or a broken
    # `qevolve expert`, and it fails the suite instead of skipping the chain
    assert proc.returncode == 0, f"qevolve expert --env textcraft failed: {proc.stderr.strip()[-600:]}"
    expert = schema.read_table(d / "expert.parquet")
    schema.write_table(corrupted_self_buffer(expert), d / "self.parquet")
    return d


def test_critic_cli_trains_on_textcraft_and_labels_advantages(textcraft_buffers, tiny_model_dir):
    d = textcraft_buffers
    run_qevolve("label", d / "expert.parquet", d / "self.parquet", "--tokenizer", tiny_model_dir,
                "--out", d / "labeled.parquet", "--json", check=True)
    lab = schema.read_table(d / "labeled.parquet")
    assert set(lab["aux_kind"].unique()) >= {"format", "invalid", "repeat"}

    proc = run_qevolve("critic", "--data", d / "labeled.parquet", "--model", tiny_model_dir, "--out", d / "critic",
                       "--preset", "cpu", "--epochs", "2", "--steps-per-traj", "3", "--batch-size", "4", "--json", check=True)
    summary = json.loads(proc.stdout)
    # the failed trajectory is not trained on; the held-out slice is not trained on either
    assert summary["trajectories"] + summary["heldout_trajectories"] == lab.filter(pl.col("error").is_null())["traj_id"].n_unique()
    assert summary["heldout_trajectories"] >= 1
    assert {"bellman_q", "ev_return", "auc_v", "v_std"} <= set(summary["diagnostics"])
    c = d / "critic"
    for f in ("critic.json", "heads.safetensors", "config.yaml", "metrics.jsonl", "tokenizer.json",
              "adapters/value/adapter_model.safetensors", "adapters/q/adapter_config.json",
              "adapters/q_target/adapter_model.safetensors"):
        assert (c / f).is_file(), f
    metrics = [json.loads(x) for x in (c / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [1, 2]
    for m in metrics:
        assert all(np.isfinite(m[k]) for k in ("loss_q", "loss_v", "mean_v", "mean_q", "td_error"))
        assert m["transitions"] > 0
    import yaml

    resolved = yaml.safe_load((c / "config.yaml").read_text())
    assert resolved["epochs"] == 2 and resolved["steps_per_traj"] == 3 and resolved["lora_rank"] == 8

    # the PEFT adapters load with plain PEFT on the base model
    from peft import PeftConfig

    assert PeftConfig.from_pretrained(str(c / "adapters" / "value")).r == 8

    # label --critic: value / next_value / advantage for every step
    run_qevolve("label", d / "labeled.parquet", "--critic", c, "--out", d / "adv.parquet", "--json", check=True)
    adv = schema.read_table(d / "adv.parquet")
    assert adv.height == lab.height
    for col in ("value", "next_value", "advantage"):
        assert adv[col].null_count() == 0 and np.isfinite(adv[col].to_numpy()).all()
    assert (adv.filter(pl.col("done"))["next_value"] == 0).all()
    # within a trajectory (one window), V(s_{t+1}) of step t is the value of step t+1
    t = adv.filter(pl.col("traj_id") == adv["traj_id"][0]).sort("step")
    assert np.allclose(t["next_value"].to_numpy()[:-1], t["value"].to_numpy()[1:], atol=1e-4)
    # A_T of the last step = r_env + 0 - V(s_T) (GAE with r_env only, V(terminal) = 0)
    last = adv.filter(pl.col("done")).row(0, named=True)
    assert last["advantage"] == pytest.approx(last["reward_env"] - last["value"], abs=1e-4)

    # critic reranking at evaluation (the paper's "w/o PI" ablation): best of N candidates by Q - V
    ev = run_qevolve("eval", "--env", "textcraft", "--policy", tiny_model_dir, "--split", "test_seen",
                     "--max-tasks", "1", "--max-steps", "2", "--max-new-tokens", "16", "--critic", c,
                     "--candidates", "3", "--out", d / "rerank.parquet", "--json", check=True)
    m = json.loads(ev.stdout)
    assert m["candidates"] == 3 and m["critic"] == str(c) and m["n"] == 1
    assert schema.read_table(d / "rerank.parquet")["traj_id"].n_unique() == 1

    # critic training is resumable and the output is atomic: a second run replaces it whole
    proc = run_qevolve("critic", "--data", d / "labeled.parquet", "--model", tiny_model_dir, "--out", c,
                       "--preset", "cpu", "--epochs", "1", "--json", check=True)
    assert json.loads(proc.stdout)["epochs"] == 1
    assert len((c / "metrics.jsonl").read_text().splitlines()) == 1


def test_critic_cli_errors_are_one_line(textcraft_buffers, tiny_model_dir, tmp_path):
    d = textcraft_buffers
    proc = run_qevolve("critic", "--data", d / "expert.parquet", "--model", tiny_model_dir, "--out", tmp_path / "c",
                       "--preset", "cpu")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "reward_aux" in proc.stderr and "expert.parquet" in proc.stderr
    assert not (tmp_path / "c").exists()
    proc = run_qevolve("critic", "--data", d / "expert.parquet", "--model", tmp_path / "nope", "--out",
                       tmp_path / "c", "--set", "expectile=2")
    assert proc.returncode == 2 and "expectile" in proc.stderr and proc.stderr.strip().count("\n") == 0
    proc = run_qevolve("critic", "--data", tmp_path / "missing.parquet", "--model", tiny_model_dir, "--out",
                       tmp_path / "c")
    assert proc.returncode == 2 and "missing.parquet" in proc.stderr
