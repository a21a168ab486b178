"""`qevolve label`: hybrid buffer -> labelled table (retrospective rewards, weights, positions, advantages)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qevolve_cli.commands.common import (
    ConfigOpt,
    JsonOpt,
    PrintConfigOpt,
    QuietOpt,
    emit_json,
    print_config,
    require,
    run_command,
)

HELP = """Label one or more step tables into ONE labelled table (docs/commands.md).

Adds reward_aux / aux_kind (retrospective labels, rules per env from configs/labels.yaml),
success and weight (w_t = (t/T + d)*0.5 + 0.5); with --tokenizer the prefix positions
pos_s / pos_sa / pos_next; with --critic (or value/next_value already present, or
--value-source oracle on an environment with an exact solver) the GAE process reward
`advantage`; with --advantage gigpo GiGPO's critic-free advantage (and how many steps share an
anchor state). Input files are never modified; the output is written atomically, and a
second `label` on the same --out while one runs is refused with one line (the output lock).

\b
Examples:
  qevolve label expert.parquet self.parquet --out labeled.parquet
  qevolve label expert.parquet self.parquet --out labeled.parquet --tokenizer runs/bc/policy
  qevolve label labeled.parquet --critic runs/iter_1/critic --out advantages.parquet --json
  qevolve label expert.parquet self.parquet --out gigpo.parquet --advantage gigpo   # GiGPO, no critic
  qevolve label buf.parquet --out l.parquet --no-retrospective     # ablation w/o RR
  qevolve label expert.parquet self.parquet --out exact.parquet --value-source oracle   # exact V* (lamps)
  qevolve label expert.parquet self.parquet --out l.parquet --step-limit 26   # steps_left on the expert rows too
"""


def register(app: typer.Typer) -> None:
    @app.command("label", help=HELP)
    def label(
        inputs: Annotated[list[Path] | None, typer.Argument(help="Input step tables (Parquet). Required.",
                                                            show_default=False)] = None,
        out: Annotated[Path | None, typer.Option("--out", "-o", help="Output path (written atomically). "
                                                 "Required.")] = None,
        tokenizer: Annotated[Path | None, typer.Option("--tokenizer", help="Tokenizer directory: add pos_s/pos_sa/pos_next.")] = None,
        critic: Annotated[Path | None, typer.Option("--critic", help="Critic directory: add value/next_value/advantage.")] = None,
        config: ConfigOpt = None,
        advantage: Annotated[str | None, typer.Option("--advantage", help="Process reward: gae, gae_aux, td, q_minus_v (these need critic values), or gigpo "
                                       "(GiGPO's anchor-state credit from the table's own returns, no critic; the "
                                       "gigpo_* fields of --config, label section).")] = None,
        retrospective: Annotated[bool | None, typer.Option("--retrospective/--no-retrospective", help="Retrospective labels on/off (ablation).")] = None,
        max_length: Annotated[int | None, typer.Option("--max-length", help="Token budget for prefix indexing.")] = None,
        window_context: Annotated[float | None, typer.Option(
            "--window-context", help="With --max-length: share of it a new window of a long trajectory starts with "
                                     "(the critic's window_context; default 0.5).")] = None,
        value_source: Annotated[str | None, typer.Option(
            "--value-source", help="value/next_value from: critic (default; --critic), oracle (exact V* of the "
                                   "env's solver: lamps, lamps-hard, lamps-habit), tabular_iql (exact IQL on the table).")] = None,
        step_limit: Annotated[int | None, typer.Option(
            "--step-limit", help="Fill steps_left (N - step) on rows without one, such as expert demonstrations: the "
                                 "self-play episodes' step limit, for a critic with time_input steps_left.")] = None,
        print_cfg: PrintConfigOpt = False,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        def body() -> None:
            from qevolve_cli.config import file_layers, flag_layer, resolve_layers
            from qevolve_cli.labeling import LabelConfig, label_tables

            flags = flag_layer({"advantage": advantage, "retrospective": retrospective, "max_length": max_length,
                                "window_context": window_context, "value_source": value_source, "step_limit": step_limit},
                               rename={"retrospective": "--retrospective/--no-retrospective"})
            res = resolve_layers(LabelConfig, file_layers(
                config, "label" if config and _has_section(config, "label") else None) + [flags])
            if print_cfg:
                return print_config(res.rows(), "qevolve label: resolved config (field, value, set by)", json_out)
            require({"INPUTS": inputs, "--out": out})
            cfg = res.config
            from qevolve_cli.models.hub import resolve_model

            tok = resolve_model(tokenizer, "--tokenizer")
            tok = Path(tok) if tok is not None else None
            # an explicit --advantage asks for advantages: without critic values that is an error
            from qevolve_cli.lock import hold_output

            with hold_output(out, hint="wait for it to end or stop it, then rerun"):
                summary = label_tables(inputs, out, cfg, tokenizer=tok, critic=critic,
                                       require_advantage=advantage is not None)
            if json_out:
                emit_json(summary)
            elif not quiet:
                # click's styling, not rich: importing rich costs a tenth of a short `label` run
                typer.echo(
                    typer.style("wrote", fg="green") + f" {summary['out']}: {summary['trajectories']} trajectories, "
                    f"{summary['steps']} steps, success {summary['success_rate']:.3f}, "
                    f"aux {summary['aux_kind']} in {summary['seconds']['total']:.2f}s", err=True)
                if "prefix" in summary:
                    p = summary["prefix"]
                    typer.echo("prefix positions: " + ", ".join(f"{k}={v}" for k, v in p.items()), err=True)
                if "gigpo" in summary:
                    from qevolve_cli.rewards import gigpo_line

                    typer.echo(gigpo_line(summary["gigpo"]), err=True)

        # without --tokenizer/--critic, label makes a few hundred Python objects (the rows live in
        # Polars and the Rust core): it can finish without the cyclic collector (restore_gc)
        run_command(body, keep_gc_off=tokenizer is None and critic is None)


def _has_section(path: Path, name: str) -> bool:
    from qevolve_cli.config import load_yaml

    return name in load_yaml(path)
