"""The plan of an evolve run: per stage and iteration, memory per GPU under each setting, the smallest
setting that fits, and the wall time from token counts and stated throughputs (docs/cluster.md).

Stages (as ``qevolve evolve`` runs them, docs/evolve.md): ``rollout`` (vLLM, every train task x
``n_per_task``), ``label`` (CPU; then the critic's scoring pass for the advantages), ``critic`` (three
LoRA adapters on the frozen base, ZeRO-0/2), ``policy`` (BPPO, full or LoRA, ZeRO-0/2/3) and ``eval``
(vLLM, greedy, every task of the eval splits). The training stages train on the hybrid buffer: the
expert trajectories plus the iteration's rollouts.

Wall time = tokens / (throughput per GPU x GPUs). The throughputs are assumptions (:class:`Assumptions`,
every one overridable): tokens per second per GPU for a 7B model on an H100, scaled by 6.7e9 / P for
another model size P (generation and training are bound by the weights read or the FLOPs per token,
both proportional to P) and by :data:`GPU_SPEED` for another GPU.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qevolve_cli.planner.memory import (
    GPUS,
    GiB,
    ModelShape,
    TrainSetting,
    inference_memory,
    training_memory,
    vllm_memory,
)
from qevolve_cli.planner.tokens import TokenStats

REF_PARAMS = 6.74e9  # the throughputs below are for a Llama-2-7B-sized model
GPU_SPEED = {"h100-80gb": 1.0, "h200-141gb": 1.15, "a100-80gb": 0.45, "a100-40gb": 0.4, "l40s-48gb": 0.4,
             "a10-24gb": 0.12}
TRAIN_SETTINGS = ((0, False), (2, False), (3, False), (0, True), (2, True), (3, True))


@dataclass
class Assumptions:
    """Throughputs and reserves the plan rests on (every one a flag of ``qevolve plan``)."""

    prefill_tps: float = field(default=12000.0, metadata={"help": "vLLM prefill tokens/s per GPU (7B, H100)"})
    decode_tps: float = field(default=2500.0, metadata={"help": "vLLM decode tokens/s per GPU with >= 32 live "
                                                                "sequences (7B, H100)"})
    train_tps: float = field(default=2500.0, metadata={"help": "training tokens/s per GPU, forward + backward "
                                                               "with ZeRO communication (7B, H100)"})
    env_step_s: float = field(default=0.2, metadata={"help": "seconds of one environment step on one worker"})
    env_workers_per_gpu: int = field(default=4, metadata={"help": "environment worker processes per GPU"})
    reserve_gib: float = field(default=3.0, metadata={"help": "GiB per GPU kept free (CUDA context, NCCL "
                                                               "buffers, fragmentation)"})
    vllm_utilization: float = field(default=0.85, metadata={"help": "vLLM gpu_memory_utilization (the vllm "
                                                                      "backend's)"})
    vllm_workspace_gib: float = field(default=2.0, metadata={"help": "vLLM activations and CUDA graphs, GiB"})
    prefix_caching: bool = field(default=True, metadata={"help": "vLLM prefix caching (prefill only new tokens)"})


@dataclass
class PlanInputs:
    shape: ModelShape
    env: str
    gpus: int
    gpu: str
    gpu_gib: float
    stats: TokenStats  # rollout-like trajectories (a previous run's rollouts, else the expert's)
    expert: TokenStats  # the expert trajectories (the hybrid buffer's other half)
    train_tasks: int
    expert_trajectories: int
    eval_tasks: int
    iters: int
    configs: dict[str, Any]  # per iteration: {"rollout", "critic", "policy"} stage configs
    assumptions: Assumptions = field(default_factory=Assumptions)
    gpus_per_node: int = 8


def _scale(inp: PlanInputs) -> float:
    return REF_PARAMS / inp.shape.params() * GPU_SPEED.get(inp.gpu, 1.0)


BYTE_FIELDS = {"weights", "lora", "optimizer", "gradients", "activations", "zero3_gathered", "backward_transient",
               "peak", "kv_cache_needed", "kv_cache_available", "workspace", "budget"}


def _gib(parts: dict[str, Any]) -> dict[str, Any]:
    """Byte counts in GiB (2 decimals); other fields as they are."""
    return {k: (round(v / GiB, 2) if k in BYTE_FIELDS else v) for k, v in parts.items()}


def _fits(peak: int, inp: PlanInputs) -> bool:
    return peak <= (inp.gpu_gib - inp.assumptions.reserve_gib) * GiB


def generation_stage(inp: PlanInputs, trajectories: int, stats: TokenStats, rollout_cfg: Any) -> dict[str, Any]:
    """rollout / eval: vLLM memory per tensor-parallel size and the wall time."""
    a = inp.assumptions
    context = rollout_cfg.max_context or inp.shape.max_positions
    live = rollout_cfg.workers * rollout_cfg.envs_per_worker
    settings = []
    tp = 1
    while tp <= min(inp.gpus, inp.gpus_per_node):
        if inp.shape.heads % tp == 0:
            m = vllm_memory(inp.shape, tp=tp, live_seqs=live, context=context, gpu_gib=inp.gpu_gib,
                            utilization=a.vllm_utilization, workspace_gib=a.vllm_workspace_gib)
            settings.append({"setting": f"tp{tp}", "tensor_parallel": tp, "engines": inp.gpus // tp, **_gib(m)})
        tp *= 2
    chosen = next((s for s in settings if s["fits"]), None)
    steps = trajectories * stats.steps
    decode = steps * stats.completion
    prefill = steps * (stats.new_prompt if a.prefix_caching else stats.prompt)
    k = _scale(inp)
    gen_s = prefill / (a.prefill_tps * k * inp.gpus) + decode / (a.decode_tps * k * inp.gpus)
    env_s = steps * a.env_step_s / (a.env_workers_per_gpu * inp.gpus)
    return {"fits": chosen is not None, "smallest_fitting": chosen["setting"] if chosen else None,
            "settings": settings, "live_sequences_per_engine": live, "context": context,
            "tokens": {"trajectories": trajectories, "steps": round(steps), "prefill": round(prefill),
                       "decode": round(decode)},
            "seconds": round(max(gen_s, env_s)), "generation_seconds": round(gen_s), "env_seconds": round(env_s)}


def training_stage(inp: PlanInputs, *, trainable: int | None, frozen_extra: int, tokens: int, zero_stages: tuple,
                   checkpointing: bool, train_tokens: float, passes: float, zero3_max_live: float = 1e9,
                   logits: bool = True, lora_fallback: int | None = None) -> dict[str, Any]:
    """A training stage's settings in the order they are preferred (ZeRO-0, 2, 3, then the same with gradient
    checkpointing; ``lora_fallback``: a full fine-tuning stage is also judged as a LoRA run of that many
    trained parameters, after every full setting) -> memory, ``fits`` of each, the first that fits."""
    settings = []
    modes = [("", trainable)] + ([("lora+", lora_fallback)] if lora_fallback else [])
    for prefix, trained in modes:
        for z, gc in TRAIN_SETTINGS:
            if z not in zero_stages or (gc and checkpointing):
                continue
            s = TrainSetting(zero=z, ranks=inp.gpus, gradient_checkpointing=gc or checkpointing)
            m = training_memory(inp.shape, s, trainable=trained, tokens=tokens, b=2, frozen_extra=frozen_extra,
                                zero3_max_live=zero3_max_live, logits=logits)
            settings.append({"setting": prefix + s.name(), "zero": z, "gradient_checkpointing": s.gradient_checkpointing,
                             "mode": "full" if trained is None else "lora", **_gib(m), "fits": _fits(m["peak"], inp)})
    chosen = next((s for s in settings if s["fits"]), None)
    secs = train_tokens * passes / (inp.assumptions.train_tps * _scale(inp) * inp.gpus)
    return {"fits": chosen is not None, "smallest_fitting": chosen["setting"] if chosen else None,
            "settings": settings, "micro_batch_tokens": tokens,
            "tokens": {"trained": round(train_tokens), "passes": round(passes, 2)},
            "seconds": round(secs)}


def plan_run(inp: PlanInputs) -> dict[str, Any]:
    """Every stage of every iteration -> {"iterations": [...], "seconds_per_iteration": [...]}."""
    iterations = []
    sh = inp.shape
    for k in range(1, inp.iters + 1):
        cfgs = inp.configs[k]
        r, c, p = cfgs["rollout"], cfgs["critic"], cfgs["policy"]
        n_roll = inp.train_tasks * r.n_per_task
        buffer_traj = inp.expert_trajectories + n_roll
        # what each trainer runs over: long trajectories are split into windows (docs/policy.md, docs/critic.md)
        critic_tokens = inp.expert_trajectories * inp.expert.critic_tokens + n_roll * inp.stats.critic_tokens
        policy_tokens = inp.expert_trajectories * inp.expert.policy_tokens + n_roll * inp.stats.policy_tokens
        longest = max(inp.expert.trajectory_max, inp.stats.trajectory_max)
        stages: dict[str, Any] = {}
        stages["rollout"] = generation_stage(inp, n_roll, inp.stats, r)
        # critic: value and q adapters trained (one engine each), q_target kept, small MLP heads
        lora = sh.lora_params(c.lora_rank, c.lora_target_modules)
        heads = 3 * (sh.hidden * c.head_hidden + c.head_hidden + c.head_hidden + 1)
        c_tokens = min(c.batch_size * longest, c.batch_size * (c.max_length or sh.max_positions))
        stages["critic"] = training_stage(
            inp, trainable=2 * lora + heads, frozen_extra=lora, tokens=c_tokens, zero_stages=(0, 2),
            checkpointing=c.gradient_checkpointing, train_tokens=c.epochs * critic_tokens, passes=1 + 2 / 3,
            logits=False)
        stages["critic"]["epochs"] = c.epochs
        # label --critic: one scoring pass (value and q adapters) over the buffer, forward only
        inf = inference_memory(sh, tokens=c_tokens, b=2, adapters=3 * lora)
        stages["label"] = {"fits": _fits(inf["peak"], inp), "memory": _gib(inf),
                           "seconds": round(2 * critic_tokens / (3 * inp.assumptions.train_tps * _scale(inp) * inp.gpus)),
                           "note": "retrospective labels on CPU (seconds); the GPU part is the critic's scoring pass"}
        p_tokens = max(p.micro_batch_tokens, min(longest, p.max_length))
        p_trainable = sh.lora_params(p.lora_r, p.lora_target_modules) if p.lora else None
        passes = {"bppo": 1 + 1 / 3 + (1 / 3 if p.old_refresh_steps else 0), "awr": 1.0, "bc": 1.0, "rft": 1.0,
                  "dpo": 1 + 1 / 3}.get(p.objective, 1.0)
        stages["policy"] = training_stage(
            inp, trainable=p_trainable, frozen_extra=0, tokens=p_tokens, zero_stages=(0, 2, 3),
            checkpointing=p.gradient_checkpointing, train_tokens=p.epochs * policy_tokens, passes=passes,
            lora_fallback=None if p.lora else sh.lora_params(p.lora_r, p.lora_target_modules))
        stages["policy"]["epochs"] = p.epochs
        stages["policy"]["mode"] = "lora" if p.lora else "full"
        stages["eval"] = generation_stage(inp, inp.eval_tasks, inp.stats, r)
        for st in stages.values():
            st["hours"] = round(st["seconds"] / 3600, 2)
        iterations.append({"iteration": k, "buffer_trajectories": buffer_traj, "stages": stages,
                           "seconds": sum(s["seconds"] for s in stages.values())})
    return {"iterations": iterations, "fits": all(s["fits"] for it in iterations for s in it["stages"].values()),
            "hours_per_iteration": [round(it["seconds"] / 3600, 2) for it in iterations],
            "assumptions": {**asdict(inp.assumptions), "throughput_scale": round(_scale(inp), 3),
                            "reference": f"throughputs per GPU for a {REF_PARAMS / 1e9:.2f}B model on an H100, "
                                         "scaled by params and GPU speed"}}


# token counts used when no table is given: measured on the environment's expert replays
# (`qevolve expert`, 4 characters per token, the system prompt of qevolve_cli/envs/prompts.py)
DEFAULT_STATS: dict[str, dict[str, Any]] = {
    "alfworld": {"source": "ALFWorld expert replays: train shards 5, 25 and 45 of 60 (178 games), context and "
                           "trajectories capped at 3600 tokens",
                 "trajectories": 178, "steps": 15.7, "completion": 26.8, "prompt": 1080.4, "new_prompt": 30.1,
                 "trajectory": 1213.4, "trajectory_max": 3600, "counted_with": "4 characters per token"},
}

# the tokens the policy / the critic train on per trajectory of those replays (TokenStats.policy_tokens /
# critic_tokens: the windows of a trajectory longer than the stage's max_length, window_context 0.5) at the
# presets' max_length values (0: no limit), the same count as DEFAULT_STATS: planner.tokens.measure(tables,
# "alfworld", counter(None, 4.0)[0], ..., max_length=L, critic_max_length=L) on the replays that
# benchmarks/bench_windows.py writes (~/.cache/qevolve/bench_windows/alfworld_*.parquet)
DEFAULT_WINDOWS: dict[str, dict[int, tuple[float, float]]] = {
    "alfworld": {1024: (2023.7, 2030.0), 1536: (1536.8, 1542.0), 2048: (1388.4, 1409.4), 3072: (1255.3, 1269.5),
                 3600: (1218.9, 1233.1), 4096: (1220.5, 1234.4), 0: (1207.7, 1221.8)},
}


def builtin_stats(env: str, max_length: int, critic_max_length: int, window_context: float,
                  critic_window_context: float) -> tuple[TokenStats, list[str]]:
    """The built-in token counts of ``env`` (``DEFAULT_STATS``) with the training tokens per trajectory at the
    stages' max_length (``DEFAULT_WINDOWS``: the measured value at the nearest max_length) -> (stats, notes)."""
    stats = TokenStats(**DEFAULT_STATS[env])
    table, notes = DEFAULT_WINDOWS.get(env), []
    if not table:
        return stats, notes
    measured = sorted(k for k in table if k)

    def at(length: int, which: int, stage: str) -> float:
        if length not in table:
            near = min(measured, key=lambda k: abs(k - length))
            notes.append(f"{stage} max_length {length}: the built-in training tokens are those measured at "
                         f"{near}; pass --expert (an expert table) for this length's")
            length = near
        return table[length][which]

    stats.policy_tokens = at(max_length or 0, 0, "policy")
    stats.critic_tokens = at(critic_max_length or 0, 1, "critic")
    if window_context != 0.5 or critic_window_context != 0.5:
        notes.append("the built-in training tokens are window_context 0.5's; pass --expert for this run's")
    return stats, notes


def build_inputs(*, env: str, model: Path | None, gpus: int, gpus_per_node: int | None, gpu: str,
                 gpu_gib: float | None, preset: str, config: Path | None, iters: int | None,
                 tables: list[Path] | None, expert: Path | None, chars_per_token: float,
                 assumptions: Assumptions) -> tuple[PlanInputs, dict[str, Any]]:
    """The evolve config (preset, file, flags), the model's shape, the split sizes and the token counts."""
    from qevolve_cli.envs.registry import list_tasks
    from qevolve_cli.errors import QevolveError
    from qevolve_cli.evolve.config import resolve
    from qevolve_cli.planner import tokens as tk

    cfg = resolve(env, preset, config, {"iters": iters, "model": str(model) if model is not None else None,
                                        "init_model": None} if model is not None else {"iters": iters})
    model_dir = model if model is not None else (Path(cfg.model) if cfg.model else None)
    if model_dir is None:
        raise QevolveError("--model: give the model directory (its config.json is enough)")
    shape = ModelShape.from_config(model_dir)
    count, counted_with = tk.counter(model_dir if Path(model_dir).is_dir() else None, chars_per_token)
    example = tk.shows_example(model_dir, cfg.init_model)
    r1 = cfg.stage("rollout", 1)
    notes = []
    p1, c1 = cfg.stage("policy", 1), cfg.stage("critic", 1)
    windows = dict(window_context=p1.window_context, critic_max_length=c1.max_length or 0,
                   critic_window_context=c1.window_context)
    if expert is not None:
        ex = tk.measure([expert], env, count, counted_with, r1.max_context, p1.max_length, example, **windows)
    elif env in DEFAULT_STATS:
        ex, builtin_notes = builtin_stats(env, p1.max_length, c1.max_length or 0, p1.window_context,
                                          c1.window_context)
        notes.extend(builtin_notes)
    else:
        raise QevolveError(f"--expert: no token counts for {env} built in; give its expert table "
                           f"(qevolve expert --env {env} --limit 200 --out expert.parquet) or --tables")
    if tables:
        st = tk.measure(tables, env, count, counted_with, r1.max_context, p1.max_length, example, **windows)
    else:
        st = ex
        notes.append("rollout token counts are the expert's (a learning policy takes more steps per task); "
                     "pass --tables of a previous run's rollouts")
    train = len(list_tasks(env, "train"))
    if r1.max_tasks:
        train = min(train, r1.max_tasks)
    n_expert = min(train, cfg.expert_limit) if cfg.expert_limit else train
    eval_tasks = 0
    for split in cfg.eval_splits:
        n = len(list_tasks(env, split))
        eval_tasks += min(n, cfg.eval_max_tasks) if cfg.eval_max_tasks else n
    configs = {k: {"rollout": cfg.stage("rollout", k), "critic": cfg.stage("critic", k),
                   "policy": cfg.stage("policy", k)} for k in range(1, cfg.iters + 1)}
    inp = PlanInputs(shape=shape, env=env, gpus=gpus, gpu=gpu, gpu_gib=gpu_gib_of(gpu, gpu_gib), stats=st,
                     expert=ex, train_tasks=train, expert_trajectories=n_expert, eval_tasks=eval_tasks,
                     iters=cfg.iters, configs=configs, assumptions=assumptions,
                     gpus_per_node=gpus_per_node or min(gpus, 8))
    info = {"env": env, "preset": preset, "model": str(model_dir), "shape": shape.to_dict(), "gpus": gpus,
            "gpus_per_node": inp.gpus_per_node, "gpu": gpu, "gpu_gib": inp.gpu_gib, "train_tasks": train,
            "expert_trajectories": n_expert, "eval_tasks": eval_tasks, "token_counts": {
                "rollouts": st.to_dict(), "expert": ex.to_dict()}, "notes": notes}
    return inp, info


def gpu_gib_of(kind: str, override: float | None = None) -> float:
    from qevolve_cli.errors import QevolveError

    if override:
        return float(override)
    if kind not in GPUS:
        raise QevolveError(f"--gpu: unknown GPU kind {kind!r} (choose from {', '.join(GPUS)}, or give --gpu-gib)")
    return GPUS[kind]


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The plan as text: one line per stage and iteration."""
    sh = result["shape"]
    lines = [f"{result['env']}: {sh['params'] / 1e9:.2f}B parameters, {result['gpus']} x {result['gpu']} "
             f"({result['gpu_gib']} GiB usable each), {result['train_tasks']} train tasks, "
             f"{result['eval_tasks']} eval tasks"]
    for it in result["iterations"]:
        lines.append(f"iteration {it['iteration']} ({it['buffer_trajectories']} trajectories in the buffer): "
                     f"{it['seconds'] / 3600:.1f} h")
        for name, st in it["stages"].items():
            if "settings" in st:
                best = next((s for s in st["settings"] if s["setting"] == st["smallest_fitting"]), None)
                peak = (f"{best['peak']} GiB" if best and "peak" in best else
                        f"{best['weights'] + best['kv_cache_needed']} GiB weights+KV" if best else "")
                verdict = (f"fits with {st['smallest_fitting']} ({peak})" if st["fits"] else
                           "does not fit in any setting judged")
            else:
                verdict = f"fits ({st['memory']['peak']} GiB)" if st["fits"] else "does not fit"
            lines.append(f"  {name:8s} {verdict}; {st['hours']} h")
    lines.extend(f"note: {n}" for n in result.get("notes", []))
    a = result["assumptions"]
    lines.append(f"assumed per GPU (7B on H100, x{a['throughput_scale']} here): prefill {a['prefill_tps']:g}, "
                 f"decode {a['decode_tps']:g}, training {a['train_tps']:g} tokens/s; --json for every number")
    return lines
