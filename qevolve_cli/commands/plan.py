"""``qevolve plan``: memory per GPU and wall time of every stage of an evolve run, before it is queued."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qevolve_cli.commands.common import ConfigOpt, JsonOpt, emit_json, run_command

HELP = """Plan an evolve run on GPUs: per stage (rollout, label, critic, policy, eval) and
iteration, memory per GPU under each setting, the smallest setting that fits, and the
wall time (docs/cluster.md).

Memory (no weights are read: the model's size comes from its config.json): weights,
LoRA, optimiser state, gradients and activations at the configured token budget for
the critic and the policy under ZeRO-0/2/3 (with and without gradient checkpointing),
and for vLLM (rollout, eval) the weights and KV cache per tensor-parallel size. A
setting fits when its peak stays --reserve-gib below the GPU's memory.

Time: token counts measured on tables (steps per trajectory, prompt and completion
tokens per step, tokens per trajectory) from --tables (a previous run's rollouts) or
--expert (the expert data; learned policies take more steps), or, for ALFWorld, the
counts measured on its expert replays (training tokens at the stage's max_length, the
windows of long trajectories included); divided by stated throughputs per GPU (for a
7B model on an H100, scaled by model size and GPU; override them).
\b
Examples:
  qevolve plan --env alfworld --model /models/Llama-2-7b-hf --gpus 8 --gpu h100-80gb
  qevolve plan --env alfworld --model llama7b-config/ --gpus 1 --json
  qevolve plan --env sciworld --model M --expert expert.parquet --tables runs/sw/iter_1/rollout.parquet --gpus 16
  qevolve plan --env alfworld --model M --gpus 8 --decode-tps 4000 --train-tps 3500 --json
"""


def register(app: typer.Typer) -> None:
    @app.command("plan", help=HELP)
    def plan(
        env: Annotated[str, typer.Option("--env", help="Environment of the run.")],
        model: Annotated[Path | None, typer.Option("--model", help="Model directory (only its config.json is "
                                                   "read; default: the run config's model).")] = None,
        gpus: Annotated[int, typer.Option("--gpus", help="GPUs in all (data-parallel ranks).", min=1)] = 1,
        gpus_per_node: Annotated[int | None, typer.Option("--gpus-per-node", help="GPUs per node (bounds "
                                                          "vLLM tensor parallelism; default min(--gpus, 8)).",
                                                          min=1)] = None,
        gpu: Annotated[str, typer.Option("--gpu", help="GPU kind: h100-80gb, h200-141gb, a100-80gb, a100-40gb, "
                                         "l40s-48gb, a10-24gb.")] = "h100-80gb",
        gpu_gib: Annotated[float | None, typer.Option("--gpu-gib", help="Usable GiB per GPU (overrides --gpu's).")] = None,
        preset: Annotated[str, typer.Option("--preset", help="Evolve preset: paper (default), smoke, cpu or cpu-smol.")] = "paper",
        config: ConfigOpt = None,
        iters: Annotated[int | None, typer.Option("--iters", help="Evolving iterations (default: the preset's).")] = None,
        tables: Annotated[list[Path] | None, typer.Option("--tables", help="Rollout tables of a previous run "
                                                          "(token counts of the policy's trajectories).")] = None,
        expert: Annotated[Path | None, typer.Option("--expert", help="Expert table (the hybrid buffer's expert "
                                                    "half; the rollouts too when --tables is not given).")] = None,
        chars_per_token: Annotated[float, typer.Option("--chars-per-token", help="Characters per token when the "
                                                       "model directory has no tokenizer.", min=0.5)] = 4.0,
        prefill_tps: Annotated[float | None, typer.Option("--prefill-tps", help="vLLM prefill tokens/s per GPU.")] = None,
        decode_tps: Annotated[float | None, typer.Option("--decode-tps", help="vLLM decode tokens/s per GPU.")] = None,
        train_tps: Annotated[float | None, typer.Option("--train-tps", help="Training tokens/s per GPU.")] = None,
        env_step_s: Annotated[float | None, typer.Option("--env-step-s", help="Seconds per environment step.")] = None,
        reserve_gib: Annotated[float | None, typer.Option("--reserve-gib", help="GiB kept free per GPU.")] = None,
        json_out: JsonOpt = False,
    ) -> None:
        def body() -> None:
            from qevolve_cli.planner.plan import Assumptions, build_inputs, plan_run, summary_lines

            given = {"prefill_tps": prefill_tps, "decode_tps": decode_tps, "train_tps": train_tps,
                     "env_step_s": env_step_s, "reserve_gib": reserve_gib}
            for k, v in given.items():
                if v is not None and v <= 0:
                    from qevolve_cli.errors import QevolveError

                    raise QevolveError(f"--{k.replace('_', '-')}: must be > 0, got {v}")
            assumptions = Assumptions(**{k: v for k, v in given.items() if v is not None})
            inp, info = build_inputs(env=env, model=model, gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu,
                                     gpu_gib=gpu_gib, preset=preset, config=config, iters=iters, tables=tables,
                                     expert=expert, chars_per_token=chars_per_token, assumptions=assumptions)
            result = {**info, **plan_run(inp)}
            if json_out:
                emit_json(result)
            else:
                for line in summary_lines(result):
                    typer.echo(line)

        run_command(body)
