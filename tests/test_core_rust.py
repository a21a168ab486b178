"""The Rust core against plain-Python references: hand-computed cases and property-based tests."""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import ref_gae, ref_label, ref_parse_action, ref_weights

from qevolve_cli import _core, core, react

SCI_RULE = {
    "env": "sciworld", "r_fmt": -0.3, "r_inv": -0.2, "r_repeat": -0.1,
    "invalid_patterns": ["No known action matches that input"], "repeat_enabled": True,
    "repeat_exempt_commands": ["wait1?"],
}
WEB_RULE = {"env": "webshop", "r_fmt": -0.3, "r_inv": 0.0, "r_repeat": 0.0,
            "invalid_patterns": ["^Invalid action"], "repeat_enabled": False, "repeat_exempt_commands": []}


def offsets_of(lengths):
    return pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


# ---------------------------------------------------------------- parser
@pytest.mark.parametrize(
    "text,cmd",
    [
        ("Thought: go.\nAction: open door", "open door"),
        ("Action: a\nThought: b\nAction: c", "c"),
        ("Thought: nothing", None),
        ("Action:   ", None),
        ("Action: take apple  \nextra line", "take apple"),
        ("", None),
    ],
)
def test_parse_action_cases(text, cmd):
    assert react.parse_action(text) == cmd
    assert react.parse_action_py(text) == cmd


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("Actio:n \n\tab.xyz")), max_size=40))
def test_parse_action_matches_reference(text):
    assert _core.parse_action(text) == ref_parse_action(text)


# ---------------------------------------------------------------- weights
def test_weights_hand_computed():
    offs = offsets_of([2, 1])
    w = core.step_weights(offs, pa.array([True, False]), 3).to_list()
    assert w == pytest.approx([1.25, 1.5, 1.0])  # (0.5+1)/2+0.5, (1+1)/2+0.5, (1+0)/2+0.5


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.booleans()), min_size=1, max_size=20),
    st.booleans(), st.booleans(),
)
def test_weights_match_reference(trajs, temporal, success_term):
    lengths = [t[0] for t in trajs]
    success = [t[1] for t in trajs]
    got = core.step_weights(offsets_of(lengths), pa.array(success), sum(lengths), temporal, success_term).to_list()
    assert got == pytest.approx(ref_weights(lengths, success, temporal, success_term), rel=1e-6)


def test_success_from_rewards():
    offs = offsets_of([2, 2, 1])
    got = core.trajectory_success(offs, pl.Series([0.0, 0.5, 0.0, 0.0, -1.0]))
    assert got.to_list() == [True, False, True]


def test_weights_bad_offsets_raise():
    with pytest.raises(_core.CoreDataError, match="offsets"):
        _core.step_weights(pa.array([0, 5], pa.int64()), pa.array([True]), 3)
    with pytest.raises(_core.CoreDataError, match="success"):
        _core.step_weights(pa.array([0, 3], pa.int64()), pa.array([True, False]), 3)


# ---------------------------------------------------------------- GAE
def run_gae(lengths, r, v, nv, d, gamma, lam, aux=None):
    f = lambda x: pl.Series(x, dtype=pl.Float32)  # noqa: E731
    return core.gae(offsets_of(lengths), f(r), f(v), f(nv), pl.Series(d), gamma, lam,
                    None if aux is None else f(aux)).to_list()


def test_gae_hand_computed():
    # gamma = lambda = 0.5; delta_1 = 1 - 0.5 = 0.5 = A_1; delta_0 = 0.5*0.5 - 0.25 = 0; A_0 = 0.25*0.5
    assert run_gae([2], [0, 1], [0.25, 0.5], [0.5, 7.0], [False, True], 0.5, 0.5) == pytest.approx([0.125, 0.5])


def test_gae_lambda_zero_is_td_error():
    got = run_gae([3], [0, 0, 1], [0.1, 0.2, 0.3], [0.2, 0.3, 0.0], [False, False, True], 0.9, 0.0)
    assert got == pytest.approx([0.9 * 0.2 - 0.1, 0.9 * 0.3 - 0.2, 1 - 0.3], rel=1e-6)


def test_gae_other_trajectories_have_no_effect():
    a = run_gae([2, 3], [0, 1, 0, 0, 1], [0.1, 0.2, 0.3, 0.4, 0.5], [0.2, 0, 0.4, 0.5, 0], [0, 1, 0, 0, 1], 0.95, 0.95)
    b = run_gae([2, 3], [0, 1, 9, 9, 9], [0.1, 0.2, -3, 7, 2], [0.2, 0, 5, 5, 5], [0, 1, 0, 0, 1], 0.95, 0.95)
    assert a[:2] == pytest.approx(b[:2])
    assert a[2:] != pytest.approx(b[2:])


def test_gae_aux_decomposition():
    """Paper Prop. (GAE analysis): A_full - A_env = sum_l (gamma lambda)^l r_aux_{t+l}."""
    g, lam = 0.95, 0.95
    r, v, nv, d, aux = [0, 0, 1], [0.2, 0.4, 0.6], [0.4, 0.6, 0.0], [False, False, True], [-0.1, -0.3, 0.0]
    env = run_gae([3], r, v, nv, d, g, lam)
    full = run_gae([3], r, v, nv, d, g, lam, aux)
    for t in range(3):
        expect = sum((g * lam) ** j * aux[t + j] for j in range(3 - t))
        assert full[t] - env[t] == pytest.approx(expect, abs=1e-6)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 25), min_size=1, max_size=12),
    st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1), st.booleans(),
)
def test_gae_matches_reference(lengths, gamma, lam, seed, with_aux):
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    r, v, nv = (rng.normal(size=n).astype(np.float32) for _ in range(3))
    aux = rng.normal(size=n).astype(np.float32) if with_aux else None
    d = np.zeros(n, bool)
    d[np.cumsum(lengths) - 1] = rng.random(len(lengths)) < 0.7  # some trajectories truncated
    got = run_gae(lengths, r, v, nv, d.tolist(), gamma, lam, aux)
    want = ref_gae(lengths, r.astype(float).tolist(), v.astype(float).tolist(), nv.astype(float).tolist(),
                   d.tolist(), gamma, lam, None if aux is None else aux.astype(float).tolist())
    assert np.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_gae_rejects_bad_gamma_and_lengths():
    with pytest.raises(_core.CoreDataError, match="gamma"):
        run_gae([1], [0], [0], [0], [True], 1.5, 0.9)
    with pytest.raises(_core.CoreDataError, match="value"):
        _core.gae_advantages(offsets_of([2]), pa.array([0, 0], pa.float32()), pa.array([0], pa.float32()),
                             pa.array([0, 0], pa.float32()), pa.array([False, True]), 0.9, 0.9)


def test_gae_rejects_wrong_arrow_type():
    with pytest.raises(TypeError, match="float32"):
        _core.gae_advantages(offsets_of([1]), pa.array([0.0], pa.float64()), pa.array([0], pa.float32()),
                             pa.array([0], pa.float32()), pa.array([True]), 0.9, 0.9)


# ---------------------------------------------------------------- labels
def label(rule, rows):
    df = pl.DataFrame({"action": [r[0] for r in rows], "observation": [r[1] for r in rows],
                       "next_observation": [r[2] for r in rows]})
    r, k = core.label_steps(df, [rule], pl.Series([0] * len(rows)))
    return list(zip(r.to_list(), k.to_list(), strict=True))


def test_labels_precedence_and_exemptions():
    inv = "No known action matches that input."
    got = label(SCI_RULE, [
        ("no action here", "o", inv),          # format beats invalid
        ("Action: fly", inv, inv),             # invalid beats repeat
        ("Action: look around", "room", "room"),
        ("Action: wait", "room", "room"),      # no-op by design
        ("Action: wait1", "room", "room"),
        ("Action: look around", "room", "hall"),
    ])
    assert [k for _, k in got] == ["format", "invalid", "repeat", "none", "none", "none"]
    assert [r for r, _ in got] == pytest.approx([-0.3, -0.2, -0.1, 0.0, 0.0, 0.0])


def test_labels_webshop_repeat_exempt():
    assert label(WEB_RULE, [("Action: click[Back]", "page", "page")]) == [(0.0, "none")]


def test_labels_bad_rule_regex():
    with pytest.raises(_core.CoreDataError, match="invalid_patterns"):
        label({**SCI_RULE, "invalid_patterns": ["("]}, [("Action: x", "a", "b")])


_texts = st.sampled_from(["room", "hall", " room ", "No known action matches that input.", "x"])
_actions = st.sampled_from(["Action: look", "Action: wait", "Action: wait1", "nothing", "Thought: t\nAction: go", "Action:"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_actions, _texts, _texts), min_size=1, max_size=30), st.sampled_from([SCI_RULE, WEB_RULE]))
def test_labels_match_reference(rows, rule):
    got = label(rule, rows)
    want = [ref_label(rule, *row) for row in rows]
    assert [k for _, k in got] == [k for _, k in want]
    assert all(math.isclose(a, b, abs_tol=1e-7) for (a, _), (b, _) in zip(got, want, strict=True))


def test_labels_env_codes_route_rules():
    df = pl.DataFrame({"action": ["Action: a", "Action: a"], "observation": ["s", "s"], "next_observation": ["s", "s"]})
    r, k = core.label_steps(df, [SCI_RULE, WEB_RULE], pl.Series([0, 1]))
    assert k.to_list() == ["repeat", "none"]
    with pytest.raises(_core.CoreDataError, match="no rules"):
        core.label_steps(df, [SCI_RULE], pl.Series([0, 1]))


def test_string_view_and_large_string_inputs():
    for t in (pa.string(), pa.large_string(), pa.string_view()):
        a = pa.array(["Action: x", "y"], type=t)
        assert pa.array(_core.parse_actions(a)).to_pylist() == ["x", None]


# ---------------------------------------------------------------- Arrow interchange
def test_core_takes_polars_series_and_pyarrow_arrays_alike():
    """Polars Series travel through the Arrow stream protocol, pyarrow arrays through the array one."""
    lengths = [2, 1, 3]
    offs_pa = offsets_of(lengths)
    offs_pl = pl.Series(offs_pa.to_pylist(), dtype=pl.Int64)
    r = [0.0, 1.0, 0.0, 0.0, 0.0, 2.0]
    a = pl.Series(_core.trajectory_success(offs_pa, pa.array(r, pa.float32()))).to_list()
    b = pl.Series(_core.trajectory_success(offs_pl, pl.Series(r, dtype=pl.Float32))).to_list()
    assert a == b == [True, False, True]


def test_core_refuses_a_multi_chunk_series_by_name():
    two = pl.concat([pl.Series([0, 1], dtype=pl.Int64), pl.Series([3], dtype=pl.Int64)], rechunk=False)
    assert two.n_chunks() == 2
    with pytest.raises(ValueError, match="column 'offsets': expected one chunk, got 2"):
        _core.trajectory_success(two, pl.Series([0.0, 1.0, 0.0], dtype=pl.Float32))
    # the wrappers rechunk first
    assert core.trajectory_success(two, pl.Series([0.0, 1.0, 0.0])).to_list() == [False, True]
    with pytest.raises(TypeError, match="column 'offsets': expected an Arrow array"):
        _core.trajectory_success([0, 3], pl.Series([0.0, 1.0, 0.0], dtype=pl.Float32))


def _runs_reference(ids):
    return [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] + ([len(ids)] if ids else [])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "traj-000000000001", "traj-000000000002", "traj-000000000001 "]),
                max_size=25), st.lists(st.integers(1, 6), min_size=1, max_size=5), st.booleans())
def test_run_offsets_over_chunks_and_string_views(ids, cuts, via_pyarrow):
    """Trajectory runs are found across chunk boundaries, in every string layout. Long ids (> 12
    bytes) that share length and prefix but sit at different places in the data buffers are
    compared byte by byte; views of the same string compare as equal without reading it."""
    chunks, start = [], 0
    for c in cuts + [len(ids)]:
        chunks.append(ids[start:start + c])
        start += c
        if start >= len(ids):
            break
    chunks = [c for c in chunks if c] or [[]]
    want = _runs_reference(ids) if ids else [0]
    if via_pyarrow:
        for t in (pa.string(), pa.large_string(), pa.string_view()):
            col = pa.chunked_array([pa.array(c, type=t) for c in chunks], type=t)
            assert pl.Series(_core.offsets_from_ids(col)).to_list() == want
    else:
        col = pl.concat([pl.Series(c, dtype=pl.String) for c in chunks], rechunk=False)
        assert col.n_chunks() == len(chunks)
        assert pl.Series(_core.offsets_from_ids(col)).to_list() == want
        steps = []
        for i in range(len(ids)):
            steps.append(0 if i == 0 or ids[i] != ids[i - 1] else steps[-1] + 1)
        got = _core.step_order_offsets(col, pl.Series(steps, dtype=pl.Int32))
        sorted_ok = len({ids[o] for o in want[:-1]}) == len(want) - 1 if ids else True
        assert (None if got is None else pl.Series(got).to_list()) == (want if sorted_ok else None)


def test_step_order_offsets_refuses_null_ids_and_length_mismatch():
    with pytest.raises(ValueError, match="column 'traj_id': 1 null values"):
        _core.step_order_offsets(pl.Series(["a", None]), pl.Series([0, 0], dtype=pl.Int32))
    with pytest.raises(ValueError, match="column 'step': 1 rows, but traj_id has 2"):
        _core.step_order_offsets(pl.Series(["a", "a"]), pl.Series([0], dtype=pl.Int32))


def test_schema_with_metadata_keeps_fields_and_sets_metadata(tmp_path):
    import pyarrow.parquet as pq

    df = pl.DataFrame({"a": ["x"], "b": [1]}, schema={"a": pl.String, "b": pl.Int32})
    s = _core.schema_with_metadata(df.schema, {"k": "v"})
    assert s.metadata() == {"k": "v"}
    assert pa.schema(s).metadata == {b"k": b"v"}
    assert [(f.name, str(f.type)) for f in pa.schema(s)] == [("a", "string_view"), ("b", "int32")]
    df.write_parquet(tmp_path / "t.parquet", arrow_schema=s)
    assert pq.read_schema(tmp_path / "t.parquet").metadata == {b"k": b"v"}
    with pytest.raises(TypeError, match="expected an Arrow schema"):
        _core.schema_with_metadata(42, {})
