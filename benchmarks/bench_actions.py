"""Where a policy's commands go right or wrong, by the environment's exact solver (docs/compare.md,
"SmolLM2-135M-Instruct on lamps": why ETO's seed 2 fell below SFT), on environments with one (lamps,
lamps-hard, lamps-habit).

For each run directory (`qevolve evolve`, and `qevolve compare` when it ran), the demonstrations
(``expert.parquet``: ``expert``), every evaluation table (``iter_0/eval_*``: SFT, ``iter_K/eval_*``: Q-Evolve
iteration K, ``compare/eval/<arm>_<split>``) and the iteration-1 rollout table are replayed in the environment
(:func:`qevolve_cli.envs.oracle.replay`). Per table (JSON):

* ``episodes``, ``success`` (share of episodes that earned the reward), ``steps``;
* ``optimal``: share of the steps whose command brings the goal one command closer (fewer commands left);
* ``turn_on_states``: steps taken in the room of the task's next lamp (the first target in the task's
  order whose lamp is off: the room the hints point to, where the expert turns the lamp on), and
  ``turn_on_taken``: the share of those where the policy did turn it on;
* ``failed``: over the failed episodes, ``steps``, ``turn_on`` (share of their steps that turn a lamp on),
  ``turn_on_optimal`` (share of those turn-ons that were optimal) and ``top_commands`` (the five most
  frequent commands, a format error counted as ``<format error>``);
* ``look_after_states``: steps right after a command that lit one of the task's lamps, with lamps still to
  go, and ``look_after``: the share of those where the policy wrote ``look`` (lamps-habit's hesitant expert
  does at 85 % of them; the look costs a step and tells nothing);
* ``lost``: ``episodes`` whose goal went out of reach before it was met (the fewest commands left to finish
  came to exceed the steps left) and ``commands``: the command at which it did (five most frequent): on
  lamps-habit's tight budgets a second look, on the other testbeds mostly wrong turns or format errors.

    python benchmarks/bench_actions.py runs/smol/lamps-cpu-smol-s0 runs/smol/lamps-cpu-smol-s2   # JSON
    python benchmarks/bench_actions.py     # no run given (`make bench`): a one-iteration lamps smoke run of its own
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_credit import run_step_limit  # noqa: E402
from qevolve_cli import schema  # noqa: E402
from qevolve_cli.envs.oracle import replay  # noqa: E402
from qevolve_cli.errors import QevolveError  # noqa: E402

TURN_ON = "turn on lamp"
LOOK = "look"


def lit_targets(state: tuple) -> int:
    """How many of the task's lamps are on in :func:`replay`'s ``state``."""
    targets, _room, lit, _left = state
    return sum(t in lit for t in targets)


def at_next_lamp(state: tuple) -> bool:
    """Whether the state is in the room of the task's next lamp with that lamp off (the expert's command there
    is ``turn on lamp``): ``state`` is :func:`replay`'s (targets in the task's order, room, lamps on, steps
    left)."""
    targets, room, lit, _left = state
    nxt = next((t for t in targets if t not in lit), None)
    return nxt is not None and room == nxt


def action_stats(df: pl.DataFrame, max_steps: int | None = None, source: Any = None) -> dict[str, Any]:
    """The measures of the module docstring for one step table (trajectories contiguous, in step order)."""
    df = schema.sort_steps(df)
    if not df.height:
        return {"episodes": 0}
    recs = replay(df, source, max_steps)
    reward = df.group_by("traj_id").agg(pl.col("reward_env").sum().alias("r"))
    success = {t: r > 0 for t, r in reward.iter_rows()}
    optimal = on_states = on_taken = 0
    failed_steps = failed_on = failed_on_opt = 0
    failed_cmds: Counter[str] = Counter()
    look_states = look_taken = 0
    lost: Counter[str] = Counter()
    prev_traj, prev = None, None
    for rec, traj in zip(recs, df["traj_id"].to_list(), strict=True):
        if traj != prev_traj:
            prev_traj, prev = traj, None
        if prev is not None and lit_targets(prev["next_state"]) > lit_targets(prev["state"]) and rec["d"] > 0:
            look_states += 1
            look_taken += rec["command"] == LOOK
        if rec["d"] <= rec["left"] and rec["next_d"] > rec["next_left"]:
            lost[rec["command"]] += 1
        prev = rec
        good = rec["d"] > 0 and rec["next_d"] < rec["d"]
        optimal += good
        if at_next_lamp(rec["state"]):
            on_states += 1
            on_taken += rec["command"] == TURN_ON
        if not success[traj]:
            failed_steps += 1
            failed_cmds[rec["command"]] += 1
            if rec["command"] == TURN_ON:
                failed_on += 1
                failed_on_opt += good
    n_fail = sum(1 for s in success.values() if not s)
    return {
        "episodes": len(success),
        "success": round(sum(success.values()) / len(success), 4),
        "steps": df.height,
        "optimal": round(optimal / df.height, 4),
        "turn_on_states": on_states,
        "turn_on_taken": round(on_taken / on_states, 4) if on_states else None,
        "failed": {
            "episodes": n_fail,
            "steps": failed_steps,
            "turn_on": round(failed_on / failed_steps, 4) if failed_steps else None,
            "turn_on_optimal": round(failed_on_opt / failed_on, 4) if failed_on else None,
            "top_commands": dict(failed_cmds.most_common(5)),
        },
        "look_after_states": look_states,
        "look_after": round(look_taken / look_states, 4) if look_states else None,
        "lost": {"episodes": sum(lost.values()), "commands": dict(lost.most_common(5))},
    }


def run_tables(run: Path) -> dict[str, Path]:
    """The demonstrations (``expert``), the evaluation tables and the iteration-1 rollout of a run directory, by
    name."""
    out: dict[str, Path] = {}
    if (run / "expert.parquet").is_file():
        out["expert"] = run / "expert.parquet"
    for p in sorted(run.glob("iter_*/eval_*.parquet")):
        k = int(p.parent.name.split("_")[1])
        out[f"{'sft' if k == 0 else f'qevolve_iter{k}'}/{p.stem[len('eval_'):]}"] = p
    for p in sorted((run / "compare" / "eval").glob("*.parquet")):
        arm, _, split = p.stem.rpartition("_test_")
        out[f"{arm}/test_{split}"] = p
    if (run / "iter_1" / "rollout.parquet").is_file():
        out["rollout_iter1"] = run / "iter_1" / "rollout.parquet"
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", type=Path, help="qevolve evolve run directories (none: a smoke run of its "
                                                       "own, the tiny model on lamps)")
    ap.add_argument("--max-steps", type=int, default=None,
                    help="the episodes' step limit (default: the run's, stages/rollout_1.yaml, else the "
                         "environment's)")
    args = ap.parse_args(argv)
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-actions-") as tmp:
        runs = args.runs
        if not runs:  # the tiny model on lamps, one iteration (about a minute on 2 cores)
            runs = [Path(tmp) / "lamps-smoke"]
            subprocess.run([sys.executable, "-m", "qevolve_cli", "evolve", "--env", "lamps", "--preset", "smoke",
                            "--iters", "1", "--run-dir", str(runs[0]), "--quiet"], check=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL)
        for run in runs:
            tables = run_tables(run)
            if not tables:
                ap.error(f"{run}: no evaluation or rollout table (iter_*/eval_*.parquet, compare/eval/*.parquet)")
            limit = args.max_steps or run_step_limit(run)
            try:
                result[str(run)] = {name: action_stats(schema.read_table(p), limit, p) for name, p in tables.items()}
            except QevolveError as e:  # a table of an environment without a solver, or not readable
                ap.error(str(e))
            print(f"[bench_actions] {run}: {len(tables)} tables", file=sys.stderr)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
