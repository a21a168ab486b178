"""Token-budget ("dynamic") batching: item indices -> micro-batches -> optimiser steps. Pure, no torch."""
from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any


def token_budget_batches(lengths: Sequence[int], max_tokens: int, max_seqs: int = 0, shuffle: bool = True,
                         seed: int = 0) -> list[list[int]]:
    """Dynamic batching: group item indices into micro-batches whose *padded* size fits a token budget.

    Items are sorted by length (so padding is small), packed greedily so that
    ``len(batch) * max_len(batch) <= max_tokens`` (an item longer than the
    budget goes alone) and ``len(batch) <= max_seqs`` (0 = no cap); the batch
    order is then shuffled with ``seed``. Every index appears exactly once.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        ln = max(1, int(lengths[i]))
        new_max = max(cur_max, ln)
        if cur and ((new_max * (len(cur) + 1) > max_tokens) or (max_seqs and len(cur) >= max_seqs)):
            batches.append(cur)
            cur, cur_max = [], 0
            new_max = ln
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    if shuffle:
        random.Random(seed).shuffle(batches)
    return batches


def group_steps(micro_batches: list[Any], grad_accum: int) -> list[list[Any]]:
    """Group micro-batches into optimiser steps of ``grad_accum`` micro-batches (last may be shorter)."""
    g = max(1, grad_accum)
    return [micro_batches[i : i + g] for i in range(0, len(micro_batches), g)]

