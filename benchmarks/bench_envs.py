"""Environment benchmark: expert replay success rates and env step throughput (JSON on stdout).

* Expert replay success on the train split: TextCraft (all tasks), SciWorld (first N
  variations), ALFWorld (an evenly spaced sample of N games), through the worker pool.
* Step throughput (steps/s) with 1, 2 and 4 workers per environment, stepping expert plans
  (resets excluded); the 1-worker figure is the baseline the speed-ups are relative to.
* SciWorld step cost: our adapter step vs the package's ``ScienceWorldEnv.step`` (which also
  fetches the valid-action list, look and inventory every step) — same process, same plan.

Sizes: default (a few minutes on 2 cores), ``--quick`` (smoke), ``--full`` (the reported
figures: SciWorld 200 variations, ALFWorld 300 games).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def replay(env: str, tasks, workers: int) -> dict:
    from qevolve_cli.envs.expert import collect_expert

    st: dict = {}
    t0 = time.monotonic()
    collect_expert(env, tasks=tasks, workers=workers, stats=st)
    wall = time.monotonic() - t0
    return {"split": "train", "tasks": st["tasks"], "succeeded": st["succeeded"], "failed": st["failed"],
            "errors": st["errors"], "success_rate": round(st["success_rate"], 4), "steps": st["steps"],
            "wall_s": round(wall, 1), "workers": workers,
            "failed_examples": list(st["error_reasons"].items())[:3]}


def throughput(env: str, tasks, workers: int, steps_per_episode: int) -> dict:
    from qevolve_cli.envs.expert import expert_output
    from qevolve_cli.envs.pool import EnvPool, Failure

    with EnvPool(env, workers=workers, envs_per_worker=1, timeout_s=300) as pool:
        n_steps = 0
        step_s = 0.0
        reset_s = 0.0
        queue = list(tasks)
        while queue:
            batch, queue = queue[:workers], queue[workers:]
            t0 = time.monotonic()
            res = pool.reset_many([(t.task_id, t) for t in batch], with_expert=True, max_steps=1000)
            reset_s += time.monotonic() - t0
            plans = {k: r.info["expert_plan"][:steps_per_episode] for k, r in res.items() if not isinstance(r, Failure)}
            for i in range(max((len(p) for p in plans.values()), default=0)):
                items = [(k, expert_output(p[i])) for k, p in plans.items() if i < len(p)]
                t0 = time.monotonic()
                out = pool.act_many(items)
                step_s += time.monotonic() - t0
                n_steps += sum(1 for r in out.values() if not isinstance(r, Failure))
                for k, r in out.items():
                    if isinstance(r, Failure) or r.done:
                        plans[k] = []
            pool.release(list(plans))
    return {"workers": workers, "steps": n_steps, "steps_per_s": round(n_steps / step_s, 1) if step_s else None,
            "resets": len(tasks), "reset_s_per_episode": round(reset_s / max(1, len(tasks)) * workers, 3)}


def sciworld_step_cost(task, n: int = 40) -> dict:
    from qevolve_cli.envs import make_env

    env = make_env("sciworld")
    env.reset(task, with_expert=True, max_steps=1000)
    plan = env.expert_plan()[:n]
    t0 = time.monotonic()
    for c in plan:
        env.step(c)
    ours = (time.monotonic() - t0) / len(plan)
    sw = env._host  # the package's ScienceWorldEnv (its own simulator in the same JVM)
    sw.load(task.data["task_name"], task.data["variation"], "easy")
    sw.reset()
    t0 = time.monotonic()
    for c in plan:
        sw.step(c)
    pkg = (time.monotonic() - t0) / len(plan)
    env.close()
    return {"task": task.task_id, "steps": len(plan), "adapter_ms_per_step": round(1000 * ours, 2),
            "baseline_package_step_ms": round(1000 * pkg, 2), "speedup": round(pkg / ours, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--envs", default="textcraft,sciworld,alfworld")
    ap.add_argument("--workers", type=int, default=2, help="workers for the replay runs")
    args = ap.parse_args()
    from qevolve_cli.envs import list_tasks

    n_sci, n_alf, thr_eps = (200, 300, 8) if args.full else (3, 4, 2) if args.quick else (40, 40, 4)
    envs = args.envs.split(",")
    result: dict = {"benchmark": "envs", "size": "full" if args.full else "quick" if args.quick else "default",
                    "replay": {}, "throughput": {}}
    if "alfworld" in envs:
        from qevolve_cli.envs.alfworld import ensure_alfworld_data

        try:
            ensure_alfworld_data()
        except Exception as e:  # no data: skip with the reason
            result["alfworld_skipped"] = str(e)
            envs.remove("alfworld")
    for env in envs:
        tasks = list_tasks(env, "train")
        if env == "sciworld":
            sample = tasks[:n_sci]
        elif env == "alfworld":
            step = max(1, len(tasks) // n_alf)
            sample = tasks[::step][:n_alf]
        else:
            sample = tasks if not args.quick else tasks[:40]
        print(f"replay {env}: {len(sample)} tasks", file=sys.stderr)
        result["replay"][env] = replay(env, sample, args.workers)
        result["replay"][env]["sample"] = ("all train tasks" if len(sample) == len(tasks) else
                                           f"every {len(tasks) // len(sample)}th task ({len(sample)})"
                                           if env == "alfworld" else f"first {len(sample)} of {len(tasks)}")
        thr_tasks = (tasks[:: max(1, len(tasks) // 64)])
        rows = []
        for w in (1, 2, 4):
            n = max(w * thr_eps, 8) if env == "textcraft" else w * thr_eps
            print(f"throughput {env}: {w} workers", file=sys.stderr)
            rows.append(throughput(env, thr_tasks[:n], w, steps_per_episode=200 if env == "textcraft" else 25))
        base = rows[0]["steps_per_s"] or 0
        for r in rows:
            r["speedup_vs_1_worker"] = round(r["steps_per_s"] / base, 2) if base and r["steps_per_s"] else None
        result["throughput"][env] = rows
    if "sciworld" in envs:
        result["sciworld_step_cost"] = sciworld_step_cost(list_tasks("sciworld", "train")[4])
    import os

    result["cpu_count"] = os.cpu_count()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
