"""Step credit of a run's learned critic against the exact one (docs/compare.md, "Where the learned credit
goes wrong"), on environments with an exact solver (lamps, lamps-hard, lamps-habit).

For each `qevolve evolve` run directory, on its iteration-1 advantage table (`iter_1/advantages.parquet`:
the learned V of the run's critic), every trajectory is replayed in the environment and each step gets the
exact advantage (GAE over V*, the solver's optimal value with the steps left, docs/critic.md "Oracle
values"). A step is *optimal* when its command keeps the fewest commands to the goal in reach (exact
one-step TD error 0), and *reachable* when the goal can still be reached from its state (V* > 0; from
the other states every command is equally worthless). Printed (JSON), per value source:

* ``within_traj_corr``: correlation of the advantages with the exact ones after each trajectory's mean is
  taken out: the credit to single steps, with the outcome removed;
* ``failed.auc_optimal``: over the reachable steps of the failed self-play trajectories, the chance that an
  optimal step gets a higher advantage than a suboptimal one (0.5: no step credit; below 0.5: inverted);
* ``failed.corr_step``: correlation of the advantage with the step index in the failed trajectories;
* ``successful.auc_optimal``, ``mean_advantage`` of failed / successful self-play steps.

Value sources: ``learned`` (the run's V, GAE with lambda in ``--lambdas``), ``exact`` (V*), and exact
tabular weighted IQL on the run's own transitions (the critic's fixed point with a perfect function
approximator, :func:`qevolve_cli.tabular.tabular_iql`) with the full state (``tabular_time``) and with the
steps left dropped from the state (``tabular_no_time``: what a critic that cannot see the step budget
could learn at best).

    python benchmarks/bench_credit.py runs/hab-s0 runs/hab-s1 ...   # JSON on stdout
    python benchmarks/bench_credit.py     # no run given (`make bench`): a one-iteration lamps smoke run of its own
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import polars as pl
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qevolve_cli import schema  # noqa: E402
from qevolve_cli.critic.credit import auc, credit, with_values  # noqa: E402,F401 (auc: tests use it from here)
from qevolve_cli.envs.oracle import oracle_value, replay  # noqa: E402
from qevolve_cli.rewards import process_rewards  # noqa: E402
from qevolve_cli.tabular import tabular_iql  # noqa: E402


def run_step_limit(run: Path) -> int | None:
    """The step limit a run's rollouts and evaluations played with (``stages/rollout_1.yaml``'s ``max_steps``;
    None: the environment's own): self-play episodes are replayed with it."""
    p = run / "stages" / "rollout_1.yaml"
    return (yaml.safe_load(p.read_text()) or {}).get("max_steps") if p.is_file() else None


def run_credit(run: Path, lambdas: list[float], gamma: float, lam: float, expectile: float) -> dict:
    df = schema.sort_steps(pl.read_parquet(run / "iter_1" / "advantages.parquet"))
    recs = replay(df, source=run / "iter_1" / "advantages.parquet", max_steps=run_step_limit(run))
    done = df["done"].to_list()
    v_x = [oracle_value(r["d"], r["left"], gamma) for r in recs]
    nv_x = [0.0 if dn else oracle_value(r["next_d"], r["next_left"], gamma) for r, dn in zip(recs, done, strict=True)]
    a_x = with_values(df, v_x, nv_x, gamma, lam)
    opt = with_values(df, v_x, nv_x, gamma, 0.0) > -1e-6  # the command keeps the fewest steps to the goal
    reach = pl.Series([x > 0 for x in v_x])
    cr = lambda a: credit(df, a, a_x, opt, reach)  # noqa: E731
    out: dict = {"run": str(run), "env": df["env"][0], "trajectories": df["traj_id"].n_unique(), "steps": df.height,
                 "gamma": gamma, "lambda": lam, "exact": cr(a_x), "learned": {}}
    for lm in lambdas:
        out["learned"][f"lambda_{lm:g}"] = cr(process_rewards(df, "gae", gamma, lm))
    # the learned V along the failed trajectories against V* (does V see the budget run out?)
    f = df.with_columns(pl.Series("v_exact", v_x)).filter((pl.col("source") == "self") & ~pl.col("success"))
    if f.height:
        q = (pl.col("step") * 4 // (pl.col("step").max() + 1)).alias("quarter")
        g = f.group_by(q).agg(pl.col("value").mean(), pl.col("v_exact").mean()).sort("quarter")
        out["failed_value_by_quarter"] = {"learned": [round(x, 3) for x in g["value"].to_list()],
                                          "exact": [round(x, 3) for x in g["v_exact"].to_list()]}
    r = [a + b for a, b in zip(df["reward_env"].cast(pl.Float64).to_list(), df["reward_aux"].cast(pl.Float64).to_list(),
                               strict=True)]
    w = df["weight"].cast(pl.Float64).to_list()
    for name, key in (("tabular_time", lambda s: s), ("tabular_no_time", lambda s: s[:3])):
        tr = [(key(rec["state"]), rec["command"], ri, key(rec["next_state"]), bool(dn))
              for rec, ri, dn in zip(recs, r, done, strict=True)]
        V, _ = tabular_iql(tr, gamma, expectile, weights=w, tol=1e-9)
        v = [V.get(key(rec["state"]), 0.0) for rec in recs]
        nv = [0.0 if dn else V.get(key(rec["next_state"]), 0.0) for rec, dn in zip(recs, done, strict=True)]
        out[name] = cr(with_values(df, v, nv, gamma, lam))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", type=Path, help="qevolve evolve run directories (iteration 1 labelled); "
                                                       "none: a `qevolve evolve --env lamps --preset smoke` run of its own")
    ap.add_argument("--lambdas", type=float, nargs="+", default=[0.0, 0.5, 0.95], help="GAE lambdas of the learned V")
    ap.add_argument("--gamma", type=float, default=0.95)
    ap.add_argument("--lam", type=float, default=0.95, help="lambda of the exact and tabular rows (the runs' own)")
    ap.add_argument("--expectile", type=float, default=0.7, help="expectile of the tabular IQL rows")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-credit-") as tmp:
        runs = a.runs
        if not runs:  # a small run of its own: the tiny model on lamps, one iteration (about a minute on 2 cores)
            runs = [Path(tmp) / "lamps-smoke"]
            subprocess.run([sys.executable, "-m", "qevolve_cli", "evolve", "--env", "lamps", "--preset", "smoke",
                            "--iters", "1", "--run-dir", str(runs[0]), "--quiet"], check=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL)
        res = [run_credit(r, a.lambdas, a.gamma, a.lam, a.expectile) for r in runs]
    print(json.dumps({"bench": "credit", "runs": res}, indent=1))


if __name__ == "__main__":
    main()
