"""`qevolve compare`: the paper's baselines on one evolve run's data, one table (docs/compare.md).

From a ``qevolve evolve`` run directory (its expert table, its iteration-1
rollouts, its base model and BC policy, its evaluation settings) the arms are:

* **SFT** = the run's BC policy (``bc/policy``);
* **RFT** = ``policy --objective rft`` from the base model on the expert table
  plus the successful iteration-1 rollouts, with the run's BC settings;
* **ETO** = ``policy --objective dpo`` from the BC policy (also the frozen
  reference) on ETO pairs of the expert table and the iteration-1 rollouts,
  ETO's recipe scaled to the run (:meth:`CompareConfig.eto_config`);
* **Best-of-N** = the BC policy, N sampled trajectories per task, the best by
  final env reward (an oracle upper bound, QLASS's rule);
* **Q-Evolve** = the run's last evaluated iteration;
* **Q-Evolve (oracle V)** (environments with an exact solver: lamps, lamps-hard) = the iteration-1
  policy step (BPPO from the BC policy, the run's ``policy_1`` config) on the iteration-1 labels
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

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qevolve_cli.config import ConfigBase, field
from qevolve_cli.errors import ConfigError, QevolveError

ARMS = ("sft", "rft", "eto", "best_of_n", "qevolve", "qevolve_oracle_v")
ETO_LR_RATIO = 1e-6 / 2e-5  # ETO (run_eto.sh): DPO lr 1e-6 after SFT at lr 2e-5
ETO_NLL_WEIGHT = 1.0  # RPO (Pang et al. 2024) and TRL's rpo_alpha recommendation: DPO + 1.0 x NLL(chosen)
ARM_NAMES = {"sft": "SFT", "rft": "RFT", "eto": "ETO", "best_of_n": "Best-of-N", "qevolve": "Q-Evolve",
             "qevolve_oracle_v": "Q-Evolve (oracle V)"}


@dataclass
class CompareConfig(ConfigBase):
    arms: list[str] = field(default_factory=lambda: list(ARMS), help="Rows of the table: sft, rft, eto, best_of_n, "
                                                                      "qevolve, qevolve_oracle_v (only where the "
                                                                      "environment has an exact solver: dropped "
                                                                      "from the default list elsewhere).")
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

    def validate(self, source: Any = None, prefix: str = "") -> None:
        for a in self.arms:
            if a not in ARMS:
                raise ConfigError(source, prefix + "arms", f"unknown arm {a!r} (choose from {', '.join(ARMS)})")
        if not self.arms:
            raise ConfigError(source, prefix + "arms", "no arm to compare")

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


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample standard deviation / sqrt(n); 0 for one value)."""
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan")
    m = sum(xs) / n
    if n == 1:
        return m, 0.0
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var / n)


def _echo_stderr(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


def run_compare(run_dir: str | Path, ccfg: CompareConfig | None = None, out: str | Path | None = None,
                resume: bool = False, echo: Callable[[str], None] = _echo_stderr, quiet: bool = False
                ) -> dict[str, Any]:
    """Train and evaluate the baseline arms for the evolve run in ``run_dir``; returns the table (a dict)."""
    import yaml

    from qevolve_cli import schema
    from qevolve_cli.atomic import write_json, write_text
    from qevolve_cli.config import dump_yaml
    from qevolve_cli.envs.oracle import SOLVERS, has_solver
    from qevolve_cli.evolve.config import EvolveConfig
    from qevolve_cli.evolve.loop import Plan, _scalars
    from qevolve_cli.evolve.rundir import RunDir

    ccfg = ccfg or CompareConfig()
    run = Path(run_dir)
    cfg_path = run / "config.yaml"
    if not cfg_path.exists():
        raise QevolveError(f"{run}: not a qevolve evolve run directory (no config.yaml)")
    ecfg = EvolveConfig.from_dict(yaml.safe_load(cfg_path.read_text()), source=cfg_path)
    if "qevolve_oracle_v" in ccfg.arms and not has_solver(ecfg.env):
        if ccfg.arms != list(ARMS):  # named by the user: say why it cannot be
            raise QevolveError(f"arms: qevolve_oracle_v needs an exact solver, and {ecfg.env!r} has none (solvers: "
                               f"{', '.join(SOLVERS)})")
        ccfg = ccfg.replace(arms=[a for a in ccfg.arms if a != "qevolve_oracle_v"])
    evolve_run = RunDir(run)
    plan = Plan(ecfg, run)
    P = lambda rel: run / rel if not Path(rel).is_absolute() else Path(rel)  # noqa: E731
    expert, base, bc = P(plan.expert()), P(plan.base_model()), P(plan.policy(0))
    rollout = run / "iter_1" / "rollout.parquet"
    for what, p in (("expert table", expert), ("BC policy", bc), ("iteration-1 rollouts", rollout)):
        if not p.exists():
            raise QevolveError(f"{run}: no {what} ({p}); run `qevolve evolve --iters 1` (or --resume) first")
    k_last = ccfg.qevolve_iteration or max([k for k in range(1, ecfg.iters + 1) if (run / plan.policy(k)).exists()],
                                           default=0)
    if "qevolve" in ccfg.arms and (not k_last or not (run / plan.policy(k_last)).exists()):
        raise QevolveError(f"{run}: no Q-Evolve policy (iter_{k_last or 1}/policy); finish the evolve run first")

    # ---- the compare directory (own manifest, resumable)
    cdir = Path(out) if out is not None else run / "compare"
    cc_path = cdir / "compare.yaml"
    if cc_path.exists():
        if not resume:
            raise QevolveError(f"{cdir}: a comparison already exists here; pass --resume to continue it or choose "
                               "another --out")
        saved = CompareConfig.from_dict(yaml.safe_load(cc_path.read_text()) or {}, source=cc_path)
        if saved.hash() != ccfg.hash():
            raise QevolveError(f"{cc_path}: the comparison was started with another configuration (hash "
                               f"{saved.hash()} != {ccfg.hash()}); resume with the same flags or choose another --out")
    else:
        cdir.mkdir(parents=True, exist_ok=True)
        dump_yaml(ccfg, cc_path)
    crun = RunDir(cdir)
    data = [str(expert), str(rollout)]

    # ---- training arms
    policies: dict[str, Path] = {"sft": bc, "best_of_n": bc}
    if k_last:
        policies["qevolve"] = run / plan.policy(k_last)
    if "rft" in ccfg.arms:
        r_cfg = ccfg.rft_config(ecfg)

        def train_rft():
            from qevolve_cli.policy.trainer import train_policy

            return _scalars(train_policy(r_cfg, data, base, cdir / "rft" / "policy", quiet=quiet))

        crun.run_stage("rft", train_rft, inputs=data + [str(base)], outputs=["rft/policy"],
                       config_hash=r_cfg.hash(), iteration=1, echo=echo)
        policies["rft"] = cdir / "rft" / "policy"
    if "eto" in ccfg.arms:
        d_cfg = ccfg.eto_config(ecfg)

        def train_eto():
            from qevolve_cli.policy.trainer import train_policy

            return _scalars(train_policy(d_cfg, data, bc, cdir / "eto" / "policy", ref=bc, quiet=quiet))

        crun.run_stage("eto", train_eto, inputs=data + [str(bc)], outputs=["eto/policy"],
                       config_hash=d_cfg.hash(), iteration=1, echo=echo)
        policies["eto"] = cdir / "eto" / "policy"
    if "qevolve_oracle_v" in ccfg.arms:
        # iteration 1 with V* instead of the learned critic: the same labels (the run's label_1 config,
        # value_source oracle, the rollout's step limit for the replay), the same BPPO step from BC
        l_cfg = ecfg.stage("label", 1).replace(value_source="oracle",
                                               oracle_max_steps=ecfg.stage("rollout", 1).max_steps)
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

        def train_oracle_v():
            from qevolve_cli.policy.trainer import train_policy

            return _scalars(train_policy(o_cfg, cdir / "oracle_v" / "advantages.parquet", bc,
                                         cdir / "oracle_v" / "policy", ref=bc, quiet=quiet))

        crun.run_stage("oracle_v", train_oracle_v, inputs=["oracle_v/advantages.parquet", str(bc)],
                       outputs=["oracle_v/policy"], config_hash=o_cfg.hash(), iteration=1, echo=echo)
        policies["qevolve_oracle_v"] = cdir / "oracle_v" / "policy"

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
        k = k_last if arm == "qevolve" else (1 if arm in ("rft", "eto", "qevolve_oracle_v") else 0)
        for split in ecfg.eval_splits:
            e_cfg = eval_cfg(k, split)
            best_of = ccfg.best_of if arm == "best_of_n" else 1
            if best_of > 1 and ccfg.bon_temperature is not None:
                e_cfg = e_cfg.replace(temperature=ccfg.bon_temperature)
            reused = from_run(f"iter_{k}/eval_{split}", e_cfg.hash()) if arm in ("sft", "qevolve") else None
            if reused is not None:
                results[arm][split] = {**reused, "source": f"{run.name}/iter_{k}/eval_{split}"}
                continue
            name = f"eval/{arm}_{split}"

            def ev(e_cfg=e_cfg, name=name, policy=policies[arm], best_of=best_of):
                from qevolve_cli.rollout.evaluate import run_eval

                m = run_eval(e_cfg, policy, cdir / f"{name}.parquet", best_of=best_of, resume=True)
                return {"split": e_cfg.split, **_scalars(m)}

            h = e_cfg.hash() + (f"-bon{best_of}" if best_of > 1 else "")
            m = crun.run_stage(name, ev, inputs=[str(policies[arm])], outputs=[f"{name}.parquet"], config_hash=h,
                               iteration=k, echo=echo)
            results[arm][split] = {**m, "source": f"compare/{name}"}

    # ---- env steps: expert demonstrations (every arm starts from BC on them), self-play rollouts for training
    expert_steps = schema.read_table(expert, validate_rows=False).height
    rollout_steps = {k: schema.read_table(run / f"iter_{k}" / "rollout.parquet", validate_rows=False).height
                     for k in range(1, (k_last or 1) + 1) if (run / f"iter_{k}" / "rollout.parquet").exists()}
    self_steps = {"sft": 0, "best_of_n": 0, "rft": rollout_steps.get(1, 0), "eto": rollout_steps.get(1, 0),
                  "qevolve_oracle_v": rollout_steps.get(1, 0),
                  "qevolve": sum(rollout_steps.get(k, 0) for k in range(1, k_last + 1))}
    rows = []
    for arm in ccfg.arms:
        name = ARM_NAMES[arm] + (f" (N={ccfg.best_of}, oracle)" if arm == "best_of_n" else "")
        if arm == "qevolve":
            name += f" (iter {k_last})"
        row: dict[str, Any] = {"arm": arm, "method": name, "oracle": arm in ("best_of_n", "qevolve_oracle_v"),
                               "expert_steps": expert_steps, "self_play_steps": self_steps[arm],
                               "eval_steps": int(sum(int(m.get("env_steps", 0)) for m in results[arm].values())),
                               "scores": {}}
        for split, m in results[arm].items():
            row["scores"][f"{ecfg.env}/{split}"] = {"avg_reward": m.get("avg_reward"),
                                                    "success_rate": m.get("success_rate"), "n": m.get("n"),
                                                    "source": m.get("source")}
        rows.append(row)
    table = {"run": str(run), "env": ecfg.env, "seed": ecfg.seed, "splits": list(ecfg.eval_splits),
             "columns": [f"{ecfg.env}/{s}" for s in ecfg.eval_splits], "best_of": ccfg.best_of,
             "qevolve_iteration": k_last, "rows": rows}
    write_json(cdir / "table.json", table)
    write_text(cdir / "table.md", table_markdown(table))
    return table


def table_markdown(table: dict[str, Any]) -> str:
    """The paper's layout: rows = methods, columns = env x split (average reward x100), then env steps."""
    cols = table["columns"]
    head = "| method | " + " | ".join(cols) + " | self-play env steps (train) | env steps at eval |"
    lines = [head, "|" + "---|" * (len(cols) + 3)]
    for r in table["rows"]:
        cells = []
        for c in cols:
            s = r["scores"].get(c)
            cells.append("–" if s is None or s.get("avg_reward") is None else f"{100 * s['avg_reward']:.1f}")
        lines.append(f"| {r['method']} | " + " | ".join(cells) + f" | {r['self_play_steps']} | {r['eval_steps']} |")
    notes = [f"Average final reward x100 (the paper's metric); {table['env']}, seed {table['seed']}, "
             f"expert demonstrations: {table['rows'][0]['expert_steps'] if table['rows'] else 0} env steps "
             "(used by every arm)."]
    if any(r["arm"] == "qevolve_oracle_v" for r in table["rows"]):
        notes.append("Q-Evolve (oracle V) is iteration 1's policy step on the exact optimal values V* from the "
                     "environment's solver instead of the learned critic's: the critic's ceiling, not a deployable "
                     "method.")
    if any(r["arm"] == "best_of_n" for r in table["rows"]):
        notes.append(f"Best-of-N keeps, per task, the one of N={table['best_of']} sampled trajectories with the "
                     "highest final environment reward: an oracle upper bound (QLASS's rule), not a deployable "
                     "method.")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"
