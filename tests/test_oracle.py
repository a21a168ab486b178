"""Oracle values (``qevolve label --value-source oracle|tabular_iql``) and the ``lamps-hard`` and
``lamps-habit`` testbeds.

The exact solver is checked against a breadth-first search over the real environment's own
``step`` (deep copies of the env), the oracle value table against a hand-solved task, and the pair
"reward that V is fit on / reward that GAE uses" against hand-computed advantages of a penalised step.
"""
from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path

import polars as pl
import pytest

from qevolve_cli.env_names import BUILTIN_ENVS
from qevolve_cli.envs.builtin import (
    HABIT_LOOK,
    HABIT_LOOSE_SLACK,
    HABIT_TIGHT_SLACK,
    HARD_SLACK,
    ROOMS,
    VARIANTS,
    budget_of,
    build_splits,
    habit_plan_of,
    optimal_steps,
    parse_task_id,
    plan_of,
)
from qevolve_cli.envs.oracle import oracle_value, oracle_values, tabular_iql_values
from qevolve_cli.envs.registry import make_env
from qevolve_cli.envs.splits import task_from_id
from qevolve_cli.errors import TableError
from qevolve_cli.labeling import LabelConfig, label_frame

COMMANDS = ("go east", "go west", "turn on lamp", "turn off lamp")
G = 0.95


def bfs_distance(env) -> int:
    """Fewest commands to success from the env's current state, by search over the env itself."""
    seen = {env.state()}
    frontier = [env]
    for depth in range(1, 40):
        nxt = []
        for e in frontier:
            for c in COMMANDS:
                e2 = copy.deepcopy(e)
                e2.done, e2._episode_max_steps = False, 10_000
                _obs, r, done, info = e2.step(c)
                if info["won"]:
                    return depth
                if e2.state() not in seen:
                    seen.add(e2.state())
                    nxt.append(e2)
        frontier = nxt
    raise AssertionError("no solution found")


@pytest.mark.parametrize("env_name", ["lamps", "lamps-hard", "lamps-habit"])
def test_solver_matches_search_over_the_environment(env_name: str) -> None:
    ids = build_splits(env_name)["train"][:3]
    checked = 0
    for tid in ids:
        env = make_env(env_name)
        env.reset(task_from_id(env_name, tid))
        _s, targets = parse_task_id(tid, env_name)
        # from the start and from states with some lamps on (lit by hand: any subset, any room)
        for k in range(len(targets) + 1):
            for lit in itertools.combinations(ROOMS, k):
                for room in ROOMS[::4]:
                    e = copy.deepcopy(env)
                    e.room, e.lamps = room, {r: r in lit for r in ROOMS}
                    if all(e.lamps[t] for t in targets):
                        continue
                    assert optimal_steps(room, set(lit), targets, e.ordered) == bfs_distance(e), (tid, room, lit)
                    checked += 1
    assert checked > 30


def test_lamps_hard_expert_is_optimal_and_budgets_are_tight() -> None:
    splits = build_splits("lamps-hard")
    assert {k: len(v) for k, v in splits.items()} == {"train": 2544, "test_seen": 48, "test_unseen": 96}
    # held-out target sets never appear in train or test_seen
    sets = {k: {frozenset(parse_task_id(i, "lamps-hard")[1]) for i in v} for k, v in splits.items()}
    assert not sets["test_unseen"] & (sets["train"] | sets["test_seen"])
    for tid in splits["test_seen"]:
        start, targets = parse_task_id(tid, "lamps-hard")
        assert len(plan_of(start, targets)) == optimal_steps(start, set(), targets, ordered=True)
        env = make_env("lamps-hard")
        env.reset(task_from_id("lamps-hard", tid))
        assert env._episode_max_steps == len(plan_of(start, targets)) + HARD_SLACK
        assert f"in at most {env._episode_max_steps} steps" in env.instruction


def play(env_name: str, task_id: str, commands: list[str]) -> tuple[float, int]:
    """(final reward, steps played) of ``commands`` in a fresh environment, stopping at the episode's end."""
    env = make_env(env_name)
    env.reset(task_from_id(env_name, task_id))
    r, n = 0.0, 0
    for c in commands:
        _obs, r, done, _ = env.step(c)
        n += 1
        if done:
            break
    return r, n


def with_habit(start: str, targets: tuple[str, ...]) -> list[str]:
    """The optimal plan with a ``look`` after every lamp but the last: the habit, kept every time."""
    out, lamps = [], 0
    for c in plan_of(start, targets):
        out.append(c)
        lamps += c == "turn on lamp"
        if c == "turn on lamp" and lamps < len(targets):
            out.append("look")
    return out


def test_lamps_habit_expert_keeps_the_habit_and_budgets_split_tight_and_loose() -> None:
    splits = build_splits("lamps-habit")
    assert {k: len(v) for k, v in splits.items()} == {"train": 2544, "test_seen": 48, "test_unseen": 96}
    sets = {k: {frozenset(parse_task_id(i, "lamps-habit")[1]) for i in v} for k, v in splits.items()}
    assert not sets["test_unseen"] & (sets["train"] | sets["test_seen"])
    slack = {HABIT_TIGHT_SLACK: 0, HABIT_LOOSE_SLACK: 0}
    looks = opportunities = 0
    ids = list(splits["train"][:300]) + list(splits["test_seen"]) + list(splits["test_unseen"])
    for tid in ids:
        start, targets = parse_task_id(tid, "lamps-habit")
        plan, expert = plan_of(start, targets), habit_plan_of(start, targets, "lamps-habit")
        budget = budget_of(start, targets, "lamps-habit")
        slack[budget - len(plan)] += 1
        # the expert is the optimal plan with looks after lamps 1 and 2 only
        assert [c for c in expert if c != "look"] == plan
        assert all(expert[i - 1] == "turn on lamp" for i, c in enumerate(expert) if c == "look")
        assert expert[-1] == "turn on lamp"
        looks += expert.count("look")
        opportunities += len(targets) - 1
        # under the budget the expert succeeds unless it looks twice on a tight task; the optimal plan fits
        assert play("lamps-habit", tid, expert)[0] == float(len(expert) <= budget), (tid, expert, budget)
        assert play("lamps-habit", tid, plan)[0] == 1.0
        env = make_env("lamps-habit")
        env.reset(task_from_id("lamps-habit", tid))
        assert env._episode_max_steps == budget and f"in at most {budget} steps" in env.instruction
        # keeping the habit every time (two looks) passes the loose budgets and fails the tight ones
        habit = with_habit(start, targets)
        assert habit.count("look") == 2
        assert play("lamps-habit", tid, habit)[0] == (1.0 if budget - len(plan) >= 2 else 0.0)
    # the halves are even, and the expert's plan looks at HABIT_LOOK's rate (a sha1 draw per task and lamp)
    assert abs(slack[HABIT_TIGHT_SLACK] - slack[HABIT_LOOSE_SLACK]) < 0.15 * len(ids)
    assert abs(looks / opportunities - HABIT_LOOK) < 0.05
    # lamps-hard's expert and budgets are unchanged by the habit variant; every variant is a built-in env
    assert tuple(VARIANTS) == BUILTIN_ENVS
    s, t = parse_task_id(splits["train"][0], "lamps-habit")
    assert habit_plan_of(s, t, "lamps-hard") == plan_of(s, t)


def test_lamps_habit_demonstrations_keep_the_habit_and_its_oracle_advantage_is_negative() -> None:
    """collect_expert drops the demonstrations that ran out of steps (two looks on a tight task); the kept ones
    still look after about 74 % of the lamps; GAE over V* gives each look A* < 0 and every other command 0,
    and a dropped demonstration's second look leads to a state with V* = 0 (out of reach within the budget)."""
    from qevolve_cli.envs.expert import collect_expert

    stats: dict = {}
    df = collect_expert("lamps-habit", limit=120, stats=stats)
    kinds = {"dropped": 0, "kept": 0}
    for tid in build_splits("lamps-habit")["train"][:120]:
        start, targets = parse_task_id(tid, "lamps-habit")
        fits = len(habit_plan_of(start, targets, "lamps-habit")) <= budget_of(start, targets, "lamps-habit")
        kinds["kept" if fits else "dropped"] += 1
        assert (df["task_id"] == tid).any() == fits
    assert stats["succeeded"] == kinds["kept"] and stats["failed"] == kinds["dropped"] > 10
    after_lamp = df.filter(pl.col("observation").str.starts_with("You turn on the lamp")
                           & ~pl.col("observation").str.contains("All the lamps"))
    rate = (after_lamp["command"] == "look").mean()
    assert 0.65 < rate < 0.85, rate
    assert (df["command"] == "look").sum() == sum(
        habit_plan_of(*parse_task_id(t, "lamps-habit"), "lamps-habit").count("look") for t in df["task_id"].unique())
    v = oracle_values(df, G)
    adv = [r + G * (0.0 if d else nv) - vv
           for r, nv, vv, d in zip(v["reward_env"], v["next_value"], v["value"], v["done"], strict=True)]
    for c, a in zip(df["command"], adv, strict=True):
        assert (a < -0.01) if c == "look" else abs(a) < 1e-6, (c, a)
    # a dropped demonstration: its second look on a tight task leaves the goal out of reach (V* = 0)
    tid = next(t for t in build_splits("lamps-habit")["train"][:120] if not (df["task_id"] == t).any())
    failed = collect_expert("lamps-habit", tasks=[task_from_id("lamps-habit", tid, "train")], keep_failed=True)
    fv = oracle_values(failed, G)
    looks = fv.filter(pl.col("command") == "look")
    assert looks.height == 2 and looks["next_value"][1] == 0.0 and looks["value"][1] > 0.5
    assert failed["reward_env"].sum() == 0.0 and failed.height == budget_of(*parse_task_id(tid, "lamps-habit"),
                                                                            "lamps-habit")


def test_lamps_hard_lights_targets_in_order_only() -> None:
    env = make_env("lamps-hard")
    env.reset(task_from_id("lamps-hard", "lamps-hard:kitchen:bathroom+bedroom+hallway"))
    env.step("go east")  # bedroom: the second target, before the first
    obs, *_ = env.step("turn on lamp")
    assert obs.startswith("Nothing happens.") and not env.lamps["bedroom"]
    env.step("go east")
    env.step("turn on lamp")  # bathroom: the first
    env.step("go west")
    obs, *_ = env.step("turn on lamp")
    assert env.lamps["bedroom"] and not obs.startswith("Nothing")


def replay_table(task_id: str, commands: list[str | None], env_name: str = "lamps-hard") -> pl.DataFrame:
    """A step table written by playing ``commands`` (None = a format error) in the real environment."""
    from qevolve_cli.react import FORMAT_ERROR_OBSERVATION

    env = make_env(env_name)
    obs = env.reset(task_from_id(env_name, task_id))
    rows = []
    for t, c in enumerate(commands):
        nobs, r, done, _ = env.step(c) if c is not None else env.skip_turn(FORMAT_ERROR_OBSERVATION)
        rows.append(dict(traj_id="t0", env=env_name, task_id=task_id, split="train", source="self", iteration=1,
                         step=t, instruction=env.instruction, observation=obs,
                         action=f"Thought: x\nAction: {c}" if c else "Thought: x", command=c,
                         next_observation=nobs, reward_env=float(r), done=done))
        obs = nobs
        if done:
            break
    return pl.DataFrame(rows, schema_overrides={"step": pl.Int32, "iteration": pl.Int32, "reward_env": pl.Float32})


def test_oracle_values_on_a_hand_solved_task() -> None:
    # kitchen(0) -> bedroom(1), hallway(3), bathroom(2): plan east, on, east, east, on, west, on = 7; budget 9
    tid = "lamps-hard:kitchen:bedroom+hallway+bathroom"
    cmds = ["go west", None, "go east", "turn on lamp", "go east", "go east", "turn on lamp", "go west",
            "turn on lamp"]
    df = replay_table(tid, cmds)
    assert df.height == 9 and df["done"][-1] and df["reward_env"][-1] == 1.0
    v = oracle_values(df, G)
    # d before each step: 7 (wall), 7 (format error), 7, 6, 5, 4, 3, 2, 1; steps left 9 .. 1
    # the wall and the format error each cost a step of the budget: after them d = 7 = steps left
    d = [7, 7, 7, 6, 5, 4, 3, 2, 1]
    assert v["value"].to_list() == pytest.approx([G ** (x - 1) for x in d], abs=1e-6)
    assert v["next_value"].to_list() == pytest.approx([G ** (x - 1) for x in d[1:]] + [0.0], abs=1e-6)
    out, _ = label_frame(df, LabelConfig(value_source="oracle", retrospective=False))
    a = out["advantage"].to_list()
    # GAE (lambda 0.95) over V*: the two wasted turns are negative, every later step exactly 0
    delta0 = G * G ** 6 - G ** 6
    assert a[2:] == pytest.approx([0.0] * 7, abs=1e-6)
    assert a[1] == pytest.approx(delta0, abs=1e-6) and a[0] == pytest.approx(delta0 + G * 0.95 * delta0, abs=1e-6)
    # a third wasted step puts the task out of reach: V* = 0 after it
    late = oracle_values(replay_table(tid, ["go west", "go west", "go west"]), G)
    assert late["value"].to_list() == pytest.approx([G ** 6] * 3, abs=1e-6)
    assert late["next_value"].to_list() == pytest.approx([G ** 6, G ** 6, 0.0], abs=1e-6)
    assert oracle_value(3, 2, G) == 0.0 and oracle_value(0, 5, G) == 0.0


def test_oracle_refuses_a_table_of_another_environment_version(tmp_path: Path) -> None:
    df = replay_table("lamps-hard:kitchen:bedroom+hallway+bathroom", ["go east", "turn on lamp"])
    bad = df.with_columns(pl.Series("next_observation", ["You are somewhere else.", df["next_observation"][1]]))
    with pytest.raises(TableError) as e:
        oracle_values(bad, G, source=tmp_path / "x.parquet")
    assert "next_observation" in str(e.value) and "x.parquet" in str(e.value)
    with pytest.raises(TableError, match="no exact solver"):
        oracle_values(df.with_columns(pl.lit("textcraft").alias("env")), G)


def test_fit_reward_and_gae_reward_are_a_tested_pair() -> None:
    """V fit on r_env + r_aux with GAE on r_env (the paper's pair) refunds a penalty: a wasted step that
    drew r_aux < 0 gets A = gamma V(s') - V(s) with V(s') = V(s) + (the penalty V expects to avoid). With V
    fit on r_env (the consistent pair) the same step's advantage is < 0; GAE on r_env + r_aux charges it."""
    tid = "lamps-hard:kitchen:bedroom+hallway+bathroom"
    plan = ["go east", "turn on lamp", "go east", "go east", "turn on lamp", "go west", "turn on lamp"]
    # one trajectory that walks into the wall first (a penalised, wasted step), one that does not
    trajs = [replay_table(tid, ["go west", *plan]), replay_table(tid, plan)]
    df = pl.concat([t.with_columns(pl.lit(f"t{i}").alias("traj_id")) for i, t in enumerate(trajs)])
    cfg = LabelConfig(retrospective=True)
    lab, _ = label_frame(df, cfg)
    assert lab.filter((pl.col("traj_id") == "t0") & (pl.col("step") == 0))["aux_kind"][0] == "invalid"

    def first_adv(fit: str, advantage: str) -> float:
        v = tabular_iql_values(lab, G, 0.7, fit_reward=fit, weighted=False)
        out, _ = label_frame(v.drop("reward_aux", "aux_kind", "success", "weight"),
                             LabelConfig(advantage=advantage, retrospective=True))
        return out.filter((pl.col("traj_id") == "t0") & (pl.col("step") == 0))["advantage"][0]

    refund = first_adv("env_aux", "gae")
    consistent = first_adv("env", "gae")
    charged = first_adv("env_aux", "gae_aux")
    assert consistent < 0 and charged < 0
    assert refund > consistent  # the refund: the paper's pair credits the penalised step above its true value
    assert math.isfinite(refund)
