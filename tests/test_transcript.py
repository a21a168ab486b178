"""The transcript layouts (system role or not, with or without the in-context example), ReAct's stop,
and the in-context examples of the built-in environments replayed through the real environment."""
from __future__ import annotations

import pytest

from qevolve_cli import react, transcript
from qevolve_cli.envs import act, make_env, task_from_id
from qevolve_cli.envs.builtin import build_splits
from qevolve_cli.envs.prompts import EXAMPLES, example_prompt, instruction_prompt
from qevolve_cli.transcript import Layout

LAYOUTS = [Layout(False, False), Layout(True, False), Layout(False, True), Layout(True, True)]


@pytest.mark.parametrize("lay", LAYOUTS)
def test_prefix_indices_point_at_their_turns(lay):
    obs, acts = [f"o{t}" for t in range(4)], [f"Thought: t{t}\nAction: a{t}" for t in range(3)]
    msgs = transcript.trajectory_messages("SYS", "do it", obs[:3], acts, obs[1:], lay, "EXAMPLE" if lay.example else None)
    assert len(msgs) == lay.head + 2 * 3
    assert ("SYS" in msgs[0]["content"]) and (msgs[0]["role"] == ("user" if lay.system_in_user else "system"))
    if lay.example:
        assert [m["role"] for m in msgs[lay.head - 3: lay.head]] == ["user", "assistant", "user"]
        assert msgs[lay.head - 3]["content"].endswith("EXAMPLE") and msgs[lay.head - 2]["content"] == "OK"
    for t in range(3):
        assert msgs[transcript.state_end(t, lay)]["content"].endswith(f"o{t}")
        assert msgs[transcript.state_action_end(t, lay)] == {"role": "assistant", "content": acts[t]}
        assert msgs[transcript.next_state_end(t, lay)]["content"] == f"Observation: o{t + 1}"
    assert msgs[transcript.state_end(0, lay)]["content"].startswith("Task: do it" if not lay.system_in_user
                                                                     or lay.example else "SYS")
    # truncation keeps the whole head (system, example, "OK", task) and drops the oldest pairs
    tr = transcript.truncate(msgs, lambda m: len(m) <= lay.head + 2, lay)
    assert tr.dropped_turns == 2 and tr.messages[: lay.head] == msgs[: lay.head]
    assert tr.messages[lay.head:] == msgs[-2:]
    # the bool of older callers is the system_in_user flag without an example
    assert transcript.build_messages("SYS", "x", ["o"], [], True) == transcript.build_messages(
        "SYS", "x", ["o"], [], Layout(True, False))


def test_example_layout_needs_the_text():
    with pytest.raises(ValueError, match="in-context example"):
        transcript.build_messages("SYS", "x", ["o"], [], Layout(False, True))


def test_layout_of_tiny_template_has_no_example(tiny_model_dir):
    from qevolve_cli.tokenizer import load_tokenizer

    assert transcript.layout_of(load_tokenizer(tiny_model_dir)) == Layout(False, False)
    assert transcript.layout_of(None) == Layout(False, True)


@pytest.mark.parametrize("text, want", [
    ("Thought: east.\nAction: go east", "Thought: east.\nAction: go east"),
    ("Thought: east.\nAction: go east\nObservation: You are in the hall.\nThought: x\nAction: go west",
     "Thought: east.\nAction: go east"),
    ("Thought: east.\nAction: go east  \n\nObservation: made up", "Thought: east.\nAction: go east"),
    ("Observation: You are in the hall.", ""),
    ("Thought: the Observation: word inline stays.\nAction: look", "Thought: the Observation: word inline stays.\nAction: look"),
])
def test_cut_at_stop(text, want):
    got = react.cut_at_stop(text)
    assert got == want
    if "Action:" in want:  # the played command is the first step's, not an invented later one
        assert react.parse_action_py(got) == want.rsplit("Action:", 1)[1].strip()


@pytest.mark.parametrize("env", ["lamps", "lamps-hard", "lamps-habit"])
def test_builtin_examples_replay_in_the_environment(env):
    """The example is a train task, solved: every observation is what the environment answers."""
    ex = EXAMPLES[env]
    assert ex.task_id in build_splits(env)["train"]
    e = make_env(env)
    obs = e.reset(task_from_id(env, ex.task_id))
    assert e.instruction == ex.instruction
    for (want_obs, out), cmd in zip(ex.steps, ex.commands(), strict=True):
        assert obs == want_obs
        res = act(e, out)
        assert res.command == cmd and react.parse_action_py(out) == cmd
        obs = res.observation
    assert obs == ex.final and res.done and res.reward == 1.0


@pytest.mark.parametrize("env", sorted(EXAMPLES))
def test_example_prompt_is_in_the_transcript_format(env):
    text = example_prompt(env)
    instruction_prompt(env)  # every environment with a prompt has an example and vice versa
    lines = text.splitlines()
    assert lines[0] == "Here is an example." and lines[1].startswith("Task: ")
    assert text.count("\nAction: ") == len(EXAMPLES[env].steps) == text.count("\nThought: ")
    assert lines[-1].startswith("Observation: ") or "\nObservation: " in text


def test_planner_counts_the_example_for_pretrained_models(tiny_model_dir, tmp_path):
    from qevolve_cli.envs.expert import collect_expert
    from qevolve_cli.planner import tokens

    assert not tokens.shows_example(tiny_model_dir)
    assert tokens.shows_example(None, "from:smollm2-135m-instruct") and not tokens.shows_example(None, "llama:tiny")
    path = tmp_path / "e.parquet"
    collect_expert("lamps", limit=3).write_parquet(path)
    count = len  # characters as tokens: the difference is the example's text
    plain = tokens.measure([path], "lamps", count, "chars")
    shown = tokens.measure([path], "lamps", count, "chars", example=True)
    extra = len(example_prompt("lamps")) + len("OK") + 2 * tokens.MESSAGE_OVERHEAD
    assert shown.prompt - plain.prompt == pytest.approx(extra) and shown.trajectory - plain.trajectory == pytest.approx(extra)
