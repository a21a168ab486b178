"""``--shard I/N``: split one run's work into N disjoint, deterministic blocks (one per node or process).

Pure functions, shared by ``qevolve expert`` (blocks of tasks) and ``qevolve rollout`` / ``qevolve eval``
(blocks of (task, sample) pairs). Shard ``I`` of ``N`` is 0-based; the N blocks are contiguous, in
order, cover everything exactly once and differ in size by at most one, so concatenating the shards'
outputs in shard order gives the unsharded order back.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``N >= 1`` and ``0 <= I < N``; a ``ValueError`` naming the problem otherwise."""
    parts = str(text).split("/")
    try:
        if len(parts) != 2:
            raise ValueError
        i, n = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(f"expected I/N (e.g. 0/4), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"need N >= 1 and 0 <= I < N, got {text!r}")
    return i, n


def block(items: Sequence[T], i: int, n: int) -> list[T]:
    """The ``i``-th of ``n`` contiguous blocks of ``items`` whose sizes differ by at most one (the first
    ``len(items) % n`` blocks are one longer)."""
    base, extra = divmod(len(items), n)
    start = i * base + min(i, extra)
    return list(items[start:start + base + (1 if i < extra else 0)])


def select_shard(items: Sequence[T], shard: str, option: str = "--shard") -> list[T]:
    """Shard ``I/N`` of ``items`` (:func:`block`); a bad ``shard`` is a one-line ``QevolveError`` naming ``option``."""
    from qevolve_cli.errors import QevolveError

    try:
        i, n = parse_shard(shard)
    except ValueError as e:
        raise QevolveError(f"{option}: {e}") from None
    return block(items, i, n)


def shard_pairs(tasks: Sequence[Any], n_per_task: int, shard: str | None = None, *,
                whole_tasks: bool = False) -> list[tuple[Any, int]]:
    """The (task, sample) pairs shard ``I/N`` plays, in the order of the unsharded run's table.

    That table lists the pairs sample-major: ``(t0, 0), (t1, 0), ..., (t0, 1), (t1, 1), ...``. A shard
    is one contiguous block of that list, so the shards' tables concatenated in shard order are the
    unsharded table, row for row. ``whole_tasks=True`` (``eval --best-of``: a task's samples are
    compared with each other) takes a block of the *tasks* instead, every sample of each; the shards
    are still disjoint and cover every pair, and each shard keeps the sample-major order of its tasks.
    ``shard`` None or ``""``: every pair.
    """
    if not shard:
        return [(t, s) for s in range(n_per_task) for t in tasks]
    i, n = parse_shard(shard)
    if whole_tasks:
        mine = block(tasks, i, n)
        return [(t, s) for s in range(n_per_task) for t in mine]
    return block([(t, s) for s in range(n_per_task) for t in tasks], i, n)
