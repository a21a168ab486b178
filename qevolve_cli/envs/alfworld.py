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
* Resets: loading a game parses its grammar (tatsu) and grounds its PDDL problem with
  fast-downward's translator — twice per state (plain and optimised for the planner), and
  TextWorld's ``PddlEnv`` builds a state in ``load`` and again in ``reset``: 1.6 s per reset, more
  than a whole episode's steps. :class:`_CachedPddlEnv` keeps, per worker process and per game
  file, the parsed ``GameLogic`` and the translator's output (an LRU of
  ``$QEVOLVE_ALFWORLD_GAME_CACHE`` games, default 32; 0 = off, the old path), and builds every
  state from it: a game's first reset translates once instead of four times, and a replay of
  the same game (the ``n_per_task`` samples of a task, evaluation reruns) translates nothing.
  States are still built fresh for each episode (``load_sas`` into the worker's own
  fast-downward library, facts from the task's initial atoms), so the initial state and every
  observation are those of a fresh load (``tests/test_envs_alfworld.py``). The worker pool routes
  a task's samples to the worker that last played it, and the rollout loop starts a task's
  samples together.
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
from collections import OrderedDict
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


def alfred_wrappers() -> tuple[type, type]:
    """ALFWorld's TextWorld wrappers ``AlfredDemangler`` and ``AlfredInfos``.

    Imported without running ``alfworld.agents.environment/__init__.py``: that file also imports
    the THOR (3-D simulator) environment, whose Mask R-CNN detector pulls in torchvision and
    torch._dynamo: 4.5 s of a worker's first reset, for classes a text rollout never uses. The
    package object exists only while its submodule is imported; a later ``import
    alfworld.agents.environment`` runs the real ``__init__`` as usual.
    """
    import importlib.util
    import sys

    name = "alfworld.agents.environment"
    sub = name + ".alfred_tw_env"
    if sub not in sys.modules and name not in sys.modules:
        import alfworld.agents

        spec = importlib.util.find_spec(name)
        if spec is None or spec.submodule_search_locations is None:
            raise QevolveError("alfworld is installed without alfworld.agents.environment (pip install alfworld==0.3.5)")
        sys.modules[name] = importlib.util.module_from_spec(spec)  # the package, its __init__ not run
        try:
            importlib.import_module(sub)
        finally:
            del sys.modules[name]
            if hasattr(alfworld.agents, "environment"):
                delattr(alfworld.agents, "environment")
    mod = sys.modules.get(sub) or importlib.import_module(sub)
    return mod.AlfredDemangler, mod.AlfredInfos


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

        AlfredDemangler, AlfredInfos = alfred_wrappers()  # noqa: N806 - classes

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
            if game_cache_size() > 0:
                tw = _CachedPddlEnv(infos)
                for wrapper in (AlfredDemangler(), AlfredInfos):  # what textworld.start does
                    tw = wrapper(tw)
                tw.load(str(path))
            else:
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


# ------------------------------------------------------------------------------ game cache
def game_cache_size() -> int:
    """Games whose parsed logic and PDDL translation a worker keeps ($QEVOLVE_ALFWORLD_GAME_CACHE, default 32)."""
    try:
        return max(0, int(os.environ.get("QEVOLVE_ALFWORLD_GAME_CACHE", "32")))
    except ValueError:
        return 32


class _Translated:
    """What loading one game file computes once: its JSON, GameLogic and fast-downward translation."""

    def __init__(self, path: str):
        import fast_downward
        from textworld.envs.pddl import logic as pddl_logic

        with open(path) as f:
            self.data = json.load(f)
        self.logic = pddl_logic.GameLogic(domain=self.data["pddl_domain"], grammar=self.data["grammar"])
        self.task, self.sas = fast_downward.pddl2sas(self.logic.domain, self.data["pddl_problem"], verbose=False)
        self._sas_replan: str | None = None

    @property
    def sas_replan(self) -> str:
        """The planner's (optimised) translation: only for games whose expert plan is asked for."""
        if self._sas_replan is None:
            import fast_downward

            _, self._sas_replan = fast_downward.pddl2sas(self.logic.domain, self.data["pddl_problem"],
                                                         verbose=False, optimize=True)
        return self._sas_replan


_GAMES: OrderedDict[str, _Translated] = OrderedDict()  # per process: game file -> translation (LRU)
_GAME_STATS = {"hits": 0, "misses": 0}


def translated(path: str) -> _Translated:
    hit = _GAMES.get(path)
    if hit is not None:
        _GAMES.move_to_end(path)
        _GAME_STATS["hits"] += 1
        return hit
    _GAME_STATS["misses"] += 1
    tr = _Translated(path)
    _GAMES[path] = tr
    while len(_GAMES) > max(1, game_cache_size()):
        _GAMES.popitem(last=False)
    return tr


def clear_game_cache() -> None:
    _GAMES.clear()


def _cached_state_class():
    """``PddlState`` built from a cached translation (textworld 1.6.2's ``PddlState.__init__``
    without its two ``pddl2sas`` calls; everything else as there)."""
    global _CachedPddlState
    if _CachedPddlState is not None:
        return _CachedPddlState
    from collections import Counter, defaultdict

    import fast_downward
    import textworld
    from textworld.envs.pddl import logic as pddl_logic
    from textworld.logic import Proposition, Variable

    class CachedPddlState(pddl_logic.PddlState):
        def __init__(self, downward_lib, tr: _Translated, replan: bool):  # mirrors PddlState.__init__
            self._facts = defaultdict(set)
            self._vars_by_name = {}
            self._vars_by_type = defaultdict(set)
            self._var_counts = Counter()
            self._logic = tr.logic
            self.downward_lib = downward_lib
            self.pddl_problem = tr.data["pddl_problem"]
            self.task, self.sas = tr.task, tr.sas
            self._actions = {a.name: a for a in self.task.actions}
            for type_ in self.task.types:
                try:
                    self._logic.types.add(textworld.logic.Type(type_.name, type_.supertype_names))
                except ValueError:
                    pass
            self.downward_lib.load_sas(self.sas.encode("utf-8"))
            if replan:  # only replan() reads it: the expert plan (policy_commands), walkthroughs
                self.sas_replan = tr.sas_replan
                self.downward_lib.load_sas_replan(self.sas_replan.encode("utf-8"))
            self.name2type = {o.name: o.type_name for o in self.task.objects}

            def _atom2proposition(atom):
                if isinstance(atom, fast_downward.translate.pddl.conditions.Atom):
                    if atom.predicate == "=":
                        return None
                    return Proposition(atom.predicate, [Variable(arg, self.name2type[arg]) for arg in atom.args])
                elif isinstance(atom, fast_downward.translate.pddl.f_expression.Assign):
                    if atom.fluent.symbol == "total-cost":
                        return None
                    name = f"{atom.expression.value}"
                    if str.isdigit(name):  # Discard distance relations.
                        return None
                    return Proposition(name, [Variable(arg, self.name2type[arg]) for arg in atom.fluent.args])

            facts = [_atom2proposition(atom) for atom in self.task.init]
            self.add_facts(list(filter(None, facts)))
            state_size = self.downward_lib.get_state_size()
            atoms = (pddl_logic.Atom * state_size)()
            self.downward_lib.get_state(atoms)
            facts = [atom.get_fact(self.name2type) for atom in atoms]
            self.add_facts([fact for fact in facts if not fact.is_negation])

    _CachedPddlState = CachedPddlState
    return CachedPddlState


_CachedPddlState = None


def _memoise_template_parsing() -> None:
    """Parse each text-generation template once per process.

    TextWorld's grammar parses the same short templates (``#intro#``, every action's command and
    feedback rule) with tatsu at every reset and step, to the same symbols every time. Memoised
    here by template text (only the ``symbols`` rule: the templates); every call gets its own deep
    copy, since ``derive`` sets the copies' contexts.
    """
    from copy import deepcopy

    from textworld.envs.pddl import textgen

    if getattr(textgen._parse_and_convert, "_qevolve_memo", False):
        return
    original = textgen._parse_and_convert
    memo: dict[str, Any] = {}

    def parse_and_convert(*args, **kwargs):
        if kwargs.get("rule_name") != "symbols" or len(args) != 1 or not isinstance(args[0], str) or kwargs.get("trace"):
            return original(*args, **kwargs)
        hit = memo.get(args[0])
        if hit is None:
            if len(memo) > 100_000:
                memo.clear()
            hit = memo[args[0]] = original(*args, **kwargs)
        return deepcopy(hit)

    parse_and_convert._qevolve_memo = True
    textgen._parse_and_convert = parse_and_convert


def _cached_env_class():
    global _CachedEnvClass
    if _CachedEnvClass is not None:
        return _CachedEnvClass
    _memoise_template_parsing()
    from textworld.core import GameState
    from textworld.envs.pddl.pddl import PddlEnv

    class CachedPddlEnv(PddlEnv):
        """textworld 1.6.2's ``PddlEnv`` whose ``load`` / ``reset`` build states from :func:`translated`."""

        def load(self, filename_or_data):
            tr = translated(str(filename_or_data))
            self._translated = tr
            self._game_file = filename_or_data
            self._game_data = tr.data
            self.walkthrough = tr.data.get("walkthrough", None)
            self._logic = tr.logic
            self._pddl_state = _cached_state_class()(self.downward_lib, tr, self._replans())
            self._entity_infos = self._get_entity_infos()

        def _replans(self) -> bool:
            return bool(self.request_infos.policy_commands) or "walkthrough" in (self.request_infos.extras or [])

        def reset(self):  # PddlEnv.reset with the state from the cache
            self._pddl_state = _cached_state_class()(self.downward_lib, self._translated, self._replans())
            self.prev_state = None
            self.state = GameState()
            self._last_action = None
            self._moves = 0
            context = {"state": self._pddl_state, "facts": list(self._pddl_state.facts), "variables": {},
                       "mapping": {}, "entity_infos": self._entity_infos}
            self.state.feedback = self._logic.grammar.derive("#intro#", context)
            self.state.raw = self.state.feedback
            self._gather_infos()
            if "walkthrough" in self.request_infos.extras:
                self.state["extra.walkthrough"] = self.walkthrough or self._pddl_state.replan(self._entity_infos)
            return self.state

    _CachedEnvClass = CachedPddlEnv
    return CachedPddlEnv


_CachedEnvClass = None


def _CachedPddlEnv(infos):  # noqa: N802 - a class factory: textworld is imported lazily
    return _cached_env_class()(infos)
