"""Exact values for environments with a solver: the value sources ``oracle`` and ``tabular_iql`` of
``qevolve label --value-source`` (docs/critic.md, "Oracle values").

Every trajectory of a step table is replayed from its task's reset with its own commands (a format
error is a skipped turn, as in the rollout), and the replay is checked against the table's
``next_observation``: a table from another version of the environment is refused by name. Each
state ``s_t`` (the house, the lamps that are on, the steps left) then gets

* ``oracle``: the optimal value of the environment reward, ``V*(s) = gamma^(d - 1)`` where ``d`` is
  the fewest commands that finish the task from ``s`` (:func:`qevolve_cli.envs.builtin.optimal_steps`),
  and 0 when ``d`` exceeds the steps left. The reward is 1 on the finishing step and 0 otherwise, so
  the TD error ``r + gamma V*(s') - V*(s)`` of an optimal command is 0 and of any other < 0: GAE over
  ``V*`` gives the *exact* advantages ``A* <= 0`` (the critic's ceiling);
* ``tabular_iql``: the fixed point of the critic's own losses (weighted IQL, expectile ``m``) on the
  table's transitions with these exact states
  (:func:`qevolve_cli.tabular.tabular_iql`): what a perfect function approximator would learn
  from this data, with the critic's reward (``r_env + r_aux`` by default, the paper's; ``r_env``
  alone as the alternative).

The value after a terminal step is 0 (``next_value``). Only environments in :data:`SOLVERS` have a
solver; anything else is refused with the list.
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import polars as pl

from qevolve_cli.env_names import BUILTIN_ENVS
from qevolve_cli.errors import QevolveError, TableError

SOLVERS = BUILTIN_ENVS
"""The environments with an exact solver: the built-in ones (``envs/builtin.py``)."""
VALUE_SOURCES = ("critic", "oracle", "tabular_iql")
FIT_REWARDS = ("env_aux", "env")


def has_solver(env: str) -> bool:
    """Whether ``env`` has an exact solver (the oracle value source and compare's oracle row)."""
    return env in SOLVERS


def oracle_value(d: int, steps_left: int, gamma: float) -> float:
    """V* of a state ``d`` commands from the goal with ``steps_left`` turns left (0 when out of reach,
    and 0 at the goal itself: nothing more to earn)."""
    if d <= 0 or d > steps_left:
        return 0.0
    return float(gamma ** (d - 1))


def replay(df: pl.DataFrame, source: Any = None, max_steps: int | None = None) -> list[dict[str, Any]]:
    """One record per row (the frame's order; trajectories contiguous and in step order):
    ``state`` / ``next_state`` (hashable: targets, room, lamps on, steps left) and ``d`` / ``next_d``
    (fewest commands to finish) with ``left`` / ``next_left`` (steps left), from a replay of the
    trajectory's commands in a fresh environment."""
    from qevolve_cli.envs.builtin import optimal_steps
    from qevolve_cli.envs.expert import EXPERT_MAX_STEPS
    from qevolve_cli.envs.registry import MAX_STEPS, make_env
    from qevolve_cli.envs.splits import task_from_id
    from qevolve_cli.react import FORMAT_ERROR_OBSERVATION

    envs = sorted(set(df["env"].unique().to_list())) if df.height else []
    bad = [e for e in envs if not has_solver(e)]
    if bad:
        raise TableError(source, "env", f"no exact solver for environment {bad[0]!r} (oracle values exist for "
                                        f"{', '.join(SOLVERS)})")
    out: list[dict[str, Any]] = []
    has_source = "source" in df.columns
    cols = df.select("env", "traj_id", "task_id", "step", "command", "next_observation", "done",
                     pl.col("source") if has_source else pl.lit("self").alias("source")).rows()
    env_objs: dict[tuple[str, int], Any] = {}
    env = None
    cur = None
    for name, traj, task_id, step, command, next_obs, done, src in cols:
        if traj != cur:
            if step != 0:
                raise TableError(source, "step", f"trajectory {traj!r} does not start at step 0")
            # expert episodes were played with the expert's long step limit (envs/expert.py), self-play
            # episodes with the rollout's
            limit = EXPERT_MAX_STEPS if src == "expert" else (max_steps or MAX_STEPS[name])
            env = env_objs.get((name, limit)) or env_objs.setdefault((name, limit), make_env(name, max_steps=limit))
            try:
                env.reset(task_from_id(name, task_id))
            except QevolveError as e:
                raise TableError(source, "task_id", f"trajectory {traj!r}: {e}") from None
            cur = traj
        targets = env.targets
        room, lit = env.state()
        left = env._episode_max_steps - env.steps
        d = optimal_steps(room, lit, targets, env.ordered)
        state = (targets, room, lit, left)
        if env.done:
            raise TableError(source, "done", f"trajectory {traj!r} goes on after its episode ended (step {step})")
        if command is None:
            obs, _r, env_done, _ = env.skip_turn(FORMAT_ERROR_OBSERVATION)
        else:
            obs, _r, env_done, _ = env.step(command)
        if obs != next_obs or bool(env_done) != bool(done):
            raise TableError(source, "next_observation",
                             f"trajectory {traj!r} step {step}: replaying {command!r} gives {obs!r} "
                             f"(done={env_done}), the table has {next_obs!r} (done={done}): not a table of this "
                             f"version of {name!r}, or its step limit differs (--set oracle_max_steps=N)")
        room2, lit2 = env.state()
        left2 = env._episode_max_steps - env.steps
        nd = optimal_steps(room2, lit2, targets, env.ordered)
        out.append({"state": state, "next_state": (targets, room2, lit2, left2), "d": d, "left": left,
                    "next_d": nd, "next_left": left2, "command": command or "<format error>"})
    return out


def oracle_values(df: pl.DataFrame, gamma: float, source: Any = None,
                  max_steps: int | None = None) -> pl.DataFrame:
    """``df`` with ``value`` = V*(s_t) and ``next_value`` = V*(s_{t+1}) (0 after a terminal step)."""
    recs = replay(df, source, max_steps)
    v = [oracle_value(r["d"], r["left"], gamma) for r in recs]
    nv = [oracle_value(r["next_d"], r["next_left"], gamma) for r in recs]
    done = df["done"].to_list()
    nv = [0.0 if dn else x for x, dn in zip(nv, done, strict=True)]
    return df.with_columns(pl.Series("value", v, pl.Float32), pl.Series("next_value", nv, pl.Float32))


def tabular_iql_values(df: pl.DataFrame, gamma: float, expectile: float, fit_reward: str = "env_aux",
                       weighted: bool = True, source: Any = None,
                       max_steps: int | None = None) -> pl.DataFrame:
    """``df`` with ``value`` / ``next_value`` from exact weighted IQL on its own transitions (exact
    states from the replay). ``fit_reward``: ``env_aux`` (r_env + r_aux, the paper's critic) or
    ``env``; ``weighted``: the step weights ``w_t`` (column ``weight``) or 1."""
    from qevolve_cli.tabular import tabular_iql

    if fit_reward not in FIT_REWARDS:
        raise QevolveError(f"fit_reward: unknown {fit_reward!r} (choose from {', '.join(FIT_REWARDS)})")
    need = ["reward_env"] + (["reward_aux"] if fit_reward == "env_aux" else []) + (["weight"] if weighted else [])
    for c in need:
        if c not in df.columns:
            raise TableError(source, c, "missing column: tabular IQL values need the labels (run label first)")
    recs = replay(df, source, max_steps)
    r = df["reward_env"].cast(pl.Float64).to_list()
    if fit_reward == "env_aux":
        r = [a + b for a, b in zip(r, df["reward_aux"].cast(pl.Float64).to_list(), strict=True)]
    done = df["done"].to_list()
    w = df["weight"].cast(pl.Float64).to_list() if weighted else None
    transitions: list[tuple[Hashable, Hashable, float, Hashable, bool]] = [
        (rec["state"], rec["command"], ri, rec["next_state"], bool(dn))
        for rec, ri, dn in zip(recs, r, done, strict=True)]
    V, _Q = tabular_iql(transitions, gamma, expectile, weights=w, tol=1e-9)
    v = [V.get(rec["state"], 0.0) for rec in recs]
    nv = [0.0 if dn else V.get(rec["next_state"], 0.0) for rec, dn in zip(recs, done, strict=True)]
    return df.with_columns(pl.Series("value", v, pl.Float32), pl.Series("next_value", nv, pl.Float32))
