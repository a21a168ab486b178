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
