"""Exact dataset-constrained (weighted) IQL on a finite MDP: the reference of the critic's correctness test
and the ``tabular_iql`` value source of ``qevolve label`` (envs/oracle.py).

The fixed point of the critic's two losses on a tabular dataset of
transitions (s, a, r, s', d) with weights w:

* L_Q = sum_t w_t (Q(s_t, a_t) - y_t)^2, y_t = r_t + gamma (1 - d_t) V(s'_t)
  -> Q(s, a) = the w-weighted mean of y over the dataset transitions from (s, a);
* L_V = sum_t w_t L2^m(Q(s_t, a_t) - V(s_t))
  -> V(s) = the w-weighted m-expectile of Q(s, a_t) over the dataset transitions from s
  (only dataset actions: no max over out-of-distribution actions).

:func:`tabular_iql` iterates both to convergence (a gamma-contraction); the
expectile is solved exactly (:func:`expectile`). States that never appear as
a transition's source have V = 0 (terminal).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

Transition = tuple[Hashable, Hashable, float, Hashable, bool]  # (s, a, r, s', done)


def expectile(values: Sequence[float], weights: Sequence[float], m: float) -> float:
    """argmin_v sum_i w_i |m - 1(x_i < v)| (x_i - v)^2, exactly.

    For a fixed split of the sorted values into {x < v} and {x >= v} the
    minimiser is a closed-form weighted mean; the objective is strictly convex,
    so its minimiser is the best of these candidates.
    """
    if not values:
        raise ValueError("expectile of an empty set")
    pairs = sorted(zip(values, weights, strict=True))
    xs = [float(x) for x, _ in pairs]
    ws = [float(w) for _, w in pairs]

    def objective(v: float) -> float:
        return sum(w * (1 - m if x < v else m) * (x - v) ** 2 for x, w in zip(xs, ws, strict=True))

    best, best_obj = xs[0], float("inf")
    for k in range(len(xs) + 1):  # the first k values lie below v
        num = sum(w * (1 - m) * x for x, w in zip(xs[:k], ws[:k], strict=True))
        num += sum(w * m * x for x, w in zip(xs[k:], ws[k:], strict=True))
        den = sum(w * (1 - m) for w in ws[:k]) + sum(w * m for w in ws[k:])
        if den <= 0:
            continue
        v = num / den
        o = objective(v)
        if o < best_obj:
            best, best_obj = v, o
    return best


def tabular_iql(transitions: Sequence[Transition], gamma: float, m: float,
                weights: Sequence[float] | None = None, tol: float = 1e-12,
                max_iter: int = 100_000) -> tuple[dict[Hashable, float], dict[tuple[Hashable, Hashable], float]]:
    """(V, Q) of weighted IQL restricted to the dataset's (s, a) pairs; see the module docstring."""
    w = list(weights) if weights is not None else [1.0] * len(transitions)
    if len(w) != len(transitions):
        raise ValueError("one weight per transition")
    by_sa: dict[tuple[Hashable, Hashable], list[int]] = {}
    by_s: dict[Hashable, list[int]] = {}
    for i, (s, a, _r, _s2, _d) in enumerate(transitions):
        by_sa.setdefault((s, a), []).append(i)
        by_s.setdefault(s, []).append(i)
    V: dict[Hashable, float] = {s: 0.0 for s in by_s}
    Q: dict[tuple[Hashable, Hashable], float] = {sa: 0.0 for sa in by_sa}
    for _ in range(max_iter):
        newQ = {}
        for sa, idx in by_sa.items():
            tot = sum(w[i] for i in idx)
            y = sum(w[i] * (transitions[i][2] + (0.0 if transitions[i][4] else gamma * V.get(transitions[i][3], 0.0)))
                    for i in idx)
            newQ[sa] = y / tot
        newV = {s: expectile([newQ[(s, transitions[i][1])] for i in idx], [w[i] for i in idx], m)
                for s, idx in by_s.items()}
        delta = max(max(abs(newQ[k] - Q[k]) for k in Q), max(abs(newV[k] - V[k]) for k in V))
        Q, V = newQ, newV
        if delta < tol:
            break
    return V, Q
