"""Run directory of `qevolve evolve`: manifest of stages, resolved config, metrics, logs.

Layout::

    RUN/
      config.yaml          resolved EvolveConfig (written once; a resume must match it)
      plan.sh              the equivalent shell commands
      manifest.json        one entry per stage: status, inputs, outputs, config hash, timings (``seconds``:
                           the last attempt, ``seconds_total``: all of them), metrics
      .heartbeats/         a running stage's last sign of life (every HEARTBEAT_S), for the time of a
                           killed attempt
      metrics.jsonl        one line per stage event (losses, scores, environment steps)
      base_model/          (tiny model when the preset builds one)
      expert.parquet
      bc/policy/           BC warm-up
      iter_0/eval_*.parquet  evaluation of the BC policy
      iter_k/              rollout.parquet, labeled.parquet, critic/, advantages.parquet,
                           policy/, eval_<split>.parquet
      report/              `qevolve report` output

A stage whose manifest status is ``done`` and whose outputs exist is never
re-run. A stage interrupted mid-way (status ``running``) is re-run; stages
that can resume internally (rollout journal, critic and policy checkpoints) pick
up their partial work (docs/evolve.md, "What survives a failure").
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qevolve_cli.atomic import write_json
from qevolve_cli.envs.splits import STAGE_ENV
from qevolve_cli.errors import QevolveError
from qevolve_cli.memory import release_memory

MANIFEST = "manifest.json"
HEARTBEATS = ".heartbeats"  # RUN/.heartbeats/<stage>.json: the last sign of life of a running stage
HEARTBEAT_S = 30.0


def heartbeat_path(run_dir: Path, stage: str) -> Path:
    """Where a stage of the run directory writes its heartbeat (``iter_1/critic`` -> ``.heartbeats/iter_1__critic.json``)."""
    return Path(run_dir) / HEARTBEATS / (stage.replace("/", "__") + ".json")


def attempt_seconds(prev: dict[str, Any], heartbeat: dict[str, Any] | None) -> float:
    """Seconds the last recorded attempt of a stage ran, for the total over its attempts: a failed or
    interrupted attempt recorded its own; one killed with its process (still ``running``) counts to its last
    heartbeat (``{"attempt": n, "time": t}``, at most HEARTBEAT_S old when it died), 0 without one."""
    status = prev.get("status")
    if status in ("failed", "interrupted"):
        return float(prev.get("seconds") or 0.0)
    if status == "running" and heartbeat and heartbeat.get("attempt") == prev.get("attempts"):
        return max(0.0, float(heartbeat["time"]) - float(prev.get("started", heartbeat["time"])))
    return 0.0


class StageConfigChanged(QevolveError):
    """A finished stage's recorded configuration hash differs from the one it would run with now."""

    def __init__(self, message: str, stage: str):
        super().__init__(message)
        self.stage = stage


class Unfinished(Exception):
    """Raised in check mode where the loop cannot go on without an unfinished stage's output (a selection whose
    candidates are not validated yet)."""

    def __init__(self, stage: str):
        super().__init__(stage)
        self.stage = stage


class RunDir:
    """``check_only``: ``run_stage`` runs nothing and writes nothing; it verifies a finished stage's configuration
    hash (recording its name in ``checked``) and records an unfinished one in ``pending`` (returning no metrics)
    and, when that stage was interrupted under another configuration, its work in progress (``OUT.partial/``)
    in ``stale`` (``evolve --resume --reconfigure``)."""

    def __init__(self, path: str | Path, check_only: bool = False):
        self.path = Path(path)
        self.manifest_path = self.path / MANIFEST
        self.manifest: dict[str, Any] = {"version": 1, "stages": {}}
        if self.manifest_path.exists():
            try:
                self.manifest = json.loads(self.manifest_path.read_text())
            except json.JSONDecodeError as e:
                raise QevolveError(f"{self.manifest_path}: corrupt manifest ({e})") from None
        self.sinks: list[Any] = []
        self.check_only = check_only
        self.checked: list[str] = []
        self.pending: list[str] = []
        self.stale: list[Path] = []  # work in progress of unfinished stages whose configuration changed

    # ------------------------------------------------------------------ state
    @property
    def stages(self) -> dict[str, dict[str, Any]]:
        return self.manifest.setdefault("stages", {})

    def save(self) -> None:
        write_json(self.manifest_path, self.manifest)

    def is_done(self, name: str) -> bool:
        st = self.stages.get(name)
        if not st or st.get("status") != "done":
            return False
        return all((self.path / o).exists() for o in st.get("outputs", []))

    def log(self, record: dict[str, Any]) -> None:
        record = {"time": round(time.time(), 3), **record}
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record, default=float) + "\n")
        for sink in self.sinks:
            sink(record)

    def run_stage(self, name: str, fn: Callable[[], dict[str, Any] | None], *, inputs: list[str], outputs: list[str],
                  config_hash: str, iteration: int, echo: Callable[[str], None],
                  legacy_hash: str | None = None) -> dict[str, Any]:
        """Run ``fn`` as stage ``name`` unless already done; record status, timings and metrics.

        ``legacy_hash``: the configuration's hash as an older version computed it (``ConfigBase.legacy_hash``);
        a stage recorded under it is the same configuration's."""
        same = {config_hash} | ({legacy_hash} if legacy_hash else set())
        if self.is_done(name):
            st = self.stages[name]
            if st.get("config_hash") not in same:
                raise StageConfigChanged(
                    f"{self.manifest_path}: stage {name!r} was done with another configuration "
                    f"(hash {st.get('config_hash')} != {config_hash}); use a new --run-dir", name
                )
            if self.check_only:
                self.checked.append(name)
            else:
                echo(f"[skip] {name} (done)")
            return st.get("metrics", {})
        if self.check_only:
            self.pending.append(name)
            prev = self.stages.get(name)
            if prev and prev.get("config_hash") not in same:  # interrupted under the old configuration
                from qevolve_cli.atomic import partial_dir

                self.stale += [p for p in (partial_dir(self.path / o) for o in outputs) if p.exists()]
            return {}
        prev = self.stages.get(name, {})
        attempt = int(prev.get("attempts", 0)) + 1
        hb_path = heartbeat_path(self.path, name)
        # seconds of the earlier attempts: ``seconds`` is this attempt's, ``seconds_total`` all of them
        # (rounded as written, so that seconds_total is exactly seconds_before + seconds, as a reader adds them)
        before = round(float(prev.get("seconds_before") or 0.0) + attempt_seconds(prev, read_json(hb_path)), 3)
        self.stages[name] = {
            "stage": name, "iteration": iteration, "status": "running", "inputs": inputs, "outputs": outputs,
            "config_hash": config_hash, "started": time.time(), "attempts": attempt,
        }
        if before:
            self.stages[name]["seconds_before"] = before
        self.save()
        echo(f"[run]  {name}" + (f" (attempt {attempt}, resuming)" if attempt > 1 else ""))
        t0 = time.perf_counter()
        outer = os.environ.get(STAGE_ENV)
        os.environ[STAGE_ENV] = name  # split-access logs name the stage (envs/splits.py, SPLIT_LOG_ENV)
        stop = _heartbeat(hb_path, attempt)
        try:
            metrics = fn() or {}
        except BaseException as e:
            secs = round(time.perf_counter() - t0, 3)
            st = self.stages[name]
            st.update(status="interrupted" if isinstance(e, KeyboardInterrupt) else "failed",
                      error=str(e).splitlines()[0] if str(e) else type(e).__name__, seconds=secs,
                      seconds_total=round(before + secs, 3))
            self.save()
            release_memory()  # outside the stage's timed seconds, as below
            raise
        finally:
            stop()
            if outer is None:
                os.environ.pop(STAGE_ENV, None)
            else:
                os.environ[STAGE_ENV] = outer
        missing = [o for o in outputs if not (self.path / o).exists()]
        if missing:
            raise QevolveError(f"stage {name!r} finished without writing {', '.join(missing)}")
        secs = round(time.perf_counter() - t0, 3)
        st = self.stages[name]
        st.update(status="done", finished=time.time(), seconds=secs, seconds_total=round(before + secs, 3),
                  metrics=metrics)
        st.pop("error", None)
        self.save()
        for f in [hb_path, *hb_path.parent.glob(f".{hb_path.name}.*.tmp")]:  # and what a kill left mid-write
            f.unlink(missing_ok=True)
        self.log({"stage": name, "iteration": iteration, "seconds": st["seconds"], **_flat(metrics)})
        release_memory()  # the next stage (or another job on the machine) gets this one's peak back
        return metrics


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _heartbeat(path: Path, attempt: int) -> Callable[[], None]:
    """Write ``{"attempt", "time"}`` to ``path`` every HEARTBEAT_S seconds from a daemon thread until the
    returned function is called: if the process is killed, the next attempt knows how long this one ran."""
    import threading

    done = threading.Event()

    def beat() -> None:
        while not done.wait(HEARTBEAT_S):
            try:
                write_json(path, {"attempt": attempt, "time": time.time()})
            except OSError:  # a full disk must not stop the stage: the total just undercounts
                pass

    path.parent.mkdir(parents=True, exist_ok=True)
    t = threading.Thread(target=beat, name=f"heartbeat {path.stem}", daemon=True)
    t.start()

    def stop() -> None:
        done.set()
        t.join()

    return stop


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v
    return out


def make_sinks(kinds: list[str], run: Path, warn: Callable[[str], None]) -> list[Callable[[dict], None]]:
    """Optional TensorBoard / W&B sinks of the metrics stream (skipped with a warning when not installed)."""
    sinks = []
    for kind in kinds:
        if kind == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            except Exception:  # noqa: BLE001
                warn("tensorboard is not installed: --log-to tensorboard ignored (pip install tensorboard)")
                continue
            writer = SummaryWriter(str(run / "tensorboard"))

            def tb(rec, w=writer):
                step = int(rec.get("iteration", 0))
                for k, v in rec.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("time", "iteration"):
                        w.add_scalar(f"{rec.get('stage', 'run')}/{k}", v, step)
                w.flush()

            sinks.append(tb)
        elif kind == "wandb":
            try:
                import wandb
            except Exception:  # noqa: BLE001
                warn("wandb is not installed: --log-to wandb ignored (pip install wandb)")
                continue
            wrun = wandb.init(project="qevolve", dir=str(run), name=run.name, resume="allow")
            sinks.append(lambda rec, r=wrun: r.log({f"{rec.get('stage', 'run')}/{k}": v for k, v in rec.items()
                                                    if isinstance(v, (int, float)) and not isinstance(v, bool)}))
    return sinks


def scalars(d: Any) -> dict[str, Any]:
    """Keep the JSON-friendly part of a stage's metrics (nested dicts kept, long lists dropped)."""
    if not isinstance(d, dict):
        return {}
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, (int, float, str, bool)) or v is None:
            out[k] = v
        elif isinstance(v, dict):
            out[k] = scalars(v)
        elif isinstance(v, (list, tuple)) and len(v) <= 64 and all(isinstance(x, (int, float, str, dict)) for x in v):
            out[k] = [scalars(x) if isinstance(x, dict) else x for x in v]
    return out
