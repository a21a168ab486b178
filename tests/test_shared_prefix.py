"""The shared prompt prefix of a training batch computed once (docs/performance.md, "The shared prefix"):
:func:`shared_prefix_len` by hand, and the policy's log-probs, loss and gradients and the critic's pooled
states, losses and gradients equal to one whole forward per row, with the prefix's tokens fed to the model
once."""
from __future__ import annotations

import pytest
import torch

from qevolve_cli.models.kv import shared_prefix_len

# PEFT calls a transformers attribute deprecated in transformers 5 (the CLI filters it: qevolve_cli/__init__.py)
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")


def _rows(prefix: int, rests: list[int], vocab: int, seed: int = 0):
    """A right-padded batch whose rows share their first ``prefix`` tokens, then differ (rest lengths
    ``rests``)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (prefix,), generator=g)
    lengths = [prefix + r for r in rests]
    ids = torch.zeros((len(rests), max(lengths)), dtype=torch.long)
    att = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        rest = torch.randint(3, vocab, (n - prefix,), generator=g)
        rest[0] = 3 + (int(shared[-1]) + 1 + b) % (vocab - 3)  # rows differ at the first token after the prefix
        ids[b, :n] = torch.cat([shared, rest])
        att[b, :n] = 1
    return ids, att, lengths


def test_shared_prefix_len_by_hand():
    ids = torch.tensor([[5] * 40 + [1, 2, 3], [5] * 40 + [9, 9, 0], [5] * 40 + [1, 7, 7]])
    assert shared_prefix_len(ids, [43, 43, 43]) == 40
    assert shared_prefix_len(ids[:1], [43]) == 0  # one row: nothing to share
    assert shared_prefix_len(ids, [43, 43, 43], min_tokens=41) == 0
    # the prefix leaves a token to every row: a row of 38 tokens caps it at 37
    assert shared_prefix_len(ids, [43, 38, 43]) == 37
    assert shared_prefix_len(ids, [43, 38, 43], min_tokens=38) == 0
    # rows 0 and 2 share 41 tokens, row 1 only 40
    assert shared_prefix_len(ids[[0, 2]], [43, 43]) == 41
    # a read position ends it: keep[b, t] (prediction-aligned) at t = 35 in row 2 only
    keep = torch.zeros(ids.shape, dtype=torch.bool)
    keep[2, 35] = True
    assert shared_prefix_len(ids, [43, 43, 43], keep) == 35
    keep[0, 20] = True
    assert shared_prefix_len(ids, [43, 43, 43], keep) == 0  # 20 < min_tokens
    assert shared_prefix_len(ids, [43, 43, 43], keep, min_tokens=20) == 20
    # differing in the first token: nothing shared
    ids2 = ids.clone()
    ids2[1, 0] = 6
    assert shared_prefix_len(ids2, [43, 43, 43]) == 0


class _TokenCount:
    """Tokens fed to a model's input embeddings, counted by a forward hook."""

    def __init__(self, model):
        self.n = 0
        self.h = model.get_input_embeddings().register_forward_hook(self)

    def __call__(self, mod, args, out):
        self.n += int(args[0].numel())


def _lora(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32),
                       LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    for n, p in m.named_parameters():  # LoRA B starts at 0: move it so the adapter changes the output
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    return m


def test_policy_shared_prefix_equals_one_forward_per_row(tiny_model_dir):
    """BPPO's log-probs, loss and LoRA gradients with the 48 shared tokens computed once == one whole forward
    per row (fp32, 1e-5); the model reads 48 + sum(rests) tokens instead of 3 x 48 + sum(rests); the same in
    the padded layout (48 + 3 x (T - 48) instead of 3 x T); a mask that reads inside the shared tokens
    shortens the prefix and the values stay equal."""
    from qevolve_cli.algos import bppo_loss
    from qevolve_cli.policy.logprobs import batch_logprobs

    model = _lora(tiny_model_dir)
    vocab = model.get_base_model().config.vocab_size
    P, rests = 48, [30, 17, 41]
    ids, att, lengths = _rows(P, rests, vocab)
    assert shared_prefix_len(ids, lengths) == P
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for b, n in enumerate(lengths):  # action-like spans after the prefix; the last real position never
        for s0 in range(P + 2 + b, n - 1, 7):
            mask[b, s0 : min(s0 + 3, n - 1)] = True
    adv = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": att, "mask": mask}
    with torch.no_grad():
        old = batch_logprobs(model, batch, "cpu", True) - 0.05

    def run(shared, b=batch, per_sequence=True):
        model.zero_grad(set_to_none=True)
        count = _TokenCount(model)
        lp = batch_logprobs(model, b, "cpu", per_sequence, False, shared)
        count.h.remove()
        loss, _ = bppo_loss(lp, old, adv, b["mask"], torch.ones_like(adv), 0.2, 0.2, old, 0.0, "k3")
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return lp.detach(), loss.detach(), grads, count.n

    lp_row, loss_row, g_row, n_row = run(False)
    lp_sh, loss_sh, g_sh, n_sh = run(True)
    assert n_row == sum(lengths) and n_sh == P + sum(rests)
    torch.testing.assert_close(lp_sh[mask], lp_row[mask], atol=1e-5, rtol=1e-5)
    assert torch.all(lp_sh[~mask] == 0)
    torch.testing.assert_close(loss_sh, loss_row, atol=1e-6, rtol=1e-5)
    assert g_sh.keys() == g_row.keys() and len(g_row) > 10
    assert all(float(g.abs().max()) > 0 for n, g in g_row.items() if "lora_A" in n)
    for n in g_row:
        torch.testing.assert_close(g_sh[n], g_row[n], atol=1e-5, rtol=1e-4)
    # the padded layout (GPU): the rests as one right-padded batch on the prefix's keys and values, B times
    lp_pad, loss_pad, g_pad, n_pad = run(False, per_sequence=False)
    lp_psh, loss_psh, g_psh, n_psh = run(True, per_sequence=False)
    T = ids.shape[1]
    assert n_pad == 3 * T and n_psh == P + 3 * (T - P)
    torch.testing.assert_close(lp_psh[mask], lp_row[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp_psh[mask], lp_pad[mask], atol=1e-5, rtol=1e-5)
    assert torch.all(lp_psh[~mask] == 0)
    torch.testing.assert_close(loss_psh, loss_row, atol=1e-6, rtol=1e-5)
    for n in g_row:
        torch.testing.assert_close(g_psh[n], g_row[n], atol=1e-5, rtol=1e-4)
    # a loss position inside the shared tokens (row 1 at 40): the prefix stops there, the values stay equal
    mask2 = mask.clone()
    mask2[1, 40] = True
    b2 = {"input_ids": ids, "attention_mask": att, "mask": mask2}
    lp2_row, _, _, _ = run(False, b2)
    lp2_sh, _, _, n2 = run(True, b2)
    assert n2 == 40 + sum(lengths) - 3 * 40
    torch.testing.assert_close(lp2_sh[mask2], lp2_row[mask2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout,logits,ckpt,expect", [
    ("per_sequence", "auto", False, (True, False, True)),
    ("per_sequence", "all", False, (True, True, False)),   # the prefix needs masked logits
    ("per_sequence", "auto", True, (True, False, False)),  # a checkpointed model drops the cache
    ("padded", "auto", False, (False, False, True)),     # the padded batch of the rests on the prefix
])
def test_policy_layout_from_config(layout, logits, ckpt, expect):
    from qevolve_cli.policy.config import PolicyConfig
    from qevolve_cli.policy.logprobs import Layout

    cfg = PolicyConfig(batch_layout=layout, logits=logits, gradient_checkpointing=ckpt)
    assert tuple(Layout.of(cfg, "cpu")) == expect
    assert not Layout.of(PolicyConfig(shared_prefix=False), "cpu").shared_prefix
    # at its default the option is out of the stage hash: runs made before it resume
    assert PolicyConfig().hash() == PolicyConfig(shared_prefix=True).hash() != PolicyConfig(shared_prefix=False).hash()


def test_the_prefix_is_shared_on_models_where_it_pays(tiny_model_dir):
    """Only models of 20 M parameters or more: on the tiny llama the extra forward costs more than it saves."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from qevolve_cli.models.kv import prefix_pays
    from qevolve_cli.policy.config import PolicyConfig
    from qevolve_cli.policy.logprobs import Layout

    tiny = _lora(tiny_model_dir)
    assert not prefix_pays(tiny) and not prefix_pays(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)))
    assert not Layout.of(PolicyConfig(batch_layout="per_sequence"), "cpu", tiny).shared_prefix
    with torch.device("meta"):  # 30 M parameters, no memory
        big = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1024,
                                           num_hidden_layers=4, num_attention_heads=8))
    assert big.num_parameters() > 20_000_000 and prefix_pays(big)
    assert Layout.of(PolicyConfig(batch_layout="per_sequence"), "cpu", big).shared_prefix
    # sliding-window layers: one whole forward per row, as rollouts do
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        slid = Qwen2ForCausalLM(Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1024,
                                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                                            use_sliding_window=True, sliding_window=64, max_window_layers=2))
    assert slid.num_parameters() > 20_000_000 and not prefix_pays(slid)


def test_critic_shared_prefix_equals_one_forward_per_row(tiny_model_dir):
    """The critic's pooled states (positions inside and after the shared tokens), its V loss and the value
    adapter's gradients: the prefix once == one whole forward per row, in both layouts (per sequence, and
    the padded batch of the rests on the prefix's keys and values); the prefix's tokens are read once."""
    from qevolve_cli.algos import critic_v_loss
    from qevolve_cli.critic.config import load_critic_config
    from qevolve_cli.critic.model import CriticModel

    cfg = load_critic_config(None, None, {"lora_rank": 4, "head_hidden": 16, "device": "cpu", "dtype": "float32",
                                          "batch_layout": "per_sequence"})
    critic = CriticModel.create(tiny_model_dir, cfg)
    critic.enable_training()
    # the tiny model is below the size where the prefix pays: off unless set (set below, to test the path)
    assert critic.per_sequence and not critic.shared_prefix
    with torch.no_grad():
        for n, p in critic.backbone.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    P, rests = 40, [25, 11, 19]
    ids, att, lengths = _rows(P, rests, critic.backbone.config.vocab_size, seed=3)
    pos = torch.tensor([[10, 45, 64], [39, 41, 50], [20, 58, 58]])  # inside the prefix, after it, the last
    step_mask = torch.tensor([[True, True, True], [True, True, True], [True, True, False]])
    w = torch.ones(pos.shape)
    qbar = torch.randn(pos.shape, generator=torch.Generator().manual_seed(4))
    base = critic.backbone.get_base_model()
    outs = {}
    for per_sequence, shared in ((True, False), (True, True), (False, False), (False, True)):
        critic.per_sequence, critic.shared_prefix = per_sequence, shared
        critic.backbone.zero_grad(set_to_none=True)
        critic.heads.zero_grad(set_to_none=True)
        count = _TokenCount(base)
        h_v, h_next = critic.pooled("value", ids, att, pos, pos)
        (h_q,) = critic.pooled("q", ids, att, pos)
        count.h.remove()
        v = critic.head("v", h_v)
        loss = critic_v_loss(v, qbar, qbar, w, step_mask, 0.7, "traj_sum")
        loss.backward()
        grads = {n: p.grad.clone() for n, p in critic.adapter_params("value") if p.grad is not None}
        outs[per_sequence, shared] = (h_v.detach(), h_next.detach(), h_q.detach(), loss.detach(), grads, count.n)
    a = outs[True, False]
    T = ids.shape[1]
    assert a[5] == 2 * sum(lengths) and outs[True, True][5] == 2 * (P + sum(rests))
    assert outs[False, False][5] == 2 * 3 * T and outs[False, True][5] == 2 * (P + 3 * (T - P))
    assert any(float(g.abs().max()) > 0 for g in a[4].values()) and len(a[4]) > 4
    for key in ((True, True), (False, False), (False, True)):
        b = outs[key]
        for x, y in zip(a[:4], b[:4], strict=True):
            torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
        assert a[4].keys() == b[4].keys()
        for n in a[4]:
            # float32 round-off grows with the tensor's scale, not with each element's: bounded by the largest
            # gradient of the tensor (an element-wise rtol fails on the near-zero ones). On an AMD EPYC (no
            # AMX) the layouts differ by up to 2e-5 of it; in float64 they agree to 3e-7 of it (float32 casts
            # inside the model); a gradient lost or counted twice through the shared prefix is O(1) of it
            err, scale = float((b[4][n] - a[4][n]).abs().max()), float(a[4][n].abs().max())
            assert err <= 1e-4 * scale + 1e-7, (key, n, err, scale)
