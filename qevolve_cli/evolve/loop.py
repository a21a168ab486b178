"""`qevolve evolve`: BC warm-up, then K iterations of
rollout → label → critic → label --critic → policy (bppo) → eval  (paper Algorithm "Q-Evolve").

``policy_step: awr`` replaces the policy step by advantage-weighted regression from the base model with the
BC budget (:func:`policy_start`; docs/compare.md, "The AWR policy step").

Every stage calls the same library function as its sub-command, records itself
in the run directory's manifest, and is skipped when a resume finds it done.
"""
from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qevolve_cli.errors import ConfigError, QevolveError
from qevolve_cli.evolve.config import EvolveConfig
from qevolve_cli.evolve.rundir import RunDir, make_sinks
from qevolve_cli.evolve.rundir import scalars as _scalars  # noqa: F401 - re-exported (compare, benchmarks)
from qevolve_cli.evolve.select import held_out_hash
from qevolve_cli.rewards import CRITIC_FREE


def _echo_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def policy_start(cfg: EvolveConfig, base: str, prev: str) -> tuple[str, str | None]:
    """(model the iteration's policy step starts from, its frozen reference or None): bppo starts from the
    previous policy ``prev``, which is also pi_ref; awr starts from the base model and has no reference."""
    return (base, None) if cfg.policy_step == "awr" else (prev, prev)


class Plan:
    """The loop's stages as paths inside the run directory, and the equivalent shell commands."""

    def __init__(self, cfg: EvolveConfig, run: Path):
        self.cfg, self.run = cfg, run

    def base_model(self) -> str:
        if self.cfg.model:
            return self.cfg.model
        return "base_model" if self.cfg.init_model else (self.cfg.start_policy or "")

    def expert(self) -> str:
        """The expert table the stages train on: the run's ``expert.parquet`` (collected, or under
        --select-on-validation the ``expert_data`` table less its rows of validation tasks), else ``expert_data``."""
        if self.cfg.expert_data and not self.cfg.select_on_validation:
            return self.cfg.expert_data
        return "expert.parquet"

    def policy(self, k: int) -> str:
        if k == 0:
            return self.cfg.start_policy or "bc/policy"
        return f"iter_{k}/policy"

    def write_stage_configs(self) -> None:
        """Flat per-stage config files (stages/*.yaml) used by the plan's shell commands."""
        from qevolve_cli.config import dump_yaml

        d = self.run / "stages"
        dump_yaml(self.cfg.stage("bc", 0), d / "bc.yaml")
        for k in range(1, max(self.cfg.iters, 1) + 1):
            for name in ("rollout", "label", "critic", "policy"):
                dump_yaml(self.cfg.stage(name, k), d / f"{name}_{k}.yaml")

    def shell(self) -> str:
        c = self.cfg
        q = shlex.quote
        lines = ["#!/usr/bin/env bash", "# The stages of this run as qevolve sub-commands (run from the run directory).",
                 "set -euo pipefail", f"cd {q(str(self.run.resolve()))}"]
        if not c.model and c.init_model:
            arch, size = c.init_model.split(":")
            if arch == "from":
                lines.append(f"qevolve init-model --from {size} --out base_model")
            else:
                lines.append(f"qevolve init-model --out base_model --arch {arch} --size {size} --seed {c.seed}")
        base = q(self.base_model())
        if c.select_on_validation:
            lines.append(f"# --select-on-validation: the last {c.validation_tasks} train tasks are validation tasks, "
                         "left out of the expert data and the rollouts below (docs/compare.md, \"Fair selection\")")
        if c.expert_data and c.select_on_validation:
            lines.append(f"# expert.parquet = {c.expert_data} without its rows of validation tasks")
        elif not c.expert_data:
            lim = f" --limit {c.expert_limit}" if c.expert_limit else ""
            lines.append(f"qevolve expert --env {c.env} --split train{lim} --workers {c.expert_workers} --out expert.parquet")
        if not c.start_policy:
            lines.append(f"qevolve policy --objective bc --data {q(self.expert())} --model {base} --out bc/policy --config stages/bc.yaml")
        mt = f" --max-tasks {c.eval_max_tasks}" if c.eval_max_tasks else ""
        if c.eval_bc:
            for s in c.eval_splits:
                lines.append(f"qevolve eval --env {c.env} --policy {q(self.policy(0))} --split {s}{mt} --config stages/rollout_1.yaml --out iter_0/eval_{s}.parquet")
        for k in range(1, c.iters + 1):
            prev = q(self.policy(k - 1))
            start, ref = policy_start(c, base, prev)
            ref_flag = f" --ref {ref}" if ref else ""
            lines += [
                f"# iteration {k}",
                f"qevolve rollout --env {c.env} --policy {prev} --split train --iteration {k} --seed {c.seed + 1000 * k} "
                f"--config stages/rollout_{k}.yaml --out iter_{k}/rollout.parquet --resume",
                f"qevolve label {q(self.expert())} iter_{k}/rollout.parquet --tokenizer {base} --config stages/label_{k}.yaml "
                f"--out iter_{k}/labeled.parquet",
            ]
            critic_free = c.stage("label", k).advantage in CRITIC_FREE  # gigpo: no critic
            if not critic_free:
                lines.append(f"qevolve critic --data iter_{k}/labeled.parquet --model "
                             f"{base if c.critic_backbone == 'base' else prev} --config stages/critic_{k}.yaml "
                             f"--out iter_{k}/critic")
            lines += [
                f"qevolve label iter_{k}/labeled.parquet{'' if critic_free else f' --critic iter_{k}/critic'} "
                f"--config stages/label_{k}.yaml --out iter_{k}/advantages.parquet",
                f"qevolve policy --objective {c.policy_step} --data iter_{k}/advantages.parquet --model {start}{ref_flag} "
                f"--config stages/policy_{k}.yaml --out iter_{k}/policy",
            ]
            for s in c.eval_splits:
                lines.append(f"qevolve eval --env {c.env} --policy iter_{k}/policy --split {s}{mt} --config stages/rollout_{k}.yaml "
                             f"--out iter_{k}/eval_{s}.parquet")
        lines.append("qevolve report .")
        return "\n".join(lines) + "\n"


def run_evolve(cfg: EvolveConfig, run_dir: str | Path, resume: bool = False,
               echo: Callable[[str], None] = _echo_stderr, quiet: bool = False,
               reconfigure: bool = False) -> dict[str, Any]:
    """Run (or resume) the whole loop in ``run_dir``; returns the score summary.

    ``reconfigure`` (with ``resume``): accept a configuration other than the run's own when every finished
    stage would run with its recorded configuration (``check_reconfigure``).

    Holds an exclusive lock on ``run_dir`` throughout (``qevolve_cli/lock.py``): a second
    process on the same directory fails at once, naming this one's PID.
    """
    from qevolve_cli.lock import exclusive, run_dir_lock

    run_path = Path(run_dir)
    if run_path.exists() and not run_path.is_dir():
        raise QevolveError(f"{run_path}: not a directory (--run-dir)")
    if reconfigure and not resume:
        raise QevolveError("--reconfigure changes the configuration of an existing run: pass --resume with it")
    run_path.mkdir(parents=True, exist_ok=True)
    with exclusive(run_dir_lock(run_path), run_path):
        return _run_evolve(cfg, run_path, resume=resume, echo=echo, quiet=quiet, reconfigure=reconfigure)


def check_reconfigure(cfg: EvolveConfig, run_path: Path) -> tuple[list[str], list[str], list[Path]]:
    """(kept, to_run, stale): the finished stages of ``run_path`` that ``cfg`` keeps, the stages it will run (in
    the order the loop meets them), and the work in progress (``OUT.partial/``) of the stages among those that
    were interrupted under another configuration (their checkpoints or journals cannot be resumed with ``cfg``);
    raises a one-line QevolveError naming the first finished stage whose configuration ``cfg`` changes.

    Walks the loop in check mode (``RunDir(check_only=True)``): nothing is trained or written; every finished
    stage's recorded configuration hash is compared with the one ``cfg`` gives it. The walk goes past unfinished
    stages (an added evaluation split before finished iterations) and stops only where the loop needs an
    unfinished stage's output (a selection among candidates not yet validated); every stage after that point
    runs after the unfinished ones it needs, or is checked when it is reached."""
    from qevolve_cli.evolve.rundir import StageConfigChanged, Unfinished

    run = RunDir(run_path, check_only=True)
    try:
        _stages(cfg, run, Plan(cfg, run.path), lambda _m: None, quiet=True)
    except Unfinished as e:
        run.pending.append(f"{e.stage} (and the stages after it)")
    except StageConfigChanged as e:
        raise QevolveError(
            f"{run.path / 'config.yaml'}: --reconfigure: the finished stage {e.stage!r} was done with another "
            "configuration than the new one gives it; keep its settings or use a new --run-dir"
        ) from None
    return run.checked, run.pending, run.stale


def _next_free(name: Callable[[int], Path]) -> Path:
    """``name(n)`` for the smallest n = 1, 2, ... that does not exist yet."""
    n = 1
    while name(n).exists():
        n += 1
    return name(n)


def _set_aside(partial: Path) -> Path:
    """Rename a stale work-in-progress directory to ``NAME.stale-N`` (the next free N); return the new path."""
    dst = _next_free(lambda n: partial.with_name(f"{partial.name}.stale-{n}"))
    os.replace(partial, dst)
    return dst


def _archive_config(cfg_path: Path) -> Path:
    """Keep a run's config.yaml (compare's compare.yaml) as config.prev-N.yaml (compare.prev-N.yaml; the next
    free N) before it is replaced; return it."""
    dst = _next_free(lambda n: cfg_path.with_name(f"{cfg_path.stem}.prev-{n}{cfg_path.suffix}"))
    _link_or_copy(cfg_path, dst)  # the old config stays in place until the new one replaces it atomically
    return dst


def _run_evolve(cfg: EvolveConfig, run_dir: Path, resume: bool, echo: Callable[[str], None],
                quiet: bool, reconfigure: bool = False) -> dict[str, Any]:
    import yaml

    from qevolve_cli.atomic import write_text
    from qevolve_cli.config import dump_yaml

    run = RunDir(run_dir)
    cfg_path = run.path / "config.yaml"
    if cfg_path.exists():
        if not resume:
            raise QevolveError(f"{run.path}: a run already exists here; pass --resume to continue it or choose a new --run-dir")
        saved = EvolveConfig.from_dict(yaml.safe_load(cfg_path.read_text()), source=cfg_path)
        differs = saved.hash() != cfg.hash()
        changes = saved.operational_changes(cfg) if differs else None
        if changes is not None:  # how the stages run (checkpoints, log sinks), not what they make: nothing to redo
            prev = _archive_config(cfg_path)
            dump_yaml(cfg, cfg_path)
            echo(f"[resume] {cfg_path}: only how the stages run changed ({'; '.join(changes)}); every finished "
                 f"stage and checkpoint is kept (the earlier configuration kept as {prev.name})")
        elif differs:
            if not reconfigure:
                raise QevolveError(
                    f"{cfg_path}: the run was started with another configuration (hash {saved.hash()} != {cfg.hash()}); "
                    "resume with the same flags, add --reconfigure to keep its finished stages that the new "
                    "configuration leaves unchanged, or use a new --run-dir"
                )
            kept, to_run, stale = check_reconfigure(cfg, run.path)
            prev = _archive_config(cfg_path)
            dump_yaml(cfg, cfg_path)
            echo(f"[reconfigure] {cfg_path}: new configuration (the earlier one kept as {prev.name}); "
                 f"{len(kept)} finished stage(s) unchanged and kept; to run: {', '.join(to_run) or 'nothing'}")
            for p in stale:  # an interrupted stage's checkpoint or journal of the old configuration: start it over
                echo(f"[reconfigure] {p}: work in progress of the old configuration, set aside as "
                     f"{_set_aside(p).name} (delete it when not needed)")
    else:
        run.path.mkdir(parents=True, exist_ok=True)
        dump_yaml(cfg, cfg_path)
    plan = Plan(cfg, run.path)
    write_text(run.path / "plan.sh", plan.shell())
    plan.write_stage_configs()
    if not quiet:
        echo(f"qevolve evolve: env={cfg.env} preset={cfg.preset} iters={cfg.iters} run={run.path}")
        echo("plan (equivalent shell commands, also in plan.sh):")
        for line in plan.shell().splitlines()[4:]:
            echo("  " + line)
    run.sinks = make_sinks(cfg.log_to, run.path, echo)
    return _stages(cfg, run, plan, echo, quiet)


def _stages(cfg: EvolveConfig, run: RunDir, plan: Plan, echo: Callable[[str], None], quiet: bool) -> dict[str, Any]:
    """Every stage of the loop in order (each skipped when finished); the score summary. In check mode
    (``run.check_only``: ``check_reconfigure``) nothing runs, and it makes no report."""
    P = lambda rel: str(run.path / rel) if not Path(rel).is_absolute() else rel  # noqa: E731

    # ---- base model
    if not cfg.model and cfg.init_model:
        arch, size = cfg.init_model.split(":")

        def make_base():
            if arch == "from":  # a pretrained model (converted once, cached in ~/.cache/qevolve/models)
                from qevolve_cli.models.pretrained import init_pretrained

                init_pretrained(size, run.path / "base_model")
                return {"from": size}
            from qevolve_cli.models.tiny import create_tiny_model

            create_tiny_model(run.path / "base_model", arch=arch, size=size, seed=cfg.seed)
            return {"arch": arch, "size": size}

        run.run_stage("base_model", make_base, inputs=[], outputs=["base_model"], config_hash=_h(cfg.init_model, cfg.seed),
                      iteration=0, echo=echo)
    base = P(plan.base_model())
    if cfg.model and not Path(cfg.model).is_dir():
        raise QevolveError(f"--model {cfg.model}: no such model directory")

    # ---- expert data (--select-on-validation: the validation tasks carved out first, docs/compare.md)
    expert = P(plan.expert())
    val_ids = {t.task_id for t in validation_of(cfg)[0]} if cfg.select_on_validation else set()
    if cfg.expert_data:
        from qevolve_cli import schema

        ext = P(cfg.expert_data)
        df = schema.read_table(ext)  # validate early, with a one-line error
        if cfg.select_on_validation:
            _expert_without_validation(cfg, run, ext, df, val_ids, echo)
    else:
        e_tasks, e_held = expert_tasks(cfg)

        def collect():
            from qevolve_cli import schema
            from qevolve_cli.envs.expert import collect_expert

            stats: dict[str, Any] = {}
            if cfg.select_on_validation:
                echo(f"[select] expert: {e_held} validation tasks left out of {_first(cfg.expert_limit)} "
                     f"({len(e_tasks)} demonstrated; validation: the last {cfg.validation_tasks} train tasks)")
                df = collect_expert(cfg.env, "train", tasks=e_tasks, workers=cfg.expert_workers, stats=stats)
            else:
                df = collect_expert(cfg.env, "train", limit=cfg.expert_limit or None, workers=cfg.expert_workers,
                                    stats=stats)
            schema.write_table(df, run.path / "expert.parquet", producer="qevolve evolve: expert")
            held = {"validation_tasks_held_out": e_held} if cfg.select_on_validation else {}
            return {"trajectories": df["traj_id"].n_unique(), "env_steps": df.height,
                    "replay_success_rate": stats.get("success_rate"), **held}

        run.run_stage("expert", collect, inputs=[], outputs=["expert.parquet"],
                      config_hash=_expert_hash(cfg, e_held), iteration=0, echo=echo)

    # ---- BC warm-up
    if not cfg.start_policy:
        bc_cfg = cfg.stage("bc", 0)

        def bc():
            from qevolve_cli.policy.trainer import train_policy

            return _scalars(train_policy(bc_cfg, expert, base, run.path / "bc" / "policy", quiet=quiet))

        if cfg.select_on_validation:
            def train_bc(c, out):
                from qevolve_cli.policy.trainer import train_policy

                return train_policy(c, expert, base, out, quiet=quiet)

            _select_and_adopt(cfg, run, "bc", "bc/policy", 0, bc_cfg, cfg.bc_candidates, train_bc,
                              [plan.expert(), plan.base_model()], echo, tables=[expert], val_ids=val_ids)
        else:
            run.run_stage("bc", bc, inputs=[plan.expert(), plan.base_model()], outputs=["bc/policy"],
                          config_hash=bc_cfg.hash(), legacy_hash=bc_cfg.legacy_hash(), iteration=0,
                          echo=echo)

    scores: dict[int, dict[str, Any]] = {}
    if cfg.eval_bc:
        scores[0] = _evaluate(cfg, run, 0, P(plan.policy(0)), echo, quiet)

    # ---- evolving iterations
    for k in range(1, cfg.iters + 1):
        prev = P(plan.policy(k - 1))
        it = f"iter_{k}"
        r_cfg = cfg.stage("rollout", k).replace(split="train")
        r_tasks, r_held = rollout_tasks(cfg, k) if cfg.select_on_validation else (None, 0)

        def rollout(r_cfg=r_cfg, prev=prev, it=it, r_tasks=r_tasks, r_held=r_held):
            from qevolve_cli.rollout.loop import run_rollout

            if r_tasks is not None:
                echo(f"[select] {it}/rollout: {r_held} validation tasks left out of {_first(r_cfg.max_tasks)} "
                     f"({len(r_tasks)} played; validation: the last {cfg.validation_tasks} train tasks)")
            res = run_rollout(r_cfg, prev, run.path / it / "rollout.parquet", resume=True,
                              producer="qevolve evolve: rollout", tasks=r_tasks)
            t = res.table
            per = t.group_by("traj_id").agg(__import__("polars").col("reward_env").sum())
            held = {"validation_tasks_held_out": r_held} if r_tasks is not None else {}
            return {"trajectories": per.height, "env_steps": t.height, "success_rate": float((per["reward_env"] > 0).mean()),
                    "avg_reward": float(per["reward_env"].mean()), **held,
                    **{f"stats.{a}": b for a, b in res.stats.to_dict().items()}}

        run.run_stage(f"{it}/rollout", rollout, inputs=[plan.policy(k - 1)], outputs=[f"{it}/rollout.parquet"],
                      config_hash=held_out_hash(r_cfg.hash(), cfg.validation_tasks, r_held), iteration=k, echo=echo)

        l_cfg = cfg.stage("label", k)
        c_cfg = cfg.stage("critic", k)

        def label(l_cfg=l_cfg, it=it):
            from qevolve_cli.labeling import label_tables

            return _scalars(label_tables([expert, run.path / it / "rollout.parquet"], run.path / it / "labeled.parquet",
                                         l_cfg, tokenizer=base))

        run.run_stage(f"{it}/label", label, inputs=[plan.expert(), f"{it}/rollout.parquet"],
                      outputs=[f"{it}/labeled.parquet"], config_hash=l_cfg.hash(), iteration=k, echo=echo)

        backbone = base if cfg.critic_backbone == "base" else prev

        def critic(c_cfg=c_cfg, it=it, backbone=backbone):
            from qevolve_cli.critic.trainer import train_critic

            return _scalars(train_critic(c_cfg, run.path / it / "labeled.parquet", backbone, run.path / it / "critic"))

        critic_free = l_cfg.advantage in CRITIC_FREE  # label advantage gigpo: no critic stage (docs/policy.md)
        if not critic_free:
            run.run_stage(f"{it}/critic", critic, inputs=[f"{it}/labeled.parquet"], outputs=[f"{it}/critic"],
                          config_hash=c_cfg.hash(), legacy_hash=c_cfg.legacy_hash(), iteration=k, echo=echo)
            _echo_critic_diagnostics(run.path / it / "critic", k, echo)

        def advantage(l_cfg=l_cfg, it=it, critic_free=critic_free):
            from qevolve_cli.labeling import label_tables

            return _scalars(label_tables([run.path / it / "labeled.parquet"], run.path / it / "advantages.parquet",
                                         l_cfg, critic=None if critic_free else run.path / it / "critic"))

        run.run_stage(f"{it}/advantage", advantage,
                      inputs=[f"{it}/labeled.parquet"] + ([] if critic_free else [f"{it}/critic"]),
                      outputs=[f"{it}/advantages.parquet"], config_hash=l_cfg.hash(), iteration=k, echo=echo)

        p_cfg = cfg.stage("policy", k)
        start, ref = policy_start(cfg, base, prev)
        p_inputs = [f"{it}/advantages.parquet", policy_start(cfg, plan.base_model(), plan.policy(k - 1))[0]]

        def policy(p_cfg=p_cfg, it=it, start=start, ref=ref):
            from qevolve_cli.policy.trainer import train_policy

            return _scalars(train_policy(p_cfg, run.path / it / "advantages.parquet", start, run.path / it / "policy",
                                         ref=ref, quiet=quiet))

        if cfg.select_on_validation:
            def train_step(c, out, it=it, start=start, ref=ref):
                from qevolve_cli.policy.trainer import train_policy

                return train_policy(c, run.path / it / "advantages.parquet", start, out, ref=ref, quiet=quiet)

            _select_and_adopt(cfg, run, it, f"{it}/policy", k, p_cfg, cfg.policy_candidates, train_step, p_inputs,
                              echo, tables=[run.path / it / "advantages.parquet"], val_ids=val_ids)
        else:
            run.run_stage(f"{it}/policy", policy, inputs=p_inputs, outputs=[f"{it}/policy"],
                          config_hash=p_cfg.hash(), legacy_hash=p_cfg.legacy_hash(), iteration=k,
                          echo=echo)
        scores[k] = _evaluate(cfg, run, k, P(plan.policy(k)), echo, quiet)

    if run.check_only:
        return {}
    from qevolve_cli.evolve.report import build_report

    return build_report(run.path, plots=True)


def _echo_critic_diagnostics(critic_dir: Path, k: int, echo: Callable[[str], None]) -> None:
    """One line of the critic's held-out diagnostics (and its warning) before the policy step runs."""
    import json

    p = critic_dir / "diagnostics.json"
    if not p.is_file():
        return
    from qevolve_cli.critic.diagnostics import summary_line, warning_line

    d = json.loads(p.read_text())
    echo(f"[critic] iteration {k} ({d.get('on', 'held-out')}): {summary_line(d)}")
    if d.get("fit_ladder"):
        from qevolve_cli.critic.ladder import ladder_line

        echo(f"[critic] iteration {k}: {ladder_line(d['fit_ladder'])}")
    w = warning_line(d, d.get("on", "held-out"))
    if w:
        echo(f"[critic] iteration {k}: {w}")


def validation_of(cfg: EvolveConfig) -> tuple[list[Any], bool]:
    """The run's validation tasks (the last ``cfg.validation_tasks`` train tasks) and whether they are disjoint
    from every training table: always true, since they are carved out of them (:func:`expert_tasks`,
    :func:`rollout_tasks`, :func:`_expert_without_validation`; a configuration where they cannot be is refused)."""
    from qevolve_cli.evolve.select import validation_tasks

    return validation_tasks(cfg.env, cfg.validation_tasks), True


def expert_tasks(cfg: EvolveConfig) -> tuple[list[Any], int]:
    """The train tasks the expert stage demonstrates (the first ``expert_limit``; with --select-on-validation of
    the train tasks before the validation ones) and how many validation tasks that leaves out (0 without)."""
    from qevolve_cli.envs.splits import list_tasks
    from qevolve_cli.evolve.select import training_tasks

    if not cfg.select_on_validation:
        return list_tasks(cfg.env, "train", cfg.expert_limit or None), 0
    return training_tasks(cfg.env, cfg.validation_tasks, cfg.expert_limit)


def rollout_tasks(cfg: EvolveConfig, k: int) -> tuple[list[Any], int]:
    """The train tasks iteration ``k``'s rollouts play (the first ``max_tasks`` of its rollout stage; with
    --select-on-validation of the train tasks before the validation ones) and how many validation tasks that
    leaves out (0 without)."""
    from qevolve_cli.envs.splits import list_tasks
    from qevolve_cli.evolve.select import training_tasks

    limit = cfg.stage("rollout", k).max_tasks
    if not cfg.select_on_validation:
        return list_tasks(cfg.env, "train", limit or None), 0
    return training_tasks(cfg.env, cfg.validation_tasks, limit)


def _first(limit: int) -> str:
    return f"the first {limit} train tasks" if limit else "all train tasks"


def _expert_without_validation(cfg: EvolveConfig, run: RunDir, ext: Path, df, val_ids: set[str], echo) -> None:
    """--select-on-validation with an ``expert_data`` table: stage ``expert`` writes ``expert.parquet``, the table
    less its rows of validation tasks (how many: the output and the stage's metrics). Refused, one line, when no
    row is left, or when the run's finished stages trained on the table with those rows (a run made before
    validation was carved out)."""
    from qevolve_cli.evolve.rundir import StageConfigChanged
    from qevolve_cli.evolve.select import drop_validation_rows

    kept, rows, tasks = drop_validation_rows(df, val_ids)
    if not kept.height:
        raise ConfigError(ext, "task_id", f"every row ({rows}) is of a validation task (the last "
                          f"{cfg.validation_tasks} train tasks): nothing left to train on under --select-on-validation "
                          "(give fewer validation_tasks or another expert_data table)")
    if rows and not run.is_done("expert"):
        used = sorted(n for n, st in run.stages.items() if st.get("status") == "done"
                      and (n == "bc" or n.startswith("bc/cand_") or n.endswith("/label")))
        if used:
            raise StageConfigChanged(f"{run.manifest_path}: stage {used[0]!r} was done on {ext} with its {rows} "
                                     "rows of validation tasks (before they were carved out of the training data); "
                                     "use a new --run-dir", used[0])

    def write():
        from qevolve_cli import schema

        echo(f"[select] expert: {rows} rows of {tasks} validation tasks dropped from {ext} ({kept.height} rows kept)")
        schema.write_table(kept, run.path / "expert.parquet", producer="qevolve evolve: expert (validation tasks dropped)")
        return {"source": str(ext), "env_steps": kept.height, "validation_rows_dropped": rows,
                "validation_tasks_dropped": tasks}

    from qevolve_cli.envs.splits import TASK_ORDER

    run.run_stage("expert", write, inputs=[str(ext)], outputs=["expert.parquet"],
                  config_hash=_h(str(ext), cfg.env, "validation held out", cfg.validation_tasks,
                                 TASK_ORDER.get(cfg.env)), iteration=0, echo=echo)


def validation_config(cfg: EvolveConfig, k: int):
    """The evaluation config of the validation tasks after iteration ``k``: the run's own (greedy, same limits),
    on the train split."""
    return cfg.stage("rollout", max(k, 1)).replace(split="train", max_tasks=0, iteration=k)


def _select_and_adopt(cfg: EvolveConfig, run: RunDir, prefix: str, target: str, k: int, base_cfg, grid, train,
                      inputs: list[str], echo, tables: list[Path], val_ids: set[str]) -> dict[str, Any]:
    """--select-on-validation: train and validate every candidate (evolve/select.py), then the stage ``target``
    (``bc/policy`` or ``iter_k/policy``) adopts the chosen one (hard links) and records the selection.
    ``tables``: what the candidates train on, checked first to hold no validation task (``val_ids``)."""
    from qevolve_cli.evolve.select import check_disjoint, describe, select

    if not run.check_only and not run.is_done(target if target != "bc/policy" else "bc"):
        check_disjoint(tables, val_ids, "validation tasks must stay out of training: use a new --run-dir")
    tasks = validation_of(cfg)[0]
    sel = select(run, prefix, base_cfg, grid, train, validation_config(cfg, k), tasks, iteration=k, inputs=inputs,
                 echo=echo)

    def adopt(sel=sel):
        _link_tree(run.path / sel["policy"], run.path / target)
        return {"selection": sel}

    tags, scores = [c["tag"] for c in sel["candidates"]], [c["val_avg_reward"] for c in sel["candidates"]]
    h = _h(base_cfg.hash(), tags, scores)
    old = base_cfg.legacy_hash()  # a selection adopted before checkpoint intervals left the hash
    name = "bc" if target == "bc/policy" else target  # the stage names of a run without selection
    run.run_stage(name, adopt, inputs=list(inputs) + [sel["policy"]], outputs=[target], config_hash=h,
                  legacy_hash=_h(old, tags, scores) if old else None, iteration=k, echo=echo)
    echo(f"[select] {target}: {describe(sel)}")
    return sel


def _link_or_copy(a: str | Path, b: str | Path) -> None:
    """Hard-link file ``a`` as ``b``; a plain copy where links fail (another file system, none supported)."""
    import shutil

    try:
        os.link(a, b)
    except OSError:
        shutil.copy2(a, b)


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` = a copy of the directory ``src`` made of hard links (a plain copy where links fail), atomically."""
    import shutil

    from qevolve_cli.atomic import atomic_dir
    from qevolve_cli.models import ADAPTER_BASE_FILE, record_adapter_base

    with atomic_dir(dst) as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True, copy_function=_link_or_copy)
        if (tmp / ADAPTER_BASE_FILE).is_file():  # a LoRA policy: its base's relative path from where dst lies
            record_adapter_base(tmp)


def _evaluate(cfg: EvolveConfig, run: RunDir, k: int, policy: str, echo, quiet: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for split in cfg.eval_splits:
        e_cfg = cfg.stage("rollout", max(k, 1)).replace(split=split, max_tasks=cfg.eval_max_tasks, iteration=k)
        name = f"iter_{k}/eval_{split}"

        def ev(e_cfg=e_cfg, name=name):
            from qevolve_cli.rollout.evaluate import run_eval

            m = run_eval(e_cfg, policy, run.path / f"{name}.parquet", resume=True)
            return {"split": e_cfg.split, **_scalars(m)}

        out[split] = run.run_stage(name, ev, inputs=[str(policy)], outputs=[f"{name}.parquet"],
                                   config_hash=e_cfg.hash(), iteration=k, echo=echo)
    return out


def _expert_hash(cfg, held_out: int = 0) -> str:
    """The expert stage's hash: the environment and the number of train tasks demonstrated, and with a limit on
    ALFWorld and TextCraft the name of their task order (which first N; envs/splits.py, TASK_ORDER); where
    --select-on-validation leaves ``held_out`` > 0 validation tasks out of those, a new one."""
    from qevolve_cli.envs.splits import task_order_tag
    from qevolve_cli.evolve.select import held_out_hash

    tag = task_order_tag(cfg.env, cfg.expert_limit)
    return held_out_hash(_h(cfg.env, cfg.expert_limit, *([tag] if tag else [])), cfg.validation_tasks, held_out)


def _h(*parts: Any) -> str:
    import hashlib

    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
