"""Benchmark: what long trajectories cost and keep, with windows vs one sequence per trajectory.

For each expert table (real replays, ``qevolve expert``; by default ALFWorld train shards 5, 25, 45 of 60 and
ScienceWorld train shards 7, 27, 47 of 60, made once into ``--cache``) and each ``--max-length``:

* policy (``policy.data.build_examples``): steps whose action is a training target, training sequences,
  their tokens, the mean context before a trained action and the build time, for one sequence per
  trajectory (the oldest turns dropped: the baseline, what every objective did before windows) and for
  windows with each ``--window-context``;
* critic (``prefix.add_prefix_positions``): steps trained, sequences and tokens when whole trajectories
  longer than ``max_length`` are skipped (the baseline: what a table indexed without a budget gave the
  critic) and with windows for each ``--window-context``.

Counted with the tokenizer of ``--model`` (SmolLM2-135M-Instruct's: ``qevolve init-model --from
smollm2-135m-instruct``, the default when it is in the model cache). Prints one JSON object.

    python benchmarks/bench_windows.py [--model DIR] [--tables A.parquet B.parquet] [--max-length 2048 4096]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHARDS = {"alfworld": (5, 25, 45), "sciworld": (7, 27, 47)}


def expert_tables(cache: Path) -> list[Path]:
    """ALFWorld and ScienceWorld expert replays of three train shards of 60 each (made once)."""
    out = []
    for env, shards in SHARDS.items():
        for i in shards:
            p = cache / f"{env}_{i}of60.parquet"
            if not p.is_file():
                cache.mkdir(parents=True, exist_ok=True)
                subprocess.run([sys.executable, "-m", "qevolve_cli", "expert", "--env", env, "--shard", f"{i}/60",
                                "--out", str(p), "--quiet"], check=True)
            out.append(p)
    return out


def default_model() -> Path | None:
    root = Path(os.environ.get("QEVOLVE_MODEL_CACHE", Path.home() / ".cache" / "qevolve" / "models"))
    found = sorted(root.glob("smollm2-135m-instruct-*")) if root.is_dir() else []
    return found[-1] if found else None


def policy_row(df, tok, max_length: int, window_context: float | None) -> dict:
    import numpy as np

    from qevolve_cli.policy.data import build_examples

    t0 = time.perf_counter()
    ex = build_examples(df, tok, max_length, windows=window_context is not None,
                        window_context=window_context or 1.0)
    secs = time.perf_counter() - t0
    trained = [(e, s) for e in ex for s in np.unique(e.step[e.loss_mask])]
    return {"steps_trained": len(trained), "share_trained": round(len(trained) / df.height, 4),
            "sequences": len(ex), "tokens": int(sum(len(e) for e in ex)),
            "context_mean": round(float(np.mean([int(np.nonzero(e.step == s)[0][0]) for e, s in trained]))),
            "build_s": round(secs, 2)}


def critic_rows(df, tok, max_length: int, contexts: list[float]) -> dict:
    import polars as pl

    from qevolve_cli.prefix import add_prefix_positions

    def seqs(idx):
        return idx.group_by(["traj_id", "window"]).agg(pl.col("seq_len").first())

    whole = seqs(add_prefix_positions(df, tok))
    steps_of = df.group_by("traj_id").len()
    fit = whole.filter(pl.col("seq_len") <= max_length)
    kept = int(steps_of.join(fit, on="traj_id")["len"].sum())
    out = {"skip_long": {"steps_trained": kept, "share_trained": round(kept / df.height, 4), "sequences": fit.height,
                         "tokens": int(fit["seq_len"].sum())}}
    for c in contexts:
        t0 = time.perf_counter()
        idx = add_prefix_positions(df, tok, max_length=max_length, window_context=c)
        secs = time.perf_counter() - t0
        usable = idx.filter(pl.col("seq_len") <= max_length)
        w = seqs(idx)
        out[f"windows_{c:g}"] = {"steps_trained": usable.height, "share_trained": round(usable.height / df.height, 4),
                                 "sequences": w.height, "tokens": int(w["seq_len"].sum()), "index_s": round(secs, 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="model directory whose tokenizer counts tokens")
    ap.add_argument("--tables", type=Path, nargs="*", default=None, help="expert tables (default: made into --cache)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "qevolve" / "bench_windows")
    ap.add_argument("--max-length", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--window-context", type=float, nargs="+", default=[1.0, 0.5])
    args = ap.parse_args()

    import polars as pl

    from qevolve_cli import schema
    from qevolve_cli.tokenizer import load_tokenizer

    model = args.model or default_model()
    if model is None:
        sys.exit("error: --model: no SmolLM2 in the model cache; run `qevolve init-model --from "
                 "smollm2-135m-instruct --out DIR` or give a model directory")
    tok = load_tokenizer(str(model))
    tables = args.tables or expert_tables(args.cache)
    by_env: dict[str, list] = {}
    for p in tables:
        df = schema.read_table(p)
        by_env.setdefault(df["env"][0], []).append(df)
    res: dict = {"model": str(model), "tables": [str(p) for p in tables], "results": {}}
    for env, parts in by_env.items():
        df = pl.concat(parts, how="vertical_relaxed")
        lens = df.group_by("traj_id").len()["len"]
        env_res: dict = {"trajectories": lens.len(), "steps": df.height, "steps_max": int(lens.max())}
        for L in args.max_length:
            row = {"policy": {"one_sequence": policy_row(df, tok, L, None)}}
            for c in args.window_context:
                row["policy"][f"windows_{c:g}"] = policy_row(df, tok, L, c)
            base = row["policy"]["one_sequence"]["tokens"]
            for v in row["policy"].values():
                v["tokens_vs_one_sequence"] = round(v["tokens"] / base, 2)
            row["critic"] = critic_rows(df, tok, L, args.window_context)
            env_res[f"max_length_{L}"] = row
            print(f"{env} max_length {L}: done", file=sys.stderr, flush=True)
        res["results"][env] = env_res
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
