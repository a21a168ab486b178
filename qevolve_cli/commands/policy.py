"""``qevolve policy``: behaviour cloning, BPPO, AWR, RFT or DPO on trajectory tables."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qevolve_cli.commands.common import (
    ConfigOpt,
    EpochsOpt,
    JsonOpt,
    LrOpt,
    PrintConfigOpt,
    QuietOpt,
    SetOpt,
    emit_json,
    parse_sets,
    print_config,
    require,
    run_command,
)

HELP = """Train the policy: behaviour cloning (bc), BPPO (bppo), AWR (awr), or the baselines
rejection-sampling fine-tuning (rft) and ETO's trajectory DPO (dpo).

\b
bc   : NLL of the assistant (thought + action) tokens of expert rows.
bppo : clipped behaviour-proximal objective with the table's `advantage`
       (run `qevolve label --critic` first), KL to pi_ref, thought tokens
       down-weighted, asymmetric clipping (eps_low 0.8, eps_high 0.4).
awr  : exp(A/beta)-weighted NLL, weights clipped (the paper's ablation).
rft  : bc's NLL on expert rows plus the self trajectories whose final reward
       is >= rft_min_reward (default 1).
dpo  : per task, the expert trajectory against each self trajectory with a
       different final reward (higher reward = chosen; ties give no pair);
       DPO loss over the whole trajectory's assistant tokens against the
       frozen starting policy (or --ref), beta = dpo_beta (default 0.1,
       ETO's).
--data may be given several times (e.g. expert.parquet and rollout.parquet).

Writes OUT atomically: model weights (safetensors) or a LoRA adapter, the
tokenizer files, config.yaml (resolved), metrics.jsonl (loss per optimiser
step) and train_summary.json. A second run on the same OUT while one is running
is refused with one line (the output lock .OUT.lock; under torchrun rank 0 holds
it for all ranks). An interrupted run (also under DeepSpeed) resumes
at its last checkpoint in OUT.partial/ when started again with the same arguments:
checkpoints are written at epoch ends (the last one too: a run stopped in the
closing summary pass trains nothing again) and, with --set
checkpoint_every_steps=N, every N steps.
\b
Examples:
  qevolve policy --objective bc --data expert.parquet --model tiny/ --out bc/
  qevolve policy --objective bppo --data labeled.parquet --model bc/ --out it1/ --config configs/policy.yaml --preset alfworld_iter1
  qevolve policy --objective awr --data labeled.parquet --model bc/ --out awr/ --set awr_beta=0.5 --json
  qevolve policy --objective rft --data expert.parquet --data iter_1/rollout.parquet --model base/ --out rft/
  qevolve policy --objective dpo --data expert.parquet --data iter_1/rollout.parquet --model bc/ --out eto/ --set dpo_beta=0.1
"""


def register(app: typer.Typer) -> None:
    @app.command("policy", help=HELP)
    def policy(
        data: Annotated[list[Path] | None, typer.Option("--data", help="Trajectory table (Parquet); repeat to stack "
                                                        "several. Required.")] = None,
        model: Annotated[Path | None, typer.Option("--model", help="Initial policy: HF model directory or LoRA "
                                                   "adapter. Required.")] = None,
        out: Annotated[Path | None, typer.Option("--out", "-o", help="Output model directory (written atomically). "
                                                 "Required.")] = None,
        objective: Annotated[str | None, typer.Option("--objective", help="bc, bppo, awr, rft or dpo (default: the "
                                                      "config's objective, bc).")] = None,
        ref: Annotated[Path | None, typer.Option("--ref", help="Reference policy for the KL (default: --model).")] = None,
        config: ConfigOpt = None,
        preset: Annotated[str | None, typer.Option("--preset", help="Named preset of the config file (default file "
                                                   "configs/policy.yaml), or of configs/presets/ (cpu, smoke, "
                                                   "sciworld_iter2, ...: what `qevolve evolve` gives this stage).")] = None,
        sets: SetOpt = None,
        epochs: EpochsOpt = None,
        lr: LrOpt = None,
        lora: Annotated[bool | None, typer.Option("--lora/--full", help="Train a LoRA adapter or all weights.")] = None,
        seed: Annotated[int | None, typer.Option("--seed", help="Random seed.")] = None,
        print_cfg: PrintConfigOpt = False,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        def body():
            from qevolve_cli.commands.common import check_choice
            from qevolve_cli.config import flag_layer, resolve_layers, set_layer
            from qevolve_cli.policy.config import OBJECTIVES, PolicyConfig, policy_layers

            if objective is not None:
                check_choice(objective, OBJECTIVES, "--objective")
            set_values = parse_sets(sets)
            flags = flag_layer({"objective": objective, "epochs": epochs, "lr": lr, "lora": lora, "seed": seed},
                               {"lora": "--lora/--full"})
            res = resolve_layers(PolicyConfig, policy_layers(config, preset, objective or set_values.get("objective"))
                                 + [set_layer(set_values), flags])
            if print_cfg:
                return print_config(res.rows(), "qevolve policy: resolved config (field, value, set by)", json_out)
            require({"--data": data, "--model": model, "--out": out})
            cfg = res.config
            from qevolve_cli.lock import hold_output
            from qevolve_cli.models.hub import resolve_model
            from qevolve_cli.policy.trainer import train_policy
            from qevolve_cli.training import is_main_process

            with hold_output(out):  # under torchrun: rank 0 holds it, every rank gets its verdict
                metrics = train_policy(cfg, data[0] if len(data) == 1 else data, Path(resolve_model(model, "--model")),
                                       out, ref=Path(resolve_model(ref, "--ref")) if ref is not None else None,
                                       quiet=quiet)
            if not is_main_process():  # ranks > 0 of a multi-process (DeepSpeed) launch stay silent
                return
            if json_out:
                emit_json(metrics)
            else:
                typer.echo(
                    f"{cfg.objective}: {metrics['optimizer_steps']} steps, action NLL {metrics['nll_before']:.4f} -> "
                    f"{metrics['nll_after']:.4f}, {metrics['tokens_per_s']} tokens/s; wrote {out}"
                )

        run_command(body)
