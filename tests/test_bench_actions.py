"""benchmarks/bench_actions.py: per-step measures of episodes played in the real lamps environment, by hand."""
from __future__ import annotations

import json

import polars as pl
import pytest

from qevolve_cli.envs.registry import make_env
from qevolve_cli.envs.splits import task_from_id
from qevolve_cli.react import FORMAT_ERROR_OBSERVATION
from qevolve_cli.schema import write_table
from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_actions")


def play(traj_id: str, task_id: str, commands: list[str | None], source: str = "self") -> list[dict]:
    """Rows of an episode of ``commands`` (None: a format error) in the real environment of ``task_id``
    (lamps, lamps-habit)."""
    name = task_id.split(":")[0]
    env = make_env(name)
    obs = env.reset(task_from_id(name, task_id))
    rows = []
    for t, c in enumerate(commands):
        if c is None:
            nxt, r, done, _ = env.skip_turn(FORMAT_ERROR_OBSERVATION)
        else:
            nxt, r, done, _ = env.step(c)
        rows.append(dict(traj_id=traj_id, env=name, task_id=task_id, split="test_seen", source=source,
                         iteration=1, step=t, instruction="turn on the lamp", observation=obs,
                         action=f"Action: {c}" if c else "nonsense", command=c, next_observation=nxt,
                         reward_env=float(r), done=bool(done)))
        obs = nxt
        if done:
            break
    return rows


def test_action_stats_by_hand(bench):
    # kitchen -> bedroom (1 step east) -> bathroom: the plan is go east, go east, turn on lamp
    task = "lamps:kitchen:bathroom"
    ok = play("ok", task, ["go east", "go east", "turn on lamp"])
    # walks through the bathroom (one step there with its lamp off), turns on the hallway's lamp (a wrong
    # room), comes back to the bathroom (a second step there), then a format error and an unknown command
    bad = play("bad", task, ["go east", "go east", "go east", "turn on lamp", "go west", None, "Done."])
    assert ok[-1]["reward_env"] == 1.0 and ok[-1]["done"] and not bad[-1]["done"]
    s = bench.action_stats(pl.DataFrame(ok + bad))
    assert (s["episodes"], s["success"], s["steps"]) == (2, 0.5, 10)
    # optimal: ok's 3; bad's first two steps and its walk back west (the third go east and the wrong turn-on
    # are not, the format error and "Done." leave the goal as far)
    assert s["optimal"] == round(6 / 10, 4)
    # in the bathroom with its lamp off: ok's turn-on, bad's go east, bad's format error and its "Done."
    assert (s["turn_on_states"], s["turn_on_taken"]) == (4, 0.25)
    f = s["failed"]
    assert (f["episodes"], f["steps"], f["turn_on"], f["turn_on_optimal"]) == (1, 7, round(1 / 7, 4), 0.0)
    assert f["top_commands"] == {"go east": 3, "turn on lamp": 1, "go west": 1, "<format error>": 1, "Done.": 1}


def test_looks_after_a_lamp_and_where_the_goal_is_lost_by_hand(bench):
    """lamps-habit, a tight task (kitchen -> bedroom, bathroom, hallway: 6 commands, budget 7): one look after
    a lamp still succeeds, a second one puts the goal out of reach."""
    task = "lamps-habit:kitchen:bedroom+bathroom+hallway"
    one = play("one", task, ["go east", "turn on lamp", "look", "go east", "turn on lamp", "go east", "turn on lamp"])
    two = play("two", task, ["go east", "turn on lamp", "look", "look", "go east", "turn on lamp", "go east"])
    assert one[-1]["reward_env"] == 1.0 and two[-1]["done"] and two[-1]["reward_env"] == 0.0
    s = bench.action_stats(pl.DataFrame(one + two))
    # after each lamp with more to go: one's look and go east, two's look and go east (its last step)
    assert (s["look_after_states"], s["look_after"]) == (4, 0.5)
    assert s["lost"] == {"episodes": 1, "commands": {"look": 1}}  # two's second look, not its first
    assert bench.action_stats(pl.DataFrame(one))["lost"] == {"episodes": 0, "commands": {}}
    # lamps' 16 steps: a format error and a wrong turn cost nothing that cannot be made up
    ok = play("ok", "lamps:kitchen:bathroom", [None, "go east", "go east", "go east", "go west", "turn on lamp"])
    assert ok[-1]["reward_env"] == 1.0
    s = bench.action_stats(pl.DataFrame(ok))
    assert s["lost"]["episodes"] == 0 and s["look_after_states"] == 0 and s["look_after"] is None


def test_cli_reads_a_run_directory(bench, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "iter_0").mkdir(parents=True)
    (run / "compare" / "eval").mkdir(parents=True)
    rows = play("ok", "lamps:kitchen:bathroom", ["go east", "go east", "turn on lamp"])
    write_table(pl.DataFrame(rows), run / "iter_0" / "eval_test_seen.parquet")
    write_table(pl.DataFrame(rows), run / "compare" / "eval" / "best_of_n_test_unseen.parquet")
    out = bench.main([str(run)])
    assert set(out[str(run)]) == {"sft/test_seen", "best_of_n/test_unseen"}
    assert json.loads(capsys.readouterr().out) == out
    # the demonstrations are measured too when the run has them
    demo = play("d", "lamps:kitchen:bathroom", ["go east", "go east", "turn on lamp"], source="expert")
    write_table(pl.DataFrame(demo), run / "expert.parquet")
    out = bench.main([str(run)])
    assert set(out[str(run)]) == {"expert", "sft/test_seen", "best_of_n/test_unseen"}
    assert out[str(run)]["expert"]["episodes"] == 1 and out[str(run)]["expert"]["success"] == 1.0
    with pytest.raises(SystemExit):
        bench.main([str(tmp_path / "empty")])
    # an environment without an exact solver: one line naming the table and the column, exit 2
    other = tmp_path / "tc"
    (other / "iter_0").mkdir(parents=True)
    write_table(pl.DataFrame(rows).with_columns(pl.lit("textcraft").alias("env"), pl.lit("0").alias("task_id")),
                other / "iter_0" / "eval_test_seen.parquet")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        bench.main([str(other)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and "no exact solver for environment 'textcraft'" in err[-1]
    assert "eval_test_seen.parquet" in err[-1] and "Traceback" not in "\n".join(err)
