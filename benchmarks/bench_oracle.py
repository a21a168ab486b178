"""The oracle diagnosis of the policy step (docs/compare.md, "Oracle diagnosis"): every arm re-runs the
iteration-1 policy step of one `qevolve evolve --iters 1` run on that run's own data, from its BC policy,
everything else equal, then evaluates greedily on the whole held-out splits.

Arms (the advantages each BPPO arm trains on; `norm` = advantages standardised, `raw` = as labelled):
  sft             the run's BC policy, evaluated on the whole splits (the run may have used eval_max_tasks)
  rft_bc          RFT from BC with the iteration's policy budget (the same start and budget as BPPO)
  rft_full        RFT as `qevolve compare` trains it: from the base model with the BC budget
  bc              BC trained again from the base model exactly as the run's (only with suffixes: bc_ep24)
  bc_redraw       BC trained again from the base model on the expert rows with another seed (seed + 1000):
                  the spread of BC itself, the control of every arm that retrains from the base model
  oracle_gae      V* (the environment's exact solver) + GAE on r_env             (norm)
  oracle_gae_raw  the same, advantages as labelled                               (raw)
  oracle_td       V* + one-step TD                                               (norm)
  tab_gae         exact tabular IQL on the buffer (V fit on r_env + r_aux) + GAE (norm)
  tab_gae_aux     the same, GAE on r_env + r_aux                                 (norm)
  tab_env_gae     tabular IQL with V fit on r_env only + GAE                     (norm)
  learned         the run's learned critic + GAE                                 (norm)
  learned_raw     the run's learned critic + GAE, as labelled                    (raw)
  shuffled        the learned advantages permuted over the steps (control)       (norm)
  learned_pos     the learned advantages standardised, then the negative ones set to 0 (BPPO only
                  raises what the critic rates above average; nothing is pushed down)
  learned_trajmean  the learned advantages replaced by their trajectory's mean (control: the same
                  credit to every step of a trajectory, i.e. to its outcome; what is left of `learned`
                  without the critic's credit to single steps)                   (norm)
  learned_lam1    the run's learned V with GAE at lambda 1: G_t - V(s_t), the Monte-Carlo return less V
                  (a failure's credit spread evenly, V only a baseline)           (norm)
  learned_lam0    the same V with GAE at lambda 0: the one-step TD error           (norm)
  awr_full        AWR (weights exp(A), the learned advantages standardised) from the base model with
                  the BC budget: rft_full's start and budget, every row weighted by the critic instead
                  of keeping the successes only
  awr_full_one    control of awr_full: the same AWR with every weight 1 (BC from the base model on every row,
                  failed trajectories included): what the data adds without the critic
  awr_full_shuffled  control of awr_full: the learned advantages permuted over the steps (the same
                  weights, not where the critic put them)
  awr_oracle      awr_full on the exact V* + GAE advantages (oracle_gae's) instead of the learned critic's:
                  the ceiling of the critic under `evolve --policy-step awr`
  awr_tab         awr_full on tab_gae's advantages (exact tabular IQL on the buffer)
  awr_bc          the same AWR from BC with the iteration's budget (rft_bc's start and budget)
  a_one           A = 1 on every row: BC on everything (control)                 (raw)
  tab_gae_m05     tab_gae with expectile 0.5 (V = mean of Q: the behaviour policy's value) (norm)
  tab_gae_m09     tab_gae with expectile 0.9                                    (norm)
  learned_m05     the run's critic retrained with expectile 0.5 + GAE           (norm)
  learned_pbb     the run's critic retrained on the BC policy as its frozen backbone (evolve's
                  critic_backbone: policy) instead of the base model + GAE           (norm)
  oracle_gae_informative  oracle_gae on the informative steps only: steps whose V* is 0 (hopeless
                  states: nothing the policy does there matters) get A = 0 after standardising (norm)
  learned_feat    the feature critic of `--preset cpu` (heads on cached frozen features, FEATURE_CRITIC) trained
                  on the run's buffer + GAE                                      (norm)
  awr_feat        awr_full on learned_feat's advantages: the AWR step of `--preset cpu` with the feature critic
  learned_lora    the LoRA critic of `--preset cpu` before the feature critic (LORA_CRITIC) retrained + GAE (norm)
  gigpo           GiGPO's anchor-state credit (label --advantage gigpo; no critic; expert rows left out)
  <arm>_clip02    any BPPO arm with a binding lower clip: eps_low 0.2 instead of the paper's 0.8
  <arm>_lrK, _epN  also the arms from the base model (bc, bc_redraw, rft_full, awr_full*, awr_oracle, awr_tab):
                  the bc stage's lr times K, N epochs (rft_full_ep24: RFT with twice the BC budget)
  <arm>_betaK     any AWR arm (awr_full*, awr_oracle, awr_tab, awr_bc) with awr_beta K: weights exp(A / K)
  <arm>_lrK, _epN, _refN, _hiK  any BPPO arm (and rft_bc, awr_bc) with the policy step's lr times K, N
                  epochs, the old policy refreshed every N optimiser steps, eps_high K (combinable:
                  learned_lr10_ep4_ref25)

    python benchmarks/bench_oracle.py --runs runs/lh-s0 runs/lh-s1 --arms rft_bc oracle_gae learned
    python benchmarks/bench_oracle.py --runs runs/lh-s* --report-only --markdown   # the table of what exists
    python benchmarks/bench_oracle.py --runs runs/lh-s* --report-only --markdown --arms awr_full awr_oracle \
        --refs rft_full learned                                                    # other reference columns

Each arm's work goes to RUN/oracle/<arm>/ and is skipped when its evaluations exist (re-run to resume).
Held out means every task of the held-out splits pooled, each task counted once (`test_seen` 48 + `test_unseen`
96 = 144 tasks on lamps-hard / lamps-habit), as bench_compare.py and `qevolve compare` count it
(docs/results.md, "Held out"); before this definition the `mean` was the two split means averaged (48 and 96
tasks weighted equally), which the dated figures in docs/notebook/ say where they use it.

Prints one JSON object: per run and arm the success rate and number of tasks per split and the pooled `mean`,
per arm the mean and standard error over the runs (pooled and per split), and per run (where both were labelled) `credit`: how much of the learned
critic's advantages is credit to steps rather than to outcomes, against the exact ones (credit_stats).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # qevolve_cli from this checkout (the report reuses compare_table.mean_se)
BASE_ARMS = ("sft", "bc", "rft_bc", "rft_full", "bc_redraw", "oracle_gae", "oracle_gae_raw", "oracle_td", "tab_gae", "tab_gae_aux",
             "tab_env_gae", "tab_gae_m05", "tab_gae_m09", "learned", "learned_raw", "learned_m05", "learned_pbb", "learned_pos", "learned_trajmean", "learned_lam1", "learned_lam0", "shuffled", "a_one",
             "awr_full", "awr_full_one", "awr_full_shuffled", "awr_bc", "awr_oracle", "awr_tab",
             "oracle_gae_informative", "learned_feat", "learned_lora", "awr_feat", "gigpo")
AWR_FULL_ARMS = ("awr_full", "awr_full_one", "awr_full_shuffled", "awr_oracle", "awr_tab", "awr_feat")
FROM_BASE = ("bc", "bc_redraw", "rft_full", *AWR_FULL_ARMS)  # trained from the base model with the bc stage's budget
BPPO_ARMS = [a for a in BASE_ARMS if a not in ("sft", "rft_bc", "awr_bc", *FROM_BASE)]
ARMS = BASE_ARMS + tuple(f"{a}_clip02" for a in BPPO_ARMS)
LABEL = {  # arm -> label config overrides over the run's label stage (value source, advantage, fit reward)
    "oracle_gae": {"value_source": "oracle", "advantage": "gae"},
    "oracle_gae_raw": {"value_source": "oracle", "advantage": "gae"},
    "oracle_td": {"value_source": "oracle", "advantage": "td"},
    "tab_gae": {"value_source": "tabular_iql", "advantage": "gae", "fit_reward": "env_aux"},
    "tab_gae_aux": {"value_source": "tabular_iql", "advantage": "gae_aux", "fit_reward": "env_aux"},
    "tab_env_gae": {"value_source": "tabular_iql", "advantage": "gae", "fit_reward": "env"},
    "tab_gae_m05": {"value_source": "tabular_iql", "advantage": "gae", "fit_reward": "env_aux", "expectile": 0.5},
    "tab_gae_m09": {"value_source": "tabular_iql", "advantage": "gae", "fit_reward": "env_aux", "expectile": 0.9},
    "oracle_gae_informative": {"value_source": "oracle", "advantage": "gae"},
    "awr_oracle": {"value_source": "oracle", "advantage": "gae"},
    "awr_tab": {"value_source": "tabular_iql", "advantage": "gae", "fit_reward": "env_aux"},
    "gigpo": {"advantage": "gigpo"},  # GiGPO's anchor-state credit: no values (docs/policy.md, "GiGPO")
}
CREDIT_SOURCES = ("learned", "learned_lam1", "learned_lam0", "awr_full", "learned_pbb", "learned_m05", "tab_gae", "tab_env_gae", "tab_gae_m05",
                  "tab_gae_m09", "shuffled", "learned_feat", "learned_lora", "gigpo")
"""Arms with advantages of their own (a critic, the tabular IQL, a control) that `credit` holds against the solver's."""
RAW = {"oracle_gae_raw", "learned_raw", "a_one", "learned_pos"}  # learned_pos: standardised before clamping
# the feature critic of `--preset cpu` (configs/presets/cpu.yaml, critic section): heads on the frozen base model's
# cached last-layer features of the task plus the last 3 turns, with the steps left as an input (docs/critic.md, "The feature
# critic")
FEATURE_CRITIC = {"kind": "features", "context_turns": 3, "feature_layer": -1, "time_input": "steps_left",
                  "time_scale": 1.0, "epochs": 300, "lr": 1.0e-3, "head_lr": 1.0e-3, "ema_lambda": 0.05,
                  "head_hidden": 256, "warmup_ratio": 0.0, "lr_scheduler": "constant", "early_stop_patience": 0}
# the LoRA critic of `--preset cpu` before the feature critic (its stage config of 2026-12-01)
LORA_CRITIC = {"kind": "lora", "epochs": 6, "lr": 1.0e-3, "head_lr": 3.0e-3, "ema_lambda": 0.2, "batch_size": 2,
               "schedule": "both", "time_input": "none", "head_hidden": 64, "lora_rank": 8, "warmup_ratio": 0.0,
               "early_stop_patience": 3, "early_stop_min_delta": 0.05}
RETRAINED_CRITIC = {  # arm -> (critic config overrides, backbone inside the run) of a critic trained anew
    "learned_m05": ({"expectile": 0.5}, "base_model"),
    "learned_pbb": ({}, "bc/policy"),
    "learned_feat": (FEATURE_CRITIC, "base_model"),
    "awr_feat": (FEATURE_CRITIC, "base_model"),
    "learned_lora": (LORA_CRITIC, "base_model"),
}


SUFFIX = re.compile(r"_(clip02|lr[0-9.]+|ep[0-9]+|ref[0-9]+|hi[0-9.]+|beta[0-9.]+)$")


def split_arm(arm: str) -> tuple[str, dict]:
    """(base arm, policy overrides) of a BPPO arm with suffixes: ``_clip02`` eps_low 0.2, ``_lrK`` the lr times K,
    ``_epN`` N epochs, ``_refN`` the old policy refreshed every N optimiser steps, ``_hiK`` eps_high K (``learned_lr10_ref25``),
    ``_betaK`` awr_beta K (the AWR arms)."""
    over: dict = {}
    while (m := SUFFIX.search(arm)) and arm[: m.start()]:
        tok = m.group(1)
        if tok == "clip02":
            over["eps_low"] = 0.2
        elif tok.startswith("lr"):
            over["lr_factor"] = float(tok[2:])
        elif tok.startswith("ep"):
            over["epochs"] = int(tok[2:])
        elif tok.startswith("hi"):
            over["eps_high"] = float(tok[2:])
        elif tok.startswith("beta"):
            over["awr_beta"] = float(tok[4:])
        else:
            over["old_refresh_steps"] = int(tok[3:])
        arm = arm[: m.start()]
    return arm, over


def arm_name(name: str) -> str:
    """argparse type: a base arm, or a BPPO arm with suffixes (split_arm)."""
    base, over = split_arm(name)
    ok = not over or base in BPPO_ARMS + ["rft_bc", "awr_bc"] or (base in FROM_BASE and set(over) <= {"lr_factor", "epochs", "awr_beta"})
    ok = ok and ("awr_beta" not in over or base in (*AWR_FULL_ARMS, "awr_bc"))  # a temperature for the AWR arms only
    if base not in BASE_ARMS or base == "bc" and not over or not ok:
        raise argparse.ArgumentTypeError(f"unknown arm {name!r} (arms: {', '.join(BASE_ARMS)}; BPPO arms, rft_bc and "
                                         "awr_bc take the suffixes _clip02, _lrK, _epN, _refN, _hiK; the arms from the "
                                         f"base model ({', '.join(FROM_BASE)}) _lrK and _epN; the AWR arms _betaK; "
                                         "bc needs one)")
    return name


def qevolve(*args: str | Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    quiet = ["--quiet"] if args[0] in ("policy", "eval") else []
    r = subprocess.run([sys.executable, "-m", "qevolve_cli", *map(str, args), *quiet], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"qevolve {' '.join(map(str, args))} failed:\n{r.stderr[-2000:]}")
    return r.stdout


def write_yaml(path: Path, base: Path, overrides: dict) -> Path:
    import yaml

    d = yaml.safe_load(base.read_text()) or {}
    d.update(overrides)
    path.write_text(yaml.safe_dump(d))
    return path


def advantage_table(run: Path, arm: str, work: Path) -> Path:
    import polars as pl

    out = work / "advantages.parquet"
    if out.exists():
        return out
    import yaml

    if arm in LABEL:
        max_steps = (yaml.safe_load((run / "stages" / "rollout_1.yaml").read_text()) or {}).get("max_steps")
        vs = LABEL[arm].get("value_source", "critic")
        over = {**LABEL[arm], **({"oracle_max_steps": max_steps} if vs != "critic" else {})}
        cfg = write_yaml(work / "label.yaml", run / "stages" / "label_1.yaml", over)
        tmp = work / "labels.tmp.parquet"
        qevolve("label", run / "iter_1" / "labeled.parquet", "--config", cfg, "--out", tmp)
        if arm == "oracle_gae_informative":
            # standardise over all steps as BPPO would, then zero the hopeless ones (V* = 0 and not the last step)
            d = pl.read_parquet(tmp)
            a = pl.col("advantage")
            z = (a - a.mean()) / (a.std() + 1e-8)
            d = d.with_columns(pl.when((pl.col("value") == 0) & ~pl.col("done")).then(0.0).otherwise(z)
                               .cast(pl.Float32).alias("advantage"))
            d.write_parquet(tmp)
        tmp.rename(out)
        return out
    if arm in RETRAINED_CRITIC:
        crit = work / "critic"
        if not (crit / "critic_config.json").exists() and not (crit / "done").exists():
            overrides, backbone = RETRAINED_CRITIC[arm]
            c_cfg = write_yaml(work / "critic.yaml", run / "stages" / "critic_1.yaml", overrides)
            qevolve("critic", "--data", run / "iter_1" / "labeled.parquet", "--model", run / backbone,
                    "--config", c_cfg, "--out", crit)
            (crit / "done").write_text("")
        tmp = work / "labels.tmp.parquet"
        qevolve("label", run / "iter_1" / "labeled.parquet", "--critic", crit, "--config",
                run / "stages" / "label_1.yaml", "--out", tmp)
        tmp.rename(out)
        return out
    learned = pl.read_parquet(run / "iter_1" / "advantages.parquet")
    if arm in ("learned", "learned_raw", "awr_full", "awr_bc"):
        learned.write_parquet(out)
    elif arm == "learned_pos":
        a = pl.col("advantage")
        learned.with_columns(((a - a.mean()) / (a.std() + 1e-8)).clip(lower_bound=0.0).cast(pl.Float32)
                             .alias("advantage")).write_parquet(out)
    elif arm == "learned_trajmean":
        learned.with_columns(pl.col("advantage").mean().over("traj_id").cast(pl.Float32)).write_parquet(out)
    elif arm in ("learned_lam1", "learned_lam0"):  # the run's own V and GAE at lambda 1 (G_t - V) or 0 (TD)
        import yaml

        from qevolve_cli import schema
        from qevolve_cli.rewards import process_rewards

        gamma = float(yaml.safe_load((run / "stages" / "label_1.yaml").read_text())["gamma"])
        learned = schema.sort_steps(learned)
        learned.with_columns(process_rewards(learned, "gae", gamma, 1.0 if arm == "learned_lam1" else 0.0)
                             ).write_parquet(out)
    elif arm in ("shuffled", "awr_full_shuffled"):
        learned.with_columns(pl.col("advantage").shuffle(seed=0)).write_parquet(out)
    elif arm in ("a_one", "awr_full_one"):
        learned.with_columns(pl.lit(1.0, pl.Float32).alias("advantage")).write_parquet(out)
    return out


def bppo_stage(run: Path) -> Path:
    """The run's iteration-1 BPPO stage config (what the BPPO arms, rft_bc and awr_bc train with): its own
    ``stages/policy_1.yaml`` when the run's policy step is bppo, else (``policy_step: awr``) the same run's config
    resolved with ``policy_step: bppo``, written to ``RUN/oracle/policy_1_bppo.yaml``."""
    import yaml

    from qevolve_cli.config import dump_yaml
    from qevolve_cli.evolve.config import EvolveConfig

    ecfg = EvolveConfig.from_dict(yaml.safe_load((run / "config.yaml").read_text()), source=run / "config.yaml")
    if ecfg.policy_step == "bppo":
        return run / "stages" / "policy_1.yaml"
    out = run / "oracle" / "policy_1_bppo.yaml"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        dump_yaml(ecfg.replace(policy_step="bppo").stage("policy", 1), out)
    return out


def train(run: Path, full_arm: str, work: Path) -> Path:
    import yaml

    arm, over = split_arm(full_arm)
    if arm == "sft":
        return run / "bc" / "policy"
    policy = work / "policy"
    if (policy / "config.json").exists() or (policy / "adapter_config.json").exists():
        return policy
    stage1 = bppo_stage(run)
    p1 = yaml.safe_load(stage1.read_text())
    own = yaml.safe_load((run / "stages" / "policy_1.yaml").read_text())  # the run's own step: bppo or awr
    if not over and (arm, own["objective"]) in (("learned", "bppo"), ("awr_full", "awr")) and own["normalize_advantage"]:
        return run / "iter_1" / "policy"  # the run's own iteration-1 policy is this arm (standardised advantages)
    bc_yaml = run / "stages" / "bc.yaml"
    b = yaml.safe_load(bc_yaml.read_text())
    p_over = {k: v for k, v in over.items() if k != "lr_factor"}
    if "lr_factor" in over:  # times the lr of the stage the arm trains with: bc's for the arms from the base model
        p_over["lr"] = (b if arm in FROM_BASE else p1)["lr"] * over["lr_factor"]
    if arm == "rft_bc":
        cfg = write_yaml(work / "policy.yaml", stage1, p_over) if p_over else stage1
        qevolve("policy", "--objective", "rft", "--data", run / "iter_1" / "labeled.parquet", "--model",
                run / "bc" / "policy", "--config", cfg, "--out", policy)
    elif arm in AWR_FULL_ARMS:
        data = advantage_table(run, arm, work)
        cfg = write_yaml(work / "policy.yaml", bc_yaml, {"normalize_advantage": True, **p_over})
        qevolve("policy", "--objective", "awr", "--data", data, "--model", run / "base_model", "--config", cfg,
                "--out", policy)
    elif arm == "awr_bc":
        data = advantage_table(run, arm, work)
        cfg = write_yaml(work / "policy.yaml", stage1, {"normalize_advantage": True, **p_over})
        qevolve("policy", "--objective", "awr", "--data", data, "--model", run / "bc" / "policy", "--config", cfg,
                "--out", policy)
    elif arm in ("bc", "bc_redraw"):
        seed = {"seed": int(b.get("seed", 0)) + 1000} if arm == "bc_redraw" else {}
        cfg = write_yaml(work / "policy.yaml", bc_yaml, {**seed, **p_over})
        qevolve("policy", "--objective", "bc", "--data", run / "expert.parquet", "--model", run / "base_model",
                "--config", cfg, "--out", policy)
    elif arm == "rft_full":
        cfg = write_yaml(work / "policy.yaml", bc_yaml, p_over) if p_over else bc_yaml
        qevolve("policy", "--objective", "rft", "--data", run / "iter_1" / "labeled.parquet", "--model",
                run / "base_model", "--config", cfg, "--out", policy)
    else:
        (work.parent / arm).mkdir(parents=True, exist_ok=True)
        data = advantage_table(run, arm, work.parent / arm) if over else advantage_table(run, arm, work)
        norm = arm not in RAW and arm != "oracle_gae_informative"  # informative: standardised above
        cfg = write_yaml(work / "policy.yaml", stage1, {"normalize_advantage": norm, **p_over})
        qevolve("policy", "--objective", "bppo", "--data", data, "--model", run / "bc" / "policy", "--ref",
                run / "bc" / "policy", "--config", cfg, "--out", policy)
    return policy


VALIDATION = "validation"
"""The pseudo-split of ``--splits validation``: the run's validation tasks, the last ``validation_tasks`` train
tasks (what ``--select-on-validation`` plays; never a test split), to choose between arms without the test splits."""


def validation_metrics(run: Path, policy: Path, out: Path) -> dict:
    """Greedy play of ``policy`` on the run's validation tasks, as evolve's selection plays them."""
    from qevolve_cli.config import load_config
    from qevolve_cli.evolve.config import EvolveConfig
    from qevolve_cli.evolve.loop import validation_config, validation_of
    from qevolve_cli.rollout.evaluate import run_eval

    cfg = load_config(EvolveConfig, run / "config.yaml")
    tasks, _disjoint = validation_of(cfg)
    return run_eval(validation_config(cfg, 1), policy, out, resume=True, tasks=tasks)


def split_result(js: Path, table: Path, count: bool = True) -> tuple[float, int | None]:
    """(success rate, number of tasks) of one split's evaluation: its metrics JSON, the task count from the JSON's
    ``n_tasks`` (else ``n``), else from the evaluation table; no count (None) without ``count``."""
    m = json.loads(js.read_text())
    n = m.get("n_tasks", m.get("n"))
    if n is None:
        if not count:
            return float(m.get("success_rate", m.get("avg_reward", 0.0))), None
        from qevolve_cli.evolve.compare_table import per_task_rewards

        n = len(per_task_rewards(table))
    return float(m.get("success_rate", m.get("avg_reward", 0.0))), int(n)


def pooled(scores: dict[str, float], tasks: dict[str, int]) -> float:
    """The held-out mean: every task of the splits counted once (each split's success weighted by its tasks)."""
    n = sum(tasks.values())
    return sum(scores[s] * tasks[s] for s in scores) / n if n else 0.0


def evaluate(run: Path, env: str, policy: Path, work: Path, splits: list[str]) -> tuple[dict, dict]:
    """(success per split, tasks per split) of ``policy``, evaluated where not yet done."""
    scores, tasks = {}, {}
    for split in splits:
        out = work / f"eval_{split}.parquet"
        js = work / f"eval_{split}.json"
        if not js.exists():
            js.write_text(json.dumps(validation_metrics(run, policy, out)) if split == VALIDATION else
                          qevolve("eval", "--env", env, "--policy", policy, "--split", split, "--config",
                                  run / "stages" / "rollout_1.yaml", "--max-tasks", "0", "--out", out, "--json"))
        scores[split], tasks[split] = split_result(js, out)
    return scores, tasks


def advantage_stats(path: Path) -> dict:
    import polars as pl

    if not path.exists():
        return {}
    d = pl.read_parquet(path).filter(pl.col("source") != "expert")
    a = d["advantage"]
    return {"mean": float(a.mean()), "share_positive": float((a > 1e-6).mean()), "n_self_steps": d.height}


def credit_stats(learned, exact) -> dict:
    """How much of the learned advantages is credit to steps rather than to outcomes, against the exact ones.

    ``learned`` / ``exact``: tables (or Parquet paths) with traj_id, step, advantage over the same rows (the
    run's iteration-1 table labelled by its critic and by the solver). Both are standardised over all rows, as
    the policy step sees them. Returned: ``corr`` of the two; per source the ``within_share``, the part of the
    variance left after subtracting each trajectory's mean (0: every step of a trajectory gets the same
    advantage, i.e. the outcome; filtering successes, as RFT does, weighs rows the same way); and
    ``within_corr``, the correlation of the two once each trajectory's mean is subtracted (1: the critic
    blames the same steps as the solver inside a trajectory)."""
    import polars as pl

    k = ["traj_id", "step"]

    def z(t, name):
        t = pl.read_parquet(t) if isinstance(t, (str, Path)) else t
        a = pl.col("advantage")
        return t.select(*k, ((a - a.mean()) / a.std()).alias(name))

    d = z(learned, "l").join(z(exact, "e"), on=k, how="inner")
    if d.height < 2:
        return {}
    d = d.with_columns(*[(pl.col(c) - pl.col(c).mean().over("traj_id")).alias(c + "w") for c in ("l", "e")])
    share = {c: float(d[c + "w"].var() / d[c].var()) if d[c].var() else 0.0 for c in ("l", "e")}
    within = d.select(pl.corr("lw", "ew")).item() if min(share.values()) > 1e-9 else None
    return {"rows": d.height, "corr": round(float(d.select(pl.corr("l", "e")).item()), 3),
            "within_share": {"learned": round(share["l"], 3), "exact": round(share["e"], 3)},
            "within_corr": None if within is None else round(float(within), 3)}


def run_credit(run: Path) -> dict:
    """credit_stats of each CREDIT_SOURCES arm labelled in ``run`` against the solver's advantages (oracle_gae's,
    else awr_oracle's: the same labels); {} when neither was labelled."""
    exact = next((f for x in ("oracle_gae", "awr_oracle") if (f := run / "oracle" / x / "advantages.parquet").exists()),
                 None)
    if exact is None:
        return {}
    return {x: credit_stats(f, exact) for x in CREDIT_SOURCES if (f := run / "oracle" / x / "advantages.parquet").exists()}


def read_scores(work: Path, splits: list[str], with_tasks: bool = False):
    """The arm's success per split if all its evaluations exist (report-only mode), else None; with
    ``with_tasks``, (success per split, tasks per split)."""
    scores, tasks = {}, {}
    for split in splits:
        js = work / f"eval_{split}.json"
        if not js.exists():
            return None
        scores[split], tasks[split] = split_result(js, work / f"eval_{split}.parquet", count=with_tasks)
    return (scores, tasks) if with_tasks else scores


def arm_result(scores: dict, tasks: dict) -> dict:
    """One arm of one run: success and tasks per split, and the held-out ``mean`` pooled over the tasks."""
    return {"scores": scores, "tasks": tasks, "mean": pooled(scores, tasks)}


def run_arms(run: Path, arms: list[str], splits: list[str], report_only: bool = False) -> dict:
    import yaml

    env = yaml.safe_load((run / "config.yaml").read_text())["env"]
    out = {}
    for arm in arms:
        work = run / "oracle" / arm
        if report_only:
            got = read_scores(work, splits, with_tasks=True)
            if got is not None:
                out[arm] = {**arm_result(*got),
                            "advantages": advantage_stats(work.parent / split_arm(arm)[0] / "advantages.parquet")}
            continue
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        policy = train(run, arm, work)
        out[arm] = {**arm_result(*evaluate(run, env, policy, work, splits)),
                    "advantages": advantage_stats(work.parent / split_arm(arm)[0] / "advantages.parquet"),
                    "seconds": round(time.perf_counter() - t0, 1)}
        print(f"{run.name} {arm}: {json.dumps(out[arm]['scores'])}", file=sys.stderr, flush=True)
    return out


def choose(per_run: dict, runs: dict[str, Path], name: str, candidates: list[str]) -> None:
    """Add arm ``name`` to every run of ``per_run``: the candidate with the highest score on the run's validation
    tasks (`--splits validation`, never a test split; the first listed wins a tie), with its held-out scores.
    A run where a candidate lacks its held-out or validation evaluation gets no ``name``."""
    for r, arms in per_run.items():
        val = {c: read_scores(runs[r] / "oracle" / c, [VALIDATION]) for c in candidates}
        if any(v is None for v in val.values()) or any(c not in arms for c in candidates):
            continue
        best = max(candidates, key=lambda c: (val[c][VALIDATION], -candidates.index(c)))
        arms[name] = {**arms[best], "chosen": best, "validation": {c: val[c][VALIDATION] for c in candidates}}


def task_diffs(work_a: Path, work_b: Path, splits: list[str]) -> list[float]:
    """Per held-out task, arm A minus arm B (final reward), the splits' tasks one after the other, each task
    counted once: their mean is the difference of the pooled `mean` column."""
    from qevolve_cli.evolve.compare_table import per_task_rewards

    out: list[float] = []
    for split in splits:
        a = per_task_rewards(work_a / f"eval_{split}.parquet")
        b = per_task_rewards(work_b / f"eval_{split}.parquet")
        if set(a) != set(b):
            raise SystemExit(f"bench_oracle: {work_a} and {work_b} were evaluated on different {split} tasks")
        out += [a[t] - b[t] for t in sorted(a)]
    return out


def summarise(per_run: dict, arms: list[str], runs: dict[str, Path], splits: list[str],
              refs: tuple[str, ...] = ("rft_bc", "rft_full", "sft"), n_boot: int = 10000) -> dict:
    """Per arm: mean and standard error over the runs of the held-out success (every task of the splits pooled,
    each counted once), the same per split (``splits``), and the paired difference to each reference arm with its
    two-level bootstrap 95 % interval (runs, then each drawn run's tasks, resampled with replacement:
    compare_table.paired_bootstrap, as bench_compare.py)."""
    from qevolve_cli.evolve.compare_table import mean_se, paired_bootstrap

    summary = {}
    for arm in arms:
        xs = [per_run[r][arm]["mean"] for r in per_run if arm in per_run[r]]
        if not xs:
            continue
        m, se = mean_se(xs)
        row = {"mean": round(100 * m, 1), "se": round(100 * se, 1), "n": len(xs),
               "per_run": {r: round(100 * per_run[r][arm]["mean"], 1) for r in per_run if arm in per_run[r]}}
        for split in splits:
            s_m, s_se = mean_se([per_run[r][arm]["scores"][split] for r in per_run if arm in per_run[r]])
            row.setdefault("splits", {})[split] = {"mean": round(100 * s_m, 1), "se": round(100 * s_se, 1)}
        for ref in refs:
            if ref == arm:
                continue
            both = [r for r in per_run if arm in per_run[r] and ref in per_run[r]]
            if len(both) >= 2:
                diffs = [task_diffs(runs[r] / "oracle" / per_run[r][arm].get("chosen", arm),
                                    runs[r] / "oracle" / per_run[r][ref].get("chosen", ref), splits) for r in both]
                ci = paired_bootstrap(diffs, n_boot=n_boot)
                row[f"minus_{ref}"] = {"mean": round(100 * ci["mean"], 1),
                                       "ci95": [round(100 * ci["lo"], 1), round(100 * ci["hi"], 1)],
                                       "n": len(both), "wins": sum(per_run[r][arm]["mean"] > per_run[r][ref]["mean"]
                                                                   for r in both)}
        summary[arm] = row
    return summary


def markdown(summary: dict, runs: list[str], refs: tuple[str, ...] = ("rft_bc", "rft_full", "sft")) -> str:
    """Per arm: the runs' held-out values (pooled over the tasks), mean ± s.e., each split's mean ± s.e. (when
    there are several), and per reference arm the paired difference [95 % interval] with the number of runs on
    which the arm was above it."""
    splits = list(next(iter(summary.values()), {}).get("splits", {}))
    splits = splits if len(splits) > 1 else []
    head = ("| arm | " + " | ".join(runs) + " | held out, mean ± se | " + "".join(f"{s} | " for s in splits)
            + " | ".join(f"− {r} [95 % CI] (wins)" for r in refs) + " |")
    lines = [head, "|" + "---|" * (len(runs) + 2 + len(splits) + len(refs))]
    for arm, r in summary.items():
        cells = [f"{r['per_run'][x]:.1f}" if x in r["per_run"] else "–" for x in runs]
        cells += [f"{r['mean']:.1f} ± {r['se']:.1f}"] + [f"{r['splits'][s]['mean']:.1f} ± {r['splits'][s]['se']:.1f}"
                                                         for s in splits]
        diffs = []
        for ref in refs:
            d = r.get(f"minus_{ref}")
            diffs.append(f"{d['mean']:+.1f} [{d['ci95'][0]:+.1f}, {d['ci95'][1]:+.1f}] ({d['wins']}/{d['n']})"
                         if d else "–")
        lines.append(f"| {arm} | " + " | ".join(cells + diffs) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, nargs="+", required=True, help="Run directories of evolve --iters 1.")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), type=arm_name)
    ap.add_argument("--splits", nargs="+", default=["test_seen", "test_unseen"],
                    help="Held-out splits to evaluate on, or 'validation': the run's validation tasks (the last "
                         "validation_tasks train tasks), to choose between arms without reading a test split.")
    ap.add_argument("--choose", nargs="*", default=[], metavar="NAME=ARM,ARM",
                    help="An arm NAME that is, per run, the candidate ARM with the best score on the run's validation "
                         "tasks (evaluate them with --splits validation first): the same number of candidates gives "
                         "every method the same tuning budget. NAME is a new name (not an arm's); it is reported "
                         "like an arm and can be an --refs entry.")
    ap.add_argument("--report-only", action="store_true", help="Train and evaluate nothing: report what exists.")
    ap.add_argument("--markdown", action="store_true", help="Print a markdown table (after the JSON, on stderr).")
    ap.add_argument("--refs", nargs="+", default=["rft_bc", "rft_full", "sft"],
                    help="Reference arms of the paired differences (columns '− REF'; run like the arms where missing).")
    a = ap.parse_args()
    if VALIDATION in a.splits and len(a.splits) > 1:  # the mean column would mix a selection score into a result
        ap.error(f"--splits: {VALIDATION} is reported on its own (a separate call): its score chooses between arms, "
                 "the held-out tasks pooled report them")
    chosen = {}
    for spec in a.choose:
        name, _, cands = spec.partition("=")
        if not name or not cands:
            ap.error(f"--choose {spec}: expected NAME=ARM,ARM,...")
        try:
            arm_name(name)
        except argparse.ArgumentTypeError:
            pass
        else:
            ap.error(f"--choose {spec}: {name} is an arm's name; give the chosen arm a new one")
        try:
            chosen[name] = [arm_name(c) for c in cands.split(",")]
        except argparse.ArgumentTypeError as e:
            ap.error(f"--choose {spec}: {e}")
    try:
        refs = tuple(r if r in chosen else arm_name(r) for r in a.refs)
    except argparse.ArgumentTypeError as e:
        ap.error(f"--refs: {e}")
    for r in a.runs:
        if not (r / "config.yaml").is_file():
            ap.error(f"--runs {r}: not a run directory of qevolve evolve (no config.yaml)")
    # a reference arm and a candidate are run (or read) like the others; a chosen name is no arm to run
    every = [x for x in dict.fromkeys([*a.arms, *refs, *(c for cs in chosen.values() for c in cs)]) if x not in chosen]
    runs = {r.name: r for r in a.runs}
    per_run = {name: run_arms(r, every, a.splits, a.report_only) for name, r in runs.items()}
    for name, cands in chosen.items():
        choose(per_run, runs, name, cands)
    summary = summarise(per_run, [*a.arms, *chosen], runs, a.splits, refs)
    credit = {name: c for name, r in runs.items() if (c := run_credit(r))}
    print(json.dumps({"runs": per_run, "summary": summary, "credit": credit}, indent=1))
    if a.markdown:
        print(markdown(summary, list(per_run), refs), file=sys.stderr)


if __name__ == "__main__":
    main()
