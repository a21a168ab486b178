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

* An *episode key* is any hashable the caller chooses (e.g. ``(task_id, sample_idx)``).
  ``reset_many`` assigns each key to the least loaded worker; a key lives on that worker
  until released or done. At most ``workers * envs_per_worker`` episodes are live at once
  (``pool.capacity``); ``reset_many`` raises ``QevolveError`` beyond that.
* Calls are batched: requests for different workers run in parallel; the episodes of one
  worker run one after another inside it. Results come back per key.
* Failures are values, not exceptions: if a worker crashes (killed, dead JVM, segfault) or
  does not answer within ``timeout_s`` for one env call (reset gets ``reset_timeout_s``), the
  worker process is killed and restarted, and **every live episode on it** gets
  ``Failure(error="worker crashed: ..." | "timeout: ...")`` — the caller records that
  trajectory with the reason in the ``error`` column (SPEC §3) and goes on. Episodes on the
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

    while True:
        try:
            op, items = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            break
        if op == "close":
            break
        if op == "reset":
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
        elif op == "act":
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
        elif op == "release":
            for key in items:
                env = live.pop(key, None)
                if env is not None:
                    idle.append(env)
        elif op == "ping":
            conn.send(("ok", None, os.getpid()))
        conn.send(("end", None, None))
    for env in list(live.values()) + idle:
        discard(env)
    try:
        conn.close()
    except OSError:
        pass


# ----------------------------------------------------------------------------------- parent side
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
        self.stats = {"restarts": 0, "failures": 0, "resets": 0, "steps": 0}
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
        self._check_open()
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys):
            raise QevolveError("reset_many: duplicate episode keys")
        new = [k for k in keys if k not in self._where]
        if len(self._where) + len(new) > self.capacity:
            raise QevolveError(f"reset_many: {len(self._where) + len(new)} live episodes exceed the pool capacity "
                               f"{self.capacity} (workers x envs_per_worker); release finished ones first")
        for k in keys:
            self._lost.pop(k, None)
        load = [len(w.keys) for w in self._workers]
        batches: dict[int, list] = {}
        for key, task in items:
            if key in self._where:
                i = self._where[key]
            else:
                i = min((j for j in range(self.n_workers) if load[j] < self.envs_per_worker), key=lambda j: load[j])
                load[i] += 1
                self._where[key] = i
                self._workers[i].keys.add(key)
            batches.setdefault(i, []).append((key, task, bool(with_expert), max_steps))
        out = self._run("reset", batches, self.reset_timeout_s)
        for key, res in out.items():
            if isinstance(res, Failure):
                self._forget(key)
        self.stats["resets"] += len(items)
        return out

    def act_many(self, items: Sequence[tuple[Hashable, str]]) -> dict[Hashable, StepResult | Failure]:
        """One turn per ``(key, model_output)``; finished or failed episodes are released."""
        self._check_open()
        out: dict[Hashable, StepResult | Failure] = {}
        batches: dict[int, list] = {}
        for key, output in items:
            if key in self._lost:
                out[key] = Failure(self._lost.pop(key))
                self.stats["failures"] += 1
            elif key not in self._where:
                out[key] = Failure("no live episode for this key (not reset, released or done)")
            else:
                batches.setdefault(self._where[key], []).append((key, output))
        res = self._run("act", batches, self.timeout_s)
        for key, r in res.items():
            if isinstance(r, Failure) or r.done:
                self._forget(key)
        self.stats["steps"] += sum(1 for r in res.values() if not isinstance(r, Failure))
        out.update(res)
        return out

    def release(self, keys: Iterable[Hashable]) -> None:
        """Free the slots of these episodes (unfinished ones are abandoned)."""
        batches: dict[int, list] = {}
        for key in keys:
            self._lost.pop(key, None)
            if key in self._where:
                batches.setdefault(self._where[key], []).append(key)
                self._forget(key)
        if batches and not self._closed:
            self._run("release", batches, self.timeout_s)

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

    def _restart(self, i: int, reason: str, pending: set[Hashable], out: dict) -> None:
        """Kill worker i, mark its episodes failed with ``reason`` and start a fresh worker."""
        w = self._workers[i]
        w.kill()
        code = w.proc.exitcode
        if reason.startswith("worker crashed") and code is not None:
            reason = f"{reason} (exit code {code})"
        for key in list(w.keys):
            if key in pending:
                out[key] = Failure(reason)
            else:
                self._lost[key] = reason
            self._where.pop(key, None)
        for key in pending:
            out.setdefault(key, Failure(reason))
        self.stats["failures"] += len(pending)
        self.stats["restarts"] += 1
        self._workers[i] = _Worker(self._ctx, i, self.env_name, self.env_kwargs)

    def _run(self, op: str, batches: dict[int, list], timeout: float) -> dict[Hashable, Any]:
        out: dict[Hashable, Any] = {}
        pending: dict[int, set] = {}
        deadline: dict[int, float] = {}
        now = time.monotonic()
        for i, items in batches.items():
            w = self._workers[i]
            keys = {it if op == "release" else it[0] for it in items}
            try:
                w.conn.send((op, items))
            except (OSError, BrokenPipeError, EOFError):
                self._restart(i, "worker crashed before the request", keys if op != "release" else set(), out)
                continue
            pending[i] = keys
            deadline[i] = now + timeout
        conn_of = {self._workers[i].conn: i for i in pending}
        while conn_of:
            now = time.monotonic()
            for i in [i for i in list(conn_of.values()) if deadline[i] <= now]:
                conn_of.pop(self._workers[i].conn, None)
                what = "reset" if op == "reset" else "step"
                self._restart(i, f"timeout: worker did not answer an env {what} within {timeout:g}s",
                              pending.pop(i) if op != "release" else set(), out)
            if not conn_of:
                break
            wait_s = max(0.0, min(deadline[i] for i in conn_of.values()) - time.monotonic())
            for conn in mp_wait(list(conn_of), timeout=wait_s):
                i = conn_of[conn]
                try:
                    kind, key, payload = conn.recv()
                except (EOFError, OSError, ConnectionResetError):
                    conn_of.pop(conn, None)
                    self._restart(i, "worker crashed", pending.pop(i) if op != "release" else set(), out)
                    continue
                if kind == "end":
                    conn_of.pop(conn, None)
                    pending.pop(i, None)
                    continue
                deadline[i] = time.monotonic() + timeout
                if kind == "ok":
                    out[key] = payload
                else:
                    out[key] = Failure(str(payload))
                    self.stats["failures"] += 1
                pending.get(i, set()).discard(key)
        return out


def format_exc_line() -> str:
    """The current exception as one line (for logs)."""
    return " | ".join(traceback.format_exc().strip().splitlines()[-1:])
