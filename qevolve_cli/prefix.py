"""Tokenised prefix indexing: where each step's state / state-action / next-state prefix ends.

Contract (read by the critic and the policy trainers)
------------------------------------------------------
Each trajectory is rendered with the tokenizer's chat template from the one
transcript builder (:func:`qevolve_cli.transcript.trajectory_messages`, system
prompt = ``instruction_prompt(env)``, layout = :func:`qevolve_cli.transcript.layout_of`:
``system_in_user`` when the template has no system role, the environment's in-context
example for pretrained chat models) and tokenised **without** adding special tokens (the
template already writes BOS etc.), exactly like ``apply_chat_template(..., tokenize=True)``.

Per step t (columns added by :func:`add_prefix_positions`):

* ``pos_s``    token index of the last token of ``render(messages[:state_end(t)+1])``        (ends at o_t)
* ``pos_sa``   same for ``state_action_end(t)``                                               (ends at a_t)
* ``pos_next`` same for ``next_state_end(t)``                                                 (ends at o_{t+1})
* ``seq_len``  token length of the step's sequence (the window below); positions are < seq_len
* ``window``   index of the step's sequence within its trajectory (0 unless truncated)
* ``dropped_turns`` number of oldest (assistant, user) pairs dropped from that sequence
* ``truncated`` ``dropped_turns > 0``

"Position" means the slow reference: ``len(encode(apply_chat_template(messages[:k+1],
tokenize=False))) - 1`` (see :func:`reference_positions`), which the fast path
reproduces exactly. Within one sequence, ``pos_next[t] == pos_s[t+1]``.

Truncation (``max_length``): the rollout rule (:func:`qevolve_cli.transcript.truncate`:
keep the head = system (+ example) + first user message with the instruction and o_0, drop
the oldest (assistant, user) pairs) applied to the step's whole prefix up to
o_{t+1}: step t uses the smallest number of dropped pairs ``j_t`` (scanning
upwards from ``j_{t-1}``) such that ``head + a_j, o_{j+1}, ..., a_t, o_{t+1}``
has at most ``max_length`` tokens, but never drops the pair holding o_t
(``j_t <= max(t-1, 0)``). Consecutive steps with the same ``j`` share one
sequence (``window``): ``head + turns j .. b`` where b is the window's last
step, and their positions index that sequence. A step that does not fit even
at ``j = max(t-1, 0)`` keeps that window (``seq_len > max_length``; reported as
``overlong`` in the stats; the critic must skip or cut such steps).
Across a window change ``pos_next[t]`` (window w) and ``pos_s[t+1]`` (window
w+1) index different sequences.

Token ids: :func:`tokenize_trajectories` returns one row per (traj_id, window)
with ``input_ids`` consistent with the positions (``input_ids[pos]`` is the
last token of the prefix; ``len(input_ids) == seq_len``).

How it is fast
--------------
The template is rendered once per message-count shape with sentinel contents
(a skeleton); each trajectory's text is the skeleton with its contents spliced
in, and the character end of every prefix render is known from the skeleton
(after checking that every prefix render of the skeleton is a prefix of the
full render and, on the first trajectory of each shape, that the splice equals
the real Jinja render). The Rust core (``_core.PrefixIndexer``, tokenizers
crate, rayon, GIL released) tokenises each text once and maps character ends
to token positions, proving per prefix that the prefix's own encoding equals
the full encoding's first tokens (token boundary + independent re-encoding of
the text after the last special token). Any trajectory that fails a check is
computed by the exact slow path; the number is reported as
``fallback_trajectories`` in ``stats``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from qevolve_cli.errors import QevolveError
from qevolve_cli.tokenizer import load_tokenizer
from qevolve_cli.transcript import (
    Layout,
    layout_of,
    state_end,
    trajectory_messages,
    window_starts,
)

POS_COLUMNS = ("pos_s", "pos_sa", "pos_next")
OUT_COLUMNS = (*POS_COLUMNS, "seq_len", "window", "dropped_turns", "truncated")
NEEDED = ("traj_id", "env", "step", "instruction", "observation", "action", "next_observation")

_SENT_A, _SENT_B = "\ue000", "\ue001"


# --------------------------------------------------------------------------- tokenizer

def _tokenizer_json(tok) -> str:
    backend = getattr(tok, "backend_tokenizer", None) or getattr(tok, "_tokenizer", None)
    if backend is None:
        raise QevolveError("tokenizer: a fast tokenizer (tokenizer.json) is required for prefix indexing")
    return backend.to_str()


def _render(tok, messages: list[dict]) -> str:
    try:
        return tok.apply_chat_template(messages, tokenize=False)
    except Exception as e:  # jinja errors, missing template
        raise QevolveError(f"tokenizer: chat template failed: {e}") from None


def _slow_len(tok, messages: list[dict]) -> int:
    return len(tok(_render(tok, messages), add_special_tokens=False)["input_ids"])


# --------------------------------------------------------------------------- skeletons

class _Skeletons:
    """Per message-count skeleton of the chat template: literal pieces + prefix deltas."""

    def __init__(self, tok, layout: Layout):
        self.tok = tok
        self.layout = layout
        self.first = state_end(0, layout)
        self._cache: dict[int, tuple[list[str], list[int]] | None] = {}
        self.verified: set[int] = set()

    def roles(self, n: int) -> list[str]:
        head = [] if self.layout.system_in_user else ["system"]
        return (head + ["user", "assistant"] * n)[:n]

    def get(self, n: int):
        if n not in self._cache:
            self._cache[n] = self._build(n)
        return self._cache[n]

    def _build(self, n: int):
        msgs = [{"role": r, "content": f"{_SENT_A}{i}{_SENT_B}"} for i, r in enumerate(self.roles(n))]
        full = _render(self.tok, msgs)
        lits, ends, starts, pos = [], [], [], 0
        for m in msgs:
            s = m["content"]
            at = full.find(s, pos)
            if at < 0 or full.count(s) != 1:
                return None
            lits.append(full[pos:at])
            starts.append(at)
            pos = at + len(s)
            ends.append(pos)
        lits.append(full[pos:])
        deltas = []
        for k in range(self.first, n):
            sk = _render(self.tok, msgs[: k + 1])
            if not full.startswith(sk) or len(sk) < ends[k] or (k + 1 < n and len(sk) > starts[k + 1]):
                return None
            deltas.append(len(sk) - ends[k])
        # does the template keep leading/trailing whitespace of contents verbatim (no trim/strip)?
        padded = [{"role": m["role"], "content": f" \n{m['content']}\n "} for m in msgs]
        ws_ok = _render(self.tok, padded) == "".join(
            lits[i] + padded[i]["content"] for i in range(n)) + lits[-1]
        return lits, deltas, ws_ok

    def splice(self, contents: list[str]) -> tuple[str, list[int]] | None:
        """Full text and the char end of every prefix k >= first, or None (no usable skeleton)."""
        sk = self.get(len(contents))
        if sk is None:
            return None
        lits, deltas, ws_ok = sk
        check = len(contents) not in self.verified
        if not ws_ok and any(c != c.strip() for c in contents):
            # the template trims contents: splice stripped contents and check against one real render
            real_contents, contents, check = contents, [c.strip() for c in contents], True
        else:
            real_contents = contents
        parts: list[str] = []
        ends: list[int] = []
        pos = 0
        for i, c in enumerate(contents):
            parts.append(lits[i])
            parts.append(c)
            pos += len(lits[i]) + len(c)
            if i >= self.first:
                ends.append(pos + deltas[i - self.first])
        parts.append(lits[-1])
        text = "".join(parts)
        n = len(contents)
        if check:  # first real trajectory of this shape (or trimmed contents): compare with the real render
            real = _render(self.tok, [{"role": r, "content": c} for r, c in zip(self.roles(n), real_contents, strict=False)])
            if real != text:
                if real_contents is contents:
                    self._cache[n] = None
                return None
            self.verified.add(n)
        return text, ends


# --------------------------------------------------------------------------- trajectories

def _check_columns(df: pl.DataFrame) -> None:
    for c in NEEDED:
        if c not in df.columns:
            raise QevolveError(f"<table>: column '{c}': missing (needed for prefix indexing)")


def _system_prompt(env: str) -> str:
    from qevolve_cli.envs.prompts import instruction_prompt

    try:
        return instruction_prompt(env)
    except KeyError as e:
        raise QevolveError(f"<table>: column 'env': {e.args[0]}") from None


def _traj_offsets(df: pl.DataFrame) -> np.ndarray:
    ids = df["traj_id"]
    change = (ids != ids.shift(1)).fill_null(True).to_numpy()
    starts = np.flatnonzero(change)
    return np.append(starts, len(df)).astype(np.int64)


def _messages(env, instruction, obs, act, nxt, layout: Layout) -> list[dict]:
    from qevolve_cli.envs.prompts import example_prompt

    example = example_prompt(env) if layout.example else None
    return trajectory_messages(_system_prompt(env), instruction, obs, act, nxt, layout, example)


def _window_messages(msgs: list[dict], head: int, j: int, b: int, layout: Layout) -> list[dict]:
    """head + pairs j..b (through next_state_end(b) of the original indexing)."""
    from qevolve_cli.transcript import next_state_end

    return msgs[:head] + msgs[head + 2 * j: next_state_end(b, layout) + 1]


def _slow_trajectory(tok, msgs: list[dict], T: int, layout: Layout, max_length: int | None,
                     window_context: float = 1.0):
    """Exact reference for one trajectory: per-prefix render + tokenisation. Returns per-step tuples."""
    head = layout.head
    if max_length is None:
        js = [0] * T
    else:
        def length(j: int, t: int) -> int:
            return _slow_len(tok, _window_messages(msgs, head, j, t, layout))

        js = window_starts(T, length, max_length, _slow_len(tok, msgs[:head]), window_context)
    out = []
    w = -1
    for t in range(T):
        j = js[t]
        if t == 0 or j != js[t - 1]:
            w += 1
            b = max(u for u in range(T) if js[u] == j)
            win = _window_messages(msgs, head, j, b, layout)
            seq_len = _slow_len(tok, win)
        tt = t - j
        ks = [state_end(tt, layout), state_end(tt, layout) + 1, state_end(tt, layout) + 2]
        p = [_slow_len(tok, win[: k + 1]) - 1 for k in ks]
        out.append((p[0], p[1], p[2], seq_len, w, j, j > 0))
    return out


def reference_positions(df: pl.DataFrame, tokenizer_dir_or_obj: Any, max_length: int | None = None,
                        window_context: float = 1.0) -> pl.DataFrame:
    """The slow reference: every prefix rendered and tokenised separately (tests, benchmarks)."""
    from qevolve_cli.schema import sort_steps

    _check_columns(df)
    tok = load_tokenizer(tokenizer_dir_or_obj, require_fast=True)
    lay = layout_of(tok)
    df = sort_steps(df)
    offs = _traj_offsets(df)
    cols = {c: df[c].to_list() for c in ("env", "instruction", "observation", "action", "next_observation")}
    rows: list[tuple] = []
    for a, b in zip(offs[:-1], offs[1:], strict=False):
        msgs = _messages(cols["env"][a], cols["instruction"][a], cols["observation"][a:b], cols["action"][a:b],
                         cols["next_observation"][a:b], lay)
        rows.extend(_slow_trajectory(tok, msgs, int(b - a), lay, max_length, window_context))
    return _attach(df, rows)


def _attach(df: pl.DataFrame, rows: Sequence[tuple]) -> pl.DataFrame:
    arr = list(zip(*rows, strict=False)) if rows else [[] for _ in OUT_COLUMNS]
    new = []
    for name, vals in zip(OUT_COLUMNS, arr, strict=False):
        dt = pl.Boolean if name == "truncated" else pl.Int32
        new.append(pl.Series(name, list(vals), dtype=dt))
    return df.drop([c for c in OUT_COLUMNS if c in df.columns]).with_columns(new)


# --------------------------------------------------------------------------- fast path

class _Indexer:
    def __init__(self, tokenizer_dir_or_obj: Any):
        from qevolve_cli import _core

        self.tok = load_tokenizer(tokenizer_dir_or_obj, require_fast=True)
        self.layout = layout_of(self.tok)
        self.rust = _core.PrefixIndexer(_tokenizer_json(self.tok))
        self.skel = _Skeletons(self.tok, self.layout)
        self.head = self.layout.head

    def index_texts(self, texts: list[str], ends: list[list[int]]):
        flat = [e for es in ends for e in es]
        eo = np.zeros(len(ends) + 1, dtype=np.int64)
        eo[1:] = np.cumsum([len(es) for es in ends])
        pos, seq_len, ok = self.rust.index(pa.array(texts, pa.large_string()), pa.array(flat, pa.int64()),
                                           pa.array(eo, pa.int64()))
        pos = pa.array(pos).to_numpy(zero_copy_only=False)
        return pos, eo, pa.array(seq_len).to_pylist(), pa.array(ok).to_pylist()


def add_prefix_positions(
    df: pl.DataFrame,
    tokenizer_dir_or_obj: Any,
    max_length: int | None = None,
    *,
    window_context: float = 1.0,
    chunk_trajectories: int = 2048,
    stats: dict | None = None,
) -> pl.DataFrame:
    """Add ``pos_s, pos_sa, pos_next, seq_len, window, dropped_turns`` (int32) and ``truncated`` (bool).

    ``window_context`` (0 < c <= 1): a new window of a trajectory longer than ``max_length`` starts with
    the fewest dropped turns that keep its first sequence within the head plus c of the room after the
    head (:func:`qevolve_cli.transcript.window_starts`); 1 = the fewest that fit (one window per step once
    the first is full); lower = windows shared by more steps (CriticConfig.window_context).

    Rows come back in :func:`qevolve_cli.schema.sort_steps` order. ``stats``
    (if given) receives counts: trajectories, steps, fallback_trajectories,
    truncated_steps, overlong_steps, windows.
    """
    from qevolve_cli.schema import sort_steps

    if max_length is not None and max_length < 1:
        raise QevolveError(f"max_length: must be >= 1, got {max_length}")
    if not 0 < window_context <= 1:
        raise QevolveError(f"window_context: must be in (0, 1], got {window_context}")
    _check_columns(df)
    ix = _Indexer(tokenizer_dir_or_obj)
    df = sort_steps(df)
    offs = _traj_offsets(df)
    st = {"trajectories": len(offs) - 1, "steps": len(df), "fallback_trajectories": 0,
          "truncated_steps": 0, "overlong_steps": 0, "windows": 0}
    rows: list[tuple] = []
    for c0 in range(0, len(offs) - 1, chunk_trajectories):
        c1 = min(c0 + chunk_trajectories, len(offs) - 1)
        r0, r1 = int(offs[c0]), int(offs[c1])
        part = df.slice(r0, r1 - r0)
        cols = {c: part[c].to_list() for c in ("env", "instruction", "observation", "action", "next_observation")}
        lo = offs[c0:c1 + 1] - r0
        msgs_l, texts, ends, slow = [], [], [], []
        for i in range(c1 - c0):
            a, b = int(lo[i]), int(lo[i + 1])
            msgs = _messages(cols["env"][a], cols["instruction"][a], cols["observation"][a:b], cols["action"][a:b],
                             cols["next_observation"][a:b], ix.layout)
            msgs_l.append(msgs)
            sp = ix.skel.splice([m["content"] for m in msgs])
            if sp is None:
                slow.append(True)
                texts.append("")
                ends.append([])
            else:
                slow.append(False)
                texts.append(sp[0])
                ends.append(sp[1])
        pos, eo, seq_lens, oks = ix.index_texts(texts, ends)
        for i in range(c1 - c0):
            T = int(lo[i + 1] - lo[i])
            res = None
            if not slow[i] and oks[i]:
                P = pos[eo[i]:eo[i + 1]]
                res = _fast_rows(ix, msgs_l[i], P, int(seq_lens[i]), T, max_length, window_context)
            if res is None:
                st["fallback_trajectories"] += 1
                res = _slow_trajectory(ix.tok, msgs_l[i], T, ix.layout, max_length, window_context)
            rows.extend(res)
    out = _attach(df, rows)
    st["truncated_steps"] = int(out["truncated"].sum()) if len(out) else 0
    if max_length is not None and len(out):
        st["overlong_steps"] = int((out["seq_len"] > max_length).sum())
    if len(out):
        st["windows"] = int(out.select(pl.struct("traj_id", "window").n_unique()).item())
    if stats is not None:
        stats.update(st)
    return out


def _fast_rows(ix: _Indexer, msgs, P: np.ndarray, seq_len: int, T: int, max_length: int | None,
               window_context: float = 1.0):
    """Per-step rows from the full-text positions P (2T+1 prefix ends), or None to fall back."""
    if max_length is None or seq_len <= max_length:
        return [(int(P[2 * t]), int(P[2 * t + 1]), int(P[2 * t + 2]), seq_len, 0, 0, False) for t in range(T)]
    # estimate window lengths from the full encoding (exact when turns tokenise independently) ...
    def shift(j: int) -> int:
        return int(P[2 * j] - P[0])

    def length(j: int, t: int) -> int:
        return int(P[2 * t + 2]) + 1 - shift(j)

    js = window_starts(T, length, max_length, int(P[0]) + 1, window_context)  # the head ends at s_0's last token
    groups: list[tuple[int, int, int]] = []  # (j, first step, last step)
    for t, j in enumerate(js):
        if groups and groups[-1][0] == j:
            groups[-1] = (j, groups[-1][1], t)
        else:
            groups.append((j, t, t))
    # ... and verify each window by indexing its own text
    texts, ends = [], []
    for j, _a, b in groups:
        sp = ix.skel.splice([m["content"] for m in _window_messages(msgs, ix.head, j, b, ix.layout)])
        if sp is None:
            return None
        texts.append(sp[0])
        ends.append(sp[1])
    pos, eo, lens, oks = ix.index_texts(texts, ends)
    rows = []
    for w, (j, a, b) in enumerate(groups):
        if not oks[w]:
            return None
        Pw = pos[eo[w]:eo[w + 1]]
        for t in range(a, b + 1):
            tt = t - j
            est = [int(P[2 * t + k]) - shift(j) for k in range(3)]
            got = [int(Pw[2 * tt + k]) for k in range(3)]
            if est != got:
                return None
            rows.append((*got, int(lens[w]), w, j, j > 0))
    return rows


# --------------------------------------------------------------------------- token ids

def tokenize_trajectories(df: pl.DataFrame, tokenizer_dir_or_obj: Any) -> pl.DataFrame:
    """Token ids of every (traj_id, window) sequence of a table indexed by :func:`add_prefix_positions`.

    Returns columns ``traj_id``, ``window``, ``seq_len`` (i32) and ``input_ids``
    (list[i32]), consistent with the table's positions (same tokenizer and
    ``max_length`` must have been used). Needs the ``window`` and
    ``dropped_turns`` columns.
    """
    from qevolve_cli import _core
    from qevolve_cli.schema import sort_steps

    _check_columns(df)
    for c in ("window", "dropped_turns", "seq_len"):
        if c not in df.columns:
            raise QevolveError(f"<table>: column '{c}': missing (run add_prefix_positions / label --tokenizer first)")
    tok = load_tokenizer(tokenizer_dir_or_obj, require_fast=True)
    lay = layout_of(tok)
    head = lay.head
    skel = _Skeletons(tok, lay)
    df = sort_steps(df)
    offs = _traj_offsets(df)
    cols = {c: df[c].to_list() for c in ("traj_id", "env", "instruction", "observation", "action",
                                         "next_observation", "window", "dropped_turns", "seq_len")}
    keys, texts, lens = [], [], []
    for a, b in zip(offs[:-1], offs[1:], strict=False):
        a, b = int(a), int(b)
        msgs = _messages(cols["env"][a], cols["instruction"][a], cols["observation"][a:b], cols["action"][a:b],
                         cols["next_observation"][a:b], lay)
        t = 0
        T = b - a
        while t < T:
            w, j = cols["window"][a + t], cols["dropped_turns"][a + t]
            last = t
            while last + 1 < T and cols["window"][a + last + 1] == w:
                last += 1
            win = _window_messages(msgs, head, j, last, lay)
            sp = skel.splice([m["content"] for m in win])
            texts.append(sp[0] if sp is not None else _render(tok, win))
            keys.append((cols["traj_id"][a], w))
            lens.append(cols["seq_len"][a + t])
            t = last + 1
    rust = _core.PrefixIndexer(_tokenizer_json(tok))
    ids = pa.array(rust.encode(pa.array(texts, pa.large_string())))
    out = pl.DataFrame({
        "traj_id": [k[0] for k in keys],
        "window": pl.Series([k[1] for k in keys], dtype=pl.Int32),
        "seq_len": pl.Series(lens, dtype=pl.Int32),
    }).with_columns(pl.Series("input_ids", pl.from_arrow(ids)).cast(pl.List(pl.Int32)))
    got = out["input_ids"].list.len()
    if (got != out["seq_len"]).any():
        raise QevolveError("<table>: column 'seq_len': does not match this tokenizer (index with the same tokenizer)")
    return out


# --------------------------------------------------------------------------- recent-turn windows (feature critic)

def turn_windows(df: pl.DataFrame, tokenizer_dir_or_obj: Any, context_turns: int) -> dict[str, Any]:
    """Each step's state as the head plus its last ``context_turns`` turns: sequences and positions.

    The state of step t is ``head + a_j, o_{j+1}, ..., a_{t-1}, o_t`` with ``j = max(0, t - K)`` dropped
    (assistant, user) pairs (K = ``context_turns`` >= 1; the head, as in :func:`truncate`, is the system
    prompt, the in-context example and the task's message with o_0). Two steps of one task whose last K
    turns are the same text get the same token sequence, and so the same frozen features: that is what
    lets a critic pool equal states across trajectories (docs/critic.md, "The feature critic").

    Consecutive steps with the same ``j`` (the first K + 1 steps) share one sequence, as windows do.
    Returns ``sequences`` (list of int64 arrays), ``head_len`` (each sequence's head, in tokens) and, per row
    of ``sort_steps(df)`` order, ``rows`` (the row's index in ``df``), ``s`` / ``sa`` / ``next`` ((sequence,
    position) int64 arrays (N, 2)) where ``next`` is the state of step t + 1 in its own window (for the last
    step: a window of its own, ending at o_T).
    """
    from qevolve_cli.schema import sort_steps

    if context_turns < 1:
        raise QevolveError(f"context_turns: must be >= 1 for turn windows, got {context_turns}")
    _check_columns(df)
    ix = _Indexer(tokenizer_dir_or_obj)
    lay, head = ix.layout, ix.head
    frame = sort_steps(df.with_row_index("_tw_row"))
    offs = _traj_offsets(frame)
    cols = {c: frame[c].to_list() for c in ("env", "instruction", "observation", "action", "next_observation")}
    # per trajectory: groups (j, first step, last step) of steps sharing a window, plus the final state's
    windows: list[list[dict]] = []
    plans: list[tuple[int, int, list[tuple[int, int, int]]]] = []  # (row start, T, groups)
    for a, b in zip(offs[:-1], offs[1:], strict=False):
        a, b = int(a), int(b)
        T = b - a
        msgs = _messages(cols["env"][a], cols["instruction"][a], cols["observation"][a:b], cols["action"][a:b],
                         cols["next_observation"][a:b], lay)
        js = [max(0, t - context_turns) for t in range(T + 1)]  # T: the state after the last step
        groups: list[tuple[int, int, int]] = []
        for t, j in enumerate(js):
            if groups and groups[-1][0] == j:
                groups[-1] = (j, groups[-1][1], t)
            else:
                groups.append((j, t, t))
        for j, _g0, g1 in groups:
            # the window holds steps j .. min(g1, T - 1) through o_{last + 1}; state g1 = T ends at o_T
            windows.append(_window_messages(msgs, head, j, min(g1, T - 1), lay))
        plans.append((a, T, groups))
    texts, ends, slow = [], [], []
    for win in windows:
        sp = ix.skel.splice([m["content"] for m in win])
        slow.append(sp is None)
        texts.append("" if sp is None else sp[0])
        ends.append([] if sp is None else sp[1])
    pos, eo, _lens, oks = ix.index_texts(texts, ends)
    fast = [w for w in range(len(windows)) if not slow[w] and oks[w]]
    fast_ids = pa.array(ix.rust.encode(pa.array([texts[w] for w in fast], pa.large_string()))).to_pylist()
    ids_of = dict(zip(fast, fast_ids, strict=True))
    seqs: list[np.ndarray] = []
    prefix_ends: list[list[int]] = []
    for w, win in enumerate(windows):
        if w in ids_of:
            prefix_ends.append([int(x) for x in pos[eo[w]:eo[w + 1]]])
            seqs.append(np.asarray(ids_of[w], np.int64))
        else:  # the exact slow path: every prefix rendered and tokenised
            n_states = (len(win) - head) // 2  # pairs after the head
            prefix_ends.append([_slow_len(ix.tok, win[: state_end(0, lay) + k + 1]) - 1 for k in range(2 * n_states + 1)])
            seqs.append(np.asarray(ix.tok(_render(ix.tok, win), add_special_tokens=False)["input_ids"], np.int64))
    n = frame.height
    s = np.zeros((n, 2), np.int64)
    sa = np.zeros((n, 2), np.int64)
    nxt = np.zeros((n, 2), np.int64)
    w = 0
    for a, T, groups in plans:
        state_ref: dict[int, tuple[int, int]] = {}
        for j, g0, g1 in groups:
            P = prefix_ends[w]
            for t in range(g0, g1 + 1):
                tt = t - j
                state_ref[t] = (w, P[2 * tt])
                if t < T:
                    sa[a + t] = (w, P[2 * tt + 1])
            w += 1
        for t in range(T):
            s[a + t] = state_ref[t]
            nxt[a + t] = state_ref[t + 1]
    for name, arr in (("s", s), ("sa", sa), ("next", nxt)):
        bad = arr[:, 1] >= np.array([len(seqs[i]) for i in arr[:, 0]], np.int64) if n else np.zeros(0, bool)
        if bad.any():
            raise QevolveError(f"turn windows: a {name} position lies past its sequence (row {int(np.argmax(bad))})")
    head_len = np.array([int(pe[0]) + 1 for pe in prefix_ends], np.int64)  # every window starts with the head
    return {"sequences": seqs, "head_len": head_len, "rows": frame["_tw_row"].to_numpy().astype(np.int64), "s": s,
            "sa": sa, "next": nxt}
