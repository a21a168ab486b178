"""BC on real TextCraft expert data (issue 7): NLL and held-out success, untrained vs BC.

Runs the whole pipeline as real CLI subprocesses (``python -m qevolve_cli ...``):

1. ``qevolve init-model --size SIZE`` (the untrained model);
2. ``qevolve expert --env textcraft --split train`` (expert replays of the train goals);
3. ``qevolve policy --objective bc`` (NLL of the expert thought + action tokens);
4. ``qevolve eval --env textcraft --json`` of the untrained and of the BC model on each
   held-out split, with identical settings (greedy, ``--max-tasks``, ``--max-steps``,
   ``--max-new-tokens``).

Prints ONE JSON object on stdout (progress on stderr): the settings, the BC metrics
(action NLL before / after on the training data, optimiser steps, training seconds) and,
per split, success rate / average reward / mean steps of the untrained and the BC model,
plus the share of format-error turns (no parsable ``Action:``).

    python benchmarks/bench_bc_textcraft.py                    # the documented run (docs/policy.md), 5-20 min (load)
    python benchmarks/bench_bc_textcraft.py --quick            # ~4 min: 40 experts, 1 epoch, 6 tasks, 10 steps
    python benchmarks/bench_bc_textcraft.py --work /tmp/bc_tc --keep --splits test_seen test_unseen

A ``--work`` directory is reused: finished stages (model, experts, BC model, eval tables)
are not run again, so the numbers can be re-read without re-training.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env(threads: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def _cli(args: list[str], threads: int) -> tuple[dict, float]:
    """Run ``qevolve ARGS --json`` and return (its JSON object, wall seconds)."""
    cmd = [sys.executable, "-m", "qevolve_cli", *map(str, args), "--json"]
    print("$ qevolve " + " ".join(map(str, args)), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(threads), capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"qevolve {args[0]} failed with exit code {proc.returncode}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]), dt


def _format_error_share(table: Path) -> float:
    import polars as pl

    df = pl.read_parquet(table)
    cmd = df["command"].fill_null("")
    return float((cmd.str.strip_chars() == "").mean()) if df.height else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="40 experts, 1 epoch, 6 tasks per split, 10 steps")
    ap.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary working directory")
    ap.add_argument("--size", default="tiny-tc", help="init-model --size (tiny-tc: tiny + TextCraft vocabulary)")
    ap.add_argument("--arch", default="llama", help="init-model --arch")
    ap.add_argument("--seed", type=int, default=0, help="init-model and policy seed")
    ap.add_argument("--expert-limit", type=int, default=0, help="only the first N train goals (0 = all 324)")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--max-length", type=int, default=1536, help="policy max_length (tokens per trajectory)")
    ap.add_argument("--micro-batch-size", type=int, default=1,
                    help="policy micro_batch_size: trajectories per optimiser step (1: 8x the updates of 8)")
    ap.add_argument("--splits", nargs="+", default=["test_seen", "test_unseen"])
    ap.add_argument("--max-tasks", type=int, default=0, help="eval --max-tasks (0 = the whole split)")
    ap.add_argument("--max-steps", type=int, default=20, help="eval --max-steps (the env's limit is 40)")
    ap.add_argument("--max-new-tokens", type=int, default=80, help="eval --max-new-tokens (longest expert "
                                                                    "turn: 65 tokens)")
    ap.add_argument("--threads", type=int, default=1, help="OMP threads of every subprocess")
    a = ap.parse_args()
    if a.quick:
        a.expert_limit, a.epochs, a.max_tasks, a.max_steps = a.expert_limit or 40, 1, a.max_tasks or 6, 10

    tmp = None
    if a.work is None:
        tmp = Path(tempfile.mkdtemp(prefix="bench_bc_textcraft_"))
        work = tmp
    else:
        work = a.work.resolve()
        work.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    out: dict = {"benchmark": "bc_textcraft", "work": str(work)}
    try:
        model, experts, bc = work / "model", work / "expert_train.parquet", work / "bc"
        timings: dict = {}
        if not (model / "config.json").exists():
            info, timings["init_model_s"] = _cli(["init-model", "--out", model, "--size", a.size, "--arch", a.arch,
                                                  "--seed", a.seed], a.threads)
        else:
            info = json.loads((model / "qevolve_model.json").read_text())
        out["model"] = {k: info.get(k) for k in ("arch", "size", "parameters", "vocab_size")}
        if not experts.exists():
            ex_args = ["expert", "--env", "textcraft", "--split", "train", "--out", experts, "--workers", 2, "-q"]
            if a.expert_limit:
                ex_args += ["--limit", a.expert_limit]
            ex, timings["expert_s"] = _cli(ex_args, a.threads)
            out["experts"] = {k: ex.get(k) for k in ("tasks", "succeeded", "trajectories", "steps")}
        if not (bc / "train_summary.json").exists():
            pol, timings["bc_s"] = _cli([
                "policy", "--objective", "bc", "--data", experts, "--model", model, "--out", bc,
                "--epochs", a.epochs, "--lr", a.lr, "--seed", a.seed, "-q",
                "--set", "device=cpu", "--set", f"max_length={a.max_length}", "--set", "micro_batch_tokens=8192",
                "--set", f"micro_batch_size={a.micro_batch_size}",
            ], a.threads)
        else:
            pol = json.loads((bc / "train_summary.json").read_text())
        out["bc"] = {k: pol.get(k) for k in ("trajectories", "steps", "epochs", "optimizer_steps", "train_tokens",
                                             "train_seconds", "tokens_per_s", "nll_before", "nll_after",
                                             "truncated_trajectories")}
        out["bc"]["lr"] = a.lr
        out["bc"]["max_length"] = a.max_length
        out["bc"]["micro_batch_size"] = a.micro_batch_size
        out["eval_settings"] = {"greedy": True, "max_tasks": a.max_tasks or "all", "max_steps": a.max_steps,
                                "max_new_tokens": a.max_new_tokens}
        out["eval"] = {}
        for split in a.splits:
            res = {}
            for name, pol_dir in (("untrained", model), ("bc", bc)):
                table = work / f"eval_{name}_{split}.parquet"
                mpath = table.with_name(table.name + ".metrics.json")
                if mpath.exists() and table.exists():
                    m = json.loads(mpath.read_text())
                else:
                    ev_args = ["eval", "--env", "textcraft", "--policy", pol_dir, "--split", split, "--out", table,
                               "--max-steps", a.max_steps, "--max-new-tokens", a.max_new_tokens, "-q"]
                    if a.max_tasks:
                        ev_args += ["--max-tasks", a.max_tasks]
                    m, timings[f"eval_{name}_{split}_s"] = _cli(ev_args, a.threads)
                res[name] = {"tasks": m.get("n"), "success_rate": m.get("success_rate"),
                             "avg_reward": m.get("avg_reward"), "avg_steps": m.get("avg_steps"),
                             "successes": round((m.get("success_rate") or 0.0) * (m.get("n") or 0)),
                             "format_error_turns": round(_format_error_share(table), 4)}
            res["bc_beats_untrained"] = res["bc"]["success_rate"] > res["untrained"]["success_rate"]
            out["eval"][split] = res
        out["seconds"] = {k: round(v, 1) for k, v in timings.items()}
        out["seconds"]["total"] = round(time.perf_counter() - t_all, 1)
    finally:
        if tmp is not None and not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
