"""Training without padding waste (docs/performance.md): the per-sequence layout (one forward per row, no
padding computed) gives the padded path's log-probs, losses and gradients for the policy, and its pooled
states and losses for the critic; the padding fraction and the layout rule."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from qevolve_cli.training import padding_fraction, per_sequence_layout, token_budget_batches


def test_padding_fraction_matches_a_loop():
    rng = random.Random(0)
    batches = [[rng.randint(1, 900) for _ in range(rng.randint(1, 5))] for _ in range(40)]
    real = padded = 0
    for b in batches:
        for n in b:
            real += n
            padded += max(b)
    assert padding_fraction(batches) == pytest.approx(1 - real / padded)
    assert padding_fraction([[5, 5, 5]]) == 0.0 and padding_fraction([]) == 0.0
    assert padding_fraction([[1, 3]]) == pytest.approx(1 / 3)
    # sorting by length (token-budget batches) leaves less padding than a random order
    lens = [rng.randint(100, 900) for _ in range(200)]
    sorted_b = [[lens[i] for i in b] for b in token_budget_batches(lens, 10**9, 4)]
    random_b = [lens[i : i + 4] for i in range(0, 200, 4)]
    assert padding_fraction(sorted_b) < padding_fraction(random_b) / 5


def test_layout_rule():
    assert per_sequence_layout("auto", "cpu") and not per_sequence_layout("auto", "cuda:0")
    assert per_sequence_layout("per_sequence", "cuda") and not per_sequence_layout("padded", "cpu")
    with pytest.raises(ValueError, match="batch_layout"):
        per_sequence_layout("packed", "cpu")


def _batch(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros((len(lengths), T), dtype=torch.long)
    att = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(3, vocab, (n,), generator=g)
        att[b, :n] = 1
    return ids, att


def test_policy_per_sequence_equals_padded(tiny_model_dir):
    """Log-probs at real positions, the BPPO loss and its gradient: per-sequence == padded (fp32, 1e-5)."""
    from transformers import AutoModelForCausalLM

    from qevolve_cli.algos import bppo_loss
    from qevolve_cli.policy.trainer import batch_logprobs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    lengths = [37, 64, 12]
    ids, att = _batch(lengths, model.config.vocab_size)
    batch = {"input_ids": ids, "attention_mask": att}
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, 5 : n - 1] = True
    adv = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # ratio near 1: unclipped, so every token carries gradient
        old = batch_logprobs(model, batch, "cpu", False) - 0.05

    def run(per_sequence):
        model.zero_grad(set_to_none=True)
        lp = batch_logprobs(model, batch, "cpu", per_sequence)
        loss, _ = bppo_loss(lp, old, adv, mask, torch.ones_like(adv), 0.2, 0.2, old, 0.0, "k3")
        loss.backward()
        return lp.detach(), loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    lp_pad, loss_pad, g_pad = run(False)
    lp_seq, loss_seq, g_seq = run(True)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(lp_seq[b, : n - 1], lp_pad[b, : n - 1], atol=1e-5, rtol=1e-5)
        assert torch.all(lp_seq[b, n - 1 :] == 0)
    torch.testing.assert_close(loss_seq, loss_pad, atol=1e-6, rtol=1e-5)
    assert len(g_pad) > 5 and any(float(g.abs().max()) > 0 for g in g_pad)
    for a, b in zip(g_seq, g_pad, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # a batch of equal rows takes the one padded forward either way
    eq = {"input_ids": ids[:, :12], "attention_mask": att[:, :12]}
    torch.testing.assert_close(batch_logprobs(model, eq, "cpu", True), batch_logprobs(model, eq, "cpu", False))


def test_policy_masked_logits_equal_the_full_forward(tiny_model_dir):
    """``logits: auto`` computes the output layer at the loss positions only: the same log-probs there (0
    elsewhere), the same BPPO loss and gradients as every position (``logits: all``), padded and per sequence,
    for the plain model and a PEFT LoRA one; a model whose forward has no ``logits_to_keep`` gets every
    position."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from qevolve_cli.algos import bppo_loss
    from qevolve_cli.policy.logprobs import batch_logprobs, masked_logits_supported

    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32),
                          LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    for n, p in lora.named_parameters():  # LoRA B starts at 0: move it so the adapter changes the output
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    lengths = [37, 64, 12]
    ids, att = _batch(lengths, plain.config.vocab_size)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for b, n in enumerate(lengths):  # spans like action tokens, the last real position never
        for s0 in range(3 + b, n - 1, 9):
            mask[b, s0 : min(s0 + 4, n - 1)] = True
    batch = {"input_ids": ids, "attention_mask": att, "mask": mask}
    adv = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))

    class NoKeep(torch.nn.Module):  # a causal LM whose forward does not take logits_to_keep
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask=None, use_cache=False):
            return self.m(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)

    class Engine(torch.nn.Module):  # DeepSpeed's engine / DDP: the model under .module, a config of its own
        def __init__(self, m):
            super().__init__()
            self.module, self.config = m, {"zero_optimization": {"stage": 2}}

    assert masked_logits_supported(plain) and masked_logits_supported(lora) and not masked_logits_supported(NoKeep(plain))
    assert masked_logits_supported(Engine(lora)) and not masked_logits_supported(Engine(NoKeep(plain)))
    for model in (plain, lora):
        with torch.no_grad():
            old = batch_logprobs(model, batch, "cpu", False, all_logits=True) - 0.05

        def run(per_sequence, all_logits, m=model, old=old):
            m.zero_grad(set_to_none=True)
            lp = batch_logprobs(m, batch, "cpu", per_sequence, all_logits)
            loss, _ = bppo_loss(lp, old, adv, mask, torch.ones_like(adv), 0.2, 0.2, old, 0.0, "k3")
            loss.backward()
            return lp.detach(), loss.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]

        for per_sequence in (False, True):
            lp_all, loss_all, g_all = run(per_sequence, True)
            lp_keep, loss_keep, g_keep = run(per_sequence, False)
            torch.testing.assert_close(lp_keep[mask], lp_all[mask], atol=1e-5, rtol=1e-5)
            assert torch.all(lp_keep[~mask] == 0) and bool((lp_all[~mask] != 0).any())
            torch.testing.assert_close(loss_keep, loss_all, atol=1e-6, rtol=1e-5)
            assert len(g_keep) == len(g_all) > 2 and any(float(g.abs().max()) > 0 for g in g_keep)
            for a, b in zip(g_keep, g_all, strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # the fallback: every position, the same values
        torch.testing.assert_close(batch_logprobs(NoKeep(plain), batch, "cpu", False),
                                   batch_logprobs(plain, batch, "cpu", False, all_logits=True))


def test_critic_per_sequence_equals_padded(tiny_model_dir):
    """Pooled states at the step positions and the Q/V losses: per-sequence == padded."""
    from qevolve_cli.algos import critic_v_loss
    from qevolve_cli.critic.config import load_critic_config
    from qevolve_cli.critic.model import CriticModel

    cfg = load_critic_config(None, None, {"lora_rank": 4, "head_hidden": 16, "device": "cpu", "dtype": "float32",
                                          "batch_layout": "per_sequence"})
    critic = CriticModel.create(tiny_model_dir, cfg)
    assert critic.per_sequence
    with torch.no_grad():  # non-zero adapters, so that the adapter path is part of the comparison
        for n, p in critic.backbone.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    lengths = [50, 21, 33]
    ids, att = _batch(lengths, critic.backbone.config.vocab_size, seed=2)
    pos = torch.tensor([[5, 20, 49], [3, 10, 20], [7, 32, 32]])
    step_mask = torch.tensor([[True, True, True], [True, True, True], [True, True, False]])
    w = torch.ones(pos.shape)
    outs = {}
    for per_seq in (True, False):
        critic.per_sequence = per_seq
        h_v, h_q = critic.pooled("value", ids, att, pos, pos), critic.pooled("q", ids, att, pos)[0]
        v, q = critic.head("v", h_v[0]), critic.head("q1", h_q)
        outs[per_seq] = (h_v[0].detach(), h_q.detach(), critic_v_loss(v, q, q, w, step_mask, 0.7, "traj_sum").detach())
    for a, b in zip(outs[True], outs[False], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert not np.isnan(float(outs[True][2]))


def test_a_loaded_critic_scores_one_row_at_a_time_on_cpu(tiny_model_dir, tmp_path):
    """CriticModel.load takes batch_layout as training does (auto: per sequence on CPU, where the padded
    forward's mask forces the unfused attention kernel); `qevolve label --critic` scores a padded batch of
    unequal trajectories the same either way."""
    from qevolve_cli.critic.config import load_critic_config
    from qevolve_cli.critic.model import CriticModel
    from qevolve_cli.critic.score import score_items

    cfg = load_critic_config(None, None, {"lora_rank": 4, "head_hidden": 16, "device": "cpu", "dtype": "float32"})
    critic = CriticModel.create(tiny_model_dir, cfg)
    with torch.no_grad():
        for n, p in critic.backbone.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    critic.save(tmp_path / "critic")
    auto = CriticModel.load(tmp_path / "critic", device="cpu")
    padded = CriticModel.load(tmp_path / "critic", device="cpu", batch_layout="padded")
    assert auto.per_sequence and not padded.per_sequence
    assert CriticModel.load(tmp_path / "critic", device="cpu", batch_layout="per_sequence").per_sequence

    from qevolve_cli.critic.data import TrajItem

    def item(n, steps, seed, first_row):
        g = np.random.default_rng(seed)
        pos_s = np.linspace(2, n - 3, steps).astype(np.int64)
        return TrajItem(f"t{seed}", g.integers(3, critic.backbone.config.vocab_size, n).astype(np.int64), pos_s,
                        pos_s + 1, np.minimum(pos_s + 2, n - 1), np.arange(first_row, first_row + steps))

    items = [item(60, 4, 0, 0), item(23, 2, 1, 4), item(41, 3, 2, 6)]
    got = {name: score_items(m, items, 9, 0, torch.device("cpu"), 8)
           for name, m in (("auto", auto), ("padded", padded))}
    for k in ("value", "next_value", "q_value"):
        assert np.abs(got["auto"][k]).sum() > 0
        np.testing.assert_allclose(got["auto"][k], got["padded"][k], atol=1e-5, rtol=1e-5)
