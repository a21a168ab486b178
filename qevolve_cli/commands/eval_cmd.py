"""`qevolve eval`: greedy evaluation of a policy on a split; average reward and success rate."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from qevolve_cli.commands.common import (
    ConfigOpt,
    JsonOpt,
    PrecisionOpt,
    PrintConfigOpt,
    QuietOpt,
    ShardOpt,
    emit_json,
    precision_dtype,
    run_command,
)
from qevolve_cli.commands.rollout import (
    AdapterOpt,
    ApiKeyEnvOpt,
    BackendOpt,
    BaseUrlOpt,
    EnvReqOpt,
    EnvsPerWorkerOpt,
    IterationOpt,
    LanesOpt,
    MaxNewTokensOpt,
    MaxStepsOpt,
    MaxTasksOpt,
    PolicyOpt,
    ProgressView,
    WorkersOptN,
    prepare,
)

HELP = """Evaluate a policy on a split: one greedy trajectory per task.

Prints a table of the average reward (the paper's metric: mean final score in
[0, 1], shown x100) and the success rate (share of tasks completed, final
reward = 1), overall and per task type, naming the env and split. The
trajectories are written to --out (default eval_<env>_<split>.parquet) and the
metrics to OUT.metrics.json. --critic DIR --candidates N reranks N sampled
candidates per step by the critic's Q - V (test-time best-of-N).
--best-of N samples N whole trajectories per task (rollout temperature) and
keeps the one with the highest final env reward: QLASS's Best-of-N baseline,
an oracle upper bound (it reads the outcome), marked as such in the output.
--shard I/N evaluates one contiguous block of the tasks (with --best-of: all
N samples of each of its tasks) and prints that shard's metrics; the metrics
of the whole split come from the shards' tables (docs/rollout.md, "Shards").

\b
Examples:
  qevolve eval --env sciworld --policy runs/it1/policy --split test_seen
  qevolve eval --env textcraft --policy runs/bc/policy --split test_unseen --max-tasks 20 --json
  qevolve eval --env alfworld --policy base --adapter runs/it2/policy --split test_unseen --backend vllm
  qevolve eval --env sciworld --policy runs/it1/policy --split test_seen --critic runs/it1/critic --candidates 5
  qevolve eval --env lamps --policy runs/bc/policy --split test_seen --best-of 6 --temperature 1.0
  qevolve eval --env alfworld --policy runs/it1/policy --split test_unseen --shard 1/2 --out ev_1.parquet --json
"""


def render_table(m: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    title = f"{m['env']} / {m['split']} — {m['n']} tasks" + (f", critic best-of-{m['candidates']}" if m.get("critic") else "")
    if m.get("shard"):
        title += f", shard {m['shard']} only"
    if m.get("best_of", 1) > 1:
        title += f", best-of-{m['best_of']} by env reward (oracle upper bound)"
    tab = Table(title=title)
    for col in ("task type", "n", "avg reward (x100)", "success %", "avg steps", "failed"):
        tab.add_column(col, justify="left" if col == "task type" else "right")

    def row(name: str, d: dict[str, Any], style: str | None = None) -> None:
        tab.add_row(name, str(d["n"]), f"{100 * d['avg_reward']:.1f}", f"{100 * d['success_rate']:.1f}",
                    f"{d['avg_steps']:.1f}", str(d["failed"]), style=style)

    by = m.get("by_task_type", {})
    if len(by) > 1 or (by and next(iter(by)) != "all"):
        for name, d in by.items():
            row(name, d)
    row("overall", m, style="bold")
    Console().print(tab)


def shard_suffix(shard: str) -> str:
    """``"1/4"`` -> ``"_1of4"`` (the default output name of a shard), ``""`` -> ``""``."""
    if not shard:
        return ""
    from qevolve_cli.shard import parse_shard

    i, n = parse_shard(shard)
    return f"_{i}of{n}"


def register(app: typer.Typer) -> None:
    @app.command("eval", help=HELP)
    def eval_cmd(
        env: EnvReqOpt = None,
        policy: PolicyOpt = None,
        split: Annotated[str | None, typer.Option("--split", help="Evaluation split: test_seen, test_unseen, test "
                                                  "(WebShop), train. Required.")] = None,
        adapter: AdapterOpt = None,
        out: Annotated[Path | None, typer.Option("--out", "-o", help="Trajectory table (default eval_<env>_<split>.parquet; "
                                        "with --shard I/N eval_<env>_<split>_IofN.parquet).")] = None,
        max_tasks: MaxTasksOpt = None,
        temperature: Annotated[float | None, typer.Option("--temperature", help="Decoding temperature (default 0 = greedy; "
                                                          "with --best-of: the sampling temperature, default the "
                                                          "config's rollout temperature).")] = None,
        best_of: Annotated[int, typer.Option("--best-of", help="Sample N trajectories per task, keep the best by final "
                                             "env reward (oracle upper bound, QLASS's Best-of-N).", min=1)] = 1,
        workers: WorkersOptN = None,
        envs_per_worker: EnvsPerWorkerOpt = None,
        lanes: LanesOpt = None,
        backend: BackendOpt = None,
        base_url: BaseUrlOpt = None,
        api_key_env: ApiKeyEnvOpt = None,
        critic: Annotated[Path | None, typer.Option("--critic", help="Critic directory: rerank candidates by Q - V.")] = None,
        candidates: Annotated[int | None, typer.Option("--candidates", help="Candidates per step with --critic.")] = None,
        seed: Annotated[int | None, typer.Option("--seed", help="Random seed.")] = None,
        max_new_tokens: MaxNewTokensOpt = None,
        max_steps: MaxStepsOpt = None,
        iteration: IterationOpt = None,
        precision: PrecisionOpt = None,
        resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted evaluation.")] = False,
        shard: ShardOpt = None,
        config: ConfigOpt = None,
        print_cfg: PrintConfigOpt = False,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        def body() -> None:
            from qevolve_cli.atomic import write_json
            from qevolve_cli.rollout.evaluate import run_eval

            ready = prepare("eval", config, {
                "env": env, "split": split, "max_tasks": max_tasks,
                ("temperature" if best_of > 1 else "eval_temperature"): temperature,
                "workers": workers, "envs_per_worker": envs_per_worker, "lanes": lanes, "backend": backend, "base_url": base_url,
                "api_key_env": api_key_env, "seed": seed, "max_new_tokens": max_new_tokens, "max_steps": max_steps, "iteration": iteration,
                "candidates": candidates, "shard": shard, "dtype": precision_dtype(precision),
            }, print_cfg=print_cfg, json_out=json_out, required={"--env": env, "--policy": policy, "--split": split},
                policy=policy, adapter=adapter, rename={"eval_temperature": "--temperature"})
            if ready is None:
                return
            cfg, pol, adp = ready
            dest = out or Path(f"eval_{cfg.env}_{cfg.split}{shard_suffix(cfg.shard)}.parquet")
            with ProgressView(f"eval {cfg.env}/{cfg.split}", quiet) as view:
                m = run_eval(cfg, pol, dest, adapter=adp, critic=critic, best_of=best_of, resume=resume,
                             on_progress=view)
            write_json(dest.with_name(dest.name + ".metrics.json"), m)
            if json_out:
                emit_json(m)
            else:
                render_table(m)

        run_command(body)
