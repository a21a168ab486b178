"""`qevolve compare`: the paper's baselines on one evolve run's data, one table (docs/compare.md).

From a ``qevolve evolve`` run directory (its expert table, its iteration-1
rollouts, its base model and BC policy, its evaluation settings) the arms are:

* **SFT** = the run's BC policy (``bc/policy``);
* **RFT** = ``policy --objective rft`` from the base model on the expert table
  plus the successful iteration-1 rollouts, with the run's BC settings;
* **RFT (2 rounds)** (only when named in ``arms``) = RFT again: rollouts of the RFT policy on the train
  tasks with the run's iteration-2 rollout config, then ``policy --objective rft`` from the base model
  on the expert table plus their successes (iterated RFT, as ReST / ETO iterate): the control for
  Q-Evolve's second iteration, which also plays a second round;
* **ETO** = ``policy --objective dpo`` from the BC policy (also the frozen
  reference) on ETO pairs of the expert table and the iteration-1 rollouts,
  ETO's recipe scaled to the run (:meth:`CompareConfig.eto_config`);
* **Best-of-N** = the BC policy, N sampled trajectories per task, the best by
  final env reward (an oracle upper bound, QLASS's rule);
* **Q-Evolve** = the run's last evaluated iteration;
* **GiGPO (anchor-state credit)** = the iteration-1 policy step (the run's own, as for oracle V) on the
  iteration-1 labels with GiGPO's advantages (``label --advantage gigpo``: the returns of one task's rollouts and
  of the steps from one observation compared, no critic) in place of the critic's: does the learned critic beat
  critic-free step credit on the same data (docs/compare.md);
* **Q-Evolve (oracle V)** (environments with an exact solver: lamps, lamps-hard, lamps-habit) = the iteration-1
  policy step (the run's own: BPPO from the BC policy, or under ``policy_step: awr`` AWR from the base
  model; the run's ``policy_1`` config) on the iteration-1 labels
  with the *exact* optimal values ``V*`` in place of the learned critic's (``label --value-source
  oracle``): the ceiling of the critic. Where it does not beat RFT, the policy step is to blame,
  not the critic (docs/compare.md).

Every arm is evaluated with the run's own evaluation config (same splits,
``eval_max_tasks``, step limit, decoding); evaluations the run already did with
that config (SFT = iteration 0, Q-Evolve) are read from its manifest, not
repeated. Work goes to ``RUN/compare/`` (its own stage manifest, so an
interrupted compare resumes; training stages resume from their checkpoints,
evaluations from their journals).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qevolve_cli.config import ConfigBase, field
from qevolve_cli.errors import ConfigError, QevolveError
from qevolve_cli.evolve.compare_table import (  # noqa: F401 - mean_se, paired_bootstrap re-exported
    budget_of,
    budget_text,
    mean_se,
    paired_bootstrap,
    per_task_rewards,
    selection_text,
    table_markdown,
)
from qevolve_cli.evolve.select import DEFAULT_BC_CANDIDATES, DEFAULT_ETO_CANDIDATES, below_start, check_grid

ARMS = ("zero_shot", "sft", "rft", "rft_2", "eto", "best_of_n", "qevolve", "qevolve_oracle_v", "gigpo")
OPT_IN_ARMS = ("rft_2",)  # rows only when named in `arms` (not in the default list)
DEFAULT_ARMS = tuple(a for a in ARMS if a not in OPT_IN_ARMS)
ETO_LR_RATIO = 1e-6 / 2e-5  # ETO (run_eto.sh): DPO lr 1e-6 after SFT at lr 2e-5
ETO_NLL_WEIGHT = 1.0  # RPO (Pang et al. 2024) and TRL's rpo_alpha recommendation: DPO + 1.0 x NLL(chosen)
ARM_NAMES = {"zero_shot": "Zero-shot (base model)", "sft": "SFT", "rft": "RFT", "rft_2": "RFT (2 rounds)", "eto": "ETO",
             "best_of_n": "Best-of-N",
             "qevolve": "Q-Evolve",
             "qevolve_oracle_v": "Q-Evolve (oracle V)",
             "gigpo": "GiGPO (anchor-state credit)"}


@dataclass
class CompareConfig(ConfigBase):
    arms: list[str] = field(default_factory=lambda: list(DEFAULT_ARMS), help="Rows of the table: zero_shot (the base model, "
                                                                      "no training; dropped from the default list "
                                                                      "for a randomly initialised base), sft, rft, "
                                                                      "rft_2 (RFT again on its own rollouts: "
                                                                      "only when named), "
                                                                      "eto, best_of_n, qevolve, qevolve_oracle_v "
                                                                      "(only where the environment has an exact "
                                                                      "solver: dropped from the default list "
                                                                      "elsewhere), gigpo (iteration 1's policy step "
                                                                      "on GiGPO's critic-free advantages).")
    best_of: int = field(6, help="N of Best-of-N (the paper: 6).", ge=2)
    bon_temperature: float | None = field(None, help="Sampling temperature of Best-of-N (default: the run's rollout "
                                                     "temperature).", ge=0)
    rft: dict[str, Any] = field(default_factory=dict, help="PolicyConfig overrides of the RFT arm (over the run's "
                                                           "bc stage config).")
    eto: dict[str, Any] = field(default_factory=dict, help="PolicyConfig overrides of the ETO arm (over ETO's recipe "
                                                           "scaled to the run: dpo, beta 0.1, lr = SFT lr / 20, 3 "
                                                           "epochs, warm-up 0.1, constant, plus RPO's NLL term on "
                                                           "the chosen trajectories, dpo_nll_weight 1.0).")
    qevolve_iteration: int = field(0, help="Iteration that is the Q-Evolve row (0 = the last one with a policy).",
                                   ge=0)
    select_on_validation: bool = field(False, help="Train every candidate of rft_candidates / eto_candidates and keep "
                                       "the best on the run's validation train tasks; SFT and Q-Evolve are the run's "
                                       "own choices (the run must be made with `evolve --select-on-validation`, "
                                       "with as many candidates). docs/compare.md, 'Fair selection'.")
    rft_candidates: list[dict[str, float]] = field(default_factory=lambda: [dict(c) for c in DEFAULT_BC_CANDIDATES],
                                                   help="RFT candidates: multipliers of its config ({} = itself; "
                                                   "epochs, lr).")
    eto_candidates: list[dict[str, float]] = field(default_factory=lambda: [dict(c) for c in DEFAULT_ETO_CANDIDATES],
                                                   help="ETO candidates: multipliers of its config ({} = itself; lr, "
                                                   "dpo_beta, epochs, dpo_nll_weight).")

    SELECT_FIELDS = ("select_on_validation", "rft_candidates", "eto_candidates")

    def validate(self, source: Any = None, prefix: str = "") -> None:
        for a in self.arms:
            if a not in ARMS:
                raise ConfigError(source, prefix + "arms", f"unknown arm {a!r} (choose from {', '.join(ARMS)})")
        if not self.arms:
            raise ConfigError(source, prefix + "arms", "no arm to compare")
        if "rft_2" in self.arms and "rft" not in self.arms:
            raise ConfigError(source, prefix + "arms", "rft_2 starts from the rft arm's policy: name rft too")
        check_grid(self.rft_candidates, source, prefix + "rft_candidates")
        check_grid(self.eto_candidates, source, prefix + "eto_candidates")

    def work_hash(self) -> str:
        """:meth:`hash` of what the comparison makes: the ``rft`` / ``eto`` overrides without their operational
        fields (``PolicyConfig.OPERATIONAL``: how a training stage runs, such as how often it checkpoints)."""
        from qevolve_cli.policy.config import PolicyConfig

        ops = PolicyConfig.OPERATIONAL
        return self.replace(**{arm: {k: v for k, v in getattr(self, arm).items() if k not in ops}
                               for arm in ("rft", "eto")}).hash()

    def operational_changes(self, other: CompareConfig) -> list[str] | None:
        """What ``other`` changes of this comparison when it differs only in operational fields of its arms'
        overrides: one ``"rft.checkpoint_every_steps default -> 10"`` per changed field; None when it changes
        anything else (its finished stages would not be this comparison's)."""
        from qevolve_cli.policy.config import PolicyConfig

        if self.work_hash() != other.work_hash():
            return None
        return [f"{arm}.{f} {getattr(self, arm).get(f, 'default')} -> {getattr(other, arm).get(f, 'default')}"
                for arm in ("rft", "eto") for f in PolicyConfig.OPERATIONAL
                if getattr(self, arm).get(f) != getattr(other, arm).get(f)]

    def rft_config(self, ecfg):
        from qevolve_cli.policy.config import PolicyConfig

        d = {**ecfg.stage("bc", 0).to_dict(), "objective": "rft", **self.rft}
        return PolicyConfig.from_dict(d, source="compare config: rft")

    def eto_config(self, ecfg):
        """ETO's recipe (run_eto.sh, iteration 1) scaled to the run: beta 0.1, 3 epochs, warm-up 0.1 then a
        constant lr of the run's SFT lr x (1e-6 / 2e-5) (ETO's DPO lr over its SFT lr); batching and
        lengths of the run's iteration-1 policy stage; plus RPO's NLL term on the chosen trajectories
        (``dpo_nll_weight`` 1.0): plain DPO collapsed ETO to 0 on lamps (docs/compare.md)."""
        from qevolve_cli.policy.config import PolicyConfig

        bc = ecfg.stage("bc", 0)
        d = {**ecfg.stage("policy", 1).to_dict(), "objective": "dpo", "dpo_beta": 0.1, "lr": bc.lr * ETO_LR_RATIO,
             "epochs": 3, "warmup_ratio": 0.1, "lr_scheduler": "constant", "dpo_nll_weight": ETO_NLL_WEIGHT, **self.eto}
        return PolicyConfig.from_dict(d, source="compare config: eto")


def default_arms(env: str, base_model: str | Path) -> list[str]:
    """The rows of a comparison when none are named: every arm, less Q-Evolve (oracle V) where the environment
    has no exact solver and less the zero-shot row where the base model was initialised at random
    (``init-model --size``: it scores nothing before training, so the row would only cost evaluation time)."""
    from qevolve_cli.envs.oracle import has_solver
    from qevolve_cli.models import random_init

    return [a for a in DEFAULT_ARMS if (a != "qevolve_oracle_v" or has_solver(env))
            and (a != "zero_shot" or not random_init(base_model))]


def step_note(ecfg) -> str:
    """``, AWR step`` in the Q-Evolve rows' names of a run whose policy step is not the paper's BPPO."""
    return f", {ecfg.policy_step.upper()} step" if ecfg.policy_step != "bppo" else ""


def eto_pairs(d_cfg, data: list[str]) -> dict[str, int]:
    """The preference pairs ETO's DPO step would train on (``{"pairs", "tie", "no_anchor"}``), read without
    training: when every self trajectory ties with its anchor there is nothing to contrast."""
    from qevolve_cli.policy.data import dpo_pairs, read_training_rows

    df, _ = read_training_rows(d_cfg, data)
    pairs, info = dpo_pairs(df, d_cfg.dpo_pairs)
    return {**info, "pairs": len(pairs)}


def _echo_stderr(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


def run_compare(run_dir: str | Path, ccfg: CompareConfig | None = None, out: str | Path | None = None,
                resume: bool = False, echo: Callable[[str], None] = _echo_stderr, quiet: bool = False,
                select_only: bool = False) -> dict[str, Any]:
    """Train and evaluate the baseline arms for the evolve run in ``run_dir``; returns the table (a dict).

    ``select_only`` (with ``select_on_validation``): stop after the selection (no test split is read);
    returns ``{"selection": {arm: record}}`` and writes it to ``selection.json``."""
    from qevolve_cli.lock import exclusive, run_dir_lock

    run = Path(run_dir)
    if not (run / "config.yaml").exists():
        raise QevolveError(f"{run}: not a qevolve evolve run directory (no config.yaml)")
    # the run directory's lock, as evolve's: a second compare, or an evolve --resume rewriting the policies this
    # one trains from, is refused with one line instead of both writing the same files
    with exclusive(run_dir_lock(run), run):
        return _run_compare(run, ccfg, out, resume, echo, quiet, select_only)


def _run_compare(run: Path, ccfg: CompareConfig | None, out: str | Path | None, resume: bool,
                 echo: Callable[[str], None], quiet: bool, select_only: bool) -> dict[str, Any]:
    import yaml

    from qevolve_cli import schema
    from qevolve_cli.atomic import write_json, write_text
    from qevolve_cli.config import dump_yaml
    from qevolve_cli.envs.oracle import SOLVERS, has_solver
    from qevolve_cli.evolve.config import EvolveConfig
    from qevolve_cli.evolve.loop import Plan, _archive_config, _scalars, policy_start
    from qevolve_cli.evolve.rundir import RunDir

    ccfg = ccfg or CompareConfig()
    cfg_path = run / "config.yaml"
    ecfg = EvolveConfig.from_dict(yaml.safe_load(cfg_path.read_text()), source=cfg_path)
    evolve_run = RunDir(run)
    plan = Plan(ecfg, run)
    P = lambda rel: run / rel if not Path(rel).is_absolute() else Path(rel)  # noqa: E731
    expert, base, bc = P(plan.expert()), P(plan.base_model()), P(plan.policy(0))
    if ccfg.arms == list(DEFAULT_ARMS):  # the default list: only the rows that mean something for this run
        ccfg = ccfg.replace(arms=default_arms(ecfg.env, base))
    elif "qevolve_oracle_v" in ccfg.arms and not has_solver(ecfg.env):  # named by the user: say why it cannot be
        raise QevolveError(f"arms: qevolve_oracle_v needs an exact solver, and {ecfg.env!r} has none (solvers: "
                           f"{', '.join(SOLVERS)})")
    rollout = run / "iter_1" / "rollout.parquet"
    for what, p in (("expert table", expert), ("BC policy", bc), ("iteration-1 rollouts", rollout)):
        if not p.exists():
            raise QevolveError(f"{run}: no {what} ({p}); run `qevolve evolve --iters 1` (or --resume) first")
    k_last = ccfg.qevolve_iteration or max([k for k in range(1, ecfg.iters + 1) if (run / plan.policy(k)).exists()],
                                           default=0)
    if "qevolve" in ccfg.arms and (not k_last or not (run / plan.policy(k_last)).exists()):
        raise QevolveError(f"{run}: no Q-Evolve policy (iter_{k_last or 1}/policy); finish the evolve run first")
    for arm_config in (ccfg.rft_config, ccfg.eto_config):  # a bad rft/eto override fails here, before compare.yaml
        arm_config(ecfg)                                     # is written

    # ---- the compare directory (own manifest, resumable)
    cdir = Path(out) if out is not None else run / "compare"
    cc_path = cdir / "compare.yaml"
    if cc_path.exists():
        if not resume:
            raise QevolveError(f"{cdir}: a comparison already exists here; pass --resume to continue it or choose "
                               "another --out")
        saved = CompareConfig.from_dict(yaml.safe_load(cc_path.read_text()) or {}, source=cc_path)
        # other rows may be asked for on resume (each arm's stages carry their own config hashes), and other
        # operational fields of the arms' overrides (how a stage runs, not what it makes); nothing else
        same_rows = saved.replace(arms=ccfg.arms)
        changes = same_rows.operational_changes(ccfg) if same_rows.hash() != ccfg.hash() else []
        if changes is None:
            raise QevolveError(f"{cc_path}: the comparison was started with another configuration (hash "
                               f"{saved.hash()} != {ccfg.hash()}); resume with the same flags or choose another --out")
        if changes:
            prev = _archive_config(cc_path)
            echo(f"compare: {cc_path}: only how the stages run changed ({'; '.join(changes)}); every finished "
                 f"stage and checkpoint is kept (the earlier configuration kept as {prev.name})")
        if saved.arms != ccfg.arms:
            echo(f"compare: rows {', '.join(saved.arms)} -> {', '.join(ccfg.arms)} (the finished stages are kept)")
            # the old table describes the old rows: gone before compare.yaml names the new ones, so a run
            # stopped in between never leaves a table that a reader would take for this comparison's
            for stale in ("table.json", "table.md"):
                (cdir / stale).unlink(missing_ok=True)
        if changes or saved.arms != ccfg.arms:
            dump_yaml(ccfg, cc_path)
    else:
        cdir.mkdir(parents=True, exist_ok=True)
        dump_yaml(ccfg, cc_path)
    crun = RunDir(cdir)
    data = [str(expert), str(rollout)]

    # ---- selection on validation: SFT and Q-Evolve were chosen by the run; RFT and ETO are chosen here
    selections: dict[str, Any] = {}
    if ccfg.select_on_validation:
        from qevolve_cli.evolve.loop import validation_config, validation_of

        if not ecfg.select_on_validation:
            raise QevolveError(f"{run}: the evolve run did not select on validation, so its SFT and Q-Evolve rows "
                               "were not chosen like the others; make it with `qevolve evolve --select-on-validation`")
        n_cand = len(ecfg.bc_candidates)
        for arm, grid in (("rft", ccfg.rft_candidates), ("eto", ccfg.eto_candidates)):
            if arm in ccfg.arms and len(grid) != n_cand:
                raise QevolveError(f"compare config: field '{arm}_candidates': {len(grid)} candidates but the run "
                                   f"chose BC and its policy steps among {n_cand}: every arm gets the same number")
        val_tasks = validation_of(ecfg)[0]
        v_cfg = validation_config(ecfg, 1)
        # every arm trains on the run's tables: none may hold a validation task (a run made before they were
        # carved out is refused), so every selection record, the run's own included, says disjoint
        from qevolve_cli.evolve.select import check_disjoint

        check_disjoint([expert] + [run / f"iter_{k}" / "rollout.parquet" for k in range(1, max(k_last, 1) + 1)
                                   if (run / f"iter_{k}" / "rollout.parquet").exists()],
                       {t.task_id for t in val_tasks}, "the evolve run was made before validation tasks were carved "
                       "out of its training data: make it again with `qevolve evolve --select-on-validation` in a "
                       "new --run-dir")

        def run_selection(stage: str) -> dict[str, Any] | None:
            rec = evolve_run.stages.get(stage, {}).get("metrics", {}).get("selection")
            return {**rec, "disjoint": True} if rec else rec

        selections["sft"] = run_selection("bc")
        if k_last:
            selections["qevolve"] = run_selection(f"iter_{k_last}/policy")
            selections["qevolve_iterations"] = [run_selection(f"iter_{k}/policy") for k in range(1, k_last + 1)]

    # ---- training arms
    policies: dict[str, Path] = {"zero_shot": base, "sft": bc, "best_of_n": bc}
    if k_last:
        policies["qevolve"] = run / plan.policy(k_last)

    def rft_arm(prefix: str, stage: str, data_in: list[str], iteration: int) -> Path:
        """RFT from the base model on ``data_in``: chosen on validation among rft_candidates (stages PREFIX/cand_*),
        or the one configuration (stage ``stage``); returns the policy."""
        from qevolve_cli.policy.trainer import train_policy

        if ccfg.select_on_validation:
            from qevolve_cli.evolve.select import select

            def train(c, out_dir):
                return train_policy(c, data_in, base, out_dir, quiet=quiet)

            selections[prefix] = select(crun, prefix, ccfg.rft_config(ecfg), ccfg.rft_candidates, train, v_cfg,
                                        val_tasks, iteration=iteration, inputs=data_in + [str(base)], echo=echo)
            return cdir / selections[prefix]["policy"]
        r_cfg = ccfg.rft_config(ecfg)

        def train_one():
            return _scalars(train_policy(r_cfg, data_in, base, cdir / prefix / "policy", quiet=quiet))

        crun.run_stage(stage, train_one, inputs=data_in + [str(base)], outputs=[f"{prefix}/policy"],
                       config_hash=r_cfg.hash(), legacy_hash=r_cfg.legacy_hash(), iteration=iteration, echo=echo)
        return cdir / prefix / "policy"

    if "rft" in ccfg.arms:
        policies["rft"] = rft_arm("rft", "rft", data, 1)
    rollout_2 = cdir / "rft_2" / "rollout.parquet"
    if "rft_2" in ccfg.arms:
        # round 2: the RFT policy plays the train tasks as Q-Evolve's iteration 2 does (its rollout config),
        # then RFT from the base model on the expert table and those rollouts' successes
        # (a run that selects on validation: the train tasks before the validation ones, as its own rollouts)
        from qevolve_cli.evolve.loop import rollout_tasks
        from qevolve_cli.evolve.select import held_out_hash

        r2_roll = ecfg.stage("rollout", 2).replace(split="train")
        r2_tasks, r2_held = rollout_tasks(ecfg, 2) if ecfg.select_on_validation else (None, 0)

        def rft_rollout(r2_roll=r2_roll):
            from qevolve_cli.rollout.loop import run_rollout

            res = run_rollout(r2_roll, policies["rft"], rollout_2, resume=True, producer="qevolve compare: rft_2",
                              tasks=r2_tasks)
            held = {"validation_tasks_held_out": r2_held} if r2_tasks is not None else {}
            return {"trajectories": res.table["traj_id"].n_unique(), "env_steps": res.table.height, **held}

        crun.run_stage("rft_2/rollout", rft_rollout, inputs=[str(policies["rft"])], outputs=["rft_2/rollout.parquet"],
                       config_hash=held_out_hash(r2_roll.hash(), ecfg.validation_tasks, r2_held), iteration=2,
                       echo=echo)
        policies["rft_2"] = rft_arm("rft_2", "rft_2/train", [str(expert), str(rollout_2)], 2)
    eto_note = None
    if "eto" in ccfg.arms and not (info := eto_pairs(ccfg.eto_config(ecfg), data))["pairs"]:
        # no task has a self trajectory whose final reward differs from its anchor's: no DPO step to take
        eto_note = (f"no preference pair (tie {info['tie']}, without anchor {info['no_anchor']}): no DPO step, "
                    "ETO is the SFT policy")
        echo(f"compare: ETO: {eto_note}")
        policies["eto"] = bc
    elif ccfg.select_on_validation and "eto" in ccfg.arms:
        from qevolve_cli.evolve.select import select

        def eto_train(c, out_dir):
            from qevolve_cli.policy.trainer import train_policy

            return train_policy(c, data, bc, out_dir, ref=bc, quiet=quiet)

        selections["eto"] = select(crun, "eto", ccfg.eto_config(ecfg), ccfg.eto_candidates, eto_train, v_cfg,
                                   val_tasks, iteration=1, inputs=data + [str(bc)], echo=echo)
        policies["eto"] = cdir / selections["eto"]["policy"]
        if warn := below_start("ETO", selections["eto"], selections.get("sft"), "eto_candidates"):
            selections["eto"]["warning"] = warn
            echo(f"compare: warning: {warn}")
    elif "eto" in ccfg.arms:
        d_cfg = ccfg.eto_config(ecfg)

        def train_eto():
            from qevolve_cli.policy.trainer import train_policy

            return _scalars(train_policy(d_cfg, data, bc, cdir / "eto" / "policy", ref=bc, quiet=quiet))

        crun.run_stage("eto", train_eto, inputs=data + [str(bc)], outputs=["eto/policy"],
                       config_hash=d_cfg.hash(), legacy_hash=d_cfg.legacy_hash(), iteration=1, echo=echo)
        policies["eto"] = cdir / "eto" / "policy"
    if "qevolve_oracle_v" in ccfg.arms:
        # iteration 1 with V* instead of the learned critic: the same labels (the run's label_1 config,
        # value_source oracle, the rollout's step limit for the replay), the same BPPO step from BC
        l_cfg = ecfg.stage("label", 1).replace(value_source="oracle",
                                               oracle_max_steps=ecfg.stage("rollout", 1).max_steps)
        if l_cfg.advantage == "gigpo":  # a run on GiGPO's advantages: V* goes into the paper's GAE
            l_cfg = l_cfg.replace(advantage="gae")
        o_cfg = ecfg.stage("policy", 1)
        labeled = run / "iter_1" / "labeled.parquet"
        if not labeled.exists():
            raise QevolveError(f"{run}: no iteration-1 labels ({labeled}); run `qevolve evolve --iters 1` (or "
                               "--resume) first")

        def oracle_labels():
            from qevolve_cli.labeling import label_tables

            return _scalars(label_tables([labeled], cdir / "oracle_v" / "advantages.parquet", l_cfg))

        crun.run_stage("oracle_v/advantage", oracle_labels, inputs=[str(labeled)],
                       outputs=["oracle_v/advantages.parquet"], config_hash=l_cfg.hash(), iteration=1, echo=echo)

        o_start, o_ref = policy_start(ecfg, base, bc)  # the run's own policy step (bppo from BC, or awr)

        def train_oracle_v():
            from qevolve_cli.policy.trainer import train_policy

            return _scalars(train_policy(o_cfg, cdir / "oracle_v" / "advantages.parquet", o_start,
                                         cdir / "oracle_v" / "policy", ref=o_ref, quiet=quiet))

        if ccfg.select_on_validation:  # the candidates of the run's own policy steps
            from qevolve_cli.evolve.select import select

            def oracle_train(c, out_dir):
                from qevolve_cli.policy.trainer import train_policy

                return train_policy(c, cdir / "oracle_v" / "advantages.parquet", o_start, out_dir, ref=o_ref,
                                    quiet=quiet)

            selections["qevolve_oracle_v"] = select(crun, "oracle_v", o_cfg, ecfg.policy_candidates, oracle_train,
                                                    v_cfg, val_tasks, iteration=1,
                                                    inputs=["oracle_v/advantages.parquet", str(o_start)], echo=echo)
            policies["qevolve_oracle_v"] = cdir / selections["qevolve_oracle_v"]["policy"]
        else:
            crun.run_stage("oracle_v", train_oracle_v, inputs=["oracle_v/advantages.parquet", str(o_start)],
                           outputs=["oracle_v/policy"], config_hash=o_cfg.hash(), legacy_hash=o_cfg.legacy_hash(), iteration=1,
                           echo=echo)
            policies["qevolve_oracle_v"] = cdir / "oracle_v" / "policy"

    gigpo_stats: dict[str, Any] = {}
    if "gigpo" in ccfg.arms:
        gigpo_stats = _gigpo_arm(ecfg, ccfg, run, cdir, crun, base, bc, policies, selections,
                                 (v_cfg, val_tasks) if ccfg.select_on_validation else None, echo, quiet)

    if ccfg.select_on_validation:
        write_json(cdir / "selection.json", selections)
    if select_only:
        return {"run": str(run), "env": ecfg.env, "seed": ecfg.seed, "selection": selections}

    # ---- evaluations: the run's own eval config per split (as evolve's _evaluate)
    def eval_cfg(k: int, split: str):
        return ecfg.stage("rollout", max(k, 1)).replace(split=split, max_tasks=ecfg.eval_max_tasks, iteration=k)

    def from_run(name: str, e_hash: str) -> dict[str, Any] | None:
        """Metrics of an evaluation the evolve run did with the same config (not repeated)."""
        st = evolve_run.stages.get(name)
        if st and st.get("status") == "done" and st.get("config_hash") == e_hash and evolve_run.is_done(name):
            m = dict(st.get("metrics", {}))
            if "env_steps" not in m:  # evaluations before env_steps was recorded: count the table's rows
                m["env_steps"] = schema.read_table(run / f"{name}.parquet", validate_rows=False).height
            return m
        return None

    results: dict[str, dict[str, dict[str, Any]]] = {}
    for arm in ccfg.arms:
        results[arm] = {}
        k = k_last if arm == "qevolve" else (1 if arm in ("rft", "eto", "qevolve_oracle_v", "gigpo") else
                                              2 if arm == "rft_2" else 0)
        for split in ecfg.eval_splits:
            e_cfg = eval_cfg(k, split)
            best_of = ccfg.best_of if arm == "best_of_n" else 1
            if best_of > 1 and ccfg.bon_temperature is not None:
                e_cfg = e_cfg.replace(temperature=ccfg.bon_temperature)
            reused = from_run(f"iter_{k}/eval_{split}", e_cfg.hash()) if arm in ("sft", "qevolve") else None
            if reused is not None:
                results[arm][split] = {**reused, "source": f"{run.name}/iter_{k}/eval_{split}",
                                       "table": run / f"iter_{k}/eval_{split}.parquet"}
                continue
            name = f"eval/{arm}_{split}"

            def ev(e_cfg=e_cfg, name=name, policy=policies[arm], best_of=best_of):
                from qevolve_cli.rollout.evaluate import run_eval

                m = run_eval(e_cfg, policy, cdir / f"{name}.parquet", best_of=best_of, resume=True)
                return {"split": e_cfg.split, **_scalars(m)}

            h = e_cfg.hash() + (f"-bon{best_of}" if best_of > 1 else "")
            m = crun.run_stage(name, ev, inputs=[str(policies[arm])], outputs=[f"{name}.parquet"], config_hash=h,
                               iteration=k, echo=echo)
            results[arm][split] = {**m, "source": f"compare/{name}", "table": cdir / f"{name}.parquet"}

    # ---- earlier Q-Evolve iterations (an --iters 2 run: iteration 1 too): the run's own evaluations, read
    earlier: dict[int, dict[str, dict[str, Any]]] = {}
    for k in range(1, k_last if "qevolve" in ccfg.arms else 0):
        got = {split: from_run(f"iter_{k}/eval_{split}", eval_cfg(k, split).hash()) for split in ecfg.eval_splits}
        if all(m is not None for m in got.values()):
            earlier[k] = {split: {**m, "source": f"{run.name}/iter_{k}/eval_{split}",
                                  "table": run / f"iter_{k}/eval_{split}.parquet"} for split, m in got.items()}

    # ---- env steps: expert demonstrations (every arm starts from BC on them), self-play rollouts for training
    expert_steps = schema.read_table(expert, validate_rows=False).height
    rollout_steps = {k: schema.read_table(run / f"iter_{k}" / "rollout.parquet", validate_rows=False).height
                     for k in range(1, (k_last or 1) + 1) if (run / f"iter_{k}" / "rollout.parquet").exists()}
    rft2_steps = schema.read_table(rollout_2, validate_rows=False).height if "rft_2" in ccfg.arms else 0
    self_steps = {"zero_shot": 0, "sft": 0, "best_of_n": 0, "rft": rollout_steps.get(1, 0), "eto": rollout_steps.get(1, 0),
                  "rft_2": rollout_steps.get(1, 0) + rft2_steps,
                  "qevolve_oracle_v": rollout_steps.get(1, 0), "gigpo": rollout_steps.get(1, 0),
                  "qevolve": sum(rollout_steps.get(k, 0) for k in range(1, k_last + 1))}
    rows = []
    for arm in ccfg.arms:
        if arm == "qevolve":  # its earlier iterations first, each a row (iteration k+1 started from k)
            for k, res in sorted(earlier.items()):
                qsel = selections.get("qevolve_iterations")
                rows.append({
                    "arm": f"qevolve_iter{k}", "method": f"{ARM_NAMES['qevolve']} (iter {k}{step_note(ecfg)})", "oracle": False,
                    "expert_steps": expert_steps, "self_play_steps": sum(rollout_steps.get(j, 0) for j in range(1, k + 1)),
                    "eval_steps": int(sum(int(m.get("env_steps", 0)) for m in res.values())),
                    "scores": {f"{ecfg.env}/{split}": {"avg_reward": m.get("avg_reward"),
                                                       "success_rate": m.get("success_rate"), "n": m.get("n"),
                                                       "source": m.get("source")} for split, m in res.items()},
                    "per_task": {f"{ecfg.env}/{split}": per_task_rewards(m["table"]) for split, m in res.items()},
                    "budget": [b for b in [budget_of(bc, "BC")] + [budget_of(run / plan.policy(j), f"it {j}")
                                                                   for j in range(1, k + 1)] if b],
                    "selection": qsel[:k] if qsel else None})
        name = ARM_NAMES[arm] + (f" (N={ccfg.best_of}, oracle)" if arm == "best_of_n" else "")
        step = step_note(ecfg)
        if arm == "qevolve":
            name += f" (iter {k_last}{step})"
        elif arm == "qevolve_oracle_v" and step:
            name = f"Q-Evolve (oracle V{step})"
        elif arm == "gigpo" and step:
            name = f"GiGPO (anchor-state credit{step})"
        row: dict[str, Any] = {"arm": arm, "method": name, "oracle": arm in ("best_of_n", "qevolve_oracle_v"),
                               "expert_steps": 0 if arm == "zero_shot" else expert_steps,
                               "self_play_steps": self_steps[arm],
                               "eval_steps": int(sum(int(m.get("env_steps", 0)) for m in results[arm].values())),
                               "scores": {}}
        for split, m in results[arm].items():
            row["scores"][f"{ecfg.env}/{split}"] = {"avg_reward": m.get("avg_reward"),
                                                    "success_rate": m.get("success_rate"), "n": m.get("n"),
                                                    "source": m.get("source")}
        # per task of every split: the final reward (Best-of-N: the best of its N), for paired statistics
        row["per_task"] = {f"{ecfg.env}/{split}": per_task_rewards(m["table"]) for split, m in results[arm].items()}
        if arm == "qevolve":  # BC, then every iteration's policy step
            row["budget"] = [budget_of(bc, "BC")] + [budget_of(run / plan.policy(k), f"it {k}")
                                                     for k in range(1, k_last + 1)]
            sel = selections.get("qevolve_iterations")
        elif arm == "qevolve_oracle_v":  # BC, then iteration 1's policy step on V*
            row["budget"] = [budget_of(bc, "BC"), budget_of(policies[arm], "it 1 (V*)")]
            sel = selections.get(arm)
        elif arm == "gigpo":  # BC, then iteration 1's policy step on GiGPO's advantages
            row["budget"] = [budget_of(bc, "BC"), budget_of(policies[arm], "it 1 (GiGPO)")]
            sel = selections.get(arm)
            row["anchor_groups"] = gigpo_stats  # where GiGPO has step credit at all (label's statistics)
        else:
            plain_bc = arm in ("sft", "best_of_n") or (arm == "eto" and eto_note)
            row["budget"] = [budget_of(policies[arm], "BC" if plain_bc else ARM_NAMES[arm])]
            sel = selections.get(arm) if arm != "best_of_n" else None
        row["budget"] = [b for b in row["budget"] if b]
        row["selection"] = sel
        if arm == "best_of_n" and ccfg.select_on_validation:
            row["selection_note"] = "BC as chosen for SFT; no training of its own"
        if arm == "eto" and eto_note:
            row["selection_note"] = eto_note
        if arm == "zero_shot":
            row["selection_note"] = "no training"
        rows.append(row)
    table = {"run": str(run), "env": ecfg.env, "seed": ecfg.seed, "splits": list(ecfg.eval_splits),
             "columns": [f"{ecfg.env}/{s}" for s in ecfg.eval_splits], "best_of": ccfg.best_of,
             "qevolve_iteration": k_last, "rows": rows}
    write_json(cdir / "table.json", table)
    write_text(cdir / "table.md", table_markdown(table))
    return table


def _gigpo_arm(ecfg, ccfg: CompareConfig, run: Path, cdir: Path, crun, base: Path, bc: Path, policies: dict[str, Path],
               selections: dict[str, Any], validation, echo, quiet: bool) -> dict[str, Any]:
    """The GiGPO row: the iteration-1 labels (``iter_1/labeled.parquet``: the expert table and the iteration-1
    rollouts) relabelled with ``advantage: gigpo`` (the run's label_1 config otherwise; no critic), then the
    run's own iteration-1 policy step from the BC policy on them, chosen among the run's ``policy_candidates``
    under ``select_on_validation`` (``validation``: (config, tasks)). Sets ``policies["gigpo"]`` (and its
    selection); returns the label stage's anchor-group statistics (``label --json``'s ``gigpo``)."""
    from qevolve_cli.evolve.loop import _scalars, policy_start
    from qevolve_cli.policy.trainer import train_policy

    l_cfg = ecfg.stage("label", 1).replace(advantage="gigpo", value_source="critic")
    labeled, adv = run / "iter_1" / "labeled.parquet", cdir / "gigpo" / "advantages.parquet"
    if not labeled.exists():
        raise QevolveError(f"{run}: no iteration-1 labels ({labeled}); run `qevolve evolve --iters 1` (or --resume) "
                           "first")

    def gigpo_labels():
        from qevolve_cli.labeling import label_tables

        return _scalars(label_tables([labeled], adv, l_cfg))

    m = crun.run_stage("gigpo/advantage", gigpo_labels, inputs=[str(labeled)], outputs=["gigpo/advantages.parquet"],
                       config_hash=l_cfg.hash(), iteration=1, echo=echo)
    stats = dict(m.get("gigpo", {}))
    if stats:
        from qevolve_cli.rewards import gigpo_line

        echo(f"compare: {gigpo_line(stats)}")
    p_cfg = ecfg.stage("policy", 1)
    start, ref = policy_start(ecfg, base, bc)  # the run's own policy step (bppo from BC, or awr)
    inputs = ["gigpo/advantages.parquet", str(start)]
    if validation is not None:  # the candidates of the run's own policy steps
        from qevolve_cli.evolve.select import select

        def train(c, out_dir):
            return train_policy(c, adv, start, out_dir, ref=ref, quiet=quiet)

        v_cfg, val_tasks = validation
        selections["gigpo"] = select(crun, "gigpo", p_cfg, ecfg.policy_candidates, train, v_cfg, val_tasks,
                                     iteration=1, inputs=inputs, echo=echo)
        policies["gigpo"] = cdir / selections["gigpo"]["policy"]
    else:
        def train_one():
            return _scalars(train_policy(p_cfg, adv, start, cdir / "gigpo" / "policy", ref=ref, quiet=quiet))

        crun.run_stage("gigpo", train_one, inputs=inputs, outputs=["gigpo/policy"], config_hash=p_cfg.hash(),
                       legacy_hash=p_cfg.legacy_hash(), iteration=1, echo=echo)
        policies["gigpo"] = cdir / "gigpo" / "policy"
    return stats
