"""Benchmark: policy training throughput (tokens/s) and peak memory on CPU, bc and bppo (tiny model or SmolLM2).

Prints one JSON object. The baseline, measured in the same run on the same
padded micro-batches, is a bare PyTorch loop (forward with ``labels``,
backward, AdamW step) with no data pipeline, masking or BPPO terms; the ratio
``vs_baseline`` shows the cost of qevolve's trainer over it. Each measurement
runs in a fresh subprocess so that its peak RSS is its own.

    python benchmarks/bench_policy.py [--quick] [--threads N]
    python benchmarks/bench_policy.py --size smollm2 --lora --threads 2 --trajectories 8 --steps 4

``--size smollm2`` trains the pretrained SmolLM2-135M-Instruct (``qevolve init-model --from
smollm2-135m-instruct``, cached); ``--lora`` puts LoRA r 16 on all linear layers in both loops (the
``cpu-smol`` preset), the bare loop through the same ``peft.get_peft_model``.

``--grid`` (issue 31) trains on real lamps expert trajectories (the train split's first ``--trajectories``,
SmolLM2's chat template) with qevolve's trainers only, in every combination of precision (fp32; bf16:
autocast over fp32 weights for the policy, bf16 frozen backbone for the critic) and batch layout
(padded; per_sequence: one forward per sequence, no padding computed), each in a fresh process: BC
with LoRA (``micro_batch_size`` 4 as the presets) -> tokens/s, and one critic epoch (LoRA r 16 on all
linear layers, batch_size 2 as the presets) -> seconds and transitions/s. Also reports the
padding fraction of the batches and the final losses of each arm.

    nice -n 10 python benchmarks/bench_policy.py --size smollm2 --grid --trajectories 12 --threads 2

``--logits-ab`` trains each objective with ``logits: all`` (the output layer and log-softmax at every position)
and ``logits: auto`` (at the loss positions only: transformers' ``logits_to_keep`` as a mask), twice each,
interleaved, in fresh processes, on synthetic TextCraft-like data or an environment's expert trajectories
(``--data lamps``), and reports the speed-up of the better run of each and both final NLLs:

    python benchmarks/bench_policy.py --logits-ab --data lamps-habit --trajectories 32 --epochs 2
    python benchmarks/bench_policy.py --logits-ab --size smollm2 --lora --data lamps --trajectories 8 --epochs 1 --threads 2

``--shared-prefix-ab`` does the same with ``shared_prefix: false`` and ``true`` (the prompt prefix every sequence
of a micro-batch shares, the system prompt and the in-context example, computed once; the same loss):

    python benchmarks/bench_policy.py --shared-prefix-ab --size smollm2 --lora --data lamps --trajectories 16 --epochs 1 --threads 2
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def make_table(path: Path, n_traj: int, steps: int, seed: int = 0) -> None:
    import polars as pl

    from qevolve_cli.schema import write_table

    rng = random.Random(seed)
    items = ["oak planks", "stick", "iron ingot", "crafting table", "torch", "glass"]
    rows = []
    for k in range(n_traj):
        goal = rng.choice(items)
        for t in range(steps):
            it = rng.choice(items)
            rows.append(dict(
                traj_id=f"b{k}", env="textcraft", task_id=str(k), split="train",
                source="expert" if k % 2 == 0 else "self", iteration=0, step=t,
                instruction=f"craft {goal}",
                observation=(f"Crafting commands:\ncraft 4 {goal} using 1 {it}\ncraft 1 {it} using 2 stick\n"
                             f"Goal: craft {goal}." if t == 0 else f"Got {t} {it}"),
                action=f"Thought: I need {it} to craft {goal}. Let me get it.\nAction: get {t + 1} {it}",
                command=f"get {t + 1} {it}", next_observation=f"Got {t + 1} {it}",
                reward_env=1.0 if t == steps - 1 and k % 2 == 0 else 0.0, done=t == steps - 1,
                advantage=rng.uniform(-1, 1)))
    write_table(pl.DataFrame(rows), path)


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _run_policy(objective, data, model, out, threads, epochs, lora, overrides, q):
    """``overrides``: more PolicyConfig fields (an A/B's arm)."""
    import torch

    torch.set_num_threads(threads)
    from qevolve_cli.policy import PolicyConfig, train_policy

    cfg = PolicyConfig(objective=objective, epochs=epochs, lr=1e-3, micro_batch_tokens=4096, micro_batch_size=8,
                       warmup_ratio=0.0, bc_source="all", lora=lora, lora_r=16, lora_alpha=32,
                       lora_target_modules="all-linear", **overrides)
    m = train_policy(cfg, data, model, out, quiet=True)
    q.put({"tokens_per_s": m["tokens_per_s"], "train_tokens": m["train_tokens"], "seconds": m["train_seconds"],
           "optimizer_steps": m["optimizer_steps"], "nll_before": m["nll_before"], "nll_after": m["nll_after"],
           "peak_rss_mib": round(_peak_mib(), 1)})


def _run_baseline(data, model, threads, epochs, lora, q):
    """Bare loop on the same micro-batches: model(ids, labels).loss.backward(); AdamW.step()."""
    import polars as pl
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from qevolve_cli.policy.data import build_examples, collate
    from qevolve_cli.training import token_budget_batches

    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        lm = get_peft_model(lm, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                           task_type="CAUSAL_LM"))
    exs = build_examples(pl.read_parquet(data), tok, 4096)
    opt = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad], lr=1e-3)
    with torch.no_grad():  # warm-up, as the trainer's initial log-prob pass does
        b = collate(exs[:8], tok.pad_token_id)
        lm(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
    lm.train()
    ntok = 0
    t0 = time.perf_counter()
    for ep in range(epochs):
        for idx in token_budget_batches([len(e) for e in exs], 4096, 8, seed=ep):
            b = collate([exs[i] for i in idx], tok.pad_token_id)
            labels = b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)
            loss = lm(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            ntok += int(b["attention_mask"].sum())
    dt = time.perf_counter() - t0
    q.put({"tokens_per_s": round(ntok / dt, 1), "train_tokens": ntok, "seconds": round(dt, 3),
           "peak_rss_mib": round(_peak_mib(), 1)})


def _run_grid_policy(data, model, out, threads, precision, layout, q):
    import torch

    torch.set_num_threads(threads)
    from qevolve_cli.policy import PolicyConfig, train_policy

    cfg = PolicyConfig(objective="bc", epochs=1, lr=2e-4, max_length=2048, micro_batch_tokens=8192,
                       micro_batch_size=4, warmup_ratio=0.0, lora=True, lora_r=16, lora_alpha=32,
                       lora_target_modules="all-linear", device="cpu", precision=precision, batch_layout=layout)
    m = train_policy(cfg, data, model, out, quiet=True)
    q.put({"tokens_per_s": m["tokens_per_s"], "train_tokens": m["train_tokens"], "seconds": m["train_seconds"],
           "nll_before": round(m["nll_before"], 4), "nll_after": round(m["nll_after"], 4),
           "peak_rss_mib": round(_peak_mib(), 1)})


def _run_grid_critic(data, model, out, threads, precision, layout, q):
    import torch

    torch.set_num_threads(threads)
    from qevolve_cli.critic.config import load_critic_config
    from qevolve_cli.critic.trainer import train_critic

    cfg = load_critic_config(None, None, {
        "epochs": 1, "batch_size": 2, "lora_rank": 16, "lora_target_modules": ["all-linear"], "head_hidden": 64,
        "max_length": 2048, "device": "cpu", "heldout_fraction": 0.0, "checkpoint_every_steps": 0,
        "dtype": {"fp32": "float32", "bf16": "bfloat16"}[precision], "batch_layout": layout})
    s = train_critic(cfg, data, model, out, resume=False)
    e = s["metrics"][0]
    q.put({"epoch_seconds": e["seconds"], "transitions_per_s": round(e["transitions_per_s"], 2),
           "loss_q": round(e["loss_q"], 5), "loss_v": round(e["loss_v"], 5), "peak_rss_mib": round(_peak_mib(), 1)})


def grid(a, model, td: Path) -> dict:
    """fp32/bf16 x padded/per_sequence on lamps expert data: BC tokens/s and a critic epoch (see the doc)."""
    import polars as pl

    from qevolve_cli.policy.data import build_examples
    from qevolve_cli.tokenizer import load_tokenizer
    from qevolve_cli.training import padding_fraction, token_budget_batches

    n = a.trajectories or 12
    data = expert_data("lamps", n, td)
    lens = [len(e) for e in build_examples(pl.read_parquet(data), load_tokenizer(model), 2048)]
    res: dict = {"trajectories": n, "mean_tokens": round(sum(lens) / len(lens), 1),
                 "policy_padding_fraction": round(padding_fraction(
                     [[lens[i] for i in b] for b in token_budget_batches(lens, 8192, 4, seed=0)]), 4),
                 "loadavg_start": os.getloadavg(), "policy_bc_lora": {}, "critic_lora": {}}
    for precision in ("fp32", "bf16"):
        for layout in ("padded", "per_sequence"):
            arm = f"{precision}_{layout}"
            if "policy" in a.objectives or "bc" in a.objectives:
                res["policy_bc_lora"][arm] = _in_child(_run_grid_policy, str(data), str(model), str(td / f"p_{arm}"),
                                                       a.threads, precision, layout)
                print(f"policy {arm}: {res['policy_bc_lora'][arm]}", file=sys.stderr, flush=True)
            if "critic" in a.objectives:
                res["critic_lora"][arm] = _in_child(_run_grid_critic, str(data), str(model), str(td / f"c_{arm}"),
                                                    a.threads, precision, layout)
                print(f"critic {arm}: {res['critic_lora'][arm]}", file=sys.stderr, flush=True)
    for key, metric, higher in (("policy_bc_lora", "tokens_per_s", True), ("critic_lora", "epoch_seconds", False)):
        arms = res[key]
        if "fp32_padded" in arms:
            base = arms["fp32_padded"][metric]
            for r in arms.values():
                r["speedup_vs_fp32_padded"] = round((r[metric] / base) if higher else (base / r[metric]), 2)
    res["loadavg_end"] = os.getloadavg()
    return res


def expert_data(env: str, n: int, td: Path) -> Path:
    """The first ``n`` expert trajectories of ``env``'s train split, labelled, with a seeded random advantage per
    step in [-1, 1] (bppo / awr need one; its values do not change the work of a step)."""
    import numpy as np
    import polars as pl

    from qevolve_cli import schema
    from qevolve_cli.envs.expert import collect_expert
    from qevolve_cli.labeling import LabelConfig, label_tables

    df = collect_expert(env, "train", limit=n, workers=1)
    schema.write_table(df, td / "expert.parquet", producer="bench_policy")
    label_tables([td / "expert.parquet"], td / "labeled.parquet", LabelConfig())
    lab = pl.read_parquet(td / "labeled.parquet")
    adv = np.random.default_rng(0).uniform(-1, 1, lab.height)
    schema.write_table(lab.with_columns(pl.Series("advantage", adv)), td / "data.parquet", producer="bench_policy")
    return td / "data.parquet"


def config_ab(a, model, data: Path, td: Path, epochs: int, key: str, arms: tuple) -> dict:
    """Each objective trained twice per arm (``PolicyConfig.<key>`` = each of ``arms``), interleaved, in fresh
    processes on the same data -> tokens/s of the better run of each arm, the speed-up of the second arm over
    the first, and the final NLLs (equal up to rounding where the arms compute the same loss)."""
    import polars as pl

    from qevolve_cli.models.kv import shared_prefix_len
    from qevolve_cli.policy.data import build_examples, collate
    from qevolve_cli.tokenizer import load_tokenizer, pad_id_of

    tok = load_tokenizer(model)
    exs = build_examples(pl.read_parquet(data), tok, 4096)
    res: dict = {"sequences": len(exs), "mean_tokens": round(sum(len(e) for e in exs) / len(exs), 1),
                 "loss_token_share": round(sum(int(e.loss_mask.sum()) for e in exs) / sum(len(e) for e in exs), 4),
                 "loadavg_start": os.getloadavg()}
    if key == "shared_prefix":  # how much of a micro-batch the shared prefix is (batches of 4 sequences)
        shared = total = 0
        for i in range(0, len(exs) - 1, 4):
            b = collate(exs[i : i + 4], pad_id_of(tok))
            lens = b["attention_mask"].sum(dim=1).tolist()
            p = shared_prefix_len(b["input_ids"], lens, b["mask"])
            shared, total = shared + p * (len(lens) - 1), total + sum(lens)
        res["tokens_saved_share_batches_of_4"] = round(shared / max(1, total), 4)
    for obj in a.objectives.split(","):
        r: dict = {}
        for v in arms + arms:  # interleaved, twice: the machine's load drifts
            m = _in_child(_run_policy, obj, str(data), str(model), str(td / f"{obj}_{v}"), a.threads, epochs,
                          a.lora, {key: v})
            r.setdefault(str(v), []).append(m)
        best = {k: max(v, key=lambda m: m["tokens_per_s"]) for k, v in r.items()}
        first, second = str(arms[0]), str(arms[1])
        res[obj] = {first: best[first], second: best[second],
                    "speedup": round(best[second]["tokens_per_s"] / best[first]["tokens_per_s"], 2),
                    "tokens_per_s_runs": {k: [m["tokens_per_s"] for m in v] for k, v in r.items()}}
        print(f"{obj}: {res[obj]['speedup']}x {res[obj]['tokens_per_s_runs']}", file=sys.stderr, flush=True)
    res["loadavg_end"] = os.getloadavg()
    return res


def _in_child(fn, *args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=fn, args=(*args, q))
    p.start()
    while True:  # a child that dies (an error, the OOM killer) sends nothing: do not wait for it forever
        try:
            res = q.get(timeout=5)
            break
        except queue.Empty:
            if not p.is_alive():
                raise SystemExit(f"bench_policy: {fn.__name__} ended with exit code {p.exitcode} and no result") from None
    p.join()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller data (a few seconds)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--size", default="tiny", choices=("tiny", "small", "smollm2"))
    ap.add_argument("--lora", action="store_true", help="LoRA r 16 on all linear layers (both loops)")
    ap.add_argument("--trajectories", type=int, default=0, help="override the number of trajectories")
    ap.add_argument("--steps", type=int, default=0, help="override the steps per trajectory")
    ap.add_argument("--epochs", type=int, default=0, help="override the epochs")
    ap.add_argument("--objectives", default="bc,bppo", help="with --grid: policy,critic")
    ap.add_argument("--grid", action="store_true", help="fp32/bf16 x padded/per_sequence on lamps data (issue 31)")
    ap.add_argument("--logits-ab", action="store_true", help="logits: all vs auto (the output layer at the loss "
                                                             "positions only), each objective, same data")
    ap.add_argument("--shared-prefix-ab", action="store_true", help="shared_prefix: false vs true (the prompt "
                    "prefix every sequence of a micro-batch shares computed once), each objective, same data")
    ap.add_argument("--data", default="synthetic", help="with --logits-ab / --shared-prefix-ab: synthetic (TextCraft-like, --trajectories "
                                                        "x --steps) or an environment's expert trajectories (lamps, "
                                                        "lamps-habit, textcraft, ...: the first --trajectories)")
    a = ap.parse_args()
    if a.grid and a.objectives == "bc,bppo":
        a.objectives = "policy,critic"
    n_traj, steps, epochs = (8, 4, 1) if a.quick else (32, 8, 2)
    n_traj, steps, epochs = a.trajectories or n_traj, a.steps or steps, a.epochs or epochs

    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        if a.size == "smollm2":
            from qevolve_cli.models.pretrained import init_pretrained

            model, _, _ = init_pretrained("smollm2-135m-instruct", td / "model")
        else:
            from qevolve_cli.models.tiny import create_tiny_model

            model = create_tiny_model(td / "model", size=a.size)
        if a.grid:
            print(json.dumps({"benchmark": "training_grid_cpu", "model": "SmolLM2-135M-Instruct" if a.size == "smollm2"
                              else f"tiny llama ({a.size})", "lora": "r16 all-linear", "threads": a.threads,
                              "env": "lamps (expert, train split)", **grid(a, model, td)}))
            return
        if a.logits_ab or a.shared_prefix_ab:
            if a.data == "synthetic":
                data = td / "data.parquet"
                make_table(data, n_traj, steps)
            else:
                data = expert_data(a.data, n_traj, td)
            key, arms = ("logits", ("all", "auto")) if a.logits_ab else ("shared_prefix", (False, True))
            print(json.dumps({"benchmark": f"policy_{key}_cpu", "model": "SmolLM2-135M-Instruct" if a.size == "smollm2"
                              else f"tiny llama ({a.size})", "lora": "r16 all-linear" if a.lora else None,
                              "threads": a.threads, "data": a.data, "trajectories": n_traj, "epochs": epochs,
                              **config_ab(a, model, data, td, epochs, key, arms)}))
            return
        data = td / "data.parquet"
        make_table(data, n_traj, steps)
        base = _in_child(_run_baseline, str(data), str(model), a.threads, epochs, a.lora)
        res = {}
        for obj in a.objectives.split(","):
            r = _in_child(_run_policy, obj, str(data), str(model), str(td / obj), a.threads, epochs, a.lora, {})
            r["vs_baseline"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
            res[obj] = r
    print(json.dumps({
        "benchmark": "policy_training_cpu",
        "model": "SmolLM2-135M-Instruct" if a.size == "smollm2" else f"tiny llama ({a.size})",
        "lora": "r16 all-linear" if a.lora else None,
        "threads": a.threads,
        "trajectories": n_traj, "steps_per_trajectory": steps, "epochs": epochs,
        "baseline_bare_torch_loop": base,
        **res,
        "note": "tokens/s counts all (unpadded) tokens of the trained sequences; bppo tokens/s excludes the "
                "initial pi_old/pi_ref log-prob pass; peak RSS of each fresh process",
    }))


if __name__ == "__main__":
    main()
