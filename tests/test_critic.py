"""Critic model, data layout, scoring, weights switches and resume (tiny real model, real PEFT, CPU)."""
from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch

from qevolve_cli import core, schema
from qevolve_cli.critic.config import CriticConfig, load_critic_config
from qevolve_cli.critic.data import attach_targets, build_items, collate, step_weights_for
from qevolve_cli.critic.model import ADAPTERS, CriticModel, pool_last_token
from qevolve_cli.critic.score import score_table
from qevolve_cli.critic.trainer import CriticTrainer, train_critic
from qevolve_cli.errors import ConfigError, TableError
from qevolve_cli.rewards import process_rewards
from qevolve_cli.synthetic import synthetic_table
from qevolve_cli.tokenizer import load_tokenizer, pad_id_of
from qevolve_cli.training import lr_lambda

SMALL = dict(lora_rank=4, head_hidden=16, device="cpu", checkpoint=False, warmup_ratio=0.0)


# one thread: on the shared 2-core machine spinning OpenMP threads only slow tiny matmuls
pytestmark = pytest.mark.usefixtures("one_thread")


def labelled(n_traj=4, mean_steps=4, seed=0, obs_words=8) -> pl.DataFrame:
    df = schema.sort_steps(synthetic_table(n_traj, mean_steps=mean_steps, obs_words=obs_words, env="textcraft",
                                           seed=seed))
    offs = core.offsets(df)
    succ = core.trajectory_success(offs, df["reward_env"])
    aux = pl.Series("reward_aux", np.where(np.arange(df.height) % 3 == 0, -0.2, 0.0), pl.Float32)
    return df.with_columns(aux, pl.lit("none").alias("aux_kind"), core.broadcast(offs, succ, "success"),
                           core.step_weights(offs, succ, df.height))


@pytest.fixture(scope="module")
def critic_and_items(tiny_model_dir):
    cfg = CriticConfig(**SMALL)
    df = labelled()
    tok = load_tokenizer(tiny_model_dir)
    items = build_items(df, tok)
    attach_targets(items, df, cfg)
    return CriticModel.create(tiny_model_dir, cfg), items, tok, df, cfg


def test_three_adapters_share_one_frozen_backbone(critic_and_items, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    c, *_ = critic_and_items
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    n_base = sum(p.numel() for p in base.parameters())
    names = dict(c.backbone.named_parameters())
    non_lora = [p for n, p in names.items() if "lora_" not in n]
    assert sum(p.numel() for p in non_lora) == n_base  # no copy of the base model
    assert all(not p.requires_grad for p in non_lora)
    sizes = {a: sum(p.numel() for _, p in c.adapter_params(a)) for a in ADAPTERS}
    assert len(set(sizes.values())) == 1 and sizes["value"] > 0
    # switching adapters changes the hidden states, the base weights stay the same tensors
    ids = torch.tensor([[5, 6, 7, 8]])
    att = torch.ones_like(ids)
    ptrs = [p.data_ptr() for p in non_lora]
    with torch.no_grad():
        for _, p in c.adapter_params("q"):
            if "lora_B" in _:
                p.add_(0.5)
        hv = c.hidden("value", ids, att)
        hq = c.hidden("q", ids, att)
        for _, p in c.adapter_params("q"):
            if "lora_B" in _:
                p.sub_(0.5)
    assert not torch.allclose(hv, hq)
    assert [p.data_ptr() for p in non_lora] == ptrs


def test_one_forward_per_trajectory_equals_one_forward_per_prefix(critic_and_items):
    c, items, tok, _df, _cfg = critic_and_items
    pad = pad_id_of(tok)
    picks = [(i, np.arange(items[i].n_steps)) for i in range(len(items))]
    with torch.no_grad():
        b = collate(items, picks, pad)
        (h_s, h_sa, h_n) = c.pooled("value", b.input_ids, b.attention_mask, b.pos_s, b.pos_sa, b.pos_next)
        naive = collate(items, picks, pad, per_step=True)  # one row per step, cut at its own pos_next
        (n_s,) = c.pooled("value", naive.input_ids, naive.attention_mask, naive.pos_s)
    assert b.input_ids.shape[0] == len(items) and naive.input_ids.shape[0] == sum(it.n_steps for it in items)
    flat = torch.cat([h_s[r, : len(st)] for r, (_, st) in enumerate(b.steps)])
    assert torch.allclose(flat, n_s[:, 0], atol=1e-5)
    # a single prefix forwarded alone (no padding) gives the same pooled state
    it = items[0]
    t = 1
    ids = torch.as_tensor(it.input_ids[: it.pos_sa[t] + 1]).unsqueeze(0)
    with torch.no_grad():
        alone = c.hidden("value", ids, torch.ones_like(ids))[0, -1]
    assert torch.allclose(alone, h_sa[0, t], atol=1e-5)
    # positions are the prefix module's slow reference (render prefix, encode, length - 1)
    from qevolve_cli.prefix import reference_positions

    ref = reference_positions(_df, tok).filter(pl.col("traj_id") == it.traj_id).sort("step")
    assert ref["pos_next"].to_list() == it.pos_next.tolist()


def test_pool_last_token_gathers():
    h = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)
    pos = torch.tensor([[0, 4], [2, 2]])
    out = pool_last_token(h, pos)
    assert torch.equal(out[0, 1], h[0, 4]) and torch.equal(out[1, 0], h[1, 2])


def test_model_ema_update_is_exact(critic_and_items):
    c, *_ = critic_and_items
    q = dict(c.adapter_params("q"))
    qt = dict(c.adapter_params("q_target"))
    with torch.no_grad():
        for p in q.values():
            p.add_(torch.randn_like(p))
        for p in c.heads["q1"].parameters():
            p.add_(1.0)
    old_t = {k: v.detach().clone() for k, v in qt.items()}
    old_h = [p.detach().clone() for p in c.heads["q1_target"].parameters()]
    c.ema_update(0.005)
    for k in q:
        assert torch.allclose(qt[k], 0.995 * old_t[k] + 0.005 * q[k], rtol=1e-6, atol=1e-7)
    for o, p, t in zip(old_h, c.heads["q1"].parameters(), c.heads["q1_target"].parameters(), strict=True):
        assert torch.allclose(t, 0.995 * o + 0.005 * p, rtol=1e-6, atol=1e-7)
    c.hard_update_target()  # restore for other tests
    for k in q:
        assert torch.equal(qt[k], q[k])


def test_updates_touch_only_their_own_parameters(critic_and_items):
    c, items, tok, _df, cfg = critic_and_items
    tr = CriticTrainer(c, cfg.replace(lr=1e-2), items, pad_id_of(tok))
    b = collate(items, [(i, np.arange(items[i].n_steps)) for i in range(len(items))], pad_id_of(tok))
    snap = lambda: {n: p.detach().clone() for n, p in c.named_parameters()}  # noqa: E731
    before = snap()
    tr.q_update(b)
    after = snap()
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all((".q." in n) or n.startswith(("heads.q1.", "heads.q2.")) for n in changed), changed
    tr.v_update(b)
    after2 = snap()
    changed = {n for n in after if not torch.equal(after[n], after2[n])}
    assert changed and all((".value." in n) or n.startswith("heads.v.") for n in changed), changed


def test_weight_switches_and_shaping():
    df = labelled(n_traj=5, seed=3)
    on = CriticConfig()
    assert np.array_equal(step_weights_for(df, on), df["weight"].to_numpy())
    assert np.all(step_weights_for(df, on.replace(weighted=False)) == 1.0)
    no_t = step_weights_for(df, on.replace(weight_temporal=False))
    no_s = step_weights_for(df, on.replace(weight_success=False))
    for r, wt, ws in zip(df.iter_rows(named=True), no_t, no_s, strict=True):
        T = df.filter(pl.col("traj_id") == r["traj_id"]).height
        d = 1.0 if r["success"] else 0.0
        assert wt == pytest.approx(d * 0.5 + 0.5)
        assert ws == pytest.approx((r["step"] + 1) / T * 0.5 + 0.5)
    # shuffled rows: weights follow their rows
    perm = df.sample(fraction=1.0, shuffle=True, seed=1)
    assert np.allclose(step_weights_for(perm, on.replace(weight_success=False)),
                       perm.join(df.with_columns(pl.Series("w2", no_s)), on=["traj_id", "step"], maintain_order="left")["w2"].to_numpy())


def test_shaping_switch_sets_the_td_reward(critic_and_items):
    _c, items, tok, df, cfg = critic_and_items
    its = build_items(df, tok)
    attach_targets(its, df, cfg.replace(shaping=False))
    r_env = df["reward_env"].to_numpy()
    aux = df["reward_aux"].to_numpy()
    assert np.allclose(np.concatenate([it.reward for it in its]), np.concatenate([r_env[it.rows] for it in its]))
    attach_targets(its, df, cfg)
    assert np.allclose(np.concatenate([it.reward for it in its]),
                       np.concatenate([(r_env + aux)[it.rows] for it in its]))
    with pytest.raises(TableError, match="reward_aux"):
        attach_targets(its, df.drop("reward_aux"), cfg)


def test_process_reward_variants():
    hand = pl.DataFrame({"traj_id": ["a", "a"], "reward_env": [0.0, 1.0], "value": [0.5, 0.8],
                         "next_value": [0.8, 9.0], "done": [False, True], "q_value": [1.0, 0.0]},
                        schema_overrides={"reward_env": pl.Float32, "value": pl.Float32, "next_value": pl.Float32})
    assert np.allclose(process_rewards(hand, "td", gamma=0.9).to_numpy(), [0.9 * 0.8 - 0.5, 1.0 - 0.8])
    assert np.allclose(process_rewards(hand, "q_minus_v").to_numpy(), [0.5, -0.8])
    df = labelled(n_traj=3)
    rng = np.random.default_rng(0)
    df = df.with_columns(pl.Series("value", rng.random(df.height), pl.Float32),
                         pl.Series("next_value", rng.random(df.height), pl.Float32),
                         pl.Series("q_value", rng.random(df.height), pl.Float32))
    td = process_rewards(df, "td", gamma=0.9).to_numpy()
    gae0 = core.gae(core.offsets(df), df["reward_env"], df["value"],
                    df.select(pl.when(pl.col("done")).then(0.0).otherwise(pl.col("next_value")))
                    .to_series().cast(pl.Float32), df["done"], 0.9, 0.0).to_numpy()
    assert np.allclose(td, gae0, atol=1e-6)  # r + gamma V' - V is GAE with lambda = 0
    g = process_rewards(df, "gae", 0.9, 0.95).to_numpy()
    ga = process_rewards(df, "gae_aux", 0.9, 0.95).to_numpy()
    assert not np.allclose(g, ga)  # r_aux enters only the _aux variant
    assert np.allclose(process_rewards(df, "q_minus_v").to_numpy(), (df["q_value"] - df["value"]).to_numpy())


def test_lr_schedule():
    assert lr_lambda(0, 100, 10, "cosine") == pytest.approx(0.1)
    assert lr_lambda(9, 100, 10, "cosine") == pytest.approx(1.0)
    assert lr_lambda(10, 100, 10, "cosine") == pytest.approx(1.0)
    assert lr_lambda(55, 100, 10, "cosine") == pytest.approx(0.5)
    assert lr_lambda(55, 100, 10, "linear") == pytest.approx(0.5)
    assert lr_lambda(99, 100, 0, "constant") == 1.0


def test_config_presets_and_errors(tmp_path):
    it2 = load_critic_config(preset="iter2")
    assert (it2.epochs, it2.lr, it2.gamma, it2.ema_lambda, it2.ema_every) == (2, 5e-6, 0.95, 0.005, 2)
    assert load_critic_config(preset="iter1").epochs == 20 and CriticConfig().epochs == 20
    assert load_critic_config(preset="no_wiql").weighted is False
    bad = tmp_path / "c.yaml"
    bad.write_text("expectile: 1.5\n")
    with pytest.raises(ConfigError, match="expectile"):
        load_critic_config(bad)
    with pytest.raises(ConfigError, match="nope"):
        load_critic_config(preset="nope")
    # mid-epoch checkpoints: off by default (tiny runs), every 250 updates in the paper presets
    assert CriticConfig().checkpoint_every_steps == load_critic_config().checkpoint_every_steps == 0
    assert it2.checkpoint_every_steps == load_critic_config(preset="alfworld_iter1").checkpoint_every_steps == 250
    with pytest.raises(ConfigError, match="checkpoint_every_steps"):
        load_critic_config(overrides={"checkpoint_every_steps": -1})
    with pytest.raises(ConfigError, match="checkpoint_every_steps.*needs checkpoint: true"):
        load_critic_config(overrides={"checkpoint_every_steps": 10, "checkpoint": False})


def test_train_save_load_score_and_resume(tiny_model_dir, tmp_path):
    df = labelled(n_traj=3, mean_steps=3, seed=2)
    cfg = CriticConfig(epochs=3, lr=1e-3, batch_size=2, steps_per_traj=2, **{**SMALL, "checkpoint": True})
    full = train_critic(cfg, df, tiny_model_dir, tmp_path / "full")
    out = tmp_path / "full"
    for a in ADAPTERS:
        assert (out / "adapters" / a / "adapter_config.json").is_file()
        assert (out / "adapters" / a / "adapter_model.safetensors").is_file()
    assert load_critic_config(out / "config.yaml") == cfg
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == [1, 2, 3]
    assert all(m["transitions"] > 0 and m["loss_q"] is not None for m in lines)
    assert not (tmp_path / "full.partial").exists()

    # interrupted during epoch 3: the output is not written, the partial checkpoint holds 2 epochs
    calls = {"n": 0}

    def factory(total):
        def cb(adv, info):
            calls["n"] += adv
            if calls["n"] > 4:  # 2 batches per epoch -> interrupt in the third epoch
                raise KeyboardInterrupt
        return cb

    with pytest.raises(KeyboardInterrupt):
        train_critic(cfg, df, tiny_model_dir, tmp_path / "res", progress=factory)
    assert not (tmp_path / "res").exists()
    assert json.loads((tmp_path / "res.partial" / "checkpoint.json").read_text())["epochs_done"] == 2
    # resumed with another checkpoint interval (how it runs, not what it makes): the checkpoint is taken
    resumed = train_critic(cfg.replace(checkpoint_every_steps=1), df, tiny_model_dir, tmp_path / "res")
    assert resumed["resumed_from_epoch"] == 2
    assert resumed["metrics"][-1]["loss_q"] == pytest.approx(full["metrics"][-1]["loss_q"], rel=1e-5)

    # the resumed critic scores exactly like the uninterrupted one; next_value is 0 after terminal steps
    a = score_table(df, out, device="cpu")
    b = score_table(df, tmp_path / "res", device="cpu")
    assert np.allclose(a["value"].to_numpy(), b["value"].to_numpy(), atol=1e-5)
    assert (a.filter(pl.col("done"))["next_value"] == 0).all()
    # row order kept, shuffled input gives the same per-row scores
    perm = df.sample(fraction=1.0, shuffle=True, seed=4)
    c = score_table(perm, out, device="cpu")
    j = c.join(a.select("traj_id", "step", pl.col("value").alias("v0")), on=["traj_id", "step"], maintain_order="left")
    assert np.allclose(j["value"].to_numpy(), j["v0"].to_numpy(), atol=1e-5)
    assert c["traj_id"].to_list() == perm["traj_id"].to_list()


def test_bad_tables_fail_with_one_line(tiny_model_dir, tmp_path):
    df = labelled(n_traj=2, mean_steps=2)
    cfg = CriticConfig(epochs=1, **SMALL)
    with pytest.raises(TableError, match="reward_aux"):
        train_critic(cfg, df.drop("reward_aux"), tiny_model_dir, tmp_path / "x")
    failed = df.with_columns(pl.lit("worker crashed").alias("error"))
    with pytest.raises(TableError, match="failed"):
        train_critic(cfg, failed, tiny_model_dir, tmp_path / "x")
    tok = load_tokenizer(tiny_model_dir)
    from qevolve_cli.prefix import add_prefix_positions

    idx = add_prefix_positions(df, tok).with_columns((pl.col("pos_next") + 10_000).alias("pos_next"))
    with pytest.raises(TableError, match="pos_next"):
        build_items(idx, tok)
    assert not (tmp_path / "x").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_critic_trains_and_scores_on_gpu_bf16(tiny_model_dir, tmp_path):
    df = labelled(n_traj=3, mean_steps=3, seed=5)
    # schedule both: every epoch updates Q and V (alternate gives this one batch to Q, then to V)
    cfg = CriticConfig(epochs=2, lr=1e-3, lora_rank=4, head_hidden=16, device="cuda", dtype="bfloat16",
                       schedule="both", gradient_checkpointing=True, checkpoint=False)
    s = train_critic(cfg, df, tiny_model_dir, tmp_path / "c")
    last = s["metrics"][-1]
    assert last["q_updates"] > 0 and last["v_updates"] > 0
    assert np.isfinite([last["loss_q"], last["loss_v"]]).all()
    sc = score_table(df, tmp_path / "c", device="cuda")
    assert np.isfinite(sc["value"].to_numpy()).all()
    cpu = score_table(df, tmp_path / "c", device="cpu")
    assert np.allclose(sc["value"].to_numpy(), cpu["value"].to_numpy(), atol=0.05)


@pytest.mark.parametrize("loader", ["critic", "policy", "rollout"])
def test_model_loads_print_no_transformers_bar(tiny_model_dir, capfd, loader):
    """Every model load of a stage keeps transformers' "Loading weights" bar and warnings off the terminal, even
    when nothing earlier in the process turned them off (a resumed evolve starts at the critic)."""
    from transformers.utils import logging as hf_logging

    from qevolve_cli.critic.model import _load_base
    from qevolve_cli.policy.model import load_causal_lm
    from qevolve_cli.rollout.backends.hf import HFBackend

    hf_logging.enable_progress_bar()
    hf_logging.set_verbosity_warning()
    capfd.readouterr()
    try:
        if loader == "critic":
            _load_base(tiny_model_dir, torch.float32, torch.device("cpu"))
        elif loader == "policy":
            load_causal_lm(tiny_model_dir)
        else:
            HFBackend(str(tiny_model_dir), device="cpu")
        err = capfd.readouterr().err
        assert "Loading weights" not in err and "it/s" not in err, err
    finally:
        hf_logging.disable_progress_bar()


def test_time_input_feeds_the_step_index_to_the_heads(tiny_model_dir, tmp_path):
    """time_input: step (a time-aware critic): every head takes t / time_scale as one more input, V(s') is
    read at t + 1, the scale survives save / load, and the new fields leave older runs' config hashes alone."""
    cfg = CriticConfig(**SMALL, time_input="step", time_scale=8.0)
    c = CriticModel.create(tiny_model_dir, cfg)
    assert c.time_scale == 8.0 and c.heads["v"].net[0].in_features == c.hidden_size + 1
    assert CriticModel.create(tiny_model_dir, CriticConfig(**SMALL)).heads["v"].net[0].in_features == c.hidden_size
    x = torch.zeros(1, 2, c.hidden_size)
    with pytest.raises(ValueError, match="step index"):
        c.head("v", x)
    with torch.no_grad():  # V a function of t alone: the hidden-state weights of its first layer zeroed
        c.heads["v"].net[0].weight[:, : c.hidden_size] = 0.0
        c.heads["v"].net[0].weight[:, c.hidden_size] = 1.0
        c.heads["v"].net[0].bias.zero_()
        c.heads["v"].net[2].weight.fill_(1.0)
    t = torch.tensor([[0.0, 4.0]])
    v = c.head("v", x, t)
    assert v[0, 1] > v[0, 0]  # GELU(t / 8) summed: rises with t
    tok = load_tokenizer(tiny_model_dir)
    c.save(tmp_path / "critic", tok)
    df = labelled(n_traj=3, mean_steps=5)
    sc = schema.sort_steps(score_table(df, tmp_path / "critic", device="cpu"))
    loaded = CriticModel.load(tmp_path / "critic", device="cpu")
    assert loaded.time_scale == 8.0
    for _, g in sc.group_by("traj_id", maintain_order=True):
        val, nxt, done, step = (g[k].to_list() for k in ("value", "next_value", "done", "step"))
        assert step == list(range(len(step)))
        # V depends on t only: V(s_{k+1}) read as next_value at step k (t + 1) equals value at step k + 1 (t)
        for k in range(len(val) - 1):
            assert nxt[k] == pytest.approx(val[k + 1], abs=1e-6)
        assert val == sorted(val) and val[-1] > val[0]
        assert done[-1] and nxt[-1] == 0.0
    # time_input steps_left: the table's steps_left column (one fewer at s'), a one-line error without it
    sl_cfg = CriticConfig(**SMALL, time_input="steps_left", time_scale=8.0)
    c2 = CriticModel.create(tiny_model_dir, sl_cfg)
    with torch.no_grad():
        c2.heads["v"].load_state_dict(c.heads["v"].state_dict())
    c2.save(tmp_path / "critic_sl", tok)
    with pytest.raises(TableError, match="column 'steps_left': missing column"):
        score_table(df, tmp_path / "critic_sl", device="cpu")
    with pytest.raises(TableError, match=r"column 'steps_left': \d+ null values \(.*--step-limit N"):
        score_table(df.with_columns(pl.lit(None, pl.Int32).alias("steps_left")), tmp_path / "critic_sl", device="cpu")
    n = df.group_by("traj_id").len().rename({"len": "T"})
    df_sl = schema.sort_steps(df.join(n, on="traj_id").with_columns((pl.col("T") + 3 - pl.col("step")).alias("steps_left"))
                              .drop("T"))
    sc2 = schema.sort_steps(score_table(df_sl, tmp_path / "critic_sl", device="cpu"))
    assert CriticModel.load(tmp_path / "critic_sl", device="cpu").time_input == "steps_left"
    for _, g in sc2.group_by("traj_id", maintain_order=True):
        val, nxt = g["value"].to_list(), g["next_value"].to_list()
        for k in range(len(val) - 1):
            assert nxt[k] == pytest.approx(val[k + 1], abs=1e-6)
        assert val == sorted(val, reverse=True) and val[0] > val[-1]  # fewer steps left, lower (this) V
    # hashes: the new fields at their defaults are left out (runs made before them resume), not otherwise
    import dataclasses
    import hashlib

    plain = CriticConfig(**SMALL)
    d = dataclasses.asdict(plain)
    for k in ("time_input", "time_scale", "share_value_forward", "shared_prefix", "window_context", "kind",
              "feature_layer", "context_turns", "feature_batch_steps", "feature_eval_every", "fit_ladder"):
        d.pop(k)  # every field added since
    d["checkpoint"] = True  # SMALL's False: how a stage runs, hashed at its default (below)
    assert plain.hash() == hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert cfg.hash() != plain.hash() and CriticConfig(**SMALL, time_scale=8.0).hash() != plain.hash()
    assert CriticConfig(**SMALL, kind="features").hash() != plain.hash()
    assert CriticConfig(**SMALL, context_turns=3).hash() != plain.hash()
    assert CriticConfig(**SMALL, shared_prefix=False).hash() != plain.hash()
    assert CriticConfig(**SMALL, window_context=1.0).hash() != plain.hash()
    # how often it checkpoints (or whether) is not the work: hashed as the defaults; the old hash kept apart
    ops = [CriticConfig(**{**SMALL, **o}) for o in ({"checkpoint": True}, {"checkpoint": True, "checkpoint_every_steps": 7})]
    assert all(c.hash() == plain.hash() for c in ops) and CriticConfig(**{**SMALL, "checkpoint": True}).legacy_hash() is None
    assert len({plain.legacy_hash(), ops[1].legacy_hash(), plain.hash()}) == 3  # older versions told them apart


def test_activation_checkpointing_on_cpu_changes_nothing_and_does_not_warn(tiny_model_dir, tmp_path):
    """gradient_checkpointing recomputes the backbone's activations in backward: the same losses and values as
    without it, and no deprecation warning from transformers (the helper uses its current name)."""
    import warnings

    df = labelled(n_traj=6, mean_steps=3, seed=5)
    runs = {}
    for gc in (False, True):
        cfg = CriticConfig(**SMALL, epochs=2, lr=1e-3, batch_size=2, schedule="both", gradient_checkpointing=gc)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s = train_critic(cfg, df, tiny_model_dir, tmp_path / f"c{gc}")
        assert not [w for w in caught if "checkpointing_enable" in str(w.message)]
        last = s["metrics"][-1]
        assert last["q_updates"] > 0 and last["v_updates"] > 0
        runs[gc] = ((last["loss_q"], last["loss_v"]),
                    score_table(df, tmp_path / f"c{gc}", device="cpu")["value"].to_numpy())
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-4)
    assert np.allclose(runs[True][1], runs[False][1], atol=1e-5)


@pytest.mark.parametrize("layout,gc", [("padded", False), ("per_sequence", False), ("per_sequence", True)])
def test_schedule_both_shares_one_value_forward_exactly(tiny_model_dir, layout, gc):
    """Under schedule both, the Q update's V(s') and the V update's V(s) come from one value forward (3 forwards per
    batch, not 4): every weight after two epochs is bit-equal to the two-forward path, and so is every metric, with
    activation checkpointing too (its backward recomputes the value forward after the q and q_target forwards).
    The option is left out of the config hash at its default (runs made before it resume)."""
    df = labelled(n_traj=6, mean_steps=3, seed=5)
    cfg = CriticConfig(**SMALL, epochs=2, lr=1e-2, batch_size=2, schedule="both", ema_every=1, batch_layout=layout,
                       gradient_checkpointing=gc)
    tok = load_tokenizer(tiny_model_dir)
    items = build_items(df, tok)
    attach_targets(items, df, cfg)
    runs = {}
    for share in (True, False):
        c = CriticModel.create(tiny_model_dir, cfg)
        tr = CriticTrainer(c, cfg.replace(share_value_forward=share), items, pad_id_of(tok))
        ms = [tr.run_epoch(e) for e in range(cfg.epochs)]
        runs[share] = ({n: p.detach().clone() for n, p in c.named_parameters()}, ms)
    (w_shared, m_shared), (w_two, m_two) = runs[True], runs[False]
    assert w_shared.keys() == w_two.keys()
    moved = [n for n in w_shared if ".value." in n and "lora_B" in n]
    assert moved and all(w_shared[n].abs().sum() > 0 for n in moved)  # the value adapter did train
    assert all(torch.equal(w_shared[n], w_two[n]) for n in w_shared), \
        [n for n in w_shared if not torch.equal(w_shared[n], w_two[n])][:3]
    assert cfg.hash() == cfg.replace(share_value_forward=True).hash() != cfg.replace(share_value_forward=False).hash()
    n_batches = 3  # 6 trajectories / batch 2
    for a, b in zip(m_shared, m_two, strict=True):
        assert {k: v for k, v in a.items() if "forward" not in k and "seconds" not in k and "per_s" not in k} == \
               {k: v for k, v in b.items() if "forward" not in k and "seconds" not in k and "per_s" not in k}
        assert (a["forward_calls"], b["forward_calls"]) == (3 * n_batches, 4 * n_batches)


def test_long_trajectories_are_trained_and_scored_in_windows(tiny_model_dir, tmp_path):
    """A table indexed without a budget (as `qevolve evolve`'s label stage writes it) and a critic max_length
    shorter than its longest trajectory: every step is trained on (windows, not skipped), critic.json
    keeps max_length, and scoring reads each step in the window the critic learnt it in."""
    from qevolve_cli.prefix import add_prefix_positions

    df = labelled(n_traj=3, mean_steps=6, seed=3, obs_words=30)
    tok = load_tokenizer(tiny_model_dir)
    whole = add_prefix_positions(df, tok)  # no budget: one sequence per trajectory
    longest = int(whole["seq_len"].max())
    budget = longest * 2 // 3
    assert (whole["seq_len"] > budget).any()
    cfg = CriticConfig(epochs=1, lr=1e-3, batch_size=2, steps_per_traj=2, max_length=budget, **SMALL)
    summary = train_critic(cfg, whole, tiny_model_dir, tmp_path / "c")
    assert summary["skipped_steps"] == 0 and summary["steps"] == df.height
    meta = json.loads((tmp_path / "c" / "critic.json").read_text())
    assert (meta["max_length"], meta["window_context"]) == (budget, cfg.window_context) == (budget, 0.5)
    windowed = add_prefix_positions(df, tok, max_length=budget, window_context=0.5)
    assert (windowed["window"] > 0).any() and windowed["seq_len"].max() <= budget
    a = score_table(whole, tmp_path / "c", device="cpu")  # the critic's own budget: re-indexed into windows
    b = score_table(windowed, tmp_path / "c", device="cpu")  # already in those windows: used as they are
    c = score_table(whole, tmp_path / "c", device="cpu", max_length=10**9)  # whole trajectories
    np.testing.assert_allclose(a["value"].to_numpy(), b["value"].to_numpy(), atol=1e-5)
    late = (windowed["window"] > 0).to_numpy()
    assert not np.allclose(a["value"].to_numpy()[late], c["value"].to_numpy()[late], atol=1e-4)
    # the first window is a prefix of the whole trajectory: same causal contexts, same values
    np.testing.assert_allclose(a["value"].to_numpy()[~late], c["value"].to_numpy()[~late], atol=1e-5)


def test_label_max_length_indexes_the_windows_the_critic_makes(tiny_model_dir, tmp_path):
    """`qevolve label --tokenizer T --max-length N` writes the windows of the critic's rule (window_context 0.5
    by default, the critic's): the critic trains on that table in the same windows it makes itself from an
    unindexed table. --window-context 1 gives the rollout's contexts: more windows."""
    from tests.conftest import run_qevolve

    df = labelled(n_traj=3, mean_steps=6, seed=3, obs_words=30)
    tok = load_tokenizer(tiny_model_dir)
    budget = max(len(i.input_ids) for i in build_items(df, tok)) * 2 // 3  # no budget: whole trajectories
    src = tmp_path / "t.parquet"
    schema.write_table(df, src)
    own = build_items(df, tok, max_length=budget, window_context=CriticConfig().window_context)
    assert len(own) > len({i.traj_id.split("#")[0] for i in own})  # windows were made
    for share, flag in ((0.5, []), (1.0, ["--window-context", "1"])):
        out = tmp_path / f"l{share}.parquet"
        run_qevolve("label", src, "--tokenizer", tiny_model_dir, "--max-length", budget, *flag, "--out", out,
                    "--quiet", check=True)
        indexed = pl.read_parquet(out)
        items = build_items(indexed, tok, max_length=budget, window_context=CriticConfig().window_context)
        same = [(i.traj_id, i.input_ids.tolist(), i.pos_s.tolist()) for i in items] == \
               [(i.traj_id, i.input_ids.tolist(), i.pos_s.tolist()) for i in own]
        assert same == (share == 0.5), share
        if share == 1.0:
            assert len(items) > len(own)
