"""Critic losses (qevolve_cli/algos.py, critic section) against plain reference loops and hand-computed cases."""
from __future__ import annotations

import math

import pytest
import torch

from qevolve_cli.algos import (
    critic_q_loss,
    critic_reduce,
    critic_v_loss,
    ema_update_,
    expectile_loss,
    td_target,
)
from qevolve_cli.tabular import expectile, tabular_iql

torch.set_num_threads(1)


def ref_expectile(x: float, m: float) -> float:
    return abs(m - (1.0 if x < 0 else 0.0)) * x * x


def ref_q_loss(q1, q2, y, w, mask, reduction):
    tot, n = 0.0, 0
    B, K = len(q1), len(q1[0])
    for b in range(B):
        for k in range(K):
            if mask[b][k]:
                tot += w[b][k] * ((q1[b][k] - y[b][k]) ** 2 + (q2[b][k] - y[b][k]) ** 2)
                n += 1
    return {"sum": tot, "traj_sum": tot / B, "mean": tot / max(n, 1)}[reduction]


def ref_v_loss(v, qt1, qt2, w, mask, m, reduction):
    tot, n = 0.0, 0
    B, K = len(v), len(v[0])
    for b in range(B):
        for k in range(K):
            if mask[b][k]:
                tot += w[b][k] * ref_expectile(min(qt1[b][k], qt2[b][k]) - v[b][k], m)
                n += 1
    return {"sum": tot, "traj_sum": tot / B, "mean": tot / max(n, 1)}[reduction]


def test_expectile_hand_cases():
    x = torch.tensor([2.0, -2.0, 0.0, 0.5])
    got = expectile_loss(x, 0.7)
    assert torch.allclose(got, torch.tensor([0.7 * 4, 0.3 * 4, 0.0, 0.7 * 0.25]))
    # m = 0.5: half the squared error
    y = torch.randn(50, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(expectile_loss(y, 0.5), 0.5 * y.square())


def test_td_target_hand_case_and_no_grad():
    r = torch.tensor([[1.0, -0.2]])
    d = torch.tensor([[True, False]])
    nv = torch.tensor([[5.0, 2.0]], requires_grad=True)
    y = td_target(r, d, nv, 0.9)
    assert torch.allclose(y, torch.tensor([[1.0, -0.2 + 0.9 * 2.0]]))
    assert not y.requires_grad  # the bootstrap target carries no gradient into V(s')


@pytest.mark.parametrize("reduction", ["sum", "traj_sum", "mean"])
def test_losses_match_reference_loops(reduction):
    g = torch.Generator().manual_seed(0)
    B, K = 3, 5
    q1, q2, y, v, qt1, qt2 = (torch.randn(B, K, generator=g) for _ in range(6))
    w = torch.rand(B, K, generator=g) + 0.5
    mask = torch.rand(B, K, generator=g) > 0.3
    mask[0, 0] = True
    lq = critic_q_loss(q1, q2, y, w, mask, reduction)
    lv = critic_v_loss(v, qt1, qt2, w, mask, 0.7, reduction)
    L = lambda t: t.tolist()  # noqa: E731
    assert math.isclose(float(lq), ref_q_loss(L(q1), L(q2), L(y), L(w), L(mask), reduction), rel_tol=1e-5)
    assert math.isclose(float(lv), ref_v_loss(L(v), L(qt1), L(qt2), L(w), L(mask), 0.7, reduction), rel_tol=1e-5)


def test_hand_computed_q_and_v_loss():
    # one trajectory, two steps; w = (0.75, 1.0)
    q1 = torch.tensor([[1.0, 0.0]])
    q2 = torch.tensor([[0.5, 2.0]])
    y = torch.tensor([[0.0, 1.0]])
    w = torch.tensor([[0.75, 1.0]])
    mask = torch.tensor([[True, True]])
    # 0.75 * (1 + 0.25) + 1.0 * (1 + 1) = 2.9375
    assert math.isclose(float(critic_q_loss(q1, q2, y, w, mask, "sum")), 2.9375)
    v = torch.tensor([[1.0, 0.0]])
    # diff = min(q1,q2) - v = (-0.5, 0.0); L2^0.9(-0.5) = 0.1 * 0.25
    assert math.isclose(float(critic_v_loss(v, q1, q2, w, mask, 0.9, "sum")), 0.75 * 0.1 * 0.25, rel_tol=1e-6)


def test_weights_scale_losses_linearly():
    g = torch.Generator().manual_seed(3)
    q1, q2, y, v = (torch.randn(2, 4, generator=g) for _ in range(4))
    w = torch.rand(2, 4, generator=g)
    mask = torch.ones(2, 4, dtype=torch.bool)
    for c in (0.0, 0.5, 3.0):
        assert torch.allclose(critic_q_loss(q1, q2, y, c * w, mask), c * critic_q_loss(q1, q2, y, w, mask))
        assert torch.allclose(critic_v_loss(v, q1, q2, c * w, mask, 0.7), c * critic_v_loss(v, q1, q2, w, mask, 0.7))
    # per-step: doubling one step's weight adds exactly that step's loss once more
    w2 = w.clone()
    w2[1, 2] *= 2
    one = torch.zeros_like(mask)
    one[1, 2] = True
    assert torch.allclose(critic_q_loss(q1, q2, y, w2, mask, "sum"),
                          critic_q_loss(q1, q2, y, w, mask, "sum") + critic_q_loss(q1, q2, y, w, one, "sum"))


def test_masked_positions_have_no_effect_on_loss_or_gradient():
    g = torch.Generator().manual_seed(5)
    B, K = 2, 4
    base = [torch.randn(B, K, generator=g) for _ in range(4)]
    w = torch.rand(B, K, generator=g)
    mask = torch.tensor([[True, True, False, False], [True, False, False, False]])

    def run(fill):
        q1, q2, y, v = (t.clone() for t in base)
        for t in (q1, q2, y, v):
            t[~mask] = fill
        wf = w.clone()
        wf[~mask] = 7.0
        q1.requires_grad_(True)
        v.requires_grad_(True)
        lq = critic_q_loss(q1, q2, y, wf, mask, "traj_sum")
        lv = critic_v_loss(v, q1.detach(), q2, wf, mask, 0.7, "traj_sum")
        (lq + lv).backward()
        return float(lq.detach()), float(lv.detach()), q1.grad.clone(), v.grad.clone()

    a = run(0.0)
    for fill in (123.0, float("nan"), float("inf")):
        b = run(fill)
        assert a[0] == pytest.approx(b[0]) and a[1] == pytest.approx(b[1])
        assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
        assert torch.all(b[2][~mask] == 0) and torch.all(b[3][~mask] == 0)


def test_reduce_mean_counts_only_real_steps():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    w = torch.ones(1, 3)
    mask = torch.tensor([[True, True, False]])
    assert float(critic_reduce(x, w, mask, "mean")) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        critic_reduce(x, w, mask, "median")


def test_ema_update_exact():
    g = torch.Generator().manual_seed(7)
    tgt = [torch.randn(3, 2, generator=g), torch.randn(4, generator=g)]
    onl = [torch.randn(3, 2, generator=g), torch.randn(4, generator=g)]
    before = [t.clone() for t in tgt]
    ema_update_(tgt, onl, 0.005)
    for t, b, o in zip(tgt, before, onl, strict=True):
        assert torch.allclose(t, 0.995 * b + 0.005 * o, atol=0, rtol=1e-6)
    # lambda = 1 copies, lambda applied twice composes geometrically
    t2 = [b.clone() for b in before]
    ema_update_(t2, onl, 0.1)
    ema_update_(t2, onl, 0.1)
    assert torch.allclose(t2[0], 0.81 * before[0] + 0.19 * onl[0], rtol=1e-6)
    ema_update_(t2, onl, 1.0)
    assert torch.equal(t2[1], onl[1])
    with pytest.raises(ValueError):
        ema_update_([torch.zeros(2)], [torch.zeros(3)], 0.5)


def test_tabular_expectile_minimises_the_loss():
    xs, ws = [0.0, 1.0, 3.0, -2.0], [1.0, 2.0, 0.5, 1.5]
    for m in (0.1, 0.5, 0.7, 0.95):
        v = expectile(xs, ws, m)
        obj = lambda u, m=m: sum(w * ref_expectile(x - u, m) for x, w in zip(xs, ws, strict=True))  # noqa: E731
        for du in (-1e-3, 1e-3):
            assert obj(v) <= obj(v + du) + 1e-12
    # m = 0.5 is the weighted mean
    assert expectile(xs, ws, 0.5) == pytest.approx(sum(x * w for x, w in zip(xs, ws, strict=True)) / sum(ws))
    # hand case: two values 0 and 1 with equal weight, m = 0.7 -> v = 0.7
    assert expectile([0.0, 1.0], [1.0, 1.0], 0.7) == pytest.approx(0.7)


def test_tabular_iql_hand_chain():
    # s0 --a--> s1 --good--> end (r=1) ; s1 --bad--> end (r=0); gamma 0.9, m 0.7, equal weights
    tr = [("s0", "a", 0.0, "s1", False), ("s1", "good", 1.0, "T", True), ("s1", "bad", 0.0, "T", True)]
    V, Q = tabular_iql(tr, 0.9, 0.7)
    assert V["s1"] == pytest.approx(0.7)
    assert Q[("s0", "a")] == pytest.approx(0.63)
    assert V["s0"] == pytest.approx(0.63)  # one dataset action: its expectile is itself
    assert Q[("s1", "good")] - V["s1"] > 0 > Q[("s1", "bad")] - V["s1"]
