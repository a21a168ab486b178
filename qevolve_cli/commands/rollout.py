"""`qevolve rollout`: the policy plays a split in batches; the trajectories land in a step table."""
from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated, Any

import typer

from qevolve_cli.commands.common import (
    ENVS,
    ConfigOpt,
    JsonOpt,
    PrecisionOpt,
    PrintConfigOpt,
    QuietOpt,
    ShardOpt,
    emit_json,
    precision_dtype,
    print_config,
    progress,
    require,
    run_command,
    stderr_console,
)

HELP = """Collect self-play trajectories of a policy into a step table (docs/tables.md; source=self).

Episodes are played in batches: one generation call per round for every live
episode, environment steps in a pool of worker processes, finished episodes
replaced by new (task, sample) pairs until every task has --n-per-task
trajectories. Finished episodes are appended to OUT.partial/journal.jsonl as they
finish; after an interruption --resume plays only the missing pairs. The final
table is written atomically, with the resolved config in OUT.config.yaml.
--shard I/N plays one contiguous block of the (task, sample) pairs with the
trajectory ids and seeds of the unsharded run: one shard per node, then
`qevolve label shard_0.parquet shard_1.parquet ...` labels them as one rollout.

\b
Examples:
  qevolve rollout --env textcraft --policy runs/bc/policy --split train --max-tasks 20 --out self.parquet
  qevolve rollout --env sciworld --policy Llama-2-7b-chat --adapter runs/it1/policy --backend vllm \\
      --n-per-task 3 --iteration 1 --out it1_self.parquet
  qevolve rollout --env sciworld --policy my-model --backend openai --base-url http://127.0.0.1:8000/v1 \\
      --out self.parquet
  qevolve rollout --env textcraft --policy runs/bc/policy --out self.parquet --resume   # after Ctrl-C
  qevolve rollout --env alfworld --policy runs/bc/policy --backend vllm --shard $NODE/4 --out self_$NODE.parquet
"""

PolicyOpt = Annotated[str | None, typer.Option("--policy", help="Policy model: a Hugging Face model directory (or "
                                               "the model name served at --base-url). Required.")]
EnvReqOpt = Annotated[str | None, typer.Option("--env", help=f"Environment: {', '.join(ENVS)}. Required.")]
OutReqOpt = Annotated[Path | None, typer.Option("--out", "-o", help="Output path (written atomically). Required.")]
AdapterOpt = Annotated[Path | None, typer.Option("--adapter", help="PEFT LoRA adapter directory on top of --policy.")]
BackendOpt = Annotated[str | None, typer.Option("--backend", help="Generation backend: hf, vllm, openai.")]
BaseUrlOpt = Annotated[str | None, typer.Option("--base-url", help="OpenAI-compatible server, e.g. "
                                                "http://127.0.0.1:8000/v1 (with --backend openai).")]
ApiKeyEnvOpt = Annotated[str | None, typer.Option("--api-key-env", metavar="VAR", help="Environment variable that "
                                                  "holds the server's API key, sent as a Bearer token (with --backend "
                                                  "openai; default OPENAI_API_KEY; the name, not the key).")]
# options shared with `qevolve eval`
MaxTasksOpt = Annotated[int | None, typer.Option("--max-tasks", help="Only the first N tasks of the split.")]
WorkersOptN = Annotated[int | None, typer.Option("--workers", "-w", help="Environment worker processes.")]
EnvsPerWorkerOpt = Annotated[int | None, typer.Option("--envs-per-worker", help="Live episodes per worker.")]
LanesOpt = Annotated[int | None, typer.Option("--lanes", help="Split the live episodes into N lanes: generate for one "
                                              "while the workers step the others (1 = no overlap; default 2).")]
MaxNewTokensOpt = Annotated[int | None, typer.Option("--max-new-tokens", help="Tokens generated per turn.")]
MaxStepsOpt = Annotated[int | None, typer.Option("--max-steps", help="Turns per episode (0 = the env's limit).")]
IterationOpt = Annotated[int | None, typer.Option("--iteration", help="Evolving iteration recorded in the table.")]


def resolve_config(config: Path | None, flags: dict[str, Any], rename: dict[str, str] | None = None):
    """The RolloutConfig of `rollout` / `eval` (:class:`qevolve_cli.config.Resolved`): defaults, ``--config``
    (a flat file or its ``rollout:`` section), then the flags (``None`` = not given)."""
    from qevolve_cli.config import file_layers, flag_layer, load_yaml, resolve_layers
    from qevolve_cli.rollout.config import RolloutConfig

    section = "rollout" if config is not None and "rollout" in load_yaml(config) else None
    return resolve_layers(RolloutConfig, file_layers(config, section) + [flag_layer(flags, rename)])


def prepare(command: str, config: Path | None, flags: dict[str, Any], *, print_cfg: bool, json_out: bool,
            required: dict[str, Any], policy: str | None, adapter: Path | None,
            rename: dict[str, str] | None = None):
    """What `rollout` and `eval` do before playing: resolve the config (:func:`resolve_config`); with
    ``--print-config`` print it and return ``None``; else check the ``required`` options, resolve the policy
    (:func:`resolve_policy`) and let SIGTERM end the run like Ctrl-C. Returns ``(cfg, policy, adapter)``."""
    resolved = resolve_config(config, flags, {"dtype": "--precision", **(rename or {})})
    if print_cfg:
        print_config(resolved.rows(), f"qevolve {command}: resolved config (field, value, set by)", json_out)
        return None
    require(required)
    out = resolve_policy(resolved.config, policy, adapter)
    sigterm_as_interrupt()
    return out


def resolve_policy(cfg, policy: str, adapter: Path | None):
    """``--policy`` / ``--adapter`` -> local paths (a Hub id through the HF cache), and the config that serves them.

    With ``--backend openai`` ``--policy`` may only name the served model; a Hub id that resolved to a local
    path stays the served model's name (the server knows it by that id). Returns ``(cfg, policy, adapter)``."""
    from qevolve_cli.models.hub import resolve_model

    pol = resolve_model(policy, "--policy", required=cfg.backend != "openai")
    adp = resolve_model(adapter, "--adapter")
    if cfg.backend == "openai" and pol != policy and not adp and not cfg.served_model:
        cfg = cfg.replace(served_model=policy)
    return cfg, pol, adp


def sigterm_as_interrupt() -> None:
    """SIGTERM ends the run like Ctrl-C: the pool's workers are stopped, the journal kept."""

    def handler(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


class ProgressView:
    """Rich progress bar on stderr: episodes done, success so far, steps/s."""

    def __init__(self, label: str, quiet: bool):
        self.p = progress(quiet=quiet)
        self.label = label
        self.task = None

    def __enter__(self):
        self.p.__enter__()
        return self

    def __exit__(self, *exc):
        self.p.__exit__(*exc)

    def __call__(self, st) -> None:
        if self.task is None:
            self.task = self.p.add_task(self.label, total=st.total, info="")
        info = f"success {st.successes}/{st.done}"
        if st.failed:
            info += f" · failed {st.failed}"
        info += f" · {st.steps_per_s:.1f} steps/s"
        self.p.update(self.task, completed=st.done, total=st.total, info=info)


def register(app: typer.Typer) -> None:
    @app.command("rollout", help=HELP)
    def rollout(
        env: EnvReqOpt = None,
        policy: PolicyOpt = None,
        out: OutReqOpt = None,
        split: Annotated[str | None, typer.Option("--split", help="Task split: train, test_seen, test_unseen, test.")] = None,
        adapter: AdapterOpt = None,
        n_per_task: Annotated[int | None, typer.Option("--n-per-task", help="Trajectories per task (paper: 3).")] = None,
        temperature: Annotated[float | None, typer.Option("--temperature", help="Sampling temperature (0 = greedy).")] = None,
        max_tasks: MaxTasksOpt = None,
        workers: WorkersOptN = None,
        envs_per_worker: EnvsPerWorkerOpt = None,
        lanes: LanesOpt = None,
        backend: BackendOpt = None,
        base_url: BaseUrlOpt = None,
        api_key_env: ApiKeyEnvOpt = None,
        seed: Annotated[int | None, typer.Option("--seed", help="Random seed (same seed -> same table with hf on CPU).")] = None,
        iteration: IterationOpt = None,
        max_new_tokens: MaxNewTokensOpt = None,
        max_steps: MaxStepsOpt = None,
        max_context: Annotated[int | None, typer.Option("--max-context", help="Context length in tokens (0 = model max).")] = None,
        precision: PrecisionOpt = None,
        resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted rollout from OUT.partial/journal.jsonl.")] = False,
        shard: ShardOpt = None,
        config: ConfigOpt = None,
        print_cfg: PrintConfigOpt = False,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        def body() -> None:
            from qevolve_cli.rollout.loop import run_rollout

            ready = prepare("rollout", config, {
                "env": env, "split": split, "n_per_task": n_per_task, "temperature": temperature,
                "max_tasks": max_tasks, "workers": workers, "envs_per_worker": envs_per_worker, "lanes": lanes,
                "backend": backend, "base_url": base_url, "api_key_env": api_key_env, "seed": seed, "iteration": iteration,
                "max_new_tokens": max_new_tokens, "max_steps": max_steps, "max_context": max_context,
                "shard": shard, "dtype": precision_dtype(precision),
            }, print_cfg=print_cfg, json_out=json_out, required={"--env": env, "--policy": policy, "--out": out},
                policy=policy, adapter=adapter)
            if ready is None:
                return
            cfg, pol, adp = ready
            try:
                with ProgressView(f"rollout {cfg.env}/{cfg.split}", quiet) as view:
                    res = run_rollout(cfg, pol, out, adapter=adp, resume=resume, on_progress=view)
            except KeyboardInterrupt:
                from qevolve_cli.rollout.loop import journal_path

                typer.echo(f"interrupted: finished episodes are kept in {journal_path(out)}; "
                           "rerun with --resume to complete", err=True)
                raise
            t = res.table
            n_traj = t["traj_id"].n_unique()
            per = t.group_by("traj_id").agg(pl_sum_reward())
            summary = {
                "out": str(out), "env": cfg.env, "split": cfg.split, "iteration": cfg.iteration,
                "shard": cfg.shard or None,
                "trajectories": n_traj, "steps": t.height,
                "success_rate": round(float((per["reward"] > 0).mean()), 6),
                "avg_reward": round(float(per["reward"].mean()), 6),
                "failed": int(t.filter(t["error"].is_not_null())["traj_id"].n_unique()) if "error" in t.columns else 0,
                "truncated_steps": int(t["truncated"].sum()) if "truncated" in t.columns else 0,
                "stats": res.stats.to_dict(),
            }
            if json_out:
                emit_json(summary)
            else:
                stderr_console().print(
                    f"[green]wrote[/green] {out}: {n_traj} trajectories, {t.height} steps "
                    f"({cfg.env}/{cfg.split}), non-zero reward {summary['success_rate']:.3f}, "
                    f"avg reward {summary['avg_reward']:.3f}, failed {summary['failed']}")

        run_command(body)


def pl_sum_reward():
    import polars as pl

    return pl.col("reward_env").sum().alias("reward")
