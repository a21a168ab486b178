"""The feature critic (kind: features): turn windows, cached frozen features, heads trained with the IQL losses.

Real components: the tiny offline llama, the prefix indexer, parquet tables, the `qevolve critic` / `qevolve
label` commands run as subprocesses.
"""
from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from qevolve_cli.critic.config import CriticConfig
from qevolve_cli.critic.features import cached_features, extract, state_sequences
from qevolve_cli.critic.score import score_table
from qevolve_cli.critic.trainer import train_critic
from qevolve_cli.errors import QevolveError
from qevolve_cli.prefix import _messages, _render, add_prefix_positions, tokenize_trajectories, turn_windows
from qevolve_cli.tokenizer import load_tokenizer
from qevolve_cli.transcript import layout_of, state_end
from tests.conftest import run_qevolve
from tests.test_critic_mdp import GAMMA, M, mdp_table, tabular_reference

pytestmark = pytest.mark.usefixtures("one_thread")


def lamps_table(n: int = 4) -> pl.DataFrame:
    """Expert demonstrations of lamps-habit (built-in, real environment), labelled."""
    from qevolve_cli.envs.expert import collect_expert
    from qevolve_cli.labeling import LabelConfig, label_frame

    df = collect_expert("lamps-habit", "train", limit=n)
    # --step-limit 26 (lamps-habit's own): the demonstrations' steps left from their tasks' budgets
    out, _ = label_frame(df, LabelConfig(step_limit=26))
    return out


def _expected_state_ids(tok, df: pl.DataFrame, row: dict, K: int) -> list[int]:
    """The slow reference: render head + the last K turns ending at o_t, tokenise it."""
    lay = layout_of(tok)
    tr = df.filter(pl.col("traj_id") == row["traj_id"]).sort("step")
    msgs = _messages(tr["env"][0], tr["instruction"][0], tr["observation"].to_list(), tr["action"].to_list(),
                     tr["next_observation"].to_list(), lay)
    t = row["step"]
    j = max(0, t - K)
    win = msgs[:lay.head] + msgs[lay.head + 2 * j: state_end(t, lay) + 1]
    return tok(_render(tok, win), add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("K", [1, 2])
def test_turn_windows_match_the_slow_render(tiny_model_dir, K):
    df = lamps_table(3)
    tok = load_tokenizer(tiny_model_dir)
    tw = turn_windows(df, tok, K)
    seqs = tw["sequences"]
    by_row = {int(r): i for i, r in enumerate(tw["rows"])}
    for r, row in enumerate(df.iter_rows(named=True)):
        i = by_row[r]
        si, p = tw["s"][i]
        want = _expected_state_ids(tok, df, row, K)
        assert seqs[si][: p + 1].tolist() == want, (row["traj_id"], row["step"])
        # the state-action ends after the action, inside the same sequence
        sai, pa_ = tw["sa"][i]
        assert sai == si and pa_ > p
        # s' is the next step's own state (the same window text), or the state after the last step
        ni, pn = tw["next"][i]
        nxt = df.filter((pl.col("traj_id") == row["traj_id"]) & (pl.col("step") == row["step"] + 1))
        if nxt.height:
            want_n = _expected_state_ids(tok, df, nxt.row(0, named=True), K)
        else:  # o_T after the last step: head + the last K turns through o_T
            fake = {**row, "step": row["step"] + 1}
            tr = df.filter(pl.col("traj_id") == row["traj_id"])
            ext = pl.concat([tr, tr.tail(1).with_columns(pl.lit(row["step"] + 1).cast(tr["step"].dtype).alias("step"),
                                                         pl.lit(row["next_observation"]).alias("observation"))])
            want_n = _expected_state_ids(tok, ext, fake, K)
        assert seqs[ni][: pn + 1].tolist() == want_n


def test_turn_windows_longer_than_the_episode_are_the_whole_transcript(tiny_model_dir):
    df = lamps_table(2)
    tok = load_tokenizer(tiny_model_dir)
    tw = turn_windows(df, tok, 1000)
    whole = add_prefix_positions(df, tok)
    ids = tokenize_trajectories(whole, tok)
    assert len(tw["sequences"]) == df["traj_id"].n_unique()  # one window a trajectory
    by_traj = dict(zip(ids["traj_id"].to_list(), ids["input_ids"].to_list(), strict=True))
    pos = {(r["traj_id"], r["step"]): (r["pos_s"], r["pos_sa"], r["pos_next"]) for r in whole.iter_rows(named=True)}
    for i, r in enumerate(tw["rows"]):
        row = df.row(int(r), named=True)
        assert tw["sequences"][tw["s"][i][0]].tolist() == list(by_traj[row["traj_id"]])
        assert (tw["s"][i][1], tw["sa"][i][1], tw["next"][i][1]) == pos[(row["traj_id"], row["step"])]


def test_equal_recent_turns_give_equal_features(tiny_model_dir):
    """Two trajectories that reach the hall by the same last turn share its state features (K = 1), while the
    whole-transcript view keeps them apart only where histories differ."""
    df = mdp_table()
    tok = load_tokenizer(tiny_model_dir)
    seqs = state_sequences(df, tok, 1, None, 1.0)
    f = extract(tiny_model_dir, seqs, -1)
    key = {(r["traj_id"], r["step"]): i for i, r in enumerate(df.iter_rows(named=True))}
    np.testing.assert_allclose(f["h_s"][key[("win", 1)]], f["h_s"][key[("pit", 1)]], atol=1e-6)
    np.testing.assert_allclose(f["h_next"][key[("win", 0)]], f["h_s"][key[("win", 1)]], atol=1e-6)
    assert np.abs(f["h_s"][key[("win", 1)]] - f["h_s"][key[("swamp", 1)]]).max() > 1e-3
    assert np.abs(f["h_sa"][key[("win", 1)]] - f["h_sa"][key[("pit", 1)]]).max() > 1e-3  # east vs west


def test_shared_prefix_pass_equals_whole_forwards(tiny_model_dir):
    df = lamps_table(3)
    tok = load_tokenizer(tiny_model_dir)
    seqs = state_sequences(df, tok, 2, None, 1.0)
    a = extract(tiny_model_dir, seqs, 1, prefix=False)
    b = extract(tiny_model_dir, seqs, 1, prefix=True)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-5)


def test_layer_out_of_range_is_one_line(tiny_model_dir):
    df = mdp_table()
    tok = load_tokenizer(tiny_model_dir)
    with pytest.raises(QevolveError, match="feature_layer: 9 is out of range for a model of 2 layers"):
        extract(tiny_model_dir, state_sequences(df, tok, 1, None, 1.0), 9)


def test_features_are_cached_by_content(tiny_model_dir, tmp_path):
    df = mdp_table()
    tok = load_tokenizer(tiny_model_dir)
    kw = dict(layer=-1, context_turns=1, max_length=None, window_context=1.0, cache_dir=tmp_path)
    f1, i1 = cached_features(df, tok, tiny_model_dir, **kw)
    f2, i2 = cached_features(df, tok, tiny_model_dir, **kw)
    assert not i1["cached"] and i2["cached"] and i1["key"] == i2["key"]
    for k in f1:
        np.testing.assert_array_equal(f1[k], f2[k])
    # another table (one observation changed), another layer, another view: new keys
    df2 = df.with_columns(pl.when(pl.col("step") == 1).then(pl.lit("You are lost.")).otherwise(pl.col("observation"))
                          .alias("observation"))
    keys = {i1["key"], cached_features(df2, tok, tiny_model_dir, **kw)[1]["key"],
            cached_features(df, tok, tiny_model_dir, **{**kw, "layer": 1})[1]["key"],
            cached_features(df, tok, tiny_model_dir, **{**kw, "context_turns": 2})[1]["key"]}
    assert len(keys) == 4
    assert len(list(tmp_path.glob("features-*.safetensors"))) == 4


def test_feature_critic_reproduces_tabular_iql(tiny_model_dir, tmp_path):
    """The corridor MDP of test_critic_mdp (a tree: whole transcripts are the states): the feature critic's V and
    Q - V reach the exact tabular fixed point, scoring through the saved directory gives the same values, and its
    fit ladder says it fits its own terminals."""
    df = mdp_table()
    ref = tabular_reference(df)
    cfg = CriticConfig(kind="features", context_turns=0, epochs=600, lr=3e-3, feature_batch_steps=8, ema_lambda=0.1,
                       warmup_ratio=0.0, lr_scheduler="constant", head_hidden=64, gamma=GAMMA, expectile=M,
                       device="cpu", heldout_fraction=0.0, checkpoint=False)
    table = tmp_path / "t.parquet"
    df.write_parquet(table)
    s = train_critic(cfg, table, tiny_model_dir, tmp_path / "critic")
    assert s["kind"] == "features" and s["features"]["cached"] is False
    meta = json.loads((tmp_path / "critic" / "critic.json").read_text())
    assert meta["kind"] == "features" and meta["context_turns"] == 0
    sc = score_table(df, tmp_path / "critic", device="cpu", feature_cache=tmp_path / "features")
    got = {(r["traj_id"], r["step"]): (r["value"], r["q_value"] - r["value"]) for r in sc.iter_rows(named=True)}
    for key, (v_ref, a_ref) in ref.items():
        assert got[key][0] == pytest.approx(v_ref, abs=0.06), (key, got[key], v_ref)
        assert np.sign(got[key][1]) == np.sign(a_ref) or abs(a_ref) < 1e-6, (key, got[key], a_ref)
    assert got[("pit", 0)][0] == pytest.approx(got[("win", 0)][0], abs=1e-5)  # one state, one value
    assert (sc.filter(pl.col("done"))["next_value"] == 0).all()
    lad = s["diagnostics"]["fit_ladder"]
    assert lad["terminal"]["all"]["n"] == 3 and lad["terminal"]["all"]["mae"] <= 0.05
    assert lad["td_q_mae"] <= 0.05 and "solver" not in lad  # textcraft-named table: no solver
    assert s["warning"] is None or "terminal" not in s["warning"]
    # reranking needs the LoRA critic: one line
    from qevolve_cli.critic.rerank import CriticReranker

    with pytest.raises(QevolveError, match="feature critic .* cannot rerank"):
        CriticReranker(tmp_path / "critic", device="cpu")


def test_feature_critic_cli_prints_the_ladder_and_label_uses_it(tiny_model_dir, tmp_path):
    df = lamps_table(4)
    table = tmp_path / "labeled.parquet"
    df.write_parquet(table)
    proc = run_qevolve("critic", "--data", table, "--model", tiny_model_dir, "--out", tmp_path / "fc",
                       "--set", "kind=features", "--set", "context_turns=1", "--set", "time_input=steps_left",
                       "--set", "time_scale=1.0", "--set", "heldout_fraction=0", "--epochs", "30", "--quiet",
                       check=True)
    assert "fit ladder (train): terminal |Q-r|" in proc.stdout
    assert "corr(V, tabular)" in proc.stdout and "credit" in proc.stdout  # lamps-habit has a solver
    assert "features: layer -1, context_turns 1" in proc.stdout
    summary = json.loads((tmp_path / "fc" / "summary.json").read_text())
    assert summary["features"]["cached"] is False
    proc = run_qevolve("label", table, "--critic", tmp_path / "fc", "--out", tmp_path / "adv.parquet", "--quiet",
                       check=True)
    adv = pl.read_parquet(tmp_path / "adv.parquet")
    assert adv["advantage"].null_count() == 0 and adv["value"].std() > 0
    # the label stage read the critic stage's features (one cache file, made once)
    assert len(list((tmp_path / "features").glob("features-*.safetensors"))) == 1


def test_labelled_expert_rows_of_a_budgeted_task_count_down_from_its_budget():
    df = lamps_table(2)
    for _tid, tr in df.group_by("traj_id"):
        tr = tr.sort("step")
        budget = int(tr["instruction"][0].rsplit("in at most ", 1)[1].split()[0])
        assert tr["steps_left"].to_list() == [budget - t for t in tr["step"].to_list()]


def test_head_prefix_and_equal_windows_give_the_same_features(tiny_model_dir):
    """The two-level prefix (shared prompt, then each task's head) and one forward per distinct window give the
    features of a whole forward per window; equal windows are computed once."""
    df = pl.concat([lamps_table(3), lamps_table(3).with_columns(("copy:" + pl.col("traj_id")).alias("traj_id"))])
    tok = load_tokenizer(tiny_model_dir)
    seqs = state_sequences(df, tok, 2, None, 1.0)
    assert (seqs["head_len"] > 16).all() and len(seqs["head_len"]) == len(seqs["sequences"])
    a = extract(tiny_model_dir, seqs, -1, prefix=False)
    b = extract(tiny_model_dir, seqs, -1, prefix=True)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-5)
    n = df.height // 2  # the copies' rows equal the originals'
    np.testing.assert_array_equal(a["h_s"][:n], a["h_s"][n:])
    whole = state_sequences(df, tok, 0, None, 1.0)
    c = extract(tiny_model_dir, whole, -1, prefix=False)
    d = extract(tiny_model_dir, whole, -1, prefix=True)
    for k in c:
        np.testing.assert_allclose(c[k], d[k], atol=1e-5)


def test_batched_rests_give_each_sequence_its_own_forwards_states(tiny_model_dir):
    """The rests of one head run right-padded in one forward (batch_tokens): every requested position gets the
    states of that sequence's forward alone, with and without the prefix cache, in both views; a batch of
    unequal windows (padding after the shorter ones) is among them."""
    df = lamps_table(3)
    tok = load_tokenizer(tiny_model_dir)
    for view in (2, 0):
        seqs = state_sequences(df, tok, view, None, 1.0)
        if view:
            assert len({len(s) for s in seqs["sequences"]}) > 2  # windows of unequal length: batches hold padding
        for prefix in (False, True):
            one = extract(tiny_model_dir, seqs, -1, prefix=prefix, batch_tokens=1)
            many = extract(tiny_model_dir, seqs, -1, prefix=prefix, batch_tokens=100_000)
            for k in one:
                np.testing.assert_allclose(one[k], many[k], atol=1e-5)
                assert np.abs(one[k]).sum(1).min() > 0  # every row was written


def test_feature_pass_dtype_follows_the_generation_rule_not_the_training_one():
    """``dtype: auto``: the feature pass has no gradient, so a CPU with native bf16 runs it in bf16 (as rollouts
    do), where the LoRA critic, which trains through its backbone, stays fp32; an explicit dtype and
    QEVOLVE_PRECISION win."""
    from qevolve_cli import precision
    from qevolve_cli.critic.feature_critic import feature_dtype

    bf16_cpu, plain_cpu = frozenset({"avx512f", "avx512_bf16"}), frozenset({"avx2"})
    assert feature_dtype("auto", "cpu", flags=bf16_cpu, env={}) == "bfloat16"
    assert precision.resolve("auto", "cpu", flags=bf16_cpu, env={}, training=True).dtype == "float32"
    assert feature_dtype("auto", "cpu", flags=plain_cpu, env={}) == "float32"
    assert feature_dtype("auto", "cuda", flags=plain_cpu, env={}) == "bfloat16"
    assert feature_dtype("float32", "cpu", flags=bf16_cpu, env={}) == "float32"
    assert feature_dtype("bfloat16", "cpu", flags=plain_cpu, env={}) == "bfloat16"
    assert feature_dtype("auto", "cpu", flags=bf16_cpu, env={"QEVOLVE_PRECISION": "fp32"}) == "float32"
