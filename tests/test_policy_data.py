"""Policy data: per-token loss mask, step index and thought flags from the shared transcript + chat template."""
from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from qevolve_cli.envs.prompts import instruction_prompt
from qevolve_cli.policy.data import build_examples, collate, encode_trajectory

ACTIONS = [
    "Thought: I need oak logs first.\nAction: get 1 oak log",
    "Action: craft 4 oak planks using 1 oak log",  # no thought
    "I am confused and give no action",  # format error: no Action:
]
OBS = ["Crafting commands:\ncraft 4 oak planks using 1 oak log\nGoal: craft planks.", "Got 1 oak log",
       "Crafted 4 minecraft:oak_planks"]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_mask_covers_exactly_each_action_and_its_end_of_turn(tok):
    ids, mask, step, thought, dropped, cut = encode_trajectory(
        tok, instruction_prompt("textcraft"), "craft planks", OBS, ACTIONS, 4096)
    assert dropped == 0 and not cut
    assert (mask == (step >= 0)).all()
    for t, a in enumerate(ACTIONS):
        sel = step == t
        # the masked tokens of step t are one contiguous run decoding to the action + end-of-turn
        idx = sel.nonzero()[0]
        assert (idx == range(idx[0], idx[0] + len(idx))).all()
        assert tok.decode(ids[sel]) == a + tok.eos_token
        # thought tokens are exactly the text before "Action:" (none without a thought or without Action:)
        th = tok.decode(ids[sel & thought])
        assert th == (a[: a.rfind("Action:")] if "Action:" in a and a.rfind("Action:") > 0 else "")
    # everything else (system prompt, instruction, observations, headers) is masked out
    rest = tok.decode(ids[~mask])
    assert "craft planks" in rest and "Got 1 oak log" in rest and "Interact" not in tok.decode(ids[mask])
    assert tok.eos_token not in tok.decode(ids[~mask][-3:])  # last turn's end token belongs to the action


def _long(n=6, words=40):
    obs = [f"Got {i} oak log and a long observation " + "planks " * words for i in range(n)]
    acts = [f"Thought: step {i}.\nAction: get {i} oak log" for i in range(n)]
    return obs, acts


def test_one_sequence_truncation_drops_oldest_turns_and_keeps_step_indices(tok):
    obs, acts = _long()
    full, *_ = encode_trajectory(tok, instruction_prompt("textcraft"), "craft planks", obs, acts, 100000)
    max_len = len(full) - 150
    ids, mask, step, thought, dropped, cut = encode_trajectory(
        tok, instruction_prompt("textcraft"), "craft planks", obs, acts, max_len)
    assert len(ids) <= max_len and dropped >= 1 and not cut
    kept = sorted(set(step[step >= 0].tolist()))
    assert kept == list(range(dropped, 6))  # the newest steps survive with their own indices
    for t in kept:
        assert tok.decode(ids[step == t]) == acts[t] + tok.eos_token


@pytest.mark.parametrize("cut_tokens", [150, 300])  # 3 and 5 windows
def test_windows_train_every_action_once_in_the_rollouts_context(tok, cut_tokens):
    """A trajectory longer than max_length: each step's action is a target in exactly one window, and the
    tokens up to its end are those of the rollout's context for that step (transcript.truncate with the
    fewest dropped turns that fit, ending on the action): a reference built per step by hand."""
    from qevolve_cli import transcript
    from qevolve_cli.policy.data import encode_windows, render

    obs, acts = _long()
    system = instruction_prompt("textcraft")
    full, *_ = encode_trajectory(tok, system, "craft planks", obs, acts, 100000)
    max_len = len(full) - cut_tokens
    wins = encode_windows(tok, system, "craft planks", obs, acts, max_len, window_context=1.0)
    assert len(wins) >= 2
    owner = {}
    for w, (ids, mask, step, thought, dropped, cut) in enumerate(wins):
        assert len(ids) <= max_len and not cut
        assert (mask == (step >= 0)).all()
        for t in set(step[mask].tolist()):
            assert t not in owner, f"step {t} is a target in two windows"
            owner[t] = (w, dropped)
            assert tok.decode(ids[step == t]) == acts[t] + tok.eos_token
            assert tok.decode(ids[(step == t) & thought]) == f"Thought: step {t}.\n"
        assert not (thought & ~mask).any()  # context actions carry no thought flag either
    assert sorted(owner) == list(range(6))  # no action is lost (encode_trajectory keeps only the newest)
    n_tok = lambda m: len(tok(render(tok, m), add_special_tokens=False).input_ids)  # noqa: E731
    for t in range(6):
        msgs = transcript.build_messages(system, "craft planks", obs[: t + 1], acts[: t + 1])
        ref = transcript.truncate(msgs, lambda m: n_tok(m) <= max_len)
        w, dropped = owner[t]
        assert dropped == ref.dropped_turns
        ids, _, step, *_ = wins[w]
        end = int(np.nonzero(step == t)[0][-1]) + 1
        ref_ids = tok(render(tok, ref.messages), add_special_tokens=False).input_ids
        assert ids[:end].tolist() == ref_ids[:end] and tok.decode(ref_ids[end:]).strip() == ""
        assert f"Got {t} oak log" in tok.decode(ids[:end]) or t == 0  # o_t is in step t's context
    # the windows' step advantages: every target token of step t carries A_t
    df = pl.DataFrame([dict(traj_id="t0", env="textcraft", task_id="0", split="train", source="self", iteration=1,
                            step=t, instruction="craft planks", observation=o, action=a, command=None,
                            next_observation="ok", reward_env=0.0, done=t == 5, advantage=float(t) - 2.5)
                       for t, (o, a) in enumerate(zip(obs, acts, strict=True))])
    exs = build_examples(df, tok, max_len, with_advantage=True, window_context=1.0)
    assert [e.window for e in exs] == list(range(len(wins))) and all(e.traj_id == "t0" for e in exs)
    b = collate(exs, tok.pad_token_id)
    for i, e in enumerate(exs):
        st = e.step[1:]
        m = b["mask"][i, : len(e) - 1].numpy()
        assert (b["adv"][i, : len(e) - 1].numpy()[m] == st[m] - 2.5).all()
    (one,) = build_examples(df, tok, max_len, windows=False)  # the one-sequence baseline keeps the newest only
    assert set(one.step[one.loss_mask].tolist()) < set(range(6))


@pytest.mark.parametrize("share", [0.75, 0.5, 0.25])
def test_windows_with_room_share_steps_and_still_train_each_action_once(tok, share):
    """window_context < 1: fewer windows than one per step; each action a target once; a step's context is
    never longer than the rollout's (at least as many dropped turns) and never cut."""
    from qevolve_cli.policy.data import encode_windows

    obs, acts = _long(10, 30)
    system = instruction_prompt("textcraft")
    full, *_ = encode_trajectory(tok, system, "craft planks", obs, acts, 100000)
    max_len = len(full) // 2
    tight = encode_windows(tok, system, "craft planks", obs, acts, max_len, window_context=1.0)
    roomy = encode_windows(tok, system, "craft planks", obs, acts, max_len, window_context=share)
    assert len(roomy) < len(tight)
    def owners(wins):
        return {t: (w, d) for w, (_i, m, st, _th, d, _c) in enumerate(wins) for t in set(st[m].tolist())}
    o_tight, o_roomy = owners(tight), owners(roomy)
    assert sum(int(m.any()) for _i, m, *_ in roomy) == len(roomy)
    assert sorted(o_roomy) == list(range(10)) and sum(len(set(st[m].tolist())) for _i, m, st, *_ in roomy) == 10
    for t in range(10):
        assert o_roomy[t][1] >= o_tight[t][1]
    for ids, _m, _st, _th, _d, cut in roomy:
        assert len(ids) <= max_len and not cut


def test_a_trajectory_that_fits_is_one_window_equal_to_the_single_sequence(tok):
    from qevolve_cli.policy.data import encode_windows

    obs, acts = _long(4, 5)
    one = encode_trajectory(tok, instruction_prompt("textcraft"), "craft planks", obs, acts, 4096)
    (win,) = encode_windows(tok, instruction_prompt("textcraft"), "craft planks", obs, acts, 4096)
    assert all(np.array_equal(a, b) for a, b in zip(one[:4], win[:4], strict=True)) and one[4:] == win[4:] == (0, False)


def test_window_starts_reference_loop():
    """The shared window rule against a brute-force loop on a monotone length model: per step the fewest
    dropped pairs that fit (never past max(t-1, 0)), non-decreasing across steps."""
    import random

    from qevolve_cli.transcript import window_starts

    rng = random.Random(0)
    for _ in range(200):
        T = rng.randint(1, 12)
        head = rng.randint(0, 30)
        turn = [rng.randint(1, 20) for _ in range(T)]
        limit = rng.randint(10, 120)
        length = lambda j, t: head + sum(turn[j : t + 1])  # noqa: E731, B023
        fits = lambda j, t: length(j, t) <= limit  # noqa: E731, B023
        ref = []
        for t in range(T):
            hi = max(t - 1, 0)
            ref.append(next((j for j in range(hi + 1) if fits(j, t)), hi))
        assert window_starts(T, length, limit) == ref
        # a stricter start: a new window begins at the first j whose body is within half the room
        start = lambda j, t: head + sum(turn[j : t + 1]) <= head + (limit - head) / 2  # noqa: E731, B023
        ref, j = [], 0
        for t in range(T):
            hi = max(t - 1, 0)
            if min(j, hi) < hi and not fits(min(j, hi), t):
                j = next((k for k in range(j + 1, hi + 1) if start(k, t)), hi)
            j = min(j, hi)
            ref.append(j)
        assert window_starts(T, length, limit, head, 0.5) == ref
        assert len(set(ref)) <= len(set(window_starts(T, length, limit)))  # never more windows than the fewest-dropped rule
    assert window_starts(3, lambda j, t: 10**9, 10) == [0, 0, 1]  # nothing fits: keep o_t, the caller cuts


def _table(adv):
    rows = []
    for t, (o, a) in enumerate(zip(OBS, ACTIONS, strict=False)):
        rows.append(dict(traj_id="t0", env="textcraft", task_id="0", split="train", source="self", iteration=1,
                         step=t, instruction="craft planks", observation=o, action=a, command=None,
                         next_observation="ok", reward_env=0.0, done=t == 2, advantage=adv[t]))
    return pl.DataFrame(rows)


def test_collate_broadcasts_step_advantage_to_every_action_token(tok):
    adv = [0.5, -1.0, 2.0]
    (ex,) = build_examples(_table(adv), tok, 4096, with_advantage=True)
    b = collate([ex], tok.pad_token_id, thought_weight=0.25)
    m = b["mask"][0]
    # prediction-aligned: position j predicts token j+1
    assert m.sum() == ex.loss_mask[1:].sum()
    for t, a in enumerate(adv):
        sel = (ex.step[1:] == t)
        assert (b["adv"][0, : len(ex) - 1][sel] == a).all()
    assert (b["adv"][0][~m] == 0).all()
    tw = b["token_weights"][0, : len(ex) - 1]
    assert set(tw[ex.is_thought[1:]].tolist()) == {0.25}
    assert set(tw[~ex.is_thought[1:]].tolist()) == {1.0}


# ---- RFT / DPO selection (pure table functions)


def traj_rows(traj_id, task, source, rewards, env="lamps"):
    """A trajectory whose per-step env rewards are ``rewards`` (final reward = their sum)."""
    return [dict(traj_id=traj_id, env=env, task_id=task, source=source, step=t, reward_env=float(r))
            for t, r in enumerate(rewards)]


def frame(*trajs):
    return pl.DataFrame([r for t in trajs for r in t])


def test_rft_keeps_every_expert_and_only_successful_self_trajectories():
    from qevolve_cli.policy.data import rft_select

    df = frame(traj_rows("e1", "a", "expert", [0, 1]), traj_rows("e2", "b", "expert", [0, 0]),  # failed expert kept
               traj_rows("s1", "a", "self", [0, 1]), traj_rows("s2", "a", "self", [0, 0, 0]),
               traj_rows("s3", "b", "self", [0.5]), traj_rows("s4", "c", "self", [0.25, 0.75]))
    out, counts = rft_select(df, 1.0)
    assert sorted(out["traj_id"].unique().to_list()) == ["e1", "e2", "s1", "s4"]  # s4: 0.25 + 0.75 = 1
    assert out.height == 2 + 2 + 2 + 2  # whole trajectories
    assert counts == {"expert": 2, "self_kept": 2, "self_dropped": 2}
    out, counts = rft_select(df, 0.5)
    assert "s3" in out["traj_id"].to_list() and counts["self_kept"] == 3


def test_dpo_pairs_follow_eto_construction():
    from qevolve_cli.policy.data import dpo_pairs

    df = frame(
        traj_rows("e_a", "a", "expert", [0, 1]),
        traj_rows("s_a1", "a", "self", [0, 0]),  # lower than the expert: (expert, self)  "lose"
        traj_rows("s_a2", "a", "self", [1]),  # equal: tie, no pair
        traj_rows("e_b", "b", "expert", [0.5]),  # WebShop-like partial expert reward
        traj_rows("s_b1", "b", "self", [0.75]),  # higher than the expert: (self, expert)  "win"
        traj_rows("s_c1", "c", "self", [1]),  # no expert for task c
        traj_rows("s_c2", "c", "self", [0]),
        traj_rows("e_a_other_env", "a", "expert", [1], env="textcraft"),  # same task id, other env: no partner
    )
    pairs, counts = dpo_pairs(df, "expert")
    assert pairs == [("e_a", "s_a1"), ("s_b1", "e_b")]
    assert counts == {"lose": 1, "win": 1, "tie": 1, "no_anchor": 2, "tasks_with_pairs": 2}
    pairs, counts = dpo_pairs(df, "expert_or_best")
    assert pairs == [("e_a", "s_a1"), ("s_b1", "e_b"), ("s_c1", "s_c2")]
    assert counts["no_anchor"] == 0 and counts["tasks_with_pairs"] == 3
    with pytest.raises(ValueError, match="unknown DPO anchor"):
        dpo_pairs(df, "best")
