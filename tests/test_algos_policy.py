"""Policy losses of qevolve_cli.algos against plain reference loops and hand-computed cases."""
from __future__ import annotations

import math

import pytest
import torch

from qevolve_cli import algos

torch.set_num_threads(1)


def ref_bppo_loss(logp, old, adv, mask, w, eps_low, eps_high, ref=None, kl_coef=0.0):
    """Plain python loop: -(1/N) sum_m w*min(eta A, clip(eta) A) + kl_coef (1/N) sum_m w*k3."""
    tot, kl, n = 0.0, 0.0, 0
    B, T = len(logp), len(logp[0])
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                continue
            n += 1
            eta = math.exp(logp[b][t] - old[b][t])
            a = adv[b][t]
            c = min(max(eta, 1 - eps_low), 1 + eps_high)
            tot += w[b][t] * min(eta * a, c * a)
            if ref is not None:
                r = ref[b][t] - logp[b][t]
                kl += w[b][t] * (math.exp(r) - r - 1)
    n = max(n, 1)
    return -tot / n + kl_coef * kl / n


def rand_case(seed=0, B=3, T=7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 1.5
    ref = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    thought = torch.rand(B, T, generator=g) > 0.5
    return logp, old, ref, adv, mask, thought


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_bppo_loss_matches_reference_loop(seed):
    logp, old, ref, adv, mask, thought = rand_case(seed)
    w = algos.thought_token_weights(thought, 0.3).double()
    loss, stats = algos.bppo_loss(logp, old, adv, mask, w, 0.8, 0.4, ref, kl_coef=0.1)
    exp = ref_bppo_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), w.tolist(), 0.8, 0.4,
                        ref.tolist(), 0.1)
    assert float(loss) == pytest.approx(exp, rel=1e-10, abs=1e-12)
    assert 0.0 <= stats["clip_frac"] <= 1.0


def test_bppo_hand_computed():
    # eta = e^{ln 1.5} = 1.5 > 1.4 with A = 2 -> clipped at 1.4*2 = 2.8
    # eta = 0.1 < 0.2 with A = -1 -> clip(0.1) = 0.2 -> min(-0.1, -0.2) = -0.2
    # eta = 1 with A = 3 -> 3
    logp = torch.tensor([[math.log(1.5), math.log(0.1), 0.0]], dtype=torch.float64)
    old = torch.zeros_like(logp)
    adv = torch.tensor([[2.0, -1.0, 3.0]], dtype=torch.float64)
    mask = torch.ones_like(logp, dtype=torch.bool)
    obj, clipped = algos.bppo_surrogate(logp, old, adv, 0.8, 0.4)
    assert obj.tolist()[0] == pytest.approx([2.8, -0.2, 3.0])
    assert clipped.tolist() == [[True, True, False]]
    loss, _ = algos.bppo_loss(logp, old, adv, mask)
    assert float(loss) == pytest.approx(-(2.8 - 0.2 + 3.0) / 3)


def _grad(logp_val, adv_val, eps_low=0.8, eps_high=0.4):
    logp = torch.tensor([[logp_val]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros_like(logp)
    loss, _ = algos.bppo_loss(logp, old, torch.tensor([[adv_val]], dtype=torch.float64),
                              torch.ones(1, 1, dtype=torch.bool), None, eps_low, eps_high)
    loss.backward()
    return float(logp.grad)


def test_clipping_inactive_at_ratio_one():
    for a in (-2.0, -0.5, 0.7, 3.0):
        # d(-eta*A)/dlogp = -eta*A = -A at eta=1
        assert _grad(0.0, a) == pytest.approx(-a)


def test_gradient_vanishes_outside_the_trust_region():
    # A > 0: no gradient above 1 + eps_high, full gradient below it
    assert _grad(math.log(1.41), 1.0) == 0.0
    assert _grad(math.log(1.39), 1.0) == pytest.approx(-1.39)
    assert _grad(math.log(0.1), 1.0) == pytest.approx(-0.1)  # A>0 and eta small: still pushed up
    # A < 0: no gradient below 1 - eps_low, full gradient above it
    assert _grad(math.log(0.19), -1.0) == 0.0
    assert _grad(math.log(0.21), -1.0) == pytest.approx(0.21)
    assert _grad(math.log(3.0), -1.0) == pytest.approx(3.0)  # A<0 and eta large: still pushed down
    # asymmetric bounds are the configured ones
    assert _grad(math.log(1.25), 1.0, eps_high=0.2) == 0.0


def test_masked_positions_have_no_effect():
    logp, old, ref, adv, mask, thought = rand_case(5)
    w = algos.thought_token_weights(thought, 0.5).double()
    base, _ = algos.bppo_loss(logp, old, adv, mask, w, 0.8, 0.4, ref, 0.2)
    logp2, old2, adv2, ref2 = logp.clone(), old.clone(), adv.clone(), ref.clone()
    m = ~mask
    logp2[m], old2[m], adv2[m], ref2[m] = float("nan"), 50.0, float("inf"), -1e9
    lp = logp2.clone().requires_grad_(True)
    loss2, _ = algos.bppo_loss(lp, old2, adv2, mask, w, 0.8, 0.4, ref2, 0.2)
    assert float(loss2.detach()) == pytest.approx(float(base), rel=1e-12)
    loss2.backward()
    assert torch.all(lp.grad[m] == 0)
    assert torch.isfinite(lp.grad).all()
    # same for BC and AWR
    assert float(algos.token_nll(logp2, mask)) == pytest.approx(float(algos.token_nll(logp, mask)))
    a1, _ = algos.awr_loss(logp, adv, mask)
    a2, _ = algos.awr_loss(logp2, adv2, mask)
    assert float(a1) == pytest.approx(float(a2))


def test_thought_weighting_scales_exactly_those_tokens():
    logp, old, ref, adv, mask, thought = rand_case(7)
    lp1 = logp.clone().requires_grad_(True)
    lp2 = logp.clone().requires_grad_(True)
    l1, _ = algos.bppo_loss(lp1, old, adv, mask, algos.thought_token_weights(thought, 1.0).double())
    l2, _ = algos.bppo_loss(lp2, old, adv, mask, algos.thought_token_weights(thought, 0.25).double())
    l1.backward()
    l2.backward()
    th = thought & mask
    act = ~thought & mask
    assert torch.allclose(lp2.grad[th], 0.25 * lp1.grad[th])
    assert torch.allclose(lp2.grad[act], lp1.grad[act])
    w = algos.thought_token_weights(torch.tensor([[True, False]]), 0.3)
    assert w.tolist() == [[pytest.approx(0.3), 1.0]]


def test_token_nll_hand_computed_and_weighted():
    logp = torch.tensor([[-1.0, -2.0, -4.0], [-3.0, -5.0, -6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert float(algos.token_nll(logp, mask)) == pytest.approx((1 + 2 + 3) / 3)
    w = torch.tensor([[0.5, 1.0, 1.0], [1.0, 1.0, 1.0]])
    assert float(algos.token_nll(logp, mask, w)) == pytest.approx((0.5 + 2 + 3) / 3)
    assert float(algos.masked_mean(logp, torch.zeros_like(mask))) == 0.0


def test_kl_estimators():
    logp = torch.log(torch.tensor([[0.5, 0.2]]))
    ref = torch.log(torch.tensor([[0.25, 0.2]]))
    r = math.log(0.25 / 0.5)
    k3 = algos.kl_estimate(logp, ref, "k3")
    assert k3.tolist()[0] == pytest.approx([math.exp(r) - r - 1, 0.0])
    assert algos.kl_estimate(logp, ref, "k1").tolist()[0] == pytest.approx([-r, 0.0])
    assert algos.kl_estimate(logp, ref, "k2").tolist()[0] == pytest.approx([0.5 * r * r, 0.0])
    # k3 is an unbiased estimate of KL(pi||ref) for tokens drawn from pi: check on a categorical
    p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    exact = float((p * (p / q).log()).sum())
    est = float((p * algos.kl_estimate(p.log(), q.log(), "k3")).sum())
    assert est == pytest.approx(exact, rel=1e-12)
    with pytest.raises(ValueError):
        algos.kl_estimate(logp, ref, "k9")


def test_kl_term_pulls_towards_reference():
    logp = torch.tensor([[-1.0]], requires_grad=True)
    ref = torch.tensor([[-2.0]])
    loss, stats = algos.bppo_loss(logp, logp.detach(), torch.zeros(1, 1), torch.ones(1, 1), None,
                                  logp_ref=ref, kl_coef=1.0)
    loss.backward()
    assert stats["kl"] > 0
    assert float(logp.grad) > 0  # gradient descent lowers logp towards the reference


def test_awr_weights_and_loss():
    adv = torch.tensor([[0.0, 1.0, 10.0, -2.0]])
    w = algos.awr_weights(adv, beta=1.0, max_weight=20.0)
    assert w.tolist()[0] == pytest.approx([1.0, math.e, 20.0, math.exp(-2)])
    assert algos.awr_weights(torch.tensor([[1e6]]), 0.1, 5.0).item() == pytest.approx(5.0)
    logp = torch.tensor([[-1.0, -2.0, -3.0, -4.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, _ = algos.awr_loss(logp, adv, mask, beta=1.0, max_weight=20.0)
    assert float(loss) == pytest.approx((1.0 * 1 + math.e * 2 + 20.0 * 3) / 3)
    loss.backward()
    # AWR only ever raises the likelihood of data actions (all gradients <= 0), unlike BPPO
    assert torch.all(logp.grad <= 0)


def test_sequence_logprobs_matches_loop():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    lp = algos.sequence_logprobs(logits, ids)
    ls = torch.log_softmax(logits, -1)
    for b in range(2):
        for j in range(4):
            assert float(lp[b, j]) == pytest.approx(float(ls[b, j, ids[b, j + 1]]), abs=1e-5)
        assert float(lp[b, 4]) == 0.0


# ---- DPO (ETO's trajectory-level preference loss)


def ref_dpo_loss(lp_c, ref_c, m_c, lp_r, ref_r, m_r, beta):
    """Plain loop: mean over pairs of -log sigmoid(beta * (sum_m (lp_c - ref_c) - sum_m (lp_r - ref_r)))."""
    tot = 0.0
    for p in range(len(lp_c)):
        sc = sum(lp_c[p][t] - ref_c[p][t] for t in range(len(lp_c[p])) if m_c[p][t])
        sr = sum(lp_r[p][t] - ref_r[p][t] for t in range(len(lp_r[p])) if m_r[p][t])
        z = beta * (sc - sr)
        tot += -math.log(1.0 / (1.0 + math.exp(-z)))
    return tot / len(lp_c)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_loss_matches_reference_loop(seed, beta):
    lp_c, _, ref_c, _, m_c, _ = rand_case(seed, B=4, T=9)
    lp_r, _, ref_r, _, m_r, _ = rand_case(seed + 100, B=4, T=9)
    rc = algos.sequence_logratio(lp_c, ref_c, m_c)
    rr = algos.sequence_logratio(lp_r, ref_r, m_r)
    assert rc.shape == (4,)
    loss, stats = algos.dpo_loss(rc, rr, beta)
    exp = ref_dpo_loss(lp_c.tolist(), ref_c.tolist(), m_c.tolist(), lp_r.tolist(), ref_r.tolist(), m_r.tolist(),
                       beta)
    assert float(loss) == pytest.approx(exp, rel=1e-10)
    assert 0.0 <= stats["reward_accuracy"] <= 1.0
    assert stats["reward_margin"] == pytest.approx(stats["reward_chosen"] - stats["reward_rejected"])


def test_dpo_hand_computed():
    # pi = pi_ref: z = 0 -> loss ln 2, no preference
    z = torch.zeros(2, dtype=torch.float64)
    loss, st = algos.dpo_loss(z, z, 0.1)
    assert float(loss) == pytest.approx(math.log(2.0))
    assert st["reward_accuracy"] == 0.0 and st["reward_margin"] == 0.0
    # one pair: chosen tokens logp - ref = (-1 - -2) + (-0.5 - -0.5) = 1, rejected (-3 - -1) = -2 (a masked 9 left out)
    lp = torch.tensor([[-1.0, -0.5, 0.0], [-3.0, 5.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[-2.0, -0.5, 0.0], [-1.0, -4.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    r = algos.sequence_logratio(lp, ref, mask)
    assert r.tolist() == [1.0, -2.0]
    loss, st = algos.dpo_loss(r[:1], r[1:], beta=0.5)  # z = 0.5 * 3 = 1.5
    assert float(loss) == pytest.approx(math.log1p(math.exp(-1.5)))
    assert st["reward_chosen"] == pytest.approx(0.5) and st["reward_rejected"] == pytest.approx(-1.0)
    assert st["reward_accuracy"] == 1.0
    # token weights scale exactly their own token's term
    w = torch.tensor([[0.5, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    assert algos.sequence_logratio(lp, ref, mask, w).tolist() == [0.5, -2.0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trajectory_logratio_matches_reference_loop(seed):
    """Rows (windows) owned by trajectories: each trajectory's log-ratio is the sum over its rows' unmasked
    tokens; NaN at masked positions and a trajectory's row order change nothing."""
    lp, _, ref, _, m, _ = rand_case(seed, B=6, T=7)
    owner = torch.tensor([2, 0, 2, 1, 2, 0])
    out = algos.trajectory_logratio(lp, ref, m, owner, 4)
    exp = [0.0] * 4
    for b in range(6):
        for t in range(7):
            if m[b, t]:
                exp[int(owner[b])] += float(lp[b, t] - ref[b, t])
    assert out.shape == (4,) and out.tolist() == pytest.approx(exp, rel=1e-12, abs=1e-12)
    assert float(out[3]) == 0.0  # a trajectory with no row
    lp2 = torch.where(m.bool(), lp, torch.full_like(lp, float("nan")))
    perm = torch.tensor([5, 3, 1, 0, 4, 2])
    out2 = algos.trajectory_logratio(lp2[perm], ref[perm], m[perm], owner[perm], 4)
    assert out2.tolist() == pytest.approx(exp, rel=1e-12, abs=1e-12)


def test_trajectory_logratio_hand_computed_and_its_gradient():
    # trajectory 0 in two windows: (-1 - -2) + (-0.5 - -1) = 1.5; trajectory 1 in one: (-3 - -1) = -2
    lp = torch.tensor([[-1.0, 7.0], [-0.5, 0.0], [-3.0, 0.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-2.0, 0.0], [-1.0, 0.0], [-1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0], [1, 0], [1, 0]], dtype=torch.bool)
    r = algos.trajectory_logratio(lp, ref, mask, torch.tensor([0, 0, 1]), 2)
    assert r.tolist() == [1.5, -2.0]
    loss, _ = algos.dpo_loss(r[:1], r[1:], beta=0.1)  # z = 0.35
    loss.backward()
    g = 0.1 / (1.0 + math.exp(0.35))  # beta * sigmoid(-z): the same on every window of the chosen trajectory
    assert lp.grad[:, 0].tolist() == pytest.approx([-g, -g, g]) and lp.grad[:, 1].tolist() == [0.0, 0.0, 0.0]


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    lp = torch.tensor([[-1.0, -2.0], [-1.5, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = lp.detach().clone()
    mask = torch.ones(2, 2, dtype=torch.bool)
    r = algos.sequence_logratio(lp, ref, mask)
    loss, _ = algos.dpo_loss(r[:1], r[1:], beta=0.1)
    loss.backward()
    # d loss / d logp = -beta * sigmoid(-z) = -0.05 on chosen tokens, +0.05 on rejected ones (z = 0)
    assert lp.grad[0].tolist() == pytest.approx([-0.05, -0.05])
    assert lp.grad[1].tolist() == pytest.approx([0.05, 0.05])


def test_dpo_masked_positions_have_no_effect():
    lp_c, _, ref_c, _, m_c, _ = rand_case(7, B=3, T=6)
    lp_r, _, ref_r, _, m_r, _ = rand_case(8, B=3, T=6)
    lp_c.requires_grad_(True)
    loss, _ = algos.dpo_loss(algos.sequence_logratio(lp_c, ref_c, m_c), algos.sequence_logratio(lp_r, ref_r, m_r))
    loss.backward()
    g = lp_c.grad.clone()
    # garbage (NaN / inf / huge) at masked positions of every input: same value, same gradient, zero grad there
    lp2 = lp_c.detach().clone()
    lp2[~m_c] = float("nan")
    lp2.requires_grad_(True)
    ref2 = ref_c.clone()
    ref2[~m_c] = float("inf")
    lr2 = lp_r.clone()
    lr2[~m_r] = 1e30
    loss2, _ = algos.dpo_loss(algos.sequence_logratio(lp2, ref2, m_c), algos.sequence_logratio(lr2, ref_r, m_r))
    loss2.backward()
    assert float(loss2.detach()) == pytest.approx(float(loss.detach()), rel=1e-12)
    assert torch.equal(lp2.grad, g)
    assert (lp2.grad[~m_c] == 0).all()


# ---- DPO + NLL on the chosen trajectories (RPO; the compare ETO arm)


def ref_dpo_nll_loss(lp_c, ref_c, m_c, lp_r, ref_r, m_r, beta, alpha):
    """Plain loop: ref_dpo_loss + alpha * (-sum of masked chosen logp / number of masked chosen tokens)."""
    s, n = 0.0, 0
    for p in range(len(lp_c)):
        for t in range(len(lp_c[p])):
            if m_c[p][t]:
                s += lp_c[p][t]
                n += 1
    return ref_dpo_loss(lp_c, ref_c, m_c, lp_r, ref_r, m_r, beta) + alpha * (-s / max(n, 1))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_dpo_nll_loss_matches_reference_loop(seed, alpha):
    lp_c, _, ref_c, _, m_c, _ = rand_case(seed, B=4, T=9)
    lp_r, _, ref_r, _, m_r, _ = rand_case(seed + 100, B=4, T=9)
    rc, rr = algos.sequence_logratio(lp_c, ref_c, m_c), algos.sequence_logratio(lp_r, ref_r, m_r)
    loss, st = algos.dpo_nll_loss(rc, rr, lp_c, m_c, beta=0.2, nll_weight=alpha)
    exp = ref_dpo_nll_loss(lp_c.tolist(), ref_c.tolist(), m_c.tolist(), lp_r.tolist(), ref_r.tolist(),
                           m_r.tolist(), 0.2, alpha)
    assert float(loss) == pytest.approx(exp, rel=1e-10)
    plain, _ = algos.dpo_loss(rc, rr, 0.2)
    assert st["dpo_loss"] == pytest.approx(float(plain), rel=1e-12)
    if alpha == 0.0:  # alpha 0 is plain DPO exactly
        assert float(loss) == float(plain)


def test_dpo_nll_hand_computed():
    # the dpo_hand_computed pair: chosen logratio 1, rejected -2, beta 0.5 -> DPO log(1 + e^-1.5);
    # chosen tokens logp -1 and -0.5 (a masked 0 left out): NLL = 0.75; alpha 2 -> + 1.5
    lp = torch.tensor([[-1.0, -0.5, 0.0], [-3.0, 5.0, 0.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-2.0, -0.5, 0.0], [-1.0, -4.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    r = algos.sequence_logratio(lp, ref, mask)
    loss, st = algos.dpo_nll_loss(r[:1], r[1:], lp[:1], mask[:1], beta=0.5, nll_weight=2.0)
    assert float(loss.detach()) == pytest.approx(math.log1p(math.exp(-1.5)) + 1.5)
    assert st["nll_chosen"] == pytest.approx(0.75) and st["dpo_loss"] == pytest.approx(math.log1p(math.exp(-1.5)))
    loss.backward()
    # d/d logp_chosen_j = -beta * sigmoid(-z) - alpha / n_tokens = -0.5 s(-1.5) - 1 on each chosen token
    s = 1.0 / (1.0 + math.exp(1.5))
    assert lp.grad[0].tolist() == pytest.approx([-0.5 * s - 1.0, -0.5 * s - 1.0, 0.0])
    assert lp.grad[1].tolist() == pytest.approx([0.5 * s, 0.0, 0.0])  # the NLL term does not touch the rejected


def test_dpo_nll_masked_positions_have_no_effect():
    lp_c, _, ref_c, _, m_c, _ = rand_case(3, B=3, T=6)
    lp_r, _, ref_r, _, m_r, _ = rand_case(4, B=3, T=6)
    assert (~m_c).any()
    lp_c.requires_grad_(True)
    loss, _ = algos.dpo_nll_loss(algos.sequence_logratio(lp_c, ref_c, m_c), algos.sequence_logratio(lp_r, ref_r, m_r),
                                 lp_c, m_c, 0.1, 0.7)
    loss.backward()
    g = lp_c.grad.clone()
    lp2 = lp_c.detach().clone()
    lp2[~m_c] = float("nan")
    lp2.requires_grad_(True)
    ref2 = ref_c.clone()
    ref2[~m_c] = float("-inf")
    loss2, _ = algos.dpo_nll_loss(algos.sequence_logratio(lp2, ref2, m_c), algos.sequence_logratio(lp_r, ref_r, m_r),
                                  lp2, m_c, 0.1, 0.7)
    loss2.backward()
    assert float(loss2.detach()) == pytest.approx(float(loss.detach()), rel=1e-12)
    assert torch.equal(lp2.grad, g)
    assert (lp2.grad[~m_c] == 0).all()


def test_masked_logprobs_matches_loop_and_leaves_the_rest_zero():
    """The log-probs from the kept positions' logits only (transformers' logits_to_keep as a mask): the full
    computation's values where kept, 0 elsewhere, and no gradient to a dropped position's logits."""
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 7, 13
    logits = torch.randn(B, T, V, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=g)
    keep = torch.rand(B, T, generator=g) < 0.5
    keep[:, -1] = False  # nothing to predict after the last token
    lp = algos.masked_logprobs(logits[keep], ids, keep)
    ls = torch.log_softmax(logits.detach(), -1)
    for b in range(B):
        for j in range(T):
            want = float(ls[b, j, ids[b, j + 1]]) if keep[b, j] else 0.0
            assert float(lp[b, j]) == pytest.approx(want, abs=1e-5)
    torch.testing.assert_close(lp[keep], algos.sequence_logprobs(logits.detach(), ids)[keep])
    lp.sum().backward()
    assert torch.all(logits.grad[~keep] == 0) and torch.all(logits.grad[keep].abs().sum(-1) > 0)
    # by hand: two tokens, uniform logits over 4 -> log(1/4) at the one kept position
    hand = algos.masked_logprobs(torch.zeros(1, 4), torch.tensor([[1, 2, 3]]), torch.tensor([[False, True, False]]))
    assert hand.tolist() == [[0.0, pytest.approx(-math.log(4)), 0.0]]
    # nothing kept: all 0, and a loss on it still back-propagates (a micro-batch without loss tokens)
    empty = torch.zeros(0, V, requires_grad=True)
    z = algos.masked_logprobs(empty, ids, torch.zeros(B, T, dtype=torch.bool))
    assert torch.all(z == 0) and z.requires_grad
    z.sum().backward()
