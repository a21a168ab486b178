"""ALFWorld adapter: ``alfworld`` + ``textworld`` text engine, games loaded directly.

* Game data: ``$ALFWORLD_DATA/json_2.1.1/<train|valid_seen|valid_unseen>/<game>/<trial>/game.tw-pddl``
  (the layout ``alfworld-download`` produces). :func:`ensure_alfworld_data` finds it, or
  unpacks the packed copy (``alfworld-json_2.1.1.tar.xz`` from ``$QEVOLVE_SHARED_DATA`` or
  ``../shared/data``) once into ``~/.cache/qevolve/alfworld`` and points ``ALFWORLD_DATA`` there.
* Each reset loads the game into a TextWorld PDDL environment with the ``alfworld`` wrappers
  (``AlfredDemangler``, ``AlfredInfos``) — ``AlfredTWEnv.collect_game_files`` is not used
  (it needs ``traj_data.json``, which this data omits).
* Memory: every ``PddlEnv`` loads its own copy of fast-downward's shared library and never
  unloads it, and TextWorld memoises every ``Proposition`` / ``Signature`` it ever built in
  one process-wide dict (``mementos``). Starting a fresh environment per game therefore grew a
  worker by ~4 MB per game (1.3 GB after ~150 games). The adapter keeps one TextWorld
  environment per request-info set and ``load``s each new game into it (the way
  ``textworld.gym`` does), so a worker holds at most two library copies per env slot
  (unloading them with ``fast_downward.close_lib`` crashed the interpreter at exit), and empties
  the memo dict at every reset (the memoised classes compare and hash by value, nothing relies on identity:
  the memo only saves time, and other games' objects stay valid).
* Instruction: the ``Your task is to: ...`` sentence; first observation: the room
  description (the TextWorld banner removed).
* Task type: the first part of the game folder name (``pick_heat_then_place_in_recep``).
* Invalid actions: ``Nothing happens.`` (matched by ``configs/labels.yaml``).
* Reward: 1 when the game is won (last step), else 0.
* Expert: ``gt_traj.json`` (train games) or else the TextWorld PDDL planner's
  ``policy_commands`` at reset (valid games).
"""
from __future__ import annotations

import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from qevolve_cli.envs.base import Env, Task
from qevolve_cli.errors import QevolveError

DEFAULT_MAX_STEPS = 30  # paper: maximum episode length on ALFWorld
TARBALL = "alfworld-json_2.1.1.tar.xz"
BANNER = "-= Welcome to TextWorld, ALFRED! =-"
TASK_MARKER = "Your task is to:"


def default_cache_dir() -> Path:
    return Path(os.environ.get("QEVOLVE_CACHE", Path.home() / ".cache" / "qevolve")) / "alfworld"


def _has_games(root: Path) -> bool:
    return (root / "json_2.1.1").is_dir() and (root / "logic").is_dir()


def _find_tarball() -> Path | None:
    cands = []
    if os.environ.get("QEVOLVE_SHARED_DATA"):
        cands.append(Path(os.environ["QEVOLVE_SHARED_DATA"]) / TARBALL)
    here = Path(__file__).resolve()
    cands += [here.parents[3] / "shared" / "data" / TARBALL, Path.cwd().parent / "shared" / "data" / TARBALL]
    for c in cands:
        if c.is_file():
            return c
    return None


def ensure_alfworld_data(unpack: bool = True) -> Path:
    """The ALFWorld data root (sets ``$ALFWORLD_DATA``), unpacking the packed copy once if needed.

    Raises QevolveError (one line) when no game data and no packed copy are found.
    """
    env_root = os.environ.get("ALFWORLD_DATA")
    if env_root and _has_games(Path(env_root)):
        return Path(env_root)
    cache = default_cache_dir()
    if not _has_games(cache):
        tar = _find_tarball()
        if tar is None or not unpack:
            raise QevolveError(
                "ALFWorld game data not found: set ALFWORLD_DATA to a folder with json_2.1.1/ "
                f"(alfworld-download) or provide {TARBALL} via QEVOLVE_SHARED_DATA")
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".alfworld-", dir=cache.parent))
        try:
            with tarfile.open(tar) as tf:
                tf.extractall(tmp, filter="data")
            if cache.exists():  # a partial folder from an interrupted run, or a concurrent unpack
                if _has_games(cache):
                    shutil.rmtree(tmp, ignore_errors=True)
                    os.environ["ALFWORLD_DATA"] = str(cache)
                    return cache
                shutil.rmtree(cache)
            os.replace(tmp, cache)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    os.environ["ALFWORLD_DATA"] = str(cache)
    return cache


def split_initial_feedback(feedback: str) -> tuple[str, str]:
    """(instruction, observation) from the game's first feedback text."""
    text = feedback.replace(BANNER, "").strip()
    at = text.rfind(TASK_MARKER)
    if at < 0:
        return "", text
    return text[at + len(TASK_MARKER):].strip(), text[:at].strip()


class AlfWorldEnv(Env):
    name = "alfworld"
    default_max_steps = DEFAULT_MAX_STEPS

    def __init__(self, max_steps: int | None = None, data_dir: str | None = None, **_: Any):
        super().__init__(max_steps)
        self.data_dir = Path(data_dir) if data_dir else ensure_alfworld_data()
        self._tw = None
        self._tw_by_infos: dict[bool, Any] = {}  # policy_commands -> reusable wrapped TextWorld env
        self._plan: list[str] = []

    def game_path(self, task: Task) -> Path:
        game = task.data.get("game") or task.task_id.split(":", 1)[1]
        return self.data_dir / "json_2.1.1" / game / "game.tw-pddl"

    def _reset(self, task: Task, with_expert: bool) -> tuple[str, str]:
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

        path = self.game_path(task)
        if not path.is_file():
            raise QevolveError(f"{path}: ALFWorld game file not found (task {task.task_id})")
        gt = path.parent / "gt_traj.json"
        use_gt = with_expert and gt.is_file()
        want_plan = with_expert and not use_gt
        self._tw = None
        _drop_textworld_memo()
        tw = self._tw_by_infos.get(want_plan)
        if tw is None:
            infos = textworld.EnvInfos(won=True, policy_commands=want_plan, extras=["gamefile"])
            tw = textworld.start(str(path), infos, wrappers=[AlfredDemangler(), AlfredInfos])
            self._tw_by_infos[want_plan] = tw
        else:
            tw.load(str(path))
        self._tw = tw
        state = tw.reset()
        if with_expert:
            if use_gt:
                conv = json.loads(gt.read_text())
                self._plan = [m["value"].strip() for m in conv if m.get("from") in ("gpt", "assistant")]
            else:
                self._plan = list(state.get("policy_commands") or [])
        else:
            self._plan = []
        return split_initial_feedback(state.feedback)

    def _step(self, command: str) -> tuple[str, float, bool]:
        state, _score, done = self._tw.step(command)
        won = bool(state.get("won"))
        return state.feedback.strip(), 1.0 if won else 0.0, bool(done or won)

    def _expert_plan(self) -> list[str]:
        return list(self._plan)

    def close(self) -> None:
        self._tw = None
        envs, self._tw_by_infos = list(self._tw_by_infos.values()), {}
        for tw in envs:
            try:
                tw.close()
            except Exception:
                pass


def _drop_textworld_memo() -> None:
    """Empty TextWorld's process-wide ``Proposition`` / ``Signature`` memo (it only grows)."""
    try:
        import mementos.core

        mementos.core._memento_cache.clear()
    except (ImportError, AttributeError):
        pass
