"""The rollout journal: ``OUT.partial/journal.jsonl`` (the work-in-progress directory of every stage,
:func:`qevolve_cli.atomic.partial_dir`), append-only: a header line, then one line per finished episode with all
its rows, flushed and fsynced. A resumed run reads it back (a torn last line is ignored and cut) and refuses one
of other settings."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from qevolve_cli.atomic import partial_dir
from qevolve_cli.errors import QevolveError

JOURNAL_VERSION = 1


def journal_path(out: str | Path) -> Path:
    return partial_dir(out) / "journal.jsonl"


class Journal:
    """Append-only JSON-lines record of finished episodes (one fsynced line each)."""

    def __init__(self, path: Path, header: dict[str, Any], resume: bool):
        self.path = path
        self.header = header
        self.episodes: dict[str, dict[str, Any]] = {}  # traj_id -> record (last one wins)
        if resume and path.exists():
            self._load()
            self.f = open(path, "a", encoding="utf-8")  # noqa: SIM115
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.f = open(path, "w", encoding="utf-8")  # noqa: SIM115
            self._write(header)

    def _load(self) -> None:
        lines = self.path.read_text(encoding="utf-8").split("\n")
        good_bytes = 0
        for i, line in enumerate(lines):
            if not line.strip():
                good_bytes += len(line.encode()) + 1
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                if i >= len(lines) - 2:  # torn last line of a killed run
                    break
                raise QevolveError(f"{self.path}: line {i + 1}: corrupt journal record") from None
            good_bytes += len(line.encode()) + 1
            if i == 0 or rec.get("kind") == "header":
                self._check_header(rec, i + 1)
                continue
            if rec.get("kind") == "episode":
                self.episodes[rec["traj_id"]] = rec
        # cut a torn tail so appended records start on a fresh line
        size = self.path.stat().st_size
        if good_bytes < size:
            with open(self.path, "r+b") as f:
                f.truncate(good_bytes)

    def _check_header(self, rec: dict[str, Any], lineno: int) -> None:
        if rec.get("kind") != "header":
            raise QevolveError(f"{self.path}: line {lineno}: not a rollout journal (no header)")
        for k in ("env", "split", "iteration", "source", "shard"):
            if rec.get(k, "") != self.header.get(k, ""):  # journals without a shard key are unsharded
                raise QevolveError(
                    f"{self.path}: the unfinished rollout has {k}={rec.get(k)!r}, this run {k}="
                    f"{self.header.get(k)!r}; resume with the same settings or delete the journal")

    def _write(self, rec: dict[str, Any]) -> None:
        self.f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def add(self, traj_id: str, rows: list[dict[str, Any]], error: str | None) -> None:
        rec = {"kind": "episode", "traj_id": traj_id, "error": error, "rows": rows}
        self._write(rec)
        self.episodes[traj_id] = rec

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.f.close()
