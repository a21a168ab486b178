"""`qevolve evolve`: the whole Q-Evolve loop into a resumable run directory."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qevolve_cli.commands.common import (
    ConfigOpt,
    EnvOpt,
    JsonOpt,
    PrecisionOpt,
    PrintConfigOpt,
    QuietOpt,
    emit_json,
    flag_names,
    naming_flags,
    print_config,
    run_command,
)

HELP = """Run Q-Evolve end to end: BC warm-up on expert data, then per iteration rollout -> label ->
critic -> label --critic -> policy (bppo, or awr with --policy-step awr) -> eval, into RUN_DIR
(resumable).

Presets: configs/presets/<env>.yaml holds the paper's hyper-parameters per environment and
iteration; --preset smoke|cpu scales it down to 2 CPU cores with a tiny offline model;
--preset cpu-smol is cpu with the pretrained SmolLM2-135M-Instruct and LoRA (lamps; hours).
The equivalent shell commands are printed and saved as RUN_DIR/plan.sh.

\b
Examples:
  qevolve evolve --env textcraft --preset cpu --iters 1 --run-dir runs/demo
  qevolve evolve --env lamps --preset cpu-smol --iters 1 --run-dir runs/demo-smol
  qevolve evolve --env lamps --preset cpu --iters 2 --select-on-validation --run-dir runs/lamps-sel
  qevolve evolve --env lamps-hard --preset cpu --iters 1 --policy-step bppo --run-dir runs/lh-bppo
  qevolve evolve --env sciworld --iters 2 --preset smoke --run-dir runs/sw-smoke
  qevolve evolve --env alfworld --iters 2 --model /models/Llama-3-8B-Instruct --run-dir runs/alf
  qevolve evolve --env sciworld --iters 2 --model M --run-dir runs/sw --resume   # after Ctrl-C / a crash
  qevolve evolve --env lamps --preset cpu --iters 2 --run-dir runs/l1 --resume --reconfigure   # 1 more iteration
"""


def evolve_rows(cfg, origin: dict[tuple, str]) -> list[tuple[str, object, str]]:
    """--print-config rows of an evolve config: its own fields, then every stage config per iteration."""
    import dataclasses

    from qevolve_cli.config import default_layer_name
    from qevolve_cli.evolve.config import STAGE_SECTIONS

    rows = [(f.name, getattr(cfg, f.name), origin.get((f.name,), default_layer_name(type(cfg))))
            for f in dataclasses.fields(cfg) if f.name not in (*STAGE_SECTIONS, "iterations")]
    stages = [("bc", 0)] + [(s, k) for k in range(1, max(cfg.iters, 1) + 1) for s in STAGE_SECTIONS if s != "bc"]
    for name, k in stages:
        stage, where = cfg.stage(name, k), cfg.stage_origin(name, k, origin)
        rows.append((f"# {name}" + (f" (iteration {k})" if name != "bc" else ""), None, ""))
        rows += [(f.name, getattr(stage, f.name), where[f.name]) for f in dataclasses.fields(stage)]
    return rows


def register(app: typer.Typer) -> None:
    @app.command("evolve", help=HELP)
    def evolve(
        env: EnvOpt,
        iters: Annotated[int | None, typer.Option("--iters", help="Evolving iterations K.")] = None,
        model: Annotated[str | None, typer.Option("--model", help="Base model directory (HF checkpoint).")] = None,
        policy: Annotated[str | None, typer.Option("--policy", help="Start from this policy (skip BC).")] = None,
        expert: Annotated[str | None, typer.Option("--expert", help="Existing expert table (skip collection).")] = None,
        preset: Annotated[str, typer.Option("--preset", help="paper (default), smoke, cpu or cpu-smol.")] = "paper",
        run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Run directory (default runs/<env>-<preset>).")] = None,
        resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted run (a finished run is a no-op). "
                                             "Checkpoint frequencies and --log-to may change on resume; every "
                                             "finished stage is kept (docs/evolve.md).")] = False,
        reconfigure: Annotated[bool, typer.Option(
            "--reconfigure", help="With --resume: accept a configuration other than the run's (more --iters, "
            "another --config for stages not yet run). Every finished stage the new configuration changes is "
            "refused before anything is written; the others are kept. The earlier config.yaml is kept as "
            "config.prev-N.yaml.")] = False,
        config: ConfigOpt = None,
        seed: Annotated[int | None, typer.Option("--seed", help="Seed of every stage.")] = None,
        precision: PrecisionOpt = None,
        select: Annotated[bool, typer.Option("--select-on-validation", help="Train every candidate setting of BC and "
                                             "of each iteration's policy step, keep the best on validation train "
                                             "tasks (never test; docs/compare.md).")] = False,
        policy_step: Annotated[str | None, typer.Option(
            "--policy-step", help="Each iteration's policy step: bppo (the paper: from the previous policy) or awr "
            "(advantage-weighted regression from the base model with the BC budget; docs/compare.md, 'The AWR "
            "policy step'). Default: the preset's.")] = None,
        log_to: Annotated[str | None, typer.Option("--log-to", help="Also log metrics to: tensorboard, wandb (comma list).")] = None,
        print_cfg: PrintConfigOpt = False,
        quiet: QuietOpt = False,
        json_out: JsonOpt = False,
    ) -> None:
        def body() -> None:
            from qevolve_cli.evolve.config import resolve_with_origin
            from qevolve_cli.evolve.loop import run_evolve
            from qevolve_cli.evolve.report import print_table

            overrides = {"iters": iters, "model": model, "start_policy": policy, "expert_data": expert, "seed": seed,
                         "precision": precision, "select_on_validation": True if select else None,
                         "policy_step": policy_step,
                         "log_to": log_to.split(",") if log_to else None}
            if model:  # an explicit model replaces the preset's tiny model
                overrides["init_model"] = None
            from qevolve_cli.models.hub import resolve_model

            names = flag_names({k: v for k, v in overrides.items() if k != "init_model"},
                               rename={"start_policy": "--policy", "expert_data": "--expert"})
            cfg, origin = naming_flags(lambda: resolve_with_origin(env, preset, config, overrides,
                                                                   {**names, "init_model": "--model"}), names)
            if print_cfg:
                return print_config(evolve_rows(cfg, origin), f"qevolve evolve --env {env} --preset {preset}: "
                                    "resolved config (field, value, set by); stages per iteration", json_out)
            if model:
                cfg = cfg.replace(model=resolve_model(model, "--model"))
            if cfg.start_policy:
                cfg = cfg.replace(start_policy=resolve_model(cfg.start_policy, "--policy"))
            rd = run_dir or Path("runs") / f"{env}-{preset}"
            rep = run_evolve(cfg, rd, resume=resume, quiet=quiet, reconfigure=reconfigure)
            if json_out:
                emit_json(rep)
            else:
                print_table(rep)

        run_command(body)
