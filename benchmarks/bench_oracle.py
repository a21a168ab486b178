"""The oracle diagnosis of the policy step (docs/compare.md, "Oracle diagnosis"): every arm re-runs the
iteration-1 policy step of one `qevolve evolve --iters 1` run on that run's own data, from its BC policy,
everything else equal, then evaluates greedily on the whole held-out splits.

Arms (the advantages each BPPO arm trains on; `norm` = advantages standardised, `raw` = as labelled):
  rft_bc          RFT from BC with the iteration's policy budget (the same start and budget as BPPO)
  rft_full        RFT as `qevolve compare` trains it: from the base model with the BC budget
  oracle_gae      V* (the environment's exact solver) + GAE on r_env             (norm)
  oracle_gae_raw  the same, advantages as labelled                               (raw)
  oracle_td       V* + one-step TD                                               (norm)
  tab_gae         exact tabular IQL on the buffer (V fit on r_env + r_aux) + GAE (norm)
  tab_gae_aux     the same, GAE on r_env + r_aux                                 (norm)
  tab_env_gae     tabular IQL with V fit on r_env only + GAE                     (norm)
  learned         the run's learned critic + GAE                                 (norm)
  learned_raw     the run's learned critic + GAE, as labelled                    (raw)
  shuffled        the learned advantages permuted over the steps (control)       (norm)
  a_one           A = 1 on every row: BC on everything (control)                 (raw)

    python benchmarks/bench_oracle.py --runs /work/runs/lh-s0 /work/runs/lh-s1 --arms rft_bc oracle_gae learned

Each arm's work goes to RUN/oracle/<arm>/ and is skipped when its evaluations exist (re-run to resume).
Prints one JSON object: per run and arm the success rate per split and their mean, and per arm the mean
and standard error over the runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("rft_bc", "rft_full", "oracle_gae", "oracle_gae_raw", "oracle_td", "tab_gae", "tab_gae_aux", "tab_env_gae",
        "learned", "learned_raw", "shuffled", "a_one")
LABEL = {  # arm -> label config overrides over the run's label stage (value source, advantage, fit reward)
    "oracle_gae": {"value_source": "oracle", "advantage": "gae"},
    "oracle_gae_raw": {"value_source": "oracle", "advantage": "gae"},
    "oracle_td": {"value_source": "oracle", "advantage": "td"},
    "tab_gae": {"value_source": "tabular_iql", "advantage": "gae", "fit_reward": "env_aux"},
    "tab_gae_aux": {"value_source": "tabular_iql", "advantage": "gae_aux", "fit_reward": "env_aux"},
    "tab_env_gae": {"value_source": "tabular_iql", "advantage": "gae", "fit_reward": "env"},
}
RAW = {"oracle_gae_raw", "learned_raw", "a_one"}


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
    if arm in LABEL:
        cfg = write_yaml(work / "label.yaml", run / "stages" / "label_1.yaml", LABEL[arm])
        qevolve("label", run / "iter_1" / "labeled.parquet", "--config", cfg, "--out", out)
        return out
    learned = pl.read_parquet(run / "iter_1" / "advantages.parquet")
    if arm in ("learned", "learned_raw"):
        learned.write_parquet(out)
    elif arm == "shuffled":
        learned.with_columns(pl.col("advantage").shuffle(seed=0)).write_parquet(out)
    elif arm == "a_one":
        learned.with_columns(pl.lit(1.0, pl.Float32).alias("advantage")).write_parquet(out)
    return out


def train(run: Path, arm: str, work: Path) -> Path:
    policy = work / "policy"
    if (policy / "config.json").exists() or (policy / "adapter_config.json").exists():
        return policy
    if arm == "learned":  # the run's own Q-Evolve policy when it was trained with standardised advantages
        import yaml

        if yaml.safe_load((run / "stages" / "policy_1.yaml").read_text()).get("normalize_advantage"):
            return run / "iter_1" / "policy"
    if arm == "rft_bc":
        qevolve("policy", "--objective", "rft", "--data", run / "iter_1" / "labeled.parquet", "--model",
                run / "bc" / "policy", "--config", run / "stages" / "policy_1.yaml", "--out", policy)
    elif arm == "rft_full":
        qevolve("policy", "--objective", "rft", "--data", run / "iter_1" / "labeled.parquet", "--model",
                run / "base_model", "--config", run / "stages" / "bc.yaml", "--out", policy)
    else:
        data = advantage_table(run, arm, work)
        cfg = write_yaml(work / "policy.yaml", run / "stages" / "policy_1.yaml",
                         {"normalize_advantage": arm not in RAW})
        qevolve("policy", "--objective", "bppo", "--data", data, "--model", run / "bc" / "policy", "--ref",
                run / "bc" / "policy", "--config", cfg, "--out", policy)
    return policy


def evaluate(run: Path, env: str, policy: Path, work: Path, splits: list[str]) -> dict:
    scores = {}
    for split in splits:
        out = work / f"eval_{split}.parquet"
        js = work / f"eval_{split}.json"
        if not js.exists():
            res = qevolve("eval", "--env", env, "--policy", policy, "--split", split, "--config",
                          run / "stages" / "rollout_1.yaml", "--max-tasks", "0", "--out", out, "--json")
            js.write_text(res)
        m = json.loads(js.read_text())
        scores[split] = float(m.get("success_rate", m.get("avg_reward", 0.0)))
    return scores


def advantage_stats(path: Path) -> dict:
    import polars as pl

    if not path.exists():
        return {}
    d = pl.read_parquet(path).filter(pl.col("source") != "expert")
    a = d["advantage"]
    return {"mean": float(a.mean()), "share_positive": float((a > 1e-6).mean()), "n_self_steps": d.height}


def run_arms(run: Path, arms: list[str], splits: list[str]) -> dict:
    import yaml

    env = yaml.safe_load((run / "config.yaml").read_text())["env"]
    out = {}
    for arm in arms:
        work = run / "oracle" / arm
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        policy = train(run, arm, work)
        scores = evaluate(run, env, policy, work, splits)
        out[arm] = {"scores": scores, "mean": sum(scores.values()) / len(scores),
                    "advantages": advantage_stats(work / "advantages.parquet"),
                    "seconds": round(time.perf_counter() - t0, 1)}
        print(f"{run.name} {arm}: {json.dumps(out[arm]['scores'])}", file=sys.stderr, flush=True)
    # BC (iteration 0) from the run itself, for reference
    bc = {}
    for split in splits:
        p = run / "iter_0" / f"eval_{split}.parquet"
        if p.exists():
            import polars as pl

            d = pl.read_parquet(p)
            per = d.group_by("traj_id").agg(pl.col("reward_env").sum())
            bc[split] = float((per["reward_env"] >= 1.0).mean())
    if bc:
        out["bc"] = {"scores": bc, "mean": sum(bc.values()) / len(bc)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, nargs="+", required=True, help="Run directories of evolve --iters 1.")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--splits", nargs="+", default=["test_seen", "test_unseen"])
    a = ap.parse_args()
    per_run = {r.name: run_arms(r, a.arms, a.splits) for r in a.runs}
    summary = {}
    for arm in [*a.arms, "bc"]:
        xs = [per_run[r][arm]["mean"] for r in per_run if arm in per_run[r]]
        if xs:
            m = sum(xs) / len(xs)
            se = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) if len(xs) > 1 else 0.0
            summary[arm] = {"mean": round(100 * m, 1), "se": round(100 * se, 1), "n": len(xs)}
    print(json.dumps({"runs": per_run, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
