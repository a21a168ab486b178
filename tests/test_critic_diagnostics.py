"""Held-out critic diagnostics: pure metrics against plain loops and hand-computed values."""
from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from qevolve_cli.critic import diagnostics as dg

# ---------------------------------------------------------------- references (plain loops)


def ref_explained_variance(p, y):
    n = len(y)
    my = sum(y) / n
    vy = sum((a - my) ** 2 for a in y) / n
    r = [a - b for a, b in zip(y, p, strict=True)]
    mr = sum(r) / n
    vr = sum((a - mr) ** 2 for a in r) / n
    return 1 - vr / vy


def ref_auc(s, y):
    pos = [a for a, b in zip(s, y, strict=True) if b]
    neg = [a for a, b in zip(s, y, strict=True) if not b]
    tot = 0.0
    for a in pos:
        for b in neg:
            tot += 1.0 if a > b else (0.5 if a == b else 0.0)
    return tot / (len(pos) * len(neg))


# ---------------------------------------------------------------- explained variance


def test_explained_variance_hand_computed():
    # Var(y) = 14/9, Var(y - p) = 2/9  ->  1 - 1/7
    assert dg.explained_variance([1, 2, 3], [1, 2, 4]) == pytest.approx(6 / 7)
    assert dg.explained_variance([1, 2, 4], [1, 2, 4]) == pytest.approx(1.0)
    assert dg.explained_variance([5, 5, 5], [1, 2, 4]) == pytest.approx(0.0)  # a constant explains nothing
    assert dg.explained_variance([0, 0, 0], [2, 2, 2]) is None  # no variance to explain
    assert dg.explained_variance([1], [2]) is None


def test_explained_variance_matches_reference_and_ignores_masked():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(3, 40))
        p, y = rng.normal(size=n), rng.normal(size=n)
        assert dg.explained_variance(p, y) == pytest.approx(ref_explained_variance(p, y), rel=1e-9)
        mask = rng.random(n) < 0.6
        mask[:2] = True
        p2, y2 = p.copy(), y.copy()
        p2[~mask] = 1e6
        y2[~mask] = -1e6  # garbage at masked positions changes nothing
        assert dg.explained_variance(p2, y2, mask) == pytest.approx(ref_explained_variance(p[mask], y[mask]), rel=1e-9)


# ---------------------------------------------------------------- AUC


def test_auc_hand_computed():
    assert dg.auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert dg.auc([0.5, 0.5], [1, 0]) == pytest.approx(0.5)  # a tie counts one half
    assert dg.auc([1, 2, 3], [0, 1, 1]) == pytest.approx(1.0)
    assert dg.auc([3, 2, 1], [0, 1, 1]) == pytest.approx(0.0)
    assert dg.auc([1, 2], [1, 1]) is None  # one class only


def test_auc_matches_pairwise_reference_with_ties_and_mask():
    rng = np.random.default_rng(1)
    for _ in range(30):
        n = int(rng.integers(2, 50))
        s = rng.integers(0, 6, size=n).astype(float)  # many ties
        y = rng.random(n) < 0.4
        y[0], y[1] = True, False
        assert dg.auc(s, y) == pytest.approx(ref_auc(s, y))
        mask = rng.random(n) < 0.7
        mask[:2] = True
        s2 = s.copy()
        s2[~mask] = 99.0
        assert dg.auc(s2, y, mask) == pytest.approx(ref_auc(s[mask], y[mask]))


# ---------------------------------------------------------------- returns, Bellman errors


def test_discounted_returns_hand_computed_two_trajectories():
    g = dg.discounted_returns([0, 0, 1, -0.2, 1], [0, 3, 5], 0.5)
    assert g == pytest.approx([0.25, 0.5, 1.0, -0.2 + 0.5, 1.0])


def test_bellman_errors_hand_computed_and_masked():
    # y = r + gamma (1 - d) V'  =  [0 + 0.5*1, 1 + 0]  = [0.5, 1.0]
    out = dg.bellman_errors(q1=[0.5, 0.0], q2=[0.0, 1.0], qbar=[1.0, 0.0], v=[0.5, 0.5], v_next=[1.0, 7.0],
                            reward=[0.0, 1.0], done=[0, 1], gamma=0.5, expectile=0.7)
    # Q: 1/2[(0)^2 + (0.5)^2] = 0.125 ; 1/2[(1)^2 + 0] = 0.5  -> mean 0.3125
    assert out["bellman_q"] == pytest.approx(0.3125)
    # V: qbar - v = [0.5, -0.5] -> 0.7*0.25, 0.3*0.25 -> mean 0.125
    assert out["bellman_v"] == pytest.approx(0.125)
    # TD of V: (0.5 - 0.5)^2, (1 - 0.5)^2 -> 0.125
    assert out["td_v"] == pytest.approx(0.125)
    masked = dg.bellman_errors(q1=[0.5, 0.0, 9], q2=[0.0, 1.0, 9], qbar=[1.0, 0.0, 9], v=[0.5, 0.5, 9],
                               v_next=[1.0, 7.0, 9], reward=[0.0, 1.0, 9], done=[0, 1, 0], gamma=0.5,
                               expectile=0.7, mask=[True, True, False])
    assert masked == pytest.approx(out)


def test_expectile_loss_asymmetric():
    assert dg.expectile_loss([2.0, -2.0], 0.7) == pytest.approx([0.7 * 4, 0.3 * 4])


# ---------------------------------------------------------------- held-out choice


def test_heldout_mask_is_deterministic_order_free_and_stratified():
    ids = [f"t{i}" for i in range(100)]
    succ = [i % 4 == 0 for i in range(100)]  # 25 successes, 75 failures
    m = dg.heldout_mask(ids, succ, 0.1)
    assert m.sum() == 3 + 8  # per stratum: floor(0.1 * n + 0.5) of 25 and of 75
    assert m[np.array(succ)].sum() >= 1 and m[~np.array(succ)].sum() >= 1
    perm = np.random.default_rng(0).permutation(100)
    m2 = dg.heldout_mask([ids[i] for i in perm], [succ[i] for i in perm], 0.1)
    assert {ids[i] for i in perm[m2]} == {ids[i] for i in np.flatnonzero(m)}  # same trajectories
    assert not dg.heldout_mask(ids, succ, 0.0).any()
    assert not dg.heldout_mask(["a", "b"], [True, True], 0.1).any()  # too few to hold any out



def test_heldout_ids_stratify_by_the_success_column_and_both_critics_hold_out_the_same():
    from qevolve_cli.critic.data import TrajItem
    from qevolve_cli.critic.heldout import heldout_ids, split_heldout

    # 40 two-step trajectories; success every 4th, but a partial reward on every one: a stratification by
    # "reward != 0" would see 40 successes and hold out 4 of one stratum instead of 1 + 3
    n = 40
    df = pl.DataFrame({"traj_id": [f"t{i:02d}" for i in range(n) for _ in (0, 1)], "step": [0, 1] * n,
                       "reward_env": [0.0, 0.5] * n, "success": [i % 4 == 0 for i in range(n) for _ in (0, 1)]})
    held = heldout_ids(df, 0.1)
    ids = [f"t{i:02d}" for i in range(n)]
    want = dg.heldout_mask(ids, [i % 4 == 0 for i in range(n)], 0.1)
    assert held == {ids[i] for i in np.flatnonzero(want)}
    assert len(held) == 1 + 3 and sum(int(i[1:]) % 4 == 0 for i in held) == 1
    assert heldout_ids(df.reverse(), 0.1) == held  # the table's order does not matter
    assert heldout_ids(df, 0.0) == set()
    # the LoRA critic's items (one per trajectory) split the same way
    items = [TrajItem(traj_id=t, input_ids=np.zeros(1, np.int64), rows=np.array([2 * k, 2 * k + 1]),
                      step=np.array([0, 1]), pos_s=np.zeros(2, np.int64), pos_sa=np.zeros(2, np.int64),
                      pos_next=np.zeros(2, np.int64)) for k, t in enumerate(ids)]
    train, test = split_heldout(items, df, 0.1)
    assert {it.traj_id for it in test} == held and len(train) == n - len(held)
    # without a success column: a non-zero summed reward is a success (every trajectory here: one stratum)
    assert len(heldout_ids(df.drop("success"), 0.1)) == 4

# ---------------------------------------------------------------- on a frame, verdict


def _frame(value, advantage=None):
    # two trajectories: success (r = 1 at the end) and failure; gamma 0.5
    df = pl.DataFrame({
        "traj_id": ["a", "a", "b", "b"], "step": [0, 1, 0, 1], "source": ["self"] * 4,
        "success": [True, True, False, False], "aux_kind": ["none", "none", "invalid", "none"],
        "reward_env": [0.0, 1.0, 0.0, 0.0], "reward_aux": [0.0, 0.0, -0.2, 0.0], "done": [False, True, False, True],
        "value": value,
    })
    if advantage is not None:
        df = df.with_columns(pl.Series("advantage", advantage))
    return df


def test_diagnose_perfect_and_flat_critics():
    # shaped returns with gamma 0.5: a = [0.5, 1], b = [-0.2, 0]
    good = dg.diagnose(_frame([0.5, 1.0, -0.2, 0.0], [0.1, 0.2, -0.3, -0.1]), gamma=0.5)
    assert good["ev_return"] == pytest.approx(1.0)
    assert good["auc_v"] == pytest.approx(1.0) and good["auc_v0"] == pytest.approx(1.0)
    assert good["failed_self_pos_adv"] == 0.0 and good["success_self_pos_adv"] == 1.0
    grp = {(g["success"], g["aux_kind"]): g for g in good["adv_by_group"]}
    assert grp[(False, "invalid")]["mean"] == pytest.approx(-0.3)
    lax = {"min_per_outcome": 1}  # one trajectory of each outcome: judged only when asked to
    assert dg.verdict(good, lax) == [] and dg.warning_line(good, thresholds=lax) is None
    flat = dg.diagnose(_frame([-0.11, -0.11, -0.11, -0.11], [0.1, 0.1, 0.1, 0.1]), gamma=0.5)
    assert flat["ev_return"] == pytest.approx(0.0, abs=1e-9) and flat["auc_v"] == 0.5
    problems = dg.verdict(flat, lax)
    assert len(problems) == 4  # explained variance, AUC, flat V, failed steps with A > 0
    line = dg.warning_line(flat, thresholds=lax)
    assert "\n" not in line and "--epochs" in line and "docs/critic.md" in line
    # at the default minimum (3 per outcome) only the flat V is judged, and the line says what was not
    assert dg.verdict(flat) == ["V is flat (sd 0.0000)"]
    line = dg.warning_line(flat)
    assert line.startswith("warning: the critic has not learned") and "only 1 failed of 2 trajectories" in line


def ref_bootstrap_ci(stat, offsets, success, n_boot, seed=0):
    """The stratified trajectory bootstrap as a plain loop (same random draws as the library's)."""
    rng = np.random.default_rng(seed)
    pos = [i for i, s in enumerate(success) if s]
    neg = [i for i, s in enumerate(success) if not s]
    vals = []
    for _ in range(n_boot):
        pick = list(rng.choice(pos, size=len(pos), replace=True)) + list(rng.choice(neg, size=len(neg), replace=True))
        rows = []
        for i in pick:
            rows.extend(range(offsets[i], offsets[i + 1]))
        vals.append(stat(np.array(rows)))
    vals.sort()
    return [float(np.quantile(vals, 0.025)), float(np.quantile(vals, 0.975))]


def test_trajectory_bootstrap_interval_matches_a_plain_loop_and_keeps_trajectories_whole():
    rng = np.random.default_rng(3)
    lens = rng.integers(1, 6, size=9)
    off = np.concatenate([[0], np.cumsum(lens)])
    ok = np.array([True, False, True, True, False, True, False, True, True])
    v = rng.normal(size=int(off[-1]))
    row_ok = np.repeat(ok, lens)
    stat = lambda i: dg.auc(v[i], row_ok[i])  # noqa: E731
    got = dg.trajectory_bootstrap_ci(stat, off, ok, n_boot=300)
    assert got == pytest.approx(ref_bootstrap_ci(stat, off, ok, 300))
    assert got[0] <= dg.auc(v, row_ok) <= got[1]
    # a replicate is whole trajectories, as many successful and failed ones as the slice has
    seen = []
    dg.trajectory_bootstrap_ci(lambda i: seen.append(i) or 0.0, off, ok, n_boot=50)
    traj_of = np.repeat(np.arange(len(lens)), lens)
    for i in seen:
        copies = np.bincount(traj_of[i], minlength=len(lens)) / lens
        assert np.all(copies == np.round(copies))  # every trajectory drawn whole, any number of times
        assert copies[ok].sum() == ok.sum() and copies[~ok].sum() == (~ok).sum()
    # one outcome only, or 2 of one: no interval; a perfect separator gives [1, 1]
    assert dg.trajectory_bootstrap_ci(stat, off, np.ones(9, bool), n_boot=50) is None
    assert dg.trajectory_bootstrap_ci(stat, off, np.arange(9) < 7, n_boot=50) is None
    assert dg.trajectory_bootstrap_ci(stat, off, np.arange(9) < 6, n_boot=50) is not None
    sep = row_ok.astype(float)
    assert dg.trajectory_bootstrap_ci(lambda i: dg.auc(sep[i], row_ok[i]), off, ok, n_boot=50) == [1.0, 1.0]


def _many(n_ok, n_failed, value_ok, value_failed):
    """n_ok successful and n_failed failed 3-step trajectories with the given (constant) values."""
    rows = []
    for k in range(n_ok + n_failed):
        good = k < n_ok
        for t in range(3):
            rows.append({"traj_id": f"t{k:03d}", "step": t, "source": "self", "success": good, "aux_kind": "none",
                         "reward_env": 1.0 if (good and t == 2) else 0.0, "reward_aux": 0.0, "done": t == 2,
                         "value": (value_ok if good else value_failed) + 0.01 * ((k * 7) % 5)})
    return pl.DataFrame(rows)


def test_a_slice_with_too_few_failures_is_not_judged_on_outcomes():
    # V ranks failures above successes (AUC well under 0.6): with 2 failures held out that is not judged
    few = dg.diagnose(_many(12, 2, 0.1, 0.5))
    assert (few["n_success"], few["n_failed"]) == (12, 2)
    assert few["auc_v"] < 0.6 and few["auc_v_ci"] is None and few["ev_return_ci"] is None
    assert dg.verdict(few) == []
    notes = dg.caveats(few)
    assert len(notes) == 1 and "only 2 failed of 14 trajectories" in notes[0] and "AUC of V 0.0" in notes[0]
    line = dg.warning_line(few)
    assert line.startswith("note: cannot tell") and "heldout_fraction" in line and "\n" not in line
    assert "(12 successful / 2 failed)" in dg.summary_line(few)
    assert dg.verdict_text({**few, "problems": dg.verdict(few)}) == "not judged (2 failed held out)"  # report table
    # the same critic with 3 failures held out: judged, and it fails the AUC check (interval and all)
    many = dg.diagnose(_many(12, 3, 0.1, 0.5))
    assert dg.caveats(many) == [] and any(p.startswith("AUC of V for success") for p in dg.verdict(many))
    assert many["auc_v_ci"][1] < 0.6 and "auc 0.00 [0.00, 0.00]" in dg.summary_line(many)
    assert dg.warning_line(many).startswith("warning: the critic has not learned")
    assert "AUC of V for success 0.00 < 0.60" in dg.verdict_text(many)
    assert dg.verdict_text(dg.diagnose(_many(12, 3, 0.5, 0.1))) == "learned"
    # diagnostics written before the counts existed are judged as before
    old = {k: v for k, v in few.items() if k not in ("n_success", "n_failed")}
    assert any(p.startswith("AUC of V for success") for p in dg.verdict(old)) and dg.caveats(old) == []


def test_a_value_just_under_the_bar_reads_under_it():
    """The verdict prints a failed check's value with the decimals it takes to read below the bar (a run of
    `make demo` printed "explained variance of V 0.10 < 0.10"); the narrow report column says only the word."""
    assert [dg._below(x, 0.10) for x in (0.0996, 0.05, 0.09999, -0.2)] == ["0.0996", "0.05", "0.09999", "-0.20"]
    assert dg._below(0.5994, 0.6) == "0.599"
    d = {"ev_return": 0.0996, "auc_v": 0.8, "v_std": 0.5, "failed_self_pos_adv": 0.1, "n_success": 30, "n_failed": 6}
    assert dg.verdict(d) == ["explained variance of V 0.0996 < 0.10"]
    assert dg.verdict_word(d) == "not learned" and dg.verdict_text(d) == "explained variance of V 0.0996 < 0.10"
    ok = {**d, "ev_return": 0.3}
    assert dg.verdict(ok) == [] and dg.verdict_word(ok) == "learned"
    few = {**d, "n_failed": 2}
    assert dg.verdict_word(few) == "not judged (2 failed held out)"
