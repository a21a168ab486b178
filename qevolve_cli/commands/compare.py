"""`qevolve compare`: SFT, RFT, ETO, Best-of-N and Q-Evolve on one evolve run's data, one table."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from qevolve_cli.commands.common import (
    ConfigOpt,
    JsonOpt,
    PrintConfigOpt,
    QuietOpt,
    SetOpt,
    emit_json,
    parse_sets,
    print_config,
    require,
    run_command,
)

HELP = """Compare Q-Evolve with the paper's baselines on the same data and the same evaluation.

\b
From RUN_DIR of `qevolve evolve` (its expert table, iteration-1 rollouts, base
model, BC policy and evaluation settings):
  Zero-shot  the base model, untrained (only a pretrained base: not a random
             init-model --size model)
  SFT        the run's BC policy
  RFT        policy --objective rft from the base model (expert + successful
             iteration-1 rollouts, the run's BC settings)
  ETO        policy --objective dpo from the BC policy (ETO pairs of expert vs
             iteration-1 rollouts, frozen reference = BC; ETO's recipe: beta
             0.1, 3 epochs, lr = the run's SFT lr / 20; plus RPO's NLL term
             on the chosen trajectories, weight 1.0)
  Best-of-N  the BC policy, N = 6 sampled trajectories per task, the best by
             final env reward: an ORACLE upper bound, not a deployable method
  Q-Evolve   the run's last evaluated iteration (earlier iterations: rows too)
  Q-Evolve (oracle V)  where the env has an exact solver (lamps, lamps-hard,
             lamps-habit): iteration 1's policy step on the exact values
  RFT (2 rounds)  only when named (arms=[..., rft, rft_2]): the RFT policy
             plays the train tasks again, then RFT from the base model on
             the expert table + those successes (the control for Q-Evolve's
             second iteration)
--select-on-validation: every trained arm is chosen among the same number of
candidate settings on validation train tasks (never test); the run must be
made with `evolve --select-on-validation` (docs/compare.md).
Every arm is evaluated on the run's eval splits with the run's eval config;
evaluations the run already made with that config are reused. Prints one table
(rows = methods, columns = env x split, average reward x100, plus env steps),
writes RUN_DIR/compare/ (table.md, table.json, manifest.json); --resume
continues an interrupted comparison, and with other rows (--set arms=[...])
adds them to a finished one, keeping every finished stage (so does a change of
how a training arm runs: --set rft.checkpoint_every_steps=20).
\b
Examples:
  qevolve evolve --env lamps --preset cpu --iters 1 --run-dir runs/lamps-s0
  qevolve compare --run-dir runs/lamps-s0
  qevolve compare --run-dir runs/lamps-s0 --resume --json
  qevolve evolve --env lamps --preset cpu --iters 2 --select-on-validation --run-dir runs/lamps-sel
  qevolve compare --run-dir runs/lamps-sel --select-on-validation
  qevolve compare --run-dir runs/lamps-sel --select-on-validation --resume --set "arms=[sft, rft, rft_2, eto, best_of_n, qevolve]"
  qevolve compare --run-dir runs/lamps-s0 --set best_of=4 --set eto.dpo_beta=0.5 --out runs/lamps-s0/cmp2
"""


def render(table: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from qevolve_cli.evolve.compare import budget_text, selection_text
    from qevolve_cli.evolve.compare_table import rounds_note

    tab = Table(title=f"{table['env']} (seed {table['seed']}): average reward x100 per split")
    tab.add_column("method", no_wrap=True)
    for c in table["columns"]:
        tab.add_column(c.split("/", 1)[1], justify="right", no_wrap=True)
    tab.add_column("self-play steps", justify="right")
    tab.add_column("eval steps", justify="right")
    for r in table["rows"]:
        cells = []
        for c in table["columns"]:
            s = r["scores"].get(c)
            cells.append("–" if not s or s.get("avg_reward") is None else f"{100 * s['avg_reward']:.1f}")
        tab.add_row(r["method"], *cells, str(r["self_play_steps"]), str(r["eval_steps"]),
                    style="italic" if r["oracle"] else None)
    Console().print(tab)
    for r in table["rows"]:  # the budget of every row, and its choice on validation (long: one line each)
        Console().print(f"{r['method']}: trained on {budget_text(r.get('budget', []))}; chosen on validation: "
                        f"{selection_text(r).replace('**', '')}", highlight=False, soft_wrap=True)
    if any(r["oracle"] for r in table["rows"]):
        Console().print(f"Best-of-N: best of {table['best_of']} trajectories by the environment's final reward "
                        "(oracle upper bound).")
    if note := rounds_note(table):
        Console().print(note, highlight=False, soft_wrap=True, markup=False)


def nest_sets(sets: dict[str, Any]) -> dict[str, Any]:
    """``--set rft.lr=1e-4`` -> ``{"rft": {"lr": 1e-4}}`` (the arms' PolicyConfig overrides)."""
    out: dict[str, Any] = {}
    for k, v in sets.items():
        head, _, rest = k.partition(".")
        if rest:
            out.setdefault(head, {})[rest] = v
        else:
            out[k] = v
    return out


def register(app: typer.Typer) -> None:
    @app.command("compare", help=HELP)
    def compare(
        run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Run directory of `qevolve evolve`. "
                                                     "Required.")] = None,
        out: Annotated[Path | None, typer.Option("--out", "-o", help="Comparison directory (default RUN_DIR/compare).")] = None,
        resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted comparison.")] = False,
        select: Annotated[bool, typer.Option("--select-on-validation", help="Choose every arm's setting among the "
                                             "same number of candidates on validation train tasks (never test); the "
                                             "run must be made with `evolve --select-on-validation`.")] = False,
        select_only: Annotated[bool, typer.Option("--select-only", help="Stop after the selection (prints and writes "
                                                  "selection.json; reads no test split).")] = False,
        config: ConfigOpt = None,
        sets: SetOpt = None,
        print_cfg: PrintConfigOpt = False,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        def body() -> None:
            from qevolve_cli.config import file_layers, flag_layer, resolve_layers, set_layer
            from qevolve_cli.evolve.compare import CompareConfig, _echo_stderr, run_compare

            resolved = resolve_layers(CompareConfig, file_layers(config) + [set_layer(nest_sets(parse_sets(sets))),
                                                                             flag_layer({"select_on_validation":
                                                                                         True if select else None})])
            if print_cfg:
                return print_config(resolved.rows(), "qevolve compare: resolved config (field, value, set by)",
                                    json_out)
            require({"--run-dir": run_dir})
            ccfg = resolved.config
            if select_only and not ccfg.select_on_validation:
                from qevolve_cli.errors import QevolveError

                raise QevolveError("--select-only: nothing to select without --select-on-validation")
            table = run_compare(run_dir, ccfg, out=out, resume=resume, quiet=quiet, select_only=select_only,
                                echo=(lambda _m: None) if quiet else _echo_stderr)
            if json_out or select_only:
                emit_json(table)
            else:
                render(table)

        run_command(body)
