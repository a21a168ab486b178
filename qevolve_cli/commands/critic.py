"""``qevolve critic``: train the weighted IQL critic on a labelled table."""
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
    progress,
    require,
    run_command,
)

HELP = """Train the weighted IQL critic (docs/critic.md) on a labelled table.

One frozen backbone (--model) with three LoRA adapters on the same model object:
value, q and the delayed q_target (EMA, lambda 0.005 every 2 updates), MLP heads
g_v, g_q1, g_q2 on the last-token hidden states at pos_s / pos_sa / pos_next.
L_Q = sum_t w_t [(Q1 - y)^2 + (Q2 - y)^2], y = r_env + r_aux + gamma (1 - d) V(s');
L_V = sum_t w_t L2^m(min(Qbar1, Qbar2) - V(s)); Q and V updates alternate.
One forward per adapter per trajectory gives every step's pooled states.
The table needs the columns of `qevolve label` (reward_aux, weight); positions are
taken from it when present, else computed with --model's tokenizer and chat template.

Writes OUT atomically: adapters/{value,q,q_target} (PEFT), heads.safetensors,
critic.json, config.yaml (resolved), metrics.jsonl (losses, mean V / Q, TD error and the
held-out diagnostics per epoch), diagnostics.json, summary.json and the tokenizer. A second
run on the same OUT while one is running is refused with one line (the output lock). An
interrupted run (also under DeepSpeed) resumes from OUT.partial/ when started again with
the same arguments: a checkpoint per epoch and, with --set checkpoint_every_steps=N, every
N updates.

Diagnostics (docs/critic.md#diagnostics): 10 % of the trajectories (heldout_fraction) are
held out by traj_id; after every epoch the critic is scored on them: Bellman errors of Q
and V, explained variance of V against the discounted return, AUC of V for success, mean
advantage by source x success x aux_kind. A critic that has clearly not learned gets one
warning line on stderr naming the knob to turn; a slice with fewer than 3 trajectories of an
outcome gets a note instead (too few to judge). --set early_stop_patience=3 stops when the
held-out Bellman error stops improving (epochs is then the cap) and keeps the best epoch.
\b
Examples:
  qevolve critic --data labeled.parquet --model runs/bc/policy --out runs/it1/critic
  qevolve critic --data labeled.parquet --model tiny/ --out critic/ --preset cpu --json
  qevolve critic --data labeled.parquet --model bc/ --out c2/ --preset iter2 --steps-per-traj 4
  qevolve critic --data labeled.parquet --model bc/ --out c/ --set weighted=false   # ablation w/o W-IQL
  qevolve critic --data labeled.parquet --model bc/ --out c/ --epochs 60 --set early_stop_patience=4
  qevolve critic --data labeled.parquet --model bc/ --out fc/ --set kind=features --set context_turns=1 \
      --set time_input=steps_left --epochs 300   # heads on cached frozen features (seconds a run)
  qevolve label labeled.parquet --critic runs/it1/critic --out advantages.parquet

--set kind=features trains the heads on cached frozen hidden states instead (one no-grad pass of
the backbone, cached beside the table; docs/critic.md, "The feature critic"). Every run ends with
the fit ladder on the critic's own training steps (terminal fit, TD residual, V along failed
episodes; on the lamps environments the exact tabular fixed point and the step credit), and the
warning names the first rung that fails (docs/critic.md, "The fit ladder").
"""


def register(app: typer.Typer) -> None:
    @app.command("critic", help=HELP)
    def critic(
        data: Annotated[Path | None, typer.Option("--data", help="Labelled trajectory table (qevolve label). "
                                                  "Required.")] = None,
        model: Annotated[Path | None, typer.Option("--model", help="Base model directory: the frozen backbone and "
                                                   "its tokenizer. Required.")] = None,
        out: Annotated[Path | None, typer.Option("--out", "-o", help="Output critic directory (written atomically). "
                                                 "Required.")] = None,
        config: ConfigOpt = None,
        preset: Annotated[str | None, typer.Option("--preset", help="Named preset of the config file (default file "
                                                   "configs/critic.yaml), or of configs/presets/ (cpu, smoke, "
                                                   "alfworld_iter2, ...: what `qevolve evolve` gives this stage).")] = None,
        sets: SetOpt = None,
        epochs: EpochsOpt = None,
        lr: LrOpt = None,
        steps_per_traj: Annotated[int | None, typer.Option("--steps-per-traj", help="Steps K sampled per "
                                                           "trajectory per update (0: all).")] = None,
        batch_size: Annotated[int | None, typer.Option("--batch-size", help="Trajectories per batch.")] = None,
        seed: Annotated[int | None, typer.Option("--seed", help="Random seed.")] = None,
        resume: Annotated[bool, typer.Option("--resume/--no-resume", help="Resume from OUT.partial/ if present.")] = True,
        print_cfg: PrintConfigOpt = False,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        def body():
            from qevolve_cli.config import flag_layer, resolve_layers, set_layer
            from qevolve_cli.critic.config import CriticConfig, critic_layers

            flags = flag_layer({"epochs": epochs, "lr": lr, "steps_per_traj": steps_per_traj,
                                "batch_size": batch_size, "seed": seed})
            res = resolve_layers(CriticConfig, critic_layers(config, preset) + [set_layer(parse_sets(sets)), flags])
            if print_cfg:
                return print_config(res.rows(), "qevolve critic: resolved config (field, value, set by)", json_out)
            require({"--data": data, "--model": model, "--out": out})
            cfg = res.config
            from qevolve_cli.critic.trainer import train_critic
            from qevolve_cli.models.hub import resolve_model

            base = Path(resolve_model(model, "--model"))
            from qevolve_cli.lock import hold_output
            from qevolve_cli.training import is_main_process

            # the output lock (under torchrun: rank 0 holds it, every rank gets its verdict) before anything is read
            with hold_output(out), progress(quiet or not is_main_process()) as bar:
                task = None

                def factory(total: int):
                    nonlocal task
                    task = bar.add_task("critic", total=total, info="")

                    def cb(advance: int, info: str) -> None:
                        bar.update(task, advance=advance, info=info)

                    return cb

                summary = train_critic(cfg, data, base, out, progress=factory, resume=resume)
            if not is_main_process():  # ranks > 0 of a multi-process (DeepSpeed) launch stay silent
                return
            if summary.get("warning"):
                typer.echo(f"qevolve critic: {summary['warning']}", err=True)
            if json_out:
                emit_json(summary)
            else:
                from qevolve_cli.critic.diagnostics import summary_line

                f = summary["final"] or {}
                d = summary.get("diagnostics") or {}
                stopped = (f", early-stopped after epoch {summary['early_stopped_at']}"
                           if summary.get("early_stopped_at") else "")
                kept = f", kept epoch {summary['restored_epoch']}" if summary.get("restored_epoch") else ""
                typer.echo(
                    f"critic: {summary['trajectories']} trajectories ({summary['heldout_trajectories']} held out), "
                    f"{summary['steps']} steps, {summary['epochs_run']} of {cfg.epochs} epochs{stopped}{kept}; "
                    f"last epoch loss_q {f.get('loss_q'):.4f}, loss_v {f.get('loss_v'):.4f}; "
                    f"{d.get('on', 'held-out')}: {summary_line(d)}; wrote {out}"
                )
                if d.get("fit_ladder"):
                    from qevolve_cli.critic.ladder import ladder_line

                    typer.echo(ladder_line(d["fit_ladder"]))
                feats = summary.get("features")
                if feats:
                    how = "read from the cache" if feats.get("cached") else f"{feats.get('sequences')} sequences"
                    typer.echo(f"features: layer {feats['layer']}, context_turns {feats['context_turns']}, {how} "
                               f"in {feats['seconds']:.1f} s; heads trained in {summary['train_seconds']:.1f} s")

        run_command(body)
