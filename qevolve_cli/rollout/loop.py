"""The batched rollout loop: the policy plays many episodes at once (continuous batching).

The live episodes (``workers * envs_per_worker``) are split into ``lanes``
(default 2). Each lane cycles through:

1. **generate** — one backend call for every live episode of the lane. The
   prompt is built by :func:`qevolve_cli.transcript.build_messages` (the one
   transcript builder); when it would exceed the context (``backend.fits``),
   :func:`qevolve_cli.transcript.truncate` keeps the instruction and the most
   recent turns and the step records ``truncated``; each output is cut at
   ReAct's stop (:func:`qevolve_cli.react.cut_at_stop`: a model that goes on
   with an invented ``Observation:`` plays its first step only);
2. **submit** — one non-blocking pool request per worker: free the slots of
   episodes cut by our step limit, reset new (task, sample) pairs into free
   slots (continuous batching), and step every episode with its action
   (format errors do not reach the environment);
3. **wait** for the lane's answers; finished episodes (``done``, the step
   limit, or a worker failure) leave the lane and are appended to the
   **journal**.

While the workers step one lane, the policy generates for the next one, so
generation and environment time overlap (``lanes: 1`` plays all live episodes
in one batch per round, without overlap).

The journal (``OUT.partial/journal.jsonl``, the work-in-progress directory beside
the output that every stage uses, :func:`qevolve_cli.atomic.partial_dir`) is append-only: a
header line, then one line per finished episode with all its rows, flushed and
fsynced. An interrupted run keeps every finished episode; ``resume=True``
reads the journal (a torn last line is ignored), plays only the missing
(task, sample) pairs (and, with ``retry_failed``, the failed ones again) and
finally writes the whole table atomically with :func:`schema.write_table`,
then removes the journal with its directory.

Sampling seeds are per (trajectory, step): ``hash(seed, traj_id, step)``, so
with the ``hf`` backend on CPU the same seed gives the same table, and an
episode's trajectory does not depend on which others shared its batch.

``cfg.shard = "I/N"`` plays one contiguous block of the (task, sample) pairs
in the table's order (:func:`qevolve_cli.shard.shard_pairs`): same trajectory
ids, so same seeds, as the unsharded run; the shards' tables concatenated in
shard order are the unsharded table (docs/rollout.md, "Shards").
"""
from __future__ import annotations

import contextlib
import hashlib
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from qevolve_cli import schema, transcript
from qevolve_cli.errors import QevolveError, TableError
from qevolve_cli.react import cut_at_stop
from qevolve_cli.rollout.backends import Backend, Request, make_backend
from qevolve_cli.rollout.config import RolloutConfig
from qevolve_cli.rollout.journal import JOURNAL_VERSION, Journal, journal_path
from qevolve_cli.shard import shard_pairs

# chooser(requests, candidates) -> index of the candidate to play, per request (critic reranking)
Chooser = Callable[[Sequence[Request], Sequence[Sequence[str]]], Sequence[int]]
ProgressFn = Callable[["RolloutStats"], None]


@dataclass
class RolloutStats:
    total: int = 0  # (task, sample) pairs of the run
    done: int = 0  # finished episodes (journal included)
    resumed: int = 0  # of which were already in the journal
    successes: int = 0  # episodes ending with non-zero reward
    failed: int = 0  # episodes recorded with an error
    steps: int = 0  # agent turns played in this process
    rounds: int = 0
    gen_s: float = 0.0
    env_s: float = 0.0  # seconds the policy waited for the environments (not overlapped with generation)
    reset_s: float = 0.0  # seconds the workers spent in env resets (summed over workers)
    step_s: float = 0.0  # seconds the workers spent in env steps (summed over workers)
    wall_s: float = 0.0
    truncated_steps: int = 0
    # the backend's work over the run (Backend.counters: prompt tokens, tokens computed, KV cache reuse)
    backend: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    @property
    def steps_per_s(self) -> float:
        el = time.perf_counter() - self.started
        return self.steps / el if el > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("total", "done", "resumed", "successes", "failed", "steps", "rounds",
                                           "truncated_steps")}
        d.update({k: round(getattr(self, k), 3) for k in ("gen_s", "env_s", "reset_s", "step_s", "wall_s")})
        d["steps_per_s"] = round(self.steps / self.wall_s, 3) if self.wall_s > 0 else 0.0
        if self.backend:
            d["backend"] = dict(self.backend)
            if self.steps:  # prompt tokens the model computed per environment step (the rest came from the cache)
                d["prefill_tokens_per_step"] = round(self.backend.get("prefill_tokens", 0) / self.steps, 1)
                d["generated_tokens_per_step"] = round(self.backend.get("generated_tokens", 0) / self.steps, 1)
        return d


def traj_id_of(env: str, split: str, task_id: str, iteration: int, sample: int) -> str:
    return f"{split}/it{iteration}/s{sample}/{task_id}"


def step_seed(seed: int, traj_id: str, step: int) -> int:
    h = hashlib.sha256(f"{seed}\x00{traj_id}\x00{step}".encode()).digest()
    return int.from_bytes(h[:8], "little") & 0x7FFFFFFFFFFFFFFF


@dataclass
class _Episode:
    key: tuple[str, int]
    task: Any
    traj_id: str
    instruction: str = ""
    max_steps: int = 0
    limit: int = 0  # the step limit the environment ends this episode at (a task's own budget, when tighter)
    observations: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)


def _row(ep: _Episode, cfg: RolloutConfig, source: str, step: int, **kw: Any) -> dict[str, Any]:
    t = ep.task
    return {
        "traj_id": ep.traj_id, "env": cfg.env, "task_id": t.task_id, "split": cfg.split, "source": source,
        "iteration": cfg.iteration, "step": step, "instruction": ep.instruction,
        "task_type": t.task_type, "sample": ep.key[1],
        "steps_left": ep.limit - step if ep.limit > 0 else None, **kw,
    }


def _failed_placeholder(ep: _Episode, cfg: RolloutConfig, source: str, error: str) -> list[dict[str, Any]]:
    """The one row of an episode that failed before its first step (keeps the reason in the table)."""
    return [_row(ep, cfg, source, 0, observation=ep.observations[0] if ep.observations else "", action="",
                 command=None, next_observation="", reward_env=0.0, done=True, truncated=False, error=error)]


def rows_to_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    cols = {**schema.BASE_COLUMNS, "error": pl.String(), "truncated": pl.Boolean(), "task_type": pl.String(),
            "sample": pl.Int32(), "steps_left": pl.Int32()}
    return pl.DataFrame(rows, schema=cols)


def _collect(journal: Journal, keys: Sequence[str]) -> pl.DataFrame:
    rows: list[dict[str, Any]] = []
    for tid in keys:
        rec = journal.episodes.get(tid)
        if rec is None:
            continue
        rows.extend(rec["rows"])
    return rows_to_frame(rows)


def play(
    cfg: RolloutConfig,
    backend: Backend,
    tasks: Sequence[Any],
    *,
    temperature: float,
    journal: Journal,
    source: str = "self",
    chooser: Chooser | None = None,
    on_progress: ProgressFn | None = None,
    stats: RolloutStats | None = None,
    pool: Any = None,
    pairs: Sequence[tuple[Any, int]] | None = None,
) -> RolloutStats:
    """Play every missing (task, sample) pair of ``tasks`` x ``range(n_per_task)`` into ``journal``.

    ``pairs``: play only these (task, sample) pairs instead (a shard: :func:`qevolve_cli.shard.shard_pairs`).
    ``pool``: an open :class:`EnvPool` of ``cfg.env`` to reuse (kept open); by default a pool of
    ``cfg.workers`` x ``cfg.envs_per_worker`` is started and closed here.
    """
    from qevolve_cli.envs.pool import EnvPool
    from qevolve_cli.envs.prompts import example_prompt, instruction_prompt

    st = stats or RolloutStats()
    t_start = time.perf_counter()
    system = instruction_prompt(cfg.env)
    layout = transcript.layout_of(backend.tokenizer)
    head = (system, layout, example_prompt(cfg.env) if layout.example else None)
    if pairs is None:
        pairs = [(t, s) for t in tasks for s in range(cfg.n_per_task)]
    # a task's samples one after another: they start together and the pool sends them to the worker
    # that has the game loaded (ALFWorld resets of a cached game: ~0.05 s instead of ~1.5 s).
    # The table's row order does not depend on this (``order`` in run_rollout), nor do the episodes:
    # their seeds depend on the trajectory id only (``step_seed``).
    position = {t.task_id: k for k, t in enumerate(tasks)}
    episodes = [_Episode(key=(t.task_id, s), task=t, traj_id=traj_id_of(cfg.env, cfg.split, t.task_id, cfg.iteration, s))
                for t, s in sorted(pairs, key=lambda p: (position.get(p[0].task_id, -1), p[1]))]
    st.total = len(episodes)
    pending: list[_Episode] = []
    for ep in episodes:
        rec = journal.episodes.get(ep.traj_id)
        if rec is not None and not (rec.get("error") and cfg.retry_failed):
            st.done += 1
            st.resumed += 1
            st.successes += int(_episode_reward(rec["rows"]) > 0)
            st.failed += int(bool(rec.get("error")))
        else:
            pending.append(ep)
    if on_progress:
        on_progress(st)
    if not pending:
        return st
    pending.reverse()  # pop() from the end keeps the (task, sample) order
    live: dict[tuple[str, int], _Episode] = {}

    def finish(ep: _Episode, error: str | None) -> None:
        rows = ep.rows or _failed_placeholder(ep, cfg, source, error or "no steps")
        if error:
            for r in rows:
                r["error"] = error
        journal.add(ep.traj_id, rows, error)
        st.done += 1
        st.failed += int(bool(error))
        st.successes += int(_episode_reward(rows) > 0 and not error)
        live.pop(ep.key, None)
        backend.end_episode(ep.traj_id)

    if pool is not None and getattr(pool, "env_name", cfg.env) != cfg.env:
        raise QevolveError(f"the environment pool runs {pool.env_name!r}, the rollout needs {cfg.env!r}")
    own_pool = pool is None
    if own_pool:
        pool = EnvPool(cfg.env, workers=cfg.workers, envs_per_worker=cfg.envs_per_worker, timeout_s=cfg.env_timeout_s)
    counters0 = backend.counters()
    with pool if own_pool else contextlib.nullcontext(pool):
        try:
            _rounds(cfg, backend, pool, pending, live, finish, head, temperature, source, chooser,
                    on_progress, st, t_start)
        finally:
            if live and not own_pool:  # interrupted: free the slots of a borrowed pool
                with contextlib.suppress(Exception):
                    pool.release(list(live))
            for ep in live.values():  # interrupted: drop the backend's state of unfinished episodes
                backend.end_episode(ep.traj_id)
            counters1 = backend.counters()
            for k, v in counters1.items():
                if k.endswith("_mb"):
                    st.backend[k] = v
                else:
                    st.backend[k] = st.backend.get(k, 0) + v - counters0.get(k, 0)
    st.wall_s = time.perf_counter() - t_start
    return st


def lane_sizes(capacity: int, lanes: int) -> list[int]:
    """Split ``capacity`` live episodes into ``lanes`` lanes whose sizes differ by at most one."""
    n = max(1, min(int(lanes), int(capacity)))
    base, extra = divmod(int(capacity), n)
    return [base + (1 if k < extra else 0) for k in range(n)]


@dataclass
class _Lane:
    size: int
    eps: dict[tuple[str, int], _Episode] = field(default_factory=dict)  # its live episodes
    joining: dict[tuple[str, int], _Episode] = field(default_factory=dict)  # reset in flight
    outs: dict[tuple[str, int], tuple[str, bool]] = field(default_factory=dict)  # action in flight, truncated
    release: list[tuple[str, int]] = field(default_factory=list)  # cut by our step limit: free with the next request
    ticket: Any = None


def _rounds(cfg, backend, pool, pending, live, finish, head, temperature, source, chooser, on_progress,
            st, t_start) -> None:
    """Pipelined play: the live episodes are split into lanes; while the workers step one lane's
    episodes the policy generates the next actions of another (``cfg.lanes``; 1 = no overlap)."""
    from qevolve_cli.envs.pool import Failure

    system, layout, example = head
    lanes = [_Lane(n) for n in lane_sizes(pool.capacity, cfg.lanes)]

    def generate(eps: list[_Episode]) -> tuple[list[str], list[bool]]:
        reqs: list[Request] = []
        trunc: list[bool] = []
        for ep in eps:
            msgs = transcript.build_messages(system, ep.instruction, ep.observations, ep.actions, layout, example)
            tr = transcript.truncate(msgs, backend.fits, layout)
            trunc.append(tr.truncated or not backend.fits(tr.messages))
            seed = step_seed(cfg.seed, ep.traj_id, len(ep.actions))
            reqs.append(Request(tr.messages, seed=seed, n=cfg.candidates if chooser else 1, key=ep.traj_id))
        t0 = time.perf_counter()
        if chooser is not None and cfg.candidates > 1:
            cands = [[cut_at_stop(c) for c in cs]
                     for cs in backend.generate(reqs, temperature=cfg.candidate_temperature, top_p=cfg.top_p)]
            picks = chooser(reqs, cands)
            outs = [c[int(i)] for c, i in zip(cands, picks, strict=True)]
        else:
            outs = [cut_at_stop(o[0]) for o in backend.generate(reqs, temperature=temperature, top_p=cfg.top_p)]
        st.gen_s += time.perf_counter() - t0
        return outs, trunc

    def advance(lane: _Lane) -> None:
        """Generate the lane's next actions, top it up with new pairs and send one request."""
        eps = list(lane.eps.values())
        outs, trunc = generate(eps) if eps else ([], [])
        lane.outs = {ep.key: (o, t) for ep, o, t in zip(eps, outs, trunc, strict=True)}
        lane.joining = {}
        while pending and len(lane.eps) + len(lane.joining) < lane.size:
            ep = pending.pop()
            lane.joining[ep.key] = ep
            live[ep.key] = ep
        release, lane.release = lane.release, []
        if lane.outs or lane.joining:
            lane.ticket = pool.submit(acts=[(k, o) for k, (o, _) in lane.outs.items()],
                                      resets=[(ep.key, ep.task) for ep in lane.joining.values()],
                                      releases=release, max_steps=cfg.max_steps or None)
        else:  # the lane is finished
            lane.ticket = None
            if release:
                pool.release(release)

    def settle(lane: _Lane, results: dict) -> None:
        """Record the answers of the lane's request: new episodes start, stepped ones advance or end."""
        for ep in lane.joining.values():
            r = results.get(ep.key)
            if r is None or isinstance(r, Failure):
                finish(ep, getattr(r, "error", None) or "reset failed")
                continue
            ep.instruction = r.instruction
            ep.observations = [r.observation]
            ep.max_steps = cfg.max_steps if cfg.max_steps > 0 else int(r.max_steps or 0)
            ep.limit = min([n for n in (cfg.max_steps, int(r.max_steps or 0)) if n > 0], default=0)
            lane.eps[ep.key] = ep
        for key, (out, tr_flag) in lane.outs.items():
            ep = lane.eps[key]
            r = results.get(key)
            if r is None or isinstance(r, Failure):
                lane.eps.pop(key)
                finish(ep, getattr(r, "error", None) or "no result from the environment worker")
                continue
            step = len(ep.actions)
            done = bool(r.done)
            reward = float(r.reward)
            if ep.max_steps > 0 and step + 1 >= ep.max_steps and not done:
                # our own (smaller) step limit: end like the env's limit does, free the slot next request
                done = True
                reward = float((r.info or {}).get("score", 0.0))
                lane.release.append(key)
            ep.rows.append(_row(ep, cfg, source, step, observation=ep.observations[-1], action=out,
                                command=r.command, next_observation=r.observation, reward_env=reward,
                                done=done, truncated=tr_flag, error=None))
            ep.actions.append(out)
            ep.observations.append(r.observation)
            st.steps += 1
            st.truncated_steps += int(tr_flag)
            if done:
                lane.eps.pop(key)
                finish(ep, None)
        lane.outs, lane.joining = {}, {}

    busy0 = (pool.stats.get("busy_reset_s", 0.0), pool.stats.get("busy_step_s", 0.0))
    for lane in lanes:  # first requests: every lane's resets are in flight together
        advance(lane)
    if on_progress:
        on_progress(st)
    while any(lane.ticket is not None for lane in lanes):
        for lane in lanes:
            if lane.ticket is None:
                continue
            t0 = time.perf_counter()
            results = pool.wait(lane.ticket)
            st.env_s += time.perf_counter() - t0  # time the policy waited for the environments
            settle(lane, results)
            advance(lane)
            st.rounds += 1
            st.wall_s = time.perf_counter() - t_start
            if on_progress:
                on_progress(st)
    st.reset_s += pool.stats.get("busy_reset_s", 0.0) - busy0[0]
    st.step_s += pool.stats.get("busy_step_s", 0.0) - busy0[1]


def _episode_reward(rows: Sequence[dict[str, Any]]) -> float:
    return float(sum(float(r.get("reward_env") or 0.0) for r in rows))


@dataclass
class RolloutResult:
    table: pl.DataFrame
    stats: RolloutStats
    out: Path | None


def run_rollout(
    cfg: RolloutConfig,
    policy: str | Path,
    out: str | Path,
    *,
    adapter: str | Path | None = None,
    resume: bool = False,
    source: str = "self",
    temperature: float | None = None,
    backend: Backend | None = None,
    chooser: Chooser | None = None,
    on_progress: ProgressFn | None = None,
    tasks: Sequence[Any] | None = None,
    producer: str = "qevolve rollout",
    pool: Any = None,
    shard_whole_tasks: bool = False,
) -> RolloutResult:
    """Collect ``n_per_task`` trajectories per task of ``cfg.split`` into the table ``out``.

    ``pool`` (an open ``EnvPool``) and ``backend`` may be passed to reuse warm workers and a loaded
    model across calls (the evolve loop, benchmarks). ``resume=True`` continues an interrupted run from its journal (and returns
    at once, reading ``out``, when it is already complete). Returns the
    table (validated), the stats and the output path.

    ``cfg.shard = "I/N"`` plays only that shard's contiguous block of the (task, sample) pairs, in
    the unsharded table's order and with its trajectory ids and seeds (:func:`qevolve_cli.shard.shard_pairs`;
    ``shard_whole_tasks``: a block of whole tasks instead, for best-of-N).

    Holds an exclusive lock on ``out`` and its journal throughout (``qevolve_cli/lock.py``): a
    second process on the same output fails at once, naming this one's PID.
    """
    from qevolve_cli.lock import exclusive, output_lock

    out = Path(out)
    if out.is_dir():
        raise TableError(out, None, "is a directory, expected a Parquet file path")
    with exclusive(output_lock(out), out):
        return _run_rollout(cfg, policy, out, adapter=adapter, resume=resume, source=source, temperature=temperature,
                            backend=backend, chooser=chooser, on_progress=on_progress, tasks=tasks,
                            producer=producer, pool=pool, shard_whole_tasks=shard_whole_tasks)


def _run_rollout(cfg: RolloutConfig, policy: str | Path, out: Path, *, adapter: str | Path | None, resume: bool,
                 source: str, temperature: float | None, backend: Backend | None, chooser: Chooser | None,
                 on_progress: ProgressFn | None, tasks: Sequence[Any] | None, producer: str,
                 pool: Any, shard_whole_tasks: bool) -> RolloutResult:
    from qevolve_cli.envs.splits import list_tasks

    jpath = journal_path(out)
    if resume and out.exists() and not jpath.exists():
        table = schema.read_table(out)
        st = RolloutStats(total=table["traj_id"].n_unique(), done=table["traj_id"].n_unique())
        st.resumed = st.done
        return RolloutResult(table, st, out)
    if out.exists() and out.is_dir():
        raise TableError(out, None, "is a directory, expected a Parquet file path")
    if tasks is None:
        tasks = list_tasks(cfg.env, cfg.split, limit=cfg.max_tasks or None)
    if not tasks:
        raise QevolveError(f"{cfg.env}/{cfg.split}: no tasks")
    temp = cfg.temperature if temperature is None else temperature
    # this run's (task, sample) pairs in table order: all of them, or one shard's contiguous block
    pairs = shard_pairs(tasks, cfg.n_per_task, cfg.shard, whole_tasks=shard_whole_tasks)
    if not pairs:
        raise QevolveError(f"{cfg.env}/{cfg.split}: shard {cfg.shard} of {len(tasks)} tasks x {cfg.n_per_task} "
                           "samples is empty (fewer pairs than shards)")
    header = {"kind": "header", "version": JOURNAL_VERSION, "env": cfg.env, "split": cfg.split,
              "iteration": cfg.iteration, "source": source, "shard": cfg.shard, "policy": str(policy),
              "adapter": str(adapter) if adapter else None, "config": cfg.to_dict()}
    own_backend = backend is None
    if backend is None:
        backend = make_backend(cfg.backend, policy, adapter, base_url=cfg.base_url, served_model=cfg.served_model or None,
                               api_key_env=cfg.api_key_env,
                               max_context=cfg.max_context, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                               device=cfg.device, dtype=cfg.dtype, batch_size=cfg.gen_batch_size,
                               timeout_s=cfg.request_timeout_s, threads=cfg.threads, kv_reuse=cfg.kv_reuse,
                               kv_cache_mb=cfg.kv_cache_mb)
    journal = Journal(jpath, header, resume=resume)
    try:
        st = play(cfg, backend, tasks, temperature=temp, journal=journal, source=source, chooser=chooser,
                  on_progress=on_progress, pool=pool, pairs=pairs)
    finally:
        journal.close()
        if own_backend:
            backend.close()
    order = [traj_id_of(cfg.env, cfg.split, t.task_id, cfg.iteration, s) for t, s in pairs]
    table = _collect(journal, order)
    schema.write_table(table, out, producer=producer)
    from qevolve_cli.config import dump_yaml

    dump_yaml({**cfg.to_dict(), "policy": str(policy), "adapter": str(adapter) if adapter else None,
               "temperature_used": temp, "source": source}, config_path(out))
    shutil.rmtree(jpath.parent, ignore_errors=True)
    return RolloutResult(schema.validate(table, out), st, out)


def config_path(out: str | Path) -> Path:
    """The resolved config written beside an output table (``<out>.config.yaml``)."""
    out = Path(out)
    return out.with_name(out.name + ".config.yaml")
