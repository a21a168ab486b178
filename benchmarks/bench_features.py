"""The feature critic's backbone pass (qevolve_cli/critic/features.py `extract`): one sequence a forward against the
rests of one head batched (right-padded, `batch_tokens` padded tokens a forward), and fp32 against bf16, on a real
table, per view.

    python benchmarks/bench_features.py --table runs/smol-hab-s0/iter_1/labeled.parquet --model runs/smol-hab-s0/base_model \\
        --views 3 0 --trajectories 24 --batch-tokens 1 2048 4096 8192 --dtype bfloat16
    python benchmarks/bench_features.py --table runs/smol-hab-s2/iter_1/labeled.parquet --model runs/smol-hab-s2/base_model \\
        --views 3 --trajectories 10 --batch-tokens 4096 --dtype float32 bfloat16     # the dtype on this CPU

Prints one JSON object: per view and batch size the seconds (best of --repeat, the settings interleaved), tokens/s of
the speed-up over one sequence a forward (the baseline, same run) and the largest difference
of any feature from the baseline's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--views", type=int, nargs="+", default=[3, 0], help="context_turns values (0: whole transcript)")
    ap.add_argument("--trajectories", type=int, default=24, help="The first N trajectories of the table (0: all).")
    ap.add_argument("--batch-tokens", type=int, nargs="+", default=[1, 2048, 4096, 8192])
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                    help="One or more: several are interleaved with the batch sizes, the first dtype's first batch "
                         "size is the baseline (rows keyed DTYPE:BATCH_TOKENS).")
    ap.add_argument("--layer", type=int, default=-1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args()

    import numpy as np
    import polars as pl
    import torch

    from qevolve_cli.critic.features import extract, state_sequences
    from qevolve_cli.tokenizer import load_tokenizer

    if a.threads:
        torch.set_num_threads(a.threads)
    df = pl.read_parquet(a.table)
    if a.trajectories:
        keep = df["traj_id"].unique(maintain_order=True).head(a.trajectories)
        df = df.filter(pl.col("traj_id").is_in(keep.implode()))
    tok = load_tokenizer(a.model, require_chat_template=True)
    result: dict = {"table": str(a.table), "model": str(a.model), "dtype": a.dtype[0] if len(a.dtype) == 1 else a.dtype,
                    "rows": df.height,
                    "trajectories": df["traj_id"].n_unique(), "threads": torch.get_num_threads(), "views": {}}
    for view in a.views:
        seqs = state_sequences(df, tok, view, None, 0.5)
        lens = [len(s) for s in seqs["sequences"]]
        settings = [(dt, bt) for dt in a.dtype for bt in a.batch_tokens]
        best: dict[tuple, float] = {}
        feats: dict[tuple, dict] = {}
        for dt in a.dtype:  # warm-up (load, allocator, the dtype's kernels)
            extract(a.model, seqs, a.layer, dtype=dt, batch_tokens=a.batch_tokens[-1])
        for _ in range(a.repeat):
            for st in settings:  # interleaved: a load that comes and goes hits every setting alike
                t0 = time.perf_counter()
                feats[st] = extract(a.model, seqs, a.layer, dtype=st[0], batch_tokens=st[1])
                best[st] = min(best.get(st, float("inf")), time.perf_counter() - t0)
        ref = settings[0]
        rows = {}
        for st in settings:
            diff = max(float(np.abs(feats[st][k] - feats[ref][k]).max()) for k in feats[ref])
            # per row: |f - f_ref| / |f_ref| (the heads read standardised features: scale-free is what matters)
            rel = max(float((np.linalg.norm(feats[st][k] - feats[ref][k], axis=1)
                             / np.maximum(np.linalg.norm(feats[ref][k], axis=1), 1e-12)).max()) for k in feats[ref])
            key = str(st[1]) if len(a.dtype) == 1 else f"{st[0]}:{st[1]}"
            rows[key] = {"seconds": round(best[st], 2), "speedup": round(best[ref] / best[st], 2),
                         "max_abs_diff": diff, "max_row_rel_diff": rel}
        scale = max(float(np.abs(feats[ref][k]).max()) for k in feats[ref])
        result["views"][str(view)] = {"sequences": len(lens), "tokens": int(sum(lens)), "max_abs_feature": scale,
                                      "mean_len": round(float(np.mean(lens)), 1), "baseline_batch_tokens": ref[1],
                                      **({"baseline_dtype": ref[0]} if len(a.dtype) > 1 else {}),
                                      "by_batch_tokens": rows}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
