"""Scoring a table with a trained critic, and the paper's alternative process rewards.

:func:`score_table` adds, for every step, with ONE forward per adapter per
trajectory (trajectories batched, right-padded):

* ``value``      = V(s_t)      (value adapter, pooled at ``pos_s``)
* ``next_value`` = V(s_{t+1})  (value adapter, pooled at ``pos_next``); 0 after a terminal step
* ``q_value``    = min(Qbar1, Qbar2)(s_t, a_t)  (delayed Q adapter and heads, pooled at ``pos_sa``), the
  Q used by IQL's advantage Q - V

GAE itself (docs/critic.md) is in the Rust core (``qevolve_cli.core.gae``); the process
reward variants (``gae``, ``gae_aux``, ``td``, ``q_minus_v``) are
:func:`qevolve_cli.rewards.process_rewards`, called by ``qevolve label``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from qevolve_cli.critic.data import build_items, collate
from qevolve_cli.tokenizer import load_tokenizer, pad_id_of


def score_table(df: pl.DataFrame, critic: Any, tokenizer: Any = None, batch_size: int = 8, device: str = "auto",
                with_q: bool = True, max_length: int | None = None, progress: Any = None,
                feature_cache: str | Path | None = None) -> pl.DataFrame:
    """``df`` with ``value``, ``next_value`` (and ``q_value``) columns; row order kept.

    ``critic``: a critic directory (``qevolve critic --out``) or a loaded :class:`CriticModel`.
    ``tokenizer``: defaults to the one saved in the critic directory. Positions come from the
    table's ``pos_*`` columns when present (they must match this tokenizer), else are computed.
    ``max_length``: the token budget of a scored sequence; default the one the critic was trained with
    (``critic.json``, with its ``window_context``), so that a long trajectory is scored in the windows
    of recent turns the critic learnt on (:func:`qevolve_cli.critic.data.build_items`); a critic saved
    without it (older versions) scores whole trajectories. A window still longer than the budget is
    forwarded whole.
    """

    from qevolve_cli.critic.feature_critic import FeatureCritic, is_feature_critic
    from qevolve_cli.critic.model import CriticModel

    if isinstance(critic, FeatureCritic) or (not isinstance(critic, CriticModel) and is_feature_critic(critic)):
        return _score_features(df, critic, tokenizer, device, with_q, feature_cache)
    model = critic if isinstance(critic, CriticModel) else CriticModel.load(critic, device=device)
    if tokenizer is None:
        if isinstance(critic, CriticModel):
            tokenizer = load_tokenizer(critic.base_path, require_chat_template=True)
        else:
            tokenizer = load_tokenizer(critic, require_chat_template=True)
    if max_length is None:
        max_length = model.max_length
    items = build_items(df, tokenizer, max_length=max_length, time_column=model.time_column,
                        window_context=model.window_context)
    dev = next(model.heads.parameters()).device
    outs = ("value", "next_value", "q_value") if with_q else ("value", "next_value")
    got = score_items(model, items, df.height, pad_id_of(tokenizer), dev, batch_size, outs, progress)
    value, next_value = got["value"], got["next_value"]
    done = df["done"].to_numpy().astype(bool)
    next_value[done] = 0.0  # V(terminal) = 0
    cols = [pl.Series("value", value, pl.Float32), pl.Series("next_value", next_value, pl.Float32)]
    if with_q:
        cols.append(pl.Series("q_value", got["q_value"], pl.Float32))
    return df.with_columns(cols)


def _score_features(df: pl.DataFrame, critic: Any, tokenizer: Any, device: str, with_q: bool,
                    feature_cache: str | Path | None) -> pl.DataFrame:
    """:func:`score_table` for a feature critic (``kind: features``): the table's features (read from
    ``feature_cache`` when the critic stage made them), then the heads."""
    from qevolve_cli.critic.feature_critic import FeatureCritic
    from qevolve_cli.device import resolve_device

    fc = critic if isinstance(critic, FeatureCritic) else FeatureCritic.load(critic)
    if tokenizer is None:
        tokenizer = load_tokenizer(critic if not isinstance(critic, FeatureCritic) else fc.base_path,
                                   require_chat_template=True)
    feats, _info = fc.features(df, tokenizer, cache_dir=feature_cache, device=resolve_device(device))
    got = fc.score_features(feats, df)
    next_value = got["next_value"]
    next_value[df["done"].to_numpy().astype(bool)] = 0.0  # V(terminal) = 0
    cols = [pl.Series("value", got["value"], pl.Float32), pl.Series("next_value", next_value, pl.Float32)]
    if with_q:
        cols.append(pl.Series("q_value", got["q_value"], pl.Float32))
    return df.with_columns(cols)


SCORES = ("value", "next_value", "q1", "q2", "q_value")


def score_items(model: Any, items: list, n_rows: int, pad_id: int, device: Any, batch_size: int,
                outputs: tuple[str, ...] = ("value", "next_value", "q_value"), progress: Any = None
                ) -> dict[str, np.ndarray]:
    """Critic outputs at every step of ``items`` (no gradients): arrays of length ``n_rows`` indexed
    like the source frame (rows of other items stay 0).

    ``outputs`` among :data:`SCORES`: ``value`` V(s_t) and ``next_value`` V(s_{t+1}) (value adapter,
    pooled at ``pos_s`` / ``pos_next``), ``q1``/``q2`` (online Q adapter and heads at ``pos_sa``),
    ``q_value`` min(Qbar1, Qbar2) (delayed Q adapter and heads). One forward per adapter needed per
    batch of trajectories of similar length. ``next_value`` is not zeroed after terminal steps.
    """
    import torch

    bad = set(outputs) - set(SCORES)
    if bad:
        raise ValueError(f"unknown critic outputs {sorted(bad)} (known: {SCORES})")
    cols = {k: np.zeros(n_rows, np.float32) for k in outputs}
    order = sorted(range(len(items)), key=lambda i: len(items[i].input_ids))  # similar lengths together
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            b = collate(items, [(i, np.arange(items[i].n_steps)) for i in idx], pad_id, device)
            got = {}
            if "value" in cols or "next_value" in cols:
                h_s, h_next = model.pooled("value", b.input_ids, b.attention_mask, b.pos_s, b.pos_next)
                got["value"], got["next_value"] = model.head("v", h_s, b.t), model.head("v", h_next, model.next_time(b.t))
            if "q1" in cols or "q2" in cols:
                (h_sa,) = model.pooled("q", b.input_ids, b.attention_mask, b.pos_sa)
                got["q1"], got["q2"] = model.head("q1", h_sa, b.t), model.head("q2", h_sa, b.t)
            if "q_value" in cols:
                (h_sat,) = model.pooled("q_target", b.input_ids, b.attention_mask, b.pos_sa)
                got["q_value"] = torch.minimum(model.head("q1_target", h_sat, b.t), model.head("q2_target", h_sat, b.t))
            for r, (i, steps) in enumerate(b.steps):
                rows = items[i].rows[steps]
                for k in cols:
                    cols[k][rows] = got[k][r, :len(steps)].float().cpu().numpy()
            if progress is not None:
                progress(len(idx))
    return cols


# ---------------------------------------------------------------- loading

def load_critic(critic_dir: str | Path, device: str = "auto"):
    """(CriticModel, tokenizer) of a saved critic directory."""
    from qevolve_cli.critic.model import CriticModel

    return CriticModel.load(critic_dir, device=device), load_tokenizer(critic_dir, require_chat_template=True)
