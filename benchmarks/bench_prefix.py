"""Benchmark: Rust prefix index vs the slow per-prefix reference vs one plain batch tokenisation.

SciWorld-shaped transcripts (default 10k trajectories, ~14 steps, long room
descriptions). Prints one JSON object. The slow reference runs on a sample of
trajectories and is extrapolated; its output is compared with the fast path's
on that sample (must be identical). The lower bound is one batch tokenisation
(tokenizers' Rust ``encode_batch``) of the same rendered transcripts.

    python benchmarks/bench_prefix.py [--quick] [--trajectories N] [--tokenizer DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOMS = ["kitchen", "foundry", "workshop", "bathroom", "outside", "living room", "bedroom", "greenhouse",
         "art studio", "hallway"]
OBJS = ["thermometer", "beaker", "metal pot", "stove", "sink", "freezer", "orange", "seed jar", "flower pot 1",
        "battery", "light bulb", "red wire", "blue box", "lighter", "glass cup", "table", "chair", "painting"]


def sciworld_table(n_traj: int, mean_steps: int = 14, seed: int = 0):
    import polars as pl

    rng = random.Random(seed)
    cols = {k: [] for k in ("traj_id", "env", "step", "instruction", "observation", "action", "next_observation")}

    def room_obs():
        r = rng.choice(ROOMS)
        items = rng.sample(OBJS, rng.randint(5, 12))
        return (f"This room is called the {r}. In it, you see: \n\tthe agent\n\ta substance called air\n"
                + "".join(f"\ta {o} (containing nothing)\n" for o in items)
                + "You also see:\n\tA door to the hallway (that is open)\n\tA door to the greenhouse (that is open)")

    for i in range(n_traj):
        T = max(2, min(24, int(rng.gauss(mean_steps, 3))))
        obs = [room_obs() if rng.random() < 0.4 else f"You move the {rng.choice(OBJS)} to the {rng.choice(OBJS)}."
               for _ in range(T + 1)]
        instr = f"Your task is to boil {rng.choice(OBJS)}. First, focus on the substance."
        for t in range(T):
            o = rng.choice(OBJS)
            cols["traj_id"].append(f"sw{i}")
            cols["env"].append("sciworld")
            cols["step"].append(t)
            cols["instruction"].append(instr)
            cols["observation"].append(obs[t])
            cols["action"].append(f"Thought: I should find the {o} and move it to the {rng.choice(OBJS)} in the "
                                  f"{rng.choice(ROOMS)}.\nAction: {rng.choice(['move', 'focus on', 'pick up'])} {o}")
            cols["next_observation"].append(obs[t + 1])
    return pl.DataFrame(cols)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1k trajectories, 20-trajectory slow sample")
    ap.add_argument("--trajectories", type=int, default=None)
    ap.add_argument("--sample", type=int, default=None, help="trajectories for the slow reference")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the tiny trained ChatML BPE)")
    ap.add_argument("--max-length", type=int, default=None)
    args = ap.parse_args()
    n = args.trajectories or (1000 if args.quick else 10000)
    sample = args.sample or (20 if args.quick else 60)

    import polars as pl

    from qevolve_cli.prefix import OUT_COLUMNS, _Indexer, _messages, add_prefix_positions, reference_positions

    if args.tokenizer:
        from qevolve_cli.tokenizer import load_tokenizer

        tok = load_tokenizer(args.tokenizer)
    else:
        from qevolve_cli.models.tiny import train_tokenizer, wrap_fast_tokenizer

        tok = wrap_fast_tokenizer(train_tokenizer(2048, seed=0))
    df = sciworld_table(n)
    steps = len(df)

    stats: dict = {}
    t0 = time.perf_counter()
    fast = add_prefix_positions(df, tok, max_length=args.max_length, stats=stats)
    t_fast = time.perf_counter() - t0

    # slow reference on a sample of whole trajectories
    ids = fast["traj_id"].unique(maintain_order=True).to_list()[:sample]
    sub = df.filter(pl.col("traj_id").is_in(ids))
    t0 = time.perf_counter()
    ref = reference_positions(sub, tok, max_length=args.max_length)
    t_slow_sample = time.perf_counter() - t0
    t_slow = t_slow_sample * n / len(ids)
    cols = list(OUT_COLUMNS)
    identical = fast.filter(pl.col("traj_id").is_in(ids)).select(cols).equals(ref.select(cols))

    # lower bound: one batch tokenisation of the same rendered transcripts
    ix = _Indexer(tok)
    texts = []
    for g in df.partition_by("traj_id", maintain_order=True):
        msgs = _messages("sciworld", g["instruction"][0], g["observation"].to_list(), g["action"].to_list(),
                         g["next_observation"].to_list(), ix.siu)
        texts.append(ix.skel.splice([m["content"] for m in msgs])[0])
    backend = tok.backend_tokenizer
    t0 = time.perf_counter()
    enc = backend.encode_batch(texts, add_special_tokens=False)
    t_batch = time.perf_counter() - t0
    n_tokens = sum(len(e.ids) for e in enc)

    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out = {
        "benchmark": "prefix_index",
        "trajectories": n,
        "steps": steps,
        "tokens": n_tokens,
        "tokenizer": args.tokenizer or "tiny-chatml-bpe",
        "max_length": args.max_length,
        "cpu_count": os.cpu_count(),
        "fast_s": round(t_fast, 3),
        "slow_reference_s_extrapolated": round(t_slow, 2),
        "slow_sample_trajectories": len(ids),
        "batch_tokenise_s": round(t_batch, 3),
        "speedup_vs_slow": round(t_slow / t_fast, 1),
        "ratio_vs_batch_tokenise": round(t_fast / t_batch, 2),
        "identical_on_sample": identical,
        "fallback_trajectories": stats["fallback_trajectories"],
        "truncated_steps": stats["truncated_steps"],
        "steps_per_s": round(steps / t_fast),
        "extrapolated_1m_steps_s": round(1e6 / (steps / t_fast), 1),
        "peak_rss_gib": round(rss_gib, 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
