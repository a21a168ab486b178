"""Prefix indexing (Rust fast path) == the slow per-prefix reference on four chat templates."""
from __future__ import annotations

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers_fixtures import TEMPLATES, TRICKY, build_tokenizer, synthetic_table

from qevolve_cli.errors import QevolveError
from qevolve_cli.prefix import OUT_COLUMNS, add_prefix_positions, reference_positions, tokenize_trajectories
from qevolve_cli.transcript import layout_of, state_end, trajectory_messages

ALL = list(OUT_COLUMNS)


def _assert_same(df, tok, max_length=None, expect_fallback=0):
    stats: dict = {}
    fast = add_prefix_positions(df, tok, max_length=max_length, stats=stats)
    ref = reference_positions(df, tok, max_length=max_length)
    assert fast.select(ALL).to_dicts() == ref.select(ALL).to_dicts()
    assert fast.schema["pos_s"] == pl.Int32 and fast.schema["truncated"] == pl.Boolean
    if expect_fallback is not None:
        assert stats["fallback_trajectories"] == expect_fallback
    return fast, stats


@pytest.mark.parametrize("name", TEMPLATES)
def test_equals_slow_reference(name):
    tok = build_tokenizer(name)
    df = synthetic_table(12, 5, seed=7)
    fast, stats = _assert_same(df, tok)
    assert stats["truncated_steps"] == 0 and not fast["truncated"].any()
    # within a sequence, the next state of step t is the state of step t+1
    nxt = fast.with_columns(pl.col("pos_s").shift(-1).over("traj_id").alias("s1")).drop_nulls("s1")
    assert (nxt["pos_next"] == nxt["s1"]).all()
    assert ((fast["pos_s"] < fast["pos_sa"]) & (fast["pos_sa"] < fast["pos_next"])
            & (fast["pos_next"] < fast["seq_len"])).all()


@pytest.mark.parametrize("name", TEMPLATES)
def test_truncation_equals_slow_reference(name):
    tok = build_tokenizer(name)
    df = synthetic_table(10, 6, seed=3)
    full = add_prefix_positions(df, tok)
    head = int(full["pos_s"].min())  # roughly the head length
    ml = head + 90
    fast, stats = _assert_same(df, tok, max_length=ml)
    assert stats["truncated_steps"] > 0 and stats["windows"] > stats["trajectories"]
    ok = fast.filter(pl.col("seq_len") <= ml)
    assert len(ok) > 0
    assert stats["overlong_steps"] == int((fast["seq_len"] > ml).sum())
    # a truncated step never loses its own observation: at most the pairs before o_t are dropped
    assert (fast["dropped_turns"] <= (fast["step"] - 1).clip(0)).all()


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("share", [0.5, 0.25])
def test_roomy_windows_equal_slow_reference_and_are_fewer(name, share):
    """window_context < 1 (the critic's default 0.5): fast path == slow reference, fewer windows than the
    fewest-dropped rule, and a step never sees more of the past than under that rule."""
    tok = build_tokenizer(name)
    df = synthetic_table(10, 8, seed=5)
    ml = int(add_prefix_positions(df, tok)["pos_s"].min()) + 150
    tight = add_prefix_positions(df, tok, max_length=ml)
    stats: dict = {}
    fast = add_prefix_positions(df, tok, max_length=ml, window_context=share, stats=stats)
    ref = reference_positions(df, tok, max_length=ml, window_context=share)
    assert fast.select(ALL).to_dicts() == ref.select(ALL).to_dicts()
    n_tight = tight.select(pl.struct("traj_id", "window").n_unique()).item()
    assert stats["windows"] < n_tight and stats["overlong_steps"] == int((tight["seq_len"] > ml).sum())
    assert (fast["dropped_turns"] >= tight["dropped_turns"]).all()
    assert (fast["dropped_turns"] <= (fast["step"] - 1).clip(0)).all()
    with pytest.raises(QevolveError, match="window_context"):
        add_prefix_positions(df, tok, max_length=ml, window_context=0)


@pytest.mark.parametrize("name", ["chatml_tiny", "llama2"])
def test_token_ids_consistent_with_positions(name):
    tok = build_tokenizer(name)
    df = synthetic_table(6, 5, seed=11)
    ml = int(add_prefix_positions(df, tok)["pos_s"].min()) + 80
    idx = add_prefix_positions(df, tok, max_length=ml)
    seqs = tokenize_trajectories(idx, tok)
    assert (seqs["input_ids"].list.len() == seqs["seq_len"]).all()
    assert len(seqs) == idx.select(pl.struct("traj_id", "window").n_unique()).item()
    lay = layout_of(tok)
    assert lay.example == (name != "chatml_tiny")  # the in-context example for every template but the tiny's
    head = lay.head
    from qevolve_cli.envs.prompts import example_prompt, instruction_prompt

    joined = idx.join(seqs, on=["traj_id", "window"])
    for r in joined.head(12).iter_rows(named=True):
        g = idx.filter(pl.col("traj_id") == r["traj_id"]).sort("step")
        msgs = trajectory_messages(instruction_prompt(r["env"]), r["instruction"], g["observation"].to_list(),
                                   g["action"].to_list(), g["next_observation"].to_list(), lay,
                                   example_prompt(r["env"]) if lay.example else None)
        j, tt = r["dropped_turns"], r["step"] - r["dropped_turns"]
        win = msgs[:head] + msgs[head + 2 * j:]
        prefix = tok.apply_chat_template(win[: state_end(tt, lay) + 2], tokenize=False)  # through a_t
        ids = tok(prefix, add_special_tokens=False)["input_ids"]
        assert list(r["input_ids"][: r["pos_sa"] + 1]) == ids


LAST_DEPENDENT = ("{% for m in messages %}{{ m.role }}: {{ m.content }}"
                  "{% if not loop.last %}\n{% else %} <END>{% endif %}{% endfor %}")
GLUED = "{% for m in messages %}{{ m.content }} {% endfor %}"  # a trailing space merges with the next word


@pytest.mark.parametrize("template", [LAST_DEPENDENT, GLUED])
def test_fallback_when_prefix_and_full_disagree(template):
    import copy

    tok = copy.deepcopy(build_tokenizer("qwen25"))  # its vocabulary has " Task", " Thought", " Observation"
    tok.chat_template = template
    df = synthetic_table(8, 4, seed=5, tricky=False)
    fast, stats = _assert_same(df, tok, expect_fallback=None)
    # LAST_DEPENDENT: no prefix render is a prefix of the full render; GLUED: every prefix ends
    # inside a token of the full encoding (" " + next word). Both fall back for every trajectory.
    assert stats["fallback_trajectories"] == stats["trajectories"] > 0


_text = st.lists(st.one_of(st.sampled_from(TRICKY), st.text(min_size=0, max_size=12),
                           st.sampled_from(["go to", " ", "\n", "Action: x", "Nothing happens."])),
                 min_size=0, max_size=6).map("".join)


@st.composite
def _tables(draw):
    rows = []
    for i in range(draw(st.integers(1, 3))):
        T = draw(st.integers(1, 4))
        obs = [draw(_text) for _ in range(T + 1)]
        instr = draw(_text)
        for t in range(T):
            rows.append({"traj_id": f"t{i}", "env": "textcraft", "step": t, "instruction": instr,
                         "observation": obs[t], "action": draw(_text), "next_observation": obs[t + 1]})
    return pl.DataFrame(rows)


@pytest.mark.parametrize("name", ["chatml_tiny", "llama3", "llama2"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(df=_tables())
def test_property_random_trajectories(name, df):
    tok = build_tokenizer(name)
    _assert_same(df, tok, expect_fallback=None)


def test_property_qwen_tricky():
    tok = build_tokenizer("qwen25")
    for seed in range(3):
        df = synthetic_table(6, 4, seed=100 + seed)
        _assert_same(df, tok, max_length=None if seed else 600)


def test_bad_input_is_one_line_error():
    tok = build_tokenizer("chatml_tiny")
    df = synthetic_table(2, 2, seed=0)
    with pytest.raises(QevolveError, match="column 'action'"):
        add_prefix_positions(df.drop("action"), tok)
    with pytest.raises(QevolveError, match="column 'env'.*unknown environment"):
        add_prefix_positions(df.with_columns(pl.lit("nowhere").alias("env")), tok)
    with pytest.raises(QevolveError, match="max_length"):
        add_prefix_positions(df, tok, max_length=0)
    with pytest.raises(QevolveError, match="column 'window'"):
        tokenize_trajectories(df, tok)


def test_tokenizer_dir(tmp_path, tiny_model_dir):
    df = synthetic_table(3, 3, seed=2)
    a = add_prefix_positions(df, tiny_model_dir)
    b = reference_positions(df, tiny_model_dir)
    assert a.select(ALL).equals(b.select(ALL))
    with pytest.raises(QevolveError, match="tokenizer.json"):
        add_prefix_positions(df, tmp_path)


@pytest.mark.parametrize("env", ["lamps", "textcraft", "alfworld", "sciworld"])
def test_smollm2_equals_slow_reference(smollm2_dir, env):
    """SmolLM2-135M-Instruct's real tokenizer and chat template, each environment's system prompt:
    the fast path agrees with the slow per-prefix reference, with and without truncation, no fallback."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert layout_of(tok).example  # the in-context example layout (ETO): head = system, example, "OK", task
    df = synthetic_table(8, 5, seed=5, env=env)
    fast, _ = _assert_same(df, tok)
    # s_0 ends at o_0, after the example and its reply; a_0 starts right after the generation prompt
    from qevolve_cli.envs.prompts import example_prompt

    r = fast.filter(pl.col("step") == 0).row(0, named=True)
    seq = tokenize_trajectories(fast, tok).filter(pl.col("traj_id") == r["traj_id"])["input_ids"][0].to_list()
    head = tok.decode(seq[: r["pos_s"] + 1])
    assert example_prompt(env) in head and head.endswith(r["observation"].strip() + "<|im_end|>\n")
    assert tok.decode(seq[r["pos_s"] + 1: r["pos_sa"] + 1]) == ("<|im_start|>assistant\n" + r["action"].strip()
                                                                 + "<|im_end|>\n")
    ml = int(fast["pos_s"].min()) + 90
    _, stats = _assert_same(df, tok, max_length=ml)
    assert stats["truncated_steps"] > 0
    seqs = tokenize_trajectories(add_prefix_positions(df, tok, max_length=ml), tok)
    assert (seqs["input_ids"].list.len() == seqs["seq_len"]).all()
