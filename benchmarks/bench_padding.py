"""Padding waste of policy and critic training batches (issue 31 item 4): the share of the token positions a
padded batch computes that are padding, on real lamps data tokenised with a real chat template.

Prints one JSON object. No model runs: the batches are built exactly as the trainers build them
(policy: ``token_budget_batches`` over the tokenised trajectories, sorted by length, with the preset's
``micro_batch_tokens`` / ``micro_batch_size``; critic: ``batch_size`` trajectories in the epoch's random
order, each row cut after its sampled steps' last next-state position, as ``critic.data.collate``
does) and their lengths are counted.

Data: the lamps expert trajectories of the train split (``--limit``; 60 = the cpu presets' demonstrations)
and, for the critic, the same trajectories labelled (``qevolve label``): the critic of a real iteration
also sees the rollouts' failed episodes, which are longer (up to 16 steps), so its waste is larger there.

    python benchmarks/bench_padding.py --tokenizer /tmp/perf-smol/fp32          # SmolLM2's template
    python benchmarks/bench_padding.py --tokenizer /tmp/perf-smol/fp32 --limit 389
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="model directory whose tokenizer and chat template are used")
    ap.add_argument("--limit", type=int, default=60, help="expert trajectories (train split)")
    ap.add_argument("--epochs", type=int, default=4, help="epochs of random batch orders averaged")
    args = ap.parse_args()

    import numpy as np

    from qevolve_cli import schema
    from qevolve_cli.critic.data import attach_targets, build_items, load_table, sample_steps
    from qevolve_cli.envs.expert import collect_expert
    from qevolve_cli.evolve.config import resolve
    from qevolve_cli.labeling import LabelConfig, label_tables
    from qevolve_cli.policy.data import build_examples
    from qevolve_cli.tokenizer import load_tokenizer
    from qevolve_cli.training import padding_fraction, token_budget_batches

    tok = load_tokenizer(args.tokenizer, require_chat_template=True)
    res: dict = {"benchmark": "padding", "env": "lamps", "tokenizer": str(args.tokenizer),
                 "trajectories": args.limit, "policy": {}, "critic": {}}
    with tempfile.TemporaryDirectory(prefix="bench-padding-") as td:
        td = Path(td)
        df = collect_expert("lamps", "train", limit=args.limit, workers=1)
        schema.write_table(df, td / "expert.parquet", producer="bench_padding")
        label_tables([td / "expert.parquet"], td / "labeled.parquet", LabelConfig())
        ldf, _ = load_table(td / "labeled.parquet")
        for preset in ("cpu", "cpu-smol"):
            cfg = resolve("lamps", preset, overrides={"iters": 1})
            for stage in ("bc", "policy"):
                p = cfg.stage(stage, 0 if stage == "bc" else 1)
                ex = build_examples(ldf, tok, p.max_length)
                lens = [len(e) for e in ex]
                fr = [padding_fraction([[lens[i] for i in b] for b in token_budget_batches(
                    lens, p.micro_batch_tokens, p.micro_batch_size, shuffle=True, seed=e)]) for e in range(args.epochs)]
                res["policy"][f"{preset}/{stage}"] = {
                    "micro_batch_tokens": p.micro_batch_tokens, "micro_batch_size": p.micro_batch_size,
                    "mean_tokens": round(float(np.mean(lens)), 1), "max_tokens": int(max(lens)),
                    "padding_fraction": round(float(np.mean(fr)), 4)}
            c = cfg.stage("critic", 1)
            items = build_items(ldf, tok, c.max_length)
            attach_targets(items, ldf, c)
            items = [it for it in items if it.usable.any()]
            fr = []
            for epoch in range(args.epochs):  # the trainer's order and step draws (CriticTrainer.run_epoch)
                rng = np.random.default_rng([c.seed, epoch])
                order = rng.permutation(len(items))
                batches = []
                for s in range(0, len(order), c.batch_size):
                    picks = [(int(i), sample_steps(items[i], c.steps_per_traj, rng)) for i in order[s:s + c.batch_size]]
                    batches.append([int(items[i].pos_next[idx].max()) + 1 for i, idx in picks if len(idx)])
                fr.append(padding_fraction(batches))
            res["critic"][preset] = {"batch_size": c.batch_size, "steps_per_traj": c.steps_per_traj,
                                     "padding_fraction": round(float(np.mean(fr)), 4)}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
