"""Policy data: per-token loss mask, step index and thought flags from the shared transcript + chat template."""
from __future__ import annotations

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


def test_truncation_drops_oldest_turns_and_keeps_step_indices(tok):
    obs = [f"Got {i} oak log and a long observation " + "planks " * 40 for i in range(6)]
    acts = [f"Thought: step {i}.\nAction: get {i} oak log" for i in range(6)]
    full, *_ = encode_trajectory(tok, instruction_prompt("textcraft"), "craft planks", obs, acts, 100000)
    max_len = len(full) - 150
    ids, mask, step, thought, dropped, cut = encode_trajectory(
        tok, instruction_prompt("textcraft"), "craft planks", obs, acts, max_len)
    assert len(ids) <= max_len and dropped >= 1 and not cut
    kept = sorted(set(step[step >= 0].tolist()))
    assert kept == list(range(dropped, 6))  # the newest steps survive with their own indices
    for t in kept:
        assert tok.decode(ids[step == t]) == acts[t] + tok.eos_token


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
