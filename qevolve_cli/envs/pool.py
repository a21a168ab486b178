"""Worker pool: episodes run in separate processes so many environments step in parallel.

API (used by the batched rollout loop, ``collect_expert`` and evaluation)::

    from qevolve_cli.envs.pool import EnvPool, Failure
    with EnvPool("sciworld", workers=4, envs_per_worker=2, timeout_s=60) as pool:
        res = pool.reset_many([(key, task), ...])        # dict key -> ResetResult | Failure
        # ResetResult(observation: str, instruction: str, info: dict, max_steps: int)
        #   info["expert_plan"] (list[str]) when reset_many(..., with_expert=True)
        out = pool.act_many([(key, model_output), ...])  # dict key -> StepResult | Failure
        # StepResult(command: str | None, observation, reward, done, info) exactly as
        # envs.base.act returns it (format error -> command None, env not stepped).
        pool.release([key, ...])                         # free the episode slots (also done on done=True)
        # non-blocking: several requests in flight, answered in order per worker
        t = pool.submit(acts=[...], resets=[...], releases=[...])   # -> Ticket, returns at once
        ...                                              # e.g. generate for other episodes meanwhile
        res = pool.wait(t)                               # dict key -> ResetResult | StepResult | Failure

* An *episode key* is any hashable the caller chooses (e.g. ``(task_id, sample_idx)``).
  ``reset_many`` assigns each key to the worker that last reset the same task when it has a free
  slot (it may hold the game ready: ALFWorld), else to the least loaded one; a key lives on that worker
  until released or done. At most ``workers * envs_per_worker`` episodes are live at once
  (``pool.capacity``); ``reset_many`` raises ``QevolveError`` beyond that.
* Calls are batched: requests for different workers run in parallel; the episodes of one
  worker run one after another inside it. Results come back per key. ``reset_many`` /
  ``act_many`` / ``release`` are ``submit`` + ``wait``; ``submit`` alone returns a ``Ticket`` at
  once, so the caller can overlap its own work (generation) with the workers' env steps. A
  worker answers its queued requests in order; timeouts count from the moment a request
  reaches the head of its worker's queue.
* ``pool.stats["busy_reset_s"]`` / ``["busy_step_s"]``: seconds the workers spent inside env
  resets / steps (measured in the workers, summed over them).
* Failures are values, not exceptions: if a worker crashes (killed, dead JVM, segfault) or
  does not answer within ``timeout_s`` for one env call (reset gets ``reset_timeout_s``), the
  worker process is killed and restarted, and **every live episode on it** gets
  ``Failure(error="worker crashed: ..." | "timeout: ...")`` — the caller records that
  trajectory with the reason in the ``error`` column (docs/tables.md) and goes on. Episodes on the
  other workers are untouched. An exception raised by the environment itself inside
  reset/step also gives a ``Failure`` for that key only (the worker survives).
* ``pool.stats`` counts restarts / failures; ``pool.close()`` (or the context manager)
  stops the workers.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from typing import Any

from qevolve_cli.envs.base import StepResult, Task
from qevolve_cli.errors import QevolveError


@dataclass
class ResetResult:
    observation: str
    instruction: str
    info: dict[str, Any] = field(default_factory=dict)
    max_steps: int = 0


@dataclass
class Failure:
    """An episode that could not go on; ``error`` is the one-line reason (for the ``error`` column)."""

    error: str

    @property
    def done(self) -> bool:  # a failed episode is over
        return True


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


# ----------------------------------------------------------------------------------- worker side
def _worker_main(conn, env_name: str, env_kwargs: dict[str, Any]) -> None:  # pragma: no cover - child
    # Keep stdout clean for the parent's JSON output: anything an environment prints goes to stderr.
    try:
        os.dup2(2, 1)
        sys.stdout = sys.stderr
    except OSError:
        pass
    from qevolve_cli.envs.base import act
    from qevolve_cli.envs.registry import make_env

    live: dict[Hashable, Any] = {}
    idle: list[Any] = []

    def discard(env) -> None:
        try:
            env.close()
        except Exception:
            pass

    def do_release(keys) -> None:
        for key in keys:
            env = live.pop(key, None)
            if env is not None:
                idle.append(env)

    def do_reset(items) -> None:
        for key, task, with_expert, max_steps in items:
            env = live.pop(key, None) or (idle.pop() if idle else None)
            try:
                if env is None:
                    env = make_env(env_name, **env_kwargs)
                obs = env.reset(task, with_expert=with_expert, max_steps=max_steps)
                info: dict[str, Any] = {}
                if with_expert:
                    info["expert_plan"] = env.expert_plan()
                live[key] = env
                conn.send(("ok", key, ResetResult(obs, env.instruction, info, env._episode_max_steps)))
            except Exception as e:
                if env is not None:
                    discard(env)
                conn.send(("err", key, f"reset failed: {_one_line(e)}"))

    def do_act(items) -> None:
        for key, output in items:
            env = live.get(key)
            if env is None:
                conn.send(("err", key, "no live episode for this key (not reset, released or done)"))
                continue
            try:
                res = act(env, output)
                if res.done:
                    idle.append(live.pop(key))
                conn.send(("ok", key, res))
            except Exception as e:
                discard(live.pop(key))
                conn.send(("err", key, f"step failed: {_one_line(e)}"))

    while True:
        try:
            op, items = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            break
        if op == "close":
            break
        t0 = time.perf_counter()
        busy = {"reset_s": 0.0, "step_s": 0.0}
        if op == "request":  # one request: releases, then resets, then steps (results come back in that order)
            releases, resets, acts = items
            do_release(releases)
            do_reset(resets)
            t1 = time.perf_counter()
            do_act(acts)
            busy = {"reset_s": t1 - t0, "step_s": time.perf_counter() - t1}
        conn.send(("end", None, busy))
    for env in list(live.values()) + idle:
        discard(env)
    try:
        conn.close()
    except OSError:
        pass


# ----------------------------------------------------------------------------------- parent side
@dataclass
class _Request:
    """One request in flight on one worker (a worker answers its requests in order)."""

    ticket: Ticket
    keys: set[Hashable]  # keys still owed a result
    reset_keys: set[Hashable]
    timeout: float
    what: str  # "reset" | "step" (for timeout messages)


class Ticket:
    """Handle of a :meth:`EnvPool.submit` call; :meth:`EnvPool.wait` returns its results."""

    def __init__(self) -> None:
        self.results: dict[Hashable, Any] = {}
        self.open = 0  # requests of this ticket not answered yet

    @property
    def done(self) -> bool:
        return self.open == 0


class _Worker:
    def __init__(self, ctx, idx: int, env_name: str, env_kwargs: dict[str, Any]):
        self.idx = idx
        parent, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, env_name, env_kwargs),
                                name=f"qevolve-env-{env_name}-{idx}", daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent
        self.keys: set[Hashable] = set()
        self.queue: deque[_Request] = deque()
        self.deadline = 0.0  # of the request at the head of the queue

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def kill(self) -> None:
        try:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=10)
        except Exception:
            pass
        try:
            self.conn.close()
        except OSError:
            pass


class EnvPool:
    """Parallel environment episodes in worker processes (see the module docstring)."""

    def __init__(self, env_name: str, workers: int = 1, envs_per_worker: int = 1, timeout_s: float = 60.0,
                 reset_timeout_s: float | None = None, env_kwargs: dict[str, Any] | None = None,
                 start_method: str = "spawn"):
        from qevolve_cli.envs.registry import check_env

        if workers < 1:
            raise QevolveError(f"workers must be >= 1, got {workers}")
        if envs_per_worker < 1:
            raise QevolveError(f"envs_per_worker must be >= 1, got {envs_per_worker}")
        self.env_name = check_env(env_name)
        self.n_workers = int(workers)
        self.envs_per_worker = int(envs_per_worker)
        self.timeout_s = float(timeout_s)
        self.reset_timeout_s = float(reset_timeout_s if reset_timeout_s is not None else max(timeout_s, 180.0))
        self.env_kwargs = dict(env_kwargs or {})
        self._ctx = mp.get_context(start_method)
        self._workers = [_Worker(self._ctx, i, env_name, self.env_kwargs) for i in range(self.n_workers)]
        self._where: dict[Hashable, int] = {}
        self._lost: dict[Hashable, str] = {}  # keys whose worker died while they were not being stepped
        self._affinity: dict[str, int] = {}  # task_id -> worker that last reset it
        # busy_reset_s / busy_step_s: seconds the workers spent in env resets / steps (summed over workers)
        self.stats = {"restarts": 0, "failures": 0, "resets": 0, "steps": 0, "busy_reset_s": 0.0, "busy_step_s": 0.0}
        self._closed = False

    # -- public ------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.n_workers * self.envs_per_worker

    @property
    def live_keys(self) -> list[Hashable]:
        return list(self._where)

    def worker_pids(self) -> list[int | None]:
        return [w.pid for w in self._workers]

    def pid_of(self, key: Hashable) -> int | None:
        i = self._where.get(key)
        return None if i is None else self._workers[i].pid

    def reset_many(self, items: Sequence[tuple[Hashable, Task]], with_expert: bool = False,
                   max_steps: int | None = None) -> dict[Hashable, ResetResult | Failure]:
        """Start one episode per ``(key, task)``; a key already live is restarted in place."""
        return self.wait(self.submit(resets=items, with_expert=with_expert, max_steps=max_steps))

    def act_many(self, items: Sequence[tuple[Hashable, str]]) -> dict[Hashable, StepResult | Failure]:
        """One turn per ``(key, model_output)``; finished or failed episodes are released."""
        return self.wait(self.submit(acts=items))

    def release(self, keys: Iterable[Hashable]) -> None:
        """Free the slots of these episodes (unfinished ones are abandoned)."""
        keys = list(keys)
        if keys and not self._closed:
            self.wait(self.submit(releases=keys))

    def submit(self, acts: Sequence[tuple[Hashable, str]] = (), resets: Sequence[tuple[Hashable, Task]] = (),
               releases: Iterable[Hashable] = (), with_expert: bool = False,
               max_steps: int | None = None) -> Ticket:
        """Send one request per worker involved and return at once (no waiting).

        Each worker first frees ``releases``, then starts the ``resets`` (new keys go to the least
        loaded worker; a live key is restarted in place), then plays one turn of every ``acts``
        episode. The results (``ResetResult`` / ``StepResult`` / ``Failure`` per key of ``resets``
        and ``acts``) come from :meth:`wait`. Several tickets may be in flight at once: a worker
        answers its requests in order, so the caller can generate the next actions of one group of
        episodes while the workers step another (the rollout loop's lanes).
        """
        self._check_open()
        ticket = Ticket()
        rel_keys = list(releases)
        reset_keys = [k for k, _ in resets]
        act_keys = [k for k, _ in acts]
        if len(set(reset_keys)) != len(reset_keys):
            raise QevolveError("reset_many: duplicate episode keys")
        if set(reset_keys) & set(act_keys) or len(set(act_keys)) != len(act_keys):
            raise QevolveError("submit: an episode key appears twice in one request")
        batches: dict[int, tuple[list, list, list]] = {}

        def batch(i: int) -> tuple[list, list, list]:
            return batches.setdefault(i, ([], [], []))

        for key in rel_keys:
            self._lost.pop(key, None)
            if key in self._where:
                batch(self._where[key])[0].append(key)
                self._forget(key)
        new = [k for k in reset_keys if k not in self._where]
        if len(self._where) + len(new) > self.capacity:
            raise QevolveError(f"reset_many: {len(self._where) + len(new)} live episodes exceed the pool capacity "
                               f"{self.capacity} (workers x envs_per_worker); release finished ones first")
        for k in reset_keys:
            self._lost.pop(k, None)
        load = [len(w.keys) for w in self._workers]
        for key, task in resets:
            if key in self._where:
                i = self._where[key]
            else:
                # a task goes back to the worker that last played it when that worker has a free slot:
                # environments that cache a game per worker (ALFWorld) then reset it cheaply
                i = self._affinity.get(task.task_id, -1)
                if not (0 <= i < self.n_workers and load[i] < self.envs_per_worker):
                    i = min((j for j in range(self.n_workers) if load[j] < self.envs_per_worker),
                            key=lambda j: load[j])
                load[i] += 1
                self._where[key] = i
                self._workers[i].keys.add(key)
            self._affinity[task.task_id] = i
            batch(i)[1].append((key, task, bool(with_expert), max_steps))
        for key, output in acts:
            if key in self._lost:
                ticket.results[key] = Failure(self._lost.pop(key))
                self.stats["failures"] += 1
            elif key not in self._where:
                ticket.results[key] = Failure("no live episode for this key (not reset, released or done)")
            else:
                batch(self._where[key])[2].append((key, output))
        self.stats["resets"] += len(reset_keys)
        for i, (rel, rst, stp) in batches.items():
            keys = {k for k, *_ in rst} | {k for k, _ in stp}
            req = _Request(ticket, keys, {k for k, *_ in rst}, self.reset_timeout_s if rst else self.timeout_s,
                           "reset" if rst else "step")
            self._send(i, req, (rel, rst, stp))
        return ticket

    def wait(self, ticket: Ticket) -> dict[Hashable, ResetResult | StepResult | Failure]:
        """Block until every request of ``ticket`` is answered (or its worker failed); its results."""
        while not ticket.done:
            self._pump()
        return ticket.results

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(("close", None))
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 10
        for w in self._workers:
            w.proc.join(timeout=max(0.1, deadline - time.monotonic()))
            w.kill()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    # -- internals -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise QevolveError("the environment pool is closed")

    def _forget(self, key: Hashable) -> None:
        i = self._where.pop(key, None)
        if i is not None:
            self._workers[i].keys.discard(key)

    def _send(self, i: int, req: _Request, items: tuple[list, list, list]) -> None:
        w = self._workers[i]
        req.ticket.open += 1
        if not w.queue:
            w.deadline = time.monotonic() + req.timeout
        w.queue.append(req)
        try:
            w.conn.send(("request", items))
        except (OSError, BrokenPipeError, EOFError):
            self._restart(i, "worker crashed before the request")

    def _finish_head(self, i: int, busy: dict[str, float] | None) -> None:
        w = self._workers[i]
        req = w.queue.popleft()
        for key in req.keys:  # owed but never answered (cannot happen with a sane worker)
            req.ticket.results[key] = Failure("no result from the environment worker")
            self._forget(key)
        req.ticket.open -= 1
        if busy:
            self.stats["busy_reset_s"] += float(busy.get("reset_s", 0.0))
            self.stats["busy_step_s"] += float(busy.get("step_s", 0.0))
        if w.queue:
            w.deadline = time.monotonic() + w.queue[0].timeout

    def _restart(self, i: int, reason: str) -> None:
        """Kill worker i, fail every request in flight on it with ``reason``, start a fresh worker."""
        w = self._workers[i]
        w.kill()
        code = w.proc.exitcode
        if reason.startswith("worker crashed") and code is not None:
            reason = f"{reason} (exit code {code})"
        owed: set[Hashable] = set()
        for req in w.queue:
            for key in req.keys:
                req.ticket.results[key] = Failure(reason)
            self.stats["failures"] += len(req.keys)
            owed |= req.keys
            req.ticket.open -= 1
        w.queue.clear()
        for key in list(w.keys):
            if key not in owed:
                self._lost[key] = reason
            self._where.pop(key, None)
        self.stats["restarts"] += 1
        self._workers[i] = _Worker(self._ctx, i, self.env_name, self.env_kwargs)

    def _pump(self) -> None:
        """Wait for the next answer of any busy worker (or a timeout) and route it to its ticket.

        Answers already waiting in a pipe are taken before any deadline is checked: while the
        caller generates for one lane, another lane's answers may sit unread for a while, and
        that is not the worker's delay.
        """
        busy = {w.conn: i for i, w in enumerate(self._workers) if w.queue}
        if not busy:
            return
        ready = mp_wait(list(busy), timeout=0)
        if not ready:
            now = time.monotonic()
            for conn, i in list(busy.items()):
                w = self._workers[i]
                if w.deadline <= now:
                    busy.pop(conn)
                    head = w.queue[0]
                    self._restart(i, f"timeout: worker did not answer an env {head.what} within {head.timeout:g}s")
            if not busy:
                return
            wait_s = max(0.0, min(self._workers[i].deadline for i in busy.values()) - time.monotonic())
            ready = mp_wait(list(busy), timeout=wait_s)
        for conn in ready:
            i = busy[conn]
            w = self._workers[i]
            try:
                kind, key, payload = conn.recv()
            except (EOFError, OSError, ConnectionResetError):
                self._restart(i, "worker crashed")
                continue
            if kind == "end":
                self._finish_head(i, payload)
                continue
            w.deadline = time.monotonic() + w.queue[0].timeout
            req = w.queue[0]
            req.keys.discard(key)
            if kind == "ok":
                req.ticket.results[key] = payload
                if isinstance(payload, StepResult):
                    self.stats["steps"] += 1
                    if payload.done:
                        self._forget(key)
            else:
                req.ticket.results[key] = Failure(str(payload))
                self.stats["failures"] += 1
                self._forget(key)


def format_exc_line() -> str:
    """The current exception as one line (for logs)."""
    return " | ".join(traceback.format_exc().strip().splitlines()[-1:])
