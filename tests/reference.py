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
