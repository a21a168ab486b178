"""Critic training throughput: one forward per trajectory (qevolve) vs one forward per step (naive).

Tiny offline model on CPU, trajectories of exactly 14 steps (SciWorld-like
synthetic text, real tokenizer and chat template, real PEFT adapters). Both
layouts run the same alternating Q / V updates over the same steps; the naive
baseline forwards every step's own prefix (cut at its next-state end) as a
separate sequence, the qevolve layout forwards each trajectory once per adapter
and gathers every step's pooled states from it. Prints one JSON object:
transitions learned per second and backbone forward passes (sequences) per
epoch for each layout, and the speed-up (target >= 5x).

    python benchmarks/bench_critic.py            # 16 trajectories x 14 steps
    python benchmarks/bench_critic.py --quick    # 6 trajectories

``--value-forward-ab`` measures ``schedule: both`` (the presets') with the value adapter's two forwards per batch
(V(s') for the Q update, V(s) for the V update) against the one shared forward the trainer runs since
2026-11-28: each arm twice, interleaved, each run in a fresh process (its own peak RSS), the critic stage of
``--preset`` (cpu: the tiny model; cpu-smol: SmolLM2-135M-Instruct with LoRA r 16 on all linear layers) on
an environment's expert trajectories (``--data lamps``: the train split's first ``--trajectories``) or the
synthetic table. It reports each arm's better epoch time, the speed-up, and whether the trained weights agree:

    python benchmarks/bench_critic.py --value-forward-ab --data lamps-habit --trajectories 24
    python benchmarks/bench_critic.py --value-forward-ab --preset cpu-smol --data lamps --trajectories 8

``--shared-prefix-ab`` measures the same way ``shared_prefix: false`` against ``true`` (the prompt prefix every
trajectory of a batch shares, the system prompt and the in-context example, computed once per adapter forward;
the same values up to rounding, so the weights agree to about 1e-6 rather than bit for bit):

    python benchmarks/bench_critic.py --shared-prefix-ab --preset cpu-smol --data lamps --trajectories 8 --threads 2
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


def fixed_length_table(n_traj: int, steps: int, seed: int = 0):
    import polars as pl

    from qevolve_cli import core, schema
    from qevolve_cli.synthetic import synthetic_table

    df = schema.sort_steps(synthetic_table(n_traj * 4, mean_steps=steps + 6, obs_words=30, env="sciworld", seed=seed))
    long = df.group_by("traj_id").len().filter(pl.col("len") >= steps)["traj_id"].to_list()[:n_traj]
    if len(long) < n_traj:
        raise SystemExit("not enough long synthetic trajectories")
    df = df.filter(pl.col("traj_id").is_in(long) & (pl.col("step") < steps))
    df = schema.sort_steps(df).with_columns((pl.col("step") == steps - 1).alias("done"))
    offs = core.offsets(df)
    succ = core.trajectory_success(offs, df["reward_env"])
    return df.with_columns(pl.lit(0.0, pl.Float32).alias("reward_aux"), pl.lit("none").alias("aux_kind"),
                           core.broadcast(offs, succ, "success"), core.step_weights(offs, succ, df.height))


def run_layout(model_dir: Path, df, per_step: bool, batch_size: int, epochs: int) -> dict:
    import torch

    from qevolve_cli.critic.config import CriticConfig
    from qevolve_cli.critic.data import attach_targets, build_items
    from qevolve_cli.critic.model import CriticModel
    from qevolve_cli.critic.trainer import CriticTrainer
    from qevolve_cli.tokenizer import load_tokenizer, pad_id_of

    cfg = CriticConfig(epochs=epochs, lr=1e-4, batch_size=batch_size, lora_rank=8, head_hidden=64, device="cpu",
                       checkpoint=False, warmup_ratio=0.0)
    tok = load_tokenizer(model_dir)
    items = build_items(df, tok)
    attach_targets(items, df, cfg)
    torch.manual_seed(0)
    critic = CriticModel.create(model_dir, cfg)
    tr = CriticTrainer(critic, cfg, items, pad_id_of(tok), per_step=per_step)
    tr.run_epoch(10_000)  # warm-up epoch (allocator, kernels), not timed
    t0 = time.perf_counter()
    ms = [tr.run_epoch(e) for e in range(epochs)]
    secs = time.perf_counter() - t0
    transitions = sum(m["transitions"] for m in ms)
    return {
        "layout": "per_step" if per_step else "per_trajectory",
        "seconds": round(secs, 3),
        "transitions": transitions,
        "transitions_per_s": round(transitions / secs, 2),
        "forward_passes_per_epoch": ms[-1]["forward_rows"],
        "forward_calls_per_epoch": ms[-1]["forward_calls"],
        "tokens_per_traj": round(sum(len(it.input_ids) for it in items) / len(items), 1),
    }


def _one_arm(model: str, data: str, preset: str, overrides: dict, threads: int, q) -> None:
    """One epoch of the preset's critic (with ``overrides``: the A/B's arm) on ``data`` in this (fresh) process
    -> q: seconds, counts, peak RSS, and a checksum of the trained value and q adapters."""
    import resource

    import torch

    torch.set_num_threads(threads)
    from qevolve_cli import schema
    from qevolve_cli.critic.config import load_critic_config
    from qevolve_cli.critic.data import attach_targets, build_items
    from qevolve_cli.critic.model import CriticModel
    from qevolve_cli.critic.trainer import CriticTrainer
    from qevolve_cli.tokenizer import load_tokenizer, pad_id_of

    cfg = load_critic_config(None, preset, {"epochs": 1, "schedule": "both", "device": "cpu", "dtype": "float32",
                                            "checkpoint_every_steps": 0, "heldout_fraction": 0.0, **overrides})
    df = schema.read_table(data)
    tok = load_tokenizer(model)
    items = build_items(df, tok, cfg.max_length)
    attach_targets(items, df, cfg)
    critic = CriticModel.create(model, cfg)
    tr = CriticTrainer(critic, cfg, items, pad_id_of(tok))
    m = tr.run_epoch(0)
    sums = {a: float(sum(p.detach().double().abs().sum() for _, p in critic.adapter_params(a))) for a in ("value", "q")}
    q.put({**overrides, "seconds": m["seconds"], "transitions_per_s": round(m["transitions_per_s"], 2),
           "forward_calls": m["forward_calls"], "loss_q": m["loss_q"], "loss_v": m["loss_v"],
           "adapter_abs_sums": sums, "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)})


def config_ab(a, model: Path, data: Path, key: str, names: tuple[str, str]) -> dict:
    """CriticConfig.<key> false (arm ``names[0]``) vs true (``names[1]``), each twice, interleaved."""
    # a fresh process per run (its own peak RSS); a child that dies ends the benchmark instead of hanging it
    from benchmarks.bench_policy import _in_child

    runs: dict[bool, list[dict]] = {True: [], False: []}
    for on in (False, True, False, True):  # interleaved, twice: the machine's load drifts
        r = _in_child(_one_arm, str(model), str(data), a.preset, {key: on}, a.threads)
        runs[on].append(r)
        print(f"{key}={on}: {r['seconds']:.1f} s, {r['peak_rss_mib']} MiB", file=sys.stderr, flush=True)
    best = {k: min(v, key=lambda r: r["seconds"]) for k, v in runs.items()}
    sums = [r["adapter_abs_sums"] for r in runs[True] + runs[False]]
    ref = runs[False][0]["adapter_abs_sums"]
    return {names[0]: best[False], names[1]: best[True],
            "speedup": round(best[False]["seconds"] / best[True]["seconds"], 3),
            "seconds_runs": {names[0]: [r["seconds"] for r in runs[False]],
                             names[1]: [r["seconds"] for r in runs[True]]},
            "same_weights": all(s == ref for s in sums),
            "max_rel_weight_diff": max(abs(s[k] - ref[k]) / abs(ref[k]) for s in sums for k in ref),
            "same_losses": len({(r["loss_q"], r["loss_v"]) for r in runs[True] + runs[False]}) == 1,
            "losses": {names[0]: [runs[False][0]["loss_q"], runs[False][0]["loss_v"]],
                       names[1]: [runs[True][0]["loss_q"], runs[True][0]["loss_v"]]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 trajectories instead of 16")
    ap.add_argument("--trajectories", type=int, default=None)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: stable on shared machines)")
    ap.add_argument("--model", type=Path, default=None, help="existing model directory (default: build the tiny one)")
    ap.add_argument("--value-forward-ab", action="store_true",
                    help="schedule both: two value forwards per batch vs the shared one (see the doc)")
    ap.add_argument("--shared-prefix-ab", action="store_true",
                    help="shared_prefix false vs true: the prompt prefix every trajectory of a batch shares "
                         "computed once (see the doc)")
    ap.add_argument("--preset", default="cpu", help="with --value-forward-ab / --shared-prefix-ab: the critic stage of this preset "
                                                     "(cpu: tiny model; cpu-smol: SmolLM2 + LoRA)")
    ap.add_argument("--data", default="synthetic", help="with an A/B: synthetic or an environment's "
                                                         "expert trajectories (lamps, lamps-habit, textcraft, ...)")
    a = ap.parse_args()
    if a.value_forward_ab or a.shared_prefix_ab:
        with tempfile.TemporaryDirectory() as tmp:
            if a.preset == "cpu-smol":
                from qevolve_cli.models.pretrained import init_pretrained

                model, _, _ = init_pretrained("smollm2-135m-instruct", Path(tmp) / "model")
                name = "SmolLM2-135M-Instruct"
            else:
                from qevolve_cli.models.tiny import create_tiny_model

                model, name = create_tiny_model(Path(tmp) / "tiny", arch="llama", size="tiny", seed=0), "tiny llama"
            n = a.trajectories or 16
            if a.data == "synthetic":
                data = Path(tmp) / "data.parquet"
                from qevolve_cli import schema

                schema.write_table(fixed_length_table(n, a.steps), data, producer="bench_critic")
            else:  # the first n expert trajectories, labelled (bench_policy's; its random advantage goes unread)
                from benchmarks.bench_policy import expert_data

                data = expert_data(a.data, n, Path(tmp))
            if a.value_forward_ab:
                key, names = "share_value_forward", ("two_forwards", "shared_forward")
            else:
                key, names = "shared_prefix", ("prefix_per_row", "prefix_once")
            print(json.dumps({"benchmark": f"critic_{key}_ab", "device": "cpu", "model": name,
                              "preset": a.preset, "data": a.data, "trajectories": n, "threads": a.threads,
                              "loadavg_start": os.getloadavg(), **config_ab(a, model, data, key, names),
                              "loadavg_end": os.getloadavg()}))
        return
    import torch

    torch.set_num_threads(a.threads)
    n = a.trajectories or (6 if a.quick else 16)
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            from qevolve_cli.models.tiny import create_tiny_model

            model = create_tiny_model(Path(tmp) / "tiny", arch="llama", size="tiny", seed=0)
        df = fixed_length_table(n, a.steps)
        fast = run_layout(model, df, False, a.batch_size, a.epochs)
        naive = run_layout(model, df, True, a.batch_size, a.epochs)
    speedup = fast["transitions_per_s"] / naive["transitions_per_s"]
    print(json.dumps({
        "benchmark": "critic",
        "device": "cpu",
        "model": "tiny llama (hidden 64, 2 layers)" if a.model is None else str(a.model),
        "trajectories": n,
        "steps_per_trajectory": a.steps,
        "batch_size": a.batch_size,
        "epochs": a.epochs,
        "threads": a.threads,
        "per_trajectory": fast,
        "per_step_baseline": naive,
        "speedup": round(speedup, 2),
        "forward_pass_ratio": round(naive["forward_passes_per_epoch"] / fast["forward_passes_per_epoch"], 2),
        "target_speedup": 5.0,
        "meets_target": speedup >= 5.0,
    }))


if __name__ == "__main__":
    main()
