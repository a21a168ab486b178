"""Scoring a table with a trained critic, and the paper's alternative process rewards.

:func:`score_table` adds, for every step, with ONE forward per adapter per
trajectory (trajectories batched, right-padded):

* ``value``      = V(s_t)      (value adapter, pooled at ``pos_s``)
* ``next_value`` = V(s_{t+1})  (value adapter, pooled at ``pos_next``); 0 after a terminal step
* ``q_value``    = min(Qbar1, Qbar2)(s_t, a_t)  (delayed Q adapter and heads, pooled at ``pos_sa``), the
  Q used by IQL's advantage Q - V

GAE itself (docs/critic.md) is in the Rust core (``qevolve_cli.core.gae``); the process
reward variants (``gae``, ``gae_aux``, ``td``, ``q_minus_v``) are
:func:`qevolve_cli.labeling.process_rewards`, called by ``qevolve label``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from qevolve_cli.critic.data import build_items, collate


def score_table(df: pl.DataFrame, critic: Any, tokenizer: Any = None, batch_size: int = 8, device: str = "auto",
                with_q: bool = True, max_length: int | None = None, progress: Any = None) -> pl.DataFrame:
    """``df`` with ``value``, ``next_value`` (and ``q_value``) columns; row order kept.

    ``critic``: a critic directory (``qevolve critic --out``) or a loaded :class:`CriticModel`.
    ``tokenizer``: defaults to the one saved in the critic directory. Positions come from the
    table's ``pos_*`` columns when present (they must match this tokenizer), else are computed.
    Steps beyond ``max_length`` tokens are still scored (the whole trajectory is forwarded).
    """
    import torch

    from qevolve_cli.critic.model import CriticModel
    from qevolve_cli.critic.trainer import load_tokenizer, pad_id_of

    model = critic if isinstance(critic, CriticModel) else CriticModel.load(critic, device=device)
    if tokenizer is None:
        if isinstance(critic, CriticModel):
            tokenizer = load_tokenizer(critic.base_path)
        else:
            tokenizer = load_tokenizer(critic)
    items = build_items(df, tokenizer, max_length=None)
    dev = next(model.heads.parameters()).device
    value = np.zeros(df.height, np.float32)
    next_value = np.zeros(df.height, np.float32)
    q_value = np.zeros(df.height, np.float32)
    order = sorted(range(len(items)), key=lambda i: len(items[i].input_ids))  # similar lengths together
    pad = pad_id_of(tokenizer)
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            picks = [(i, np.arange(items[i].n_steps)) for i in idx]
            b = collate(items, picks, pad, dev)
            h_s, h_next = model.pooled("value", b.input_ids, b.attention_mask, b.pos_s, b.pos_next)
            v, vn = model.head("v", h_s), model.head("v", h_next)
            if with_q:
                (h_sa,) = model.pooled("q_target", b.input_ids, b.attention_mask, b.pos_sa)
                q = torch.minimum(model.head("q1_target", h_sa), model.head("q2_target", h_sa))
            for r, (i, steps) in enumerate(b.steps):
                rows = items[i].rows[steps]
                k = len(steps)
                value[rows] = v[r, :k].cpu().numpy()
                next_value[rows] = vn[r, :k].cpu().numpy()
                if with_q:
                    q_value[rows] = q[r, :k].cpu().numpy()
            if progress is not None:
                progress(len(idx))
    done = df["done"].to_numpy().astype(bool)
    next_value[done] = 0.0  # V(terminal) = 0
    cols = [pl.Series("value", value, pl.Float32), pl.Series("next_value", next_value, pl.Float32)]
    if with_q:
        cols.append(pl.Series("q_value", q_value, pl.Float32))
    return df.with_columns(cols)


# ---------------------------------------------------------------- process rewards (pure)

def load_critic(critic_dir: str | Path, device: str = "auto"):
    """(CriticModel, tokenizer) of a saved critic directory."""
    from qevolve_cli.critic.model import CriticModel
    from qevolve_cli.critic.trainer import load_tokenizer

    return CriticModel.load(critic_dir, device=device), load_tokenizer(critic_dir)
