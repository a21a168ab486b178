"""Plain-Python reference implementations (slow loops) that the Rust core must match."""
from __future__ import annotations

import re


def ref_parse_action(text):
    at = text.rfind("Action:")
    if at < 0:
        return None
    line = text[at + len("Action:"):].split("\n", 1)[0].strip()
    return line or None


def ref_weights(lengths, success, temporal=True, success_term=True):
    out = []
    for T, d in zip(lengths, success, strict=True):
        for t in range(1, T + 1):
            term_t = t / T if temporal else 0.0
            term_d = (1.0 if d else 0.0) if success_term else 0.0
            out.append((term_t + term_d) * 0.5 + 0.5)
    return out


def ref_gae(lengths, rewards, values, next_values, dones, gamma, lam, aux=None):
    out = [0.0] * len(rewards)
    start = 0
    for T in lengths:
        adv = 0.0
        for i in reversed(range(start, start + T)):
            nd = 0.0 if dones[i] else 1.0
            r = rewards[i] + (aux[i] if aux is not None else 0.0)
            delta = r + gamma * nd * next_values[i] - values[i]
            adv = delta + gamma * lam * nd * adv
            out[i] = adv
        start += T
    return out


def ref_label(rule, action, obs, nxt):
    cmd = ref_parse_action(action)
    if cmd is None:
        return rule["r_fmt"], "format"
    if any(re.search(p, nxt) for p in rule.get("invalid_patterns", [])):
        return rule["r_inv"], "invalid"
    exempt = any(re.fullmatch(p, cmd) for p in rule.get("repeat_exempt_commands", []))
    if rule.get("repeat_enabled", True) and obs.strip() == nxt.strip() and not exempt:
        return rule["r_repeat"], "repeat"
    return 0.0, "none"


def ref_gigpo(trajs, gamma=0.95, omega=1.0, eps=1e-6, norm="std", episode_stats="trajectories"):
    """GiGPO per step, a plain loop. ``trajs``: one (group key or None, [(observation, reward), ...]) per
    trajectory, in table order. -> (advantage or None per step, anchor-group size per step (0 outside)).

    Conventions of verl-agent's gigpo/core_gigpo.py: torch.std (unbiased, n - 1); a group of one value has
    mean 0 (episode) or the value itself (anchor) and std 1."""
    import math

    def stats(xs, single):
        if len(xs) == 1:
            return single(xs[0]), 1.0
        m = sum(xs) / len(xs)
        return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    def norm_(x, m, s):
        return (x - m) / (s + eps) if norm == "std" else x - m

    rows = []  # (traj index, observation, G, R)
    for ti, (_, steps) in enumerate(trajs):
        R = sum(float(r) for _, r in steps)
        G, g = [0.0] * len(steps), 0.0
        for t in reversed(range(len(steps))):
            g = float(steps[t][1]) + gamma * g
            G[t] = g
        rows += [(ti, o, G[t], R) for t, (o, _) in enumerate(steps)]
    adv, size = [None] * len(rows), [0] * len(rows)
    keys = []
    for k, _ in trajs:
        if k is not None and k not in keys:
            keys.append(k)
    for key in keys:
        members = [ti for ti, (k, _) in enumerate(trajs) if k == key]
        if episode_stats == "trajectories":
            vals = [sum(float(r) for _, r in trajs[ti][1]) for ti in members]
        else:
            vals = [R for ti, _, _, R in rows if ti in members]
        me, se = stats(vals, lambda v: 0.0)
        idx = [i for i, r in enumerate(rows) if r[0] in members]
        for obs in {rows[i][1] for i in idx}:
            a = [i for i in idx if rows[i][1] == obs]
            ms, ss = stats([rows[i][2] for i in a], lambda v: v)
            for i in a:
                adv[i] = norm_(rows[i][3], me, se) + omega * norm_(rows[i][2], ms, ss)
                size[i] = len(a)
    return adv, size
