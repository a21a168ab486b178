"""Critic data: one tokenised sequence per item, its steps' prefix end positions and targets.

Each trajectory is rendered once with the model's chat template (the one
transcript builder, via :mod:`qevolve_cli.prefix`) and tokenised once (one
sequence per window when prefix indexing had to truncate it). The per-step
positions ``pos_s``, ``pos_sa``, ``pos_next`` (index of the last token of the
state / state-action / next-state prefix; contract in the
:mod:`qevolve_cli.prefix` docstring) come from the table when
``qevolve label --tokenizer`` added them, else from
:func:`qevolve_cli.prefix.add_prefix_positions`.

Batches (:func:`collate`) are right-padded, so the causal hidden states at real
positions do not depend on the padding; each row is one trajectory truncated
to the longest next-state prefix among its sampled steps (paper's Algorithm
"Critic optimization"). ``per_step=True`` builds the naive layout instead
(one row per sampled step, truncated to that step's own next-state prefix):
the benchmark's baseline.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from qevolve_cli import schema
from qevolve_cli.errors import QevolveError, TableError


@dataclass
class TrajItem:
    """One trajectory: token ids plus per-step arrays (length T = its number of steps)."""

    traj_id: str
    input_ids: np.ndarray  # int64 (L,)
    pos_s: np.ndarray  # int64 (T,)
    pos_sa: np.ndarray
    pos_next: np.ndarray
    rows: np.ndarray  # int64 (T,) row index of each step in the source frame
    reward: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # r used in the TD target
    done: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    weight: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    usable: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # step fits max_length
    step: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # the table's step index t of each step

    @property
    def n_steps(self) -> int:
        return len(self.rows)


def render_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a rendered chat (the chat template's text, encoded without extra special tokens)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


WINDOW_COLUMNS = ("pos_s", "pos_sa", "pos_next", "seq_len", "window", "dropped_turns")


def build_items(df: pl.DataFrame, tokenizer: Any, max_length: int | None = None,
                source: Any = None, time_column: str = "step", window_context: float = 1.0) -> list[TrajItem]:
    """One item per tokenised sequence: a trajectory, or one window of it when prefix indexing truncated it.

    Positions come from the table when ``qevolve label --tokenizer`` indexed it (columns
    pos_s/pos_sa/pos_next/seq_len/window/dropped_turns; they must match ``tokenizer``) and its
    sequences fit ``max_length``; else (no positions, or a table indexed with a larger budget or
    none, as `qevolve evolve`'s label stage does) :func:`qevolve_cli.prefix.add_prefix_positions`
    computes them with ``max_length``: a trajectory longer than that is split into windows of recent
    turns (``window_context``: CriticConfig), so every step is trained on. Token ids come from
    :func:`qevolve_cli.prefix.tokenize_trajectories` (each trajectory tokenised once). Steps whose
    window is still longer than ``max_length`` (one turn that does not fit) are marked not ``usable``
    (training skips them; scoring forwards them anyway). ``TrajItem.rows`` index the rows of ``df``.
    ``TrajItem.step`` holds the column ``time_column`` (``step``, or ``steps_left`` for a critic whose heads
    take the steps left, CriticConfig.time_input).
    """
    from qevolve_cli.prefix import OUT_COLUMNS, add_prefix_positions, tokenize_trajectories

    if time_column not in df.columns:
        raise TableError(source, time_column, "missing column: the critic's time input reads it (time_input; "
                                              "qevolve rollout writes it, label --step-limit N fills it; "
                                              "docs/critic.md, 'Time input')")
    if df[time_column].null_count():
        hint = (" (rows without a step limit, such as expert demonstrations: label with --step-limit N, the "
                "self-play episodes' limit; docs/critic.md, 'Time input')") if time_column == "steps_left" else ""
        raise TableError(source, time_column, f"{df[time_column].null_count()} null values{hint}")

    frame = df.with_row_index("_row")
    indexed = all(c in df.columns for c in WINDOW_COLUMNS)
    if indexed and max_length is not None and (df["seq_len"].max() or 0) > max_length:
        indexed = False  # indexed without a budget (or a larger one): window the long trajectories here
    if not indexed:
        frame = add_prefix_positions(frame.drop([c for c in OUT_COLUMNS if c in frame.columns]), tokenizer,
                                     max_length=max_length, window_context=window_context)
    else:
        for c in WINDOW_COLUMNS:
            n = frame[c].null_count()
            if n:
                raise TableError(source, c, f"{n} null values")
    try:
        seqs = tokenize_trajectories(frame, tokenizer)
    except QevolveError as e:
        raise TableError(source, "seq_len", f"{e}".split(": ", 2)[-1]) from None
    ids_of = {(t, int(w)): np.asarray(ids, np.int64)
              for t, w, ids in zip(seqs["traj_id"].to_list(), seqs["window"].to_list(),
                                   seqs["input_ids"].to_list(), strict=True)}
    limit = max_length or 10**12
    frame = frame.sort(["traj_id", "step"], maintain_order=True)
    items: list[TrajItem] = []
    for (tid, w), part in frame.group_by(["traj_id", "window"], maintain_order=True):
        ids = ids_of[(tid, int(w))]
        s, sa, nx = (part[c].to_numpy().astype(np.int64) for c in ("pos_s", "pos_sa", "pos_next"))
        bad = (nx >= len(ids)) | (s < 0) | ~((s < sa) & (sa < nx))
        if bad.any():
            t = int(part["step"][int(np.argmax(bad))])
            raise TableError(source, "pos_next", f"positions of trajectory {tid!r} step {t} do not fit its "
                             f"{len(ids)} tokens with this tokenizer: index the table with the critic's tokenizer")
        items.append(TrajItem(
            traj_id=str(tid) if int(w) == 0 else f"{tid}#w{int(w)}",
            input_ids=ids, pos_s=s, pos_sa=sa, pos_next=nx,
            rows=part["_row"].to_numpy().astype(np.int64),
            usable=np.full(part.height, len(ids) <= limit),
            step=part[time_column].to_numpy().astype(np.int64),
        ))
    return items


def attach_targets(items: list[TrajItem], df: pl.DataFrame, cfg: Any, source: Any = None) -> None:
    """Set reward (r_env [+ r_aux]), done and weight w_t of every item from ``df`` and the config."""
    need = ["reward_aux"] if cfg.shaping else []
    for c in need:
        if c not in df.columns:
            raise TableError(source, c, "missing column: label the table first (qevolve label), or set shaping: false")
    reward = fit_reward(df, cfg)
    done = df["done"].to_numpy().astype(bool)
    weight = step_weights_for(df, cfg)
    for it in items:
        it.reward = reward[it.rows]
        it.done = done[it.rows]
        it.weight = weight[it.rows]


def fit_reward(df: pl.DataFrame, cfg: Any) -> np.ndarray:
    """The reward the critic fits per row: r_env, plus r_aux with ``cfg.shaping``."""
    reward = df["reward_env"].to_numpy().astype(np.float32)
    if cfg.shaping:
        reward = reward + df["reward_aux"].to_numpy().astype(np.float32)
    return reward


def step_weights_for(df: pl.DataFrame, cfg: Any) -> np.ndarray:
    """w_t per row: ones (unweighted IQL), the table's ``weight`` (both terms), or recomputed with terms dropped."""
    if not cfg.weighted:
        return np.ones(df.height, np.float32)
    if cfg.weight_temporal and cfg.weight_success and "weight" in df.columns:
        return df["weight"].to_numpy().astype(np.float32)
    from qevolve_cli import core

    order = df.with_row_index("_row").sort(["traj_id", "step"], maintain_order=True)
    offs = core.offsets(order)
    success = core.trajectory_success(offs, order["reward_env"])
    w = core.step_weights(offs, success, order.height, cfg.weight_temporal, cfg.weight_success).to_numpy()
    out = np.empty(df.height, np.float32)
    out[order["_row"].to_numpy()] = w
    return out


def load_table(data: Any, source: Any = None) -> tuple[pl.DataFrame, Any]:
    """A validated frame from a path or a frame; failed trajectories (non-null ``error``) dropped."""
    if isinstance(data, pl.DataFrame):
        df = schema.validate(data, source)
    else:
        source = data
        df = schema.read_table(data)
    df = schema.drop_failed(df)
    if df.height == 0:
        raise TableError(source, "error", "every trajectory is marked failed: nothing to train on")
    return df, source


@dataclass
class Batch:
    """Padded tensors of one batch. Per-step tensors are (B, K); ``step_mask`` marks real steps."""

    input_ids: Any  # (B, L) long
    attention_mask: Any  # (B, L) long
    pos_s: Any  # (B, K) long
    pos_sa: Any
    pos_next: Any
    reward: Any  # (B, K) float
    done: Any  # (B, K) float
    weight: Any  # (B, K) float
    step_mask: Any  # (B, K) bool
    steps: list[tuple[int, np.ndarray]]  # (item index, step indices) per row
    t: Any = None  # (B, K) float: TrajItem.step of each state (the heads' time input; CriticModel.next_time for s')

    @property
    def n_steps(self) -> int:
        return int(self.step_mask.sum())


def collate(items: list[TrajItem], picks: list[tuple[int, np.ndarray]], pad_id: int, device: Any = "cpu",
            per_step: bool = False, upto: str = "pos_next") -> Batch:
    """Pad the chosen steps of the chosen items into a batch.

    ``picks`` = [(item index, sorted step indices)]. Each row's tokens are cut
    after the largest ``upto`` position of its steps (``pos_next`` for
    training, ``pos_sa`` when next states are not needed). ``per_step`` gives
    one row per step (naive baseline).
    """
    import torch

    rows: list[tuple[int, np.ndarray]] = []
    for i, idx in picks:
        if per_step:
            rows.extend((i, np.asarray([t])) for t in idx)
        else:
            rows.append((i, np.asarray(idx)))
    rows = [(i, idx) for i, idx in rows if len(idx)]
    if not rows:
        raise QevolveError("critic: a batch has no usable steps")
    B = len(rows)
    K = max(len(idx) for _, idx in rows)
    lengths = [int(getattr(items[i], upto)[idx].max()) + 1 for i, idx in rows]
    L = max(lengths)
    ids = np.full((B, L), pad_id, np.int64)
    att = np.zeros((B, L), np.int64)
    per = {k: np.zeros((B, K), np.int64) for k in ("pos_s", "pos_sa", "pos_next")}
    fl = {k: np.zeros((B, K), np.float32) for k in ("reward", "done", "weight", "t")}
    mask = np.zeros((B, K), bool)
    for b, ((i, idx), n) in enumerate(zip(rows, lengths, strict=True)):
        it = items[i]
        ids[b, :n] = it.input_ids[:n]
        att[b, :n] = 1
        k = len(idx)
        for name in per:
            # positions beyond the cut (pos_next when cutting at pos_sa) clamp to the last real token
            per[name][b, :k] = np.minimum(getattr(it, name)[idx], n - 1)
        fl["reward"][b, :k] = it.reward[idx] if len(it.reward) else 0.0
        fl["done"][b, :k] = it.done[idx] if len(it.done) else 0.0
        fl["weight"][b, :k] = it.weight[idx] if len(it.weight) else 1.0
        fl["t"][b, :k] = it.step[idx] if len(it.step) else idx
        mask[b, :k] = True
    t = lambda a, dt: torch.as_tensor(a, dtype=dt, device=device)  # noqa: E731
    return Batch(
        input_ids=t(ids, torch.long), attention_mask=t(att, torch.long),
        pos_s=t(per["pos_s"], torch.long), pos_sa=t(per["pos_sa"], torch.long),
        pos_next=t(per["pos_next"], torch.long),
        reward=t(fl["reward"], torch.float32), done=t(fl["done"], torch.float32),
        weight=t(fl["weight"], torch.float32), step_mask=t(mask, torch.bool), steps=rows,
        t=t(fl["t"], torch.float32),
    )


def sample_steps(item: TrajItem, k: int, rng: np.random.Generator) -> np.ndarray:
    """K usable steps of a trajectory without replacement, sorted (all usable steps when k = 0 or k >= T)."""
    usable = np.flatnonzero(item.usable)
    if k <= 0 or k >= len(usable):
        return usable
    return np.sort(rng.choice(usable, size=k, replace=False))
