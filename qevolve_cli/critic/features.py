"""Frozen backbone features of a table's states, computed once and cached (the feature critic's input).

One no-grad pass of the frozen base model over the table's sequences writes, for every step, the hidden
state of one layer at three positions: the end of the state ``s_t`` (``h_s``), of the state-action
``(s_t, a_t)`` (``h_sa``) and of the next state ``s_{t+1}`` (``h_next``). What a state's sequence holds is
the *view* (``context_turns``):

* ``0``: the whole transcript (the LoRA critic's input; long trajectories in the windows of
  :func:`qevolve_cli.critic.data.build_items`), one forward per trajectory;
* ``K >= 1``: the head (system prompt, example, task with o_0) plus the last K turns
  (:func:`qevolve_cli.prefix.turn_windows`), one forward per step window. Equal recent text gives equal
  features, so a critic on them pools equal states across trajectories.

The features are cached in ``cache_dir`` under a key of the table's content (the columns the sequences are
made of), the model's weights, the layer and the view (:func:`feature_key`), so a second run on the same
table (the critic stage, then ``label --critic``) reads them back instead of running the backbone again.
The cache file is written atomically (safetensors).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from qevolve_cli.errors import QevolveError

FEATURE_FORMAT = "qevolve-features/1"
TEXT_COLUMNS = ("traj_id", "env", "step", "instruction", "observation", "action", "next_observation")


def table_fingerprint(df: pl.DataFrame) -> str:
    """sha256 of the columns a state's sequence is made of, in the table's row order."""
    h = hashlib.sha256()
    for c in TEXT_COLUMNS:
        if c in df.columns:
            h.update(c.encode())
            h.update("\x1f".join("\0" if x is None else str(x) for x in df[c].to_list()).encode())
    return h.hexdigest()


def model_fingerprint(model_dir: str | Path) -> str:
    """sha256 of a model directory's config and weight files (their bytes; weights over 64 MiB by size and the
    first and last MiB, which is enough to tell checkpoints apart and costs no full read)."""
    d = Path(model_dir)
    h = hashlib.sha256()
    files = sorted(p for p in d.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".bin"))
    for p in files:
        if p.name.startswith("tokenizer") or p.name in ("special_tokens_map.json", "chat_template.json"):
            continue
        h.update(p.name.encode())
        size = p.stat().st_size
        h.update(str(size).encode())
        with p.open("rb") as f:
            if size <= 64 << 20:
                h.update(f.read())
            else:
                h.update(f.read(1 << 20))
                f.seek(size - (1 << 20))
                h.update(f.read())
    return h.hexdigest()


def feature_key(table_fp: str, model_fp: str, layer: int, context_turns: int, max_length: int | None,
                window_context: float, dtype: str) -> str:
    spec = {"format": FEATURE_FORMAT, "table": table_fp, "model": model_fp, "layer": layer,
            "context_turns": context_turns, "max_length": max_length if context_turns == 0 else None,
            "window_context": window_context if context_turns == 0 else None, "dtype": dtype}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:24]


def state_sequences(df: pl.DataFrame, tokenizer: Any, context_turns: int, max_length: int | None,
                    window_context: float) -> dict[str, Any]:
    """Sequences and, per row of ``df``, the (sequence, position) of s_t, (s_t, a_t) and s_{t+1}.

    Returns ``sequences`` (list of int64 arrays) and ``s``, ``sa``, ``next`` ((n_rows, 2) int64, indexed by
    ``df``'s row order)."""
    n = df.height
    if context_turns >= 1:
        from qevolve_cli.prefix import turn_windows

        tw = turn_windows(df, tokenizer, context_turns)
        out = {k: np.zeros((n, 2), np.int64) for k in ("s", "sa", "next")}
        for k in out:
            out[k][tw["rows"]] = tw[k]
        return {"sequences": tw["sequences"], "head_len": tw["head_len"], **out}
    from qevolve_cli.critic.data import build_items
    from qevolve_cli.prefix import OUT_COLUMNS

    # positions computed here with this tokenizer (fast): a table indexed with another tokenizer cannot mislead
    plain = df.drop([c for c in OUT_COLUMNS if c in df.columns])
    items = build_items(plain, tokenizer, max_length, time_column="step", window_context=window_context)
    out = {k: np.zeros((n, 2), np.int64) for k in ("s", "sa", "next")}
    head: dict[str, int] = {}  # a trajectory's head (up to o_0) ends at step 0's pos_s, in each of its windows
    for it in items:
        if it.traj_id.split("#w")[0] not in head and len(it.step) and "#w" not in it.traj_id:
            head[it.traj_id] = int(it.pos_s[0]) + 1
    for i, it in enumerate(items):
        for k, pos in (("s", it.pos_s), ("sa", it.pos_sa), ("next", it.pos_next)):
            out[k][it.rows, 0] = i
            out[k][it.rows, 1] = pos
    head_len = np.array([head.get(it.traj_id.split("#w")[0], 0) for it in items], np.int64)
    return {"sequences": [it.input_ids for it in items], "head_len": head_len, **out}


def resolve_layer(layer: int, n_layers: int) -> int:
    """Index into ``output_hidden_states`` (0 = embeddings, n_layers = the last layer after the final norm)."""
    idx = layer if layer >= 0 else n_layers + 1 + layer
    if not 0 <= idx <= n_layers:
        raise QevolveError(f"feature_layer: {layer} is out of range for a model of {n_layers} layers "
                           f"(0 .. {n_layers}, or -1 for the last)")
    return idx


BATCH_TOKENS = 4096
"""Padded tokens per forward of :func:`extract` (sequences of one head, right-padded, run together)."""


def extract(model_dir: str | Path, seqs: dict[str, Any], layer: int, device: str = "cpu",
            dtype: str = "float32", progress: Any = None, prefix: bool | None = None,
            batch_tokens: int = BATCH_TOKENS) -> dict[str, np.ndarray]:
    """Hidden states of layer ``layer`` at every requested position: ``h_s``, ``h_sa``, ``h_next`` (n_rows, d)
    float32. One no-grad forward per distinct sequence (equal windows, which turn windows make often, run once).
    With the prefix cache (:func:`qevolve_cli.models.kv.prefix_pays`; ``prefix`` True / False forces it on or
    off) the prefix every sequence shares (system prompt and example) runs once, then each head (the task's
    message, ``head_len`` in ``seqs``) once on it, and each sequence's rest on its head's keys and values.

    The rests of one head run together, right-padded, in forwards of at most ``batch_tokens`` padded tokens
    (``<= 1``: one sequence a forward). Causal attention keeps every real position from seeing the padding after
    it, so each row's states are its own forward's (equal up to float rounding of a larger matrix product)."""
    import torch

    from qevolve_cli.critic.model import _load_base
    from qevolve_cli.models.kv import (
        cache_kwarg,
        cache_layers,
        cache_of_layers,
        out_cache,
        prefix_pays,
        repeat_layers,
    )

    dev = torch.device(device)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    base = _load_base(model_dir, dt, dev)
    dec = getattr(base, base.base_model_prefix)
    n_layers = int(base.config.num_hidden_layers)
    li = resolve_layer(layer, n_layers)
    sequences: list[np.ndarray] = [np.asarray(sq, np.int64) for sq in seqs["sequences"]]
    heads = seqs.get("head_len")
    # one computation per distinct token sequence
    uniq: dict[bytes, int] = {}
    canon = np.zeros(len(sequences), np.int64)
    for i, sq in enumerate(sequences):
        canon[i] = uniq.setdefault(sq.tobytes(), i)
    wanted: dict[int, list[tuple[str, int, int]]] = {}
    for name in ("s", "sa", "next"):
        for row, (si, p) in enumerate(seqs[name]):
            wanted.setdefault(int(canon[int(si)]), []).append((name, row, int(p)))
    n_rows = len(seqs["s"])
    d = int(base.config.hidden_size)
    out = {f"h_{k}": np.zeros((n_rows, d), np.float32) for k in ("s", "sa", "next")}
    used = sorted(wanted)
    use_prefix = len(used) > 1 and (prefix_pays(base) if prefix is None else prefix)
    P = 0
    if use_prefix:
        first = sequences[used[0]]
        P = min(len(sequences[i]) for i in used) - 1
        for i in used[1:]:
            neq = np.flatnonzero(sequences[i][:P] != first[:P])
            P = min(P, int(neq[0]) if len(neq) else P)
        P = P if P >= 16 else 0

    def head_of(i: int) -> int:
        """Where sequence i's own forward starts: its head's end (on the head's cache), else the prefix's."""
        H = int(heads[i]) if heads is not None and use_prefix else 0
        return H if P + 16 <= H < len(sequences[i]) else P

    start = {i: head_of(i) for i in used}
    # the sequences of one head together (one head's keys and values held at a time), by length inside it
    groups: dict[bytes, list[int]] = {}
    for i in used:
        groups.setdefault(sequences[i][: start[i]].tobytes(), []).append(i)
    kw = cache_kwarg(dec)
    pad = int(getattr(base.config, "pad_token_id", None) or 0)

    def run(ids: torch.Tensor, layers: list | None) -> tuple[torch.Tensor, list]:
        """Layer ``li``'s states of ids (batch, length) on the keys / values ``layers`` (None: from position 0)."""
        extra = {kw: cache_of_layers(layers)} if layers is not None else {}
        o = dec(input_ids=ids, use_cache=True, output_hidden_states=True, **extra)
        return o.hidden_states[li].float(), cache_layers(out_cache(o))

    done = 0
    with torch.no_grad():
        h_pre, pre = run(torch.as_tensor(sequences[used[0]][:P], device=dev)[None], None) if P else (None, None)
        for members in groups.values():
            S = start[members[0]]
            parts, layers = [], pre
            if P:
                parts.append(h_pre[0])
            if S > P:  # the head, once, on the prefix
                h_head, layers = run(torch.as_tensor(sequences[members[0]][P:S], device=dev)[None], pre)
                parts.append(h_head[0])
            h_start = torch.cat(parts, 0) if parts else None
            members = sorted(members, key=lambda i: len(sequences[i]))
            k = 0
            while k < len(members):
                b = 1
                while (k + b < len(members) and batch_tokens > 1
                       and (b + 1) * (len(sequences[members[k + b]]) - S) <= batch_tokens):
                    b += 1
                chunk = members[k:k + b]
                R = len(sequences[chunk[-1]]) - S
                x = torch.full((len(chunk), R), pad, dtype=torch.long, device=dev)
                for r, i in enumerate(chunk):
                    x[r, : len(sequences[i]) - S] = torch.as_tensor(sequences[i][S:], device=dev)
                lay = repeat_layers(layers, len(chunk)) if layers is not None else None
                h, _ = run(x, lay)
                for r, i in enumerate(chunk):
                    pos = np.array([p for _n, _r, p in wanted[i]], np.int64)
                    vec = np.zeros((len(pos), d), np.float32)
                    own = pos >= S
                    if own.any():
                        vec[own] = h[r, torch.as_tensor(pos[own] - S, device=dev)].cpu().numpy()
                    if (~own).any():
                        vec[~own] = h_start[torch.as_tensor(pos[~own], device=dev)].cpu().numpy()
                    for (name, row, _p), v in zip(wanted[i], vec, strict=True):
                        out[f"h_{name}"][row] = v
                k += b
                done += b
                if progress is not None:
                    progress(done, len(used))
    return out


def cached_features(df: pl.DataFrame, tokenizer: Any, model_dir: str | Path, *, layer: int, context_turns: int,
                    max_length: int | None, window_context: float, device: str = "cpu", dtype: str = "float32",
                    cache_dir: str | Path | None = None, progress: Any = None) -> tuple[dict[str, np.ndarray], dict]:
    """The features of ``df`` (:func:`extract`), read from ``cache_dir`` when a run made them before.

    Returns (features, info) with info = ``key``, ``cached`` (read back), ``seconds`` of the pass,
    ``sequences``, ``tokens`` and ``bytes`` of the cache file."""
    import time

    from safetensors.numpy import load_file, save_file

    t0 = time.perf_counter()
    key = feature_key(table_fingerprint(df), model_fingerprint(model_dir), layer, context_turns, max_length,
                      window_context, dtype)
    path = Path(cache_dir) / f"features-{key}.safetensors" if cache_dir is not None else None
    if path is not None and path.is_file():
        got = load_file(str(path))
        if all(f"h_{k}" in got for k in ("s", "sa", "next")) and len(got["h_s"]) == df.height:
            return got, {"key": key, "cached": True, "seconds": round(time.perf_counter() - t0, 3),
                         "bytes": path.stat().st_size, "path": str(path)}
    seqs = state_sequences(df, tokenizer, context_turns, max_length, window_context)
    feats = extract(model_dir, seqs, layer, device, dtype, progress)
    info = {"key": key, "cached": False, "sequences": len(seqs["sequences"]),
            "tokens": int(sum(len(s) for s in seqs["sequences"]))}
    if path is not None:
        from qevolve_cli.atomic import atomic_path

        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            save_file(feats, str(tmp), metadata={"format": FEATURE_FORMAT, "layer": str(layer),
                                                 "context_turns": str(context_turns)})
        info["bytes"] = path.stat().st_size
        info["path"] = str(path)
    info["seconds"] = round(time.perf_counter() - t0, 3)
    return feats, info
