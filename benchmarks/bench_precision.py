"""bf16 vs fp32 for the method's result (issue 31): does bf16 change what qevolve learns or plays?

With the tiny model of ``--preset cpu`` on lamps, for each seed: BC on the preset's 60 expert
demonstrations (12 epochs) in fp32 and in bf16 (autocast over fp32 weights), then greedy eval of each
on ``test_seen`` (the preset's 40 tasks) with weights in the same precision. Reported per seed and arm:
the BC loss (action NLL after training, and the last logged training loss), held-out success and
reward, and training seconds; plus the greedy action agreement of the fp32-trained policy played with
fp32 vs bf16 weights (the inference-only effect: episodes whose actions are all identical, and steps
equal up to each episode's first difference).

    nice -n 10 python benchmarks/bench_precision.py --seeds 0,1
    nice -n 10 python benchmarks/bench_precision.py --seeds 0,1 --epochs 4 --tasks 20   # what fits a loaded machine
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("QEVOLVE_PRECISION", None)  # every arm names its precision


def actions_of(path: Path) -> dict[str, list[str]]:
    import polars as pl

    t = pl.read_parquet(path).sort(["traj_id", "step"])
    return {k: g["action"].to_list() for (k,), g in t.group_by("traj_id", maintain_order=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--tasks", type=int, default=0, help="eval tasks (0: the preset's eval_max_tasks)")
    ap.add_argument("--epochs", type=int, default=0, help="BC epochs (0: the preset's 12)")
    args = ap.parse_args()

    import transformers

    transformers.utils.logging.disable_progress_bar()
    from bench_rollout import action_agreement

    from qevolve_cli import schema
    from qevolve_cli.envs.expert import collect_expert
    from qevolve_cli.evolve.config import resolve
    from qevolve_cli.models.tiny import create_tiny_model
    from qevolve_cli.policy.trainer import train_policy
    from qevolve_cli.rollout.evaluate import run_eval

    res: dict = {"benchmark": "precision", "env": "lamps", "preset": "cpu", "split": "test_seen",
                 "loadavg_start": os.getloadavg(), "seeds": {}}
    with tempfile.TemporaryDirectory(prefix="bench-precision-") as td:
        td = Path(td)
        for seed in [int(s) for s in args.seeds.split(",")]:
            cfg = resolve("lamps", "cpu", overrides={"iters": 1, "seed": seed})
            n_tasks = args.tasks or cfg.eval_max_tasks
            arch, size = cfg.init_model.split(":")
            base = create_tiny_model(td / f"base{seed}", arch=arch, size=size, seed=seed)
            expert = td / "expert.parquet"
            if not expert.exists():
                schema.write_table(collect_expert("lamps", "train", limit=cfg.expert_limit or None, workers=2),
                                   expert, producer="bench_precision")
            out: dict = {}
            for prec in ("fp32", "bf16"):
                pol = td / f"bc{seed}_{prec}"
                t0 = time.perf_counter()
                bc_cfg = cfg.stage("bc", 0).replace(precision=prec)
                if args.epochs:
                    bc_cfg = bc_cfg.replace(epochs=args.epochs)
                m = train_policy(bc_cfg, expert, base, pol, quiet=True)
                train_s = time.perf_counter() - t0
                hist = [json.loads(ln) for ln in (pol / "metrics.jsonl").read_text().splitlines()] \
                    if (pol / "metrics.jsonl").exists() else []
                r = {"nll_before": round(m["nll_before"], 4), "nll_after": round(m["nll_after"], 4),
                     # mean training loss of the last epoch (the BC loss the optimiser saw)
                     "last_epoch_loss": round(sum(h["loss"] for h in hist if h["epoch"] == hist[-1]["epoch"])
                                              / sum(h["epoch"] == hist[-1]["epoch"] for h in hist), 4) if hist else None,
                     "train_s": round(train_s, 1),
                     "tokens_per_s": m["tokens_per_s"]}
                dtype = {"fp32": "float32", "bf16": "bfloat16"}[prec]
                e_cfg = cfg.stage("rollout", 1).replace(split="test_seen", max_tasks=n_tasks, iteration=0, dtype=dtype)
                t0 = time.perf_counter()
                ev = run_eval(e_cfg, pol, td / f"eval{seed}_{prec}.parquet")
                r.update(success_rate=ev["success_rate"], avg_reward=ev["avg_reward"], eval_s=round(time.perf_counter() - t0, 1),
                         eval_steps_per_s=ev["stats"]["steps_per_s"])
                out[prec] = r
                print(f"seed {seed} {prec}: {json.dumps(r)}", file=sys.stderr, flush=True)
            # inference-only: the fp32-trained policy with bf16 weights
            e_cfg = cfg.stage("rollout", 1).replace(split="test_seen", max_tasks=n_tasks, iteration=0, dtype="bfloat16")
            ev = run_eval(e_cfg, td / f"bc{seed}_fp32", td / f"eval{seed}_fp32_as_bf16.parquet")
            out["fp32_policy_played_in_bf16"] = {
                "success_rate": ev["success_rate"], "avg_reward": ev["avg_reward"],
                **action_agreement(actions_of(td / f"eval{seed}_fp32.parquet"),
                                   actions_of(td / f"eval{seed}_fp32_as_bf16.parquet"))}
            res["seeds"][seed] = out
            print(f"seed {seed}: {json.dumps(out['fp32_policy_played_in_bf16'])}", file=sys.stderr, flush=True)
    res["loadavg_end"] = os.getloadavg()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
