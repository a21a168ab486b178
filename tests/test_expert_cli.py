"""``qevolve expert`` as a real subprocess: a valid step table (docs/tables.md) of successful replays."""
from __future__ import annotations

import polars as pl

from qevolve_cli import react
from qevolve_cli.envs.expert import collect_expert
from qevolve_cli.schema import read_table
from tests.conftest import run_qevolve


def test_expert_textcraft_cli_writes_valid_table(tmp_path):
    out = tmp_path / "expert.parquet"
    proc = run_qevolve("expert", "--env", "textcraft", "--split", "train", "--limit", "6", "--workers", "2",
                       "--out", out, "--json", "--quiet", check=True)
    import json

    summary = json.loads(proc.stdout.strip().splitlines()[-1])  # stdout is only the JSON line
    assert len(proc.stdout.strip().splitlines()) == 1
    assert summary["tasks"] == 6 and summary["succeeded"] == 6 and summary["success_rate"] == 1.0
    df = read_table(out)
    assert df["traj_id"].n_unique() == 6 and set(df["source"]) == {"expert"} and set(df["iteration"]) == {0}
    assert set(df["split"]) == {"train"} and df["task_type"].null_count() == 0
    for traj in df.partition_by("traj_id"):
        traj = traj.sort("step")
        assert traj["done"].to_list() == [False] * (traj.height - 1) + [True]
        assert traj["reward_env"].to_list()[-1] == 1.0 and traj["reward_env"][:-1].sum() == 0
        # observation chain: o_{t+1} of step t is o of step t+1
        assert traj["next_observation"][:-1].to_list() == traj["observation"][1:].to_list()
        for a, c in zip(traj["action"], traj["command"], strict=True):
            assert a.startswith("Thought: ") and react.parse_action(a) == c


def test_expert_cli_bad_env_is_one_line_error(tmp_path):
    out = tmp_path / "x.parquet"
    proc = run_qevolve("expert", "--env", "minecraft", "--out", out)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "minecraft" in proc.stderr and not out.exists()
    proc = run_qevolve("expert", "--env", "webshop", "--split", "test_seen", "--out", out)
    assert proc.returncode == 2 and "unknown split" in proc.stderr and not out.exists()


def test_expert_cli_all_replays_failing_names_the_first_reason(tmp_path, monkeypatch):
    """Every reset fails (no WebShop server answers): one line that says why, exit 2, no table."""
    monkeypatch.setenv("QEVOLVE_WEBSHOP_URL", "http://127.0.0.1:9")
    out = tmp_path / "x.parquet"
    proc = run_qevolve("expert", "--env", "webshop", "--split", "train", "--limit", "2", "--out", out, "-q")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "no successful expert trajectory (0 failed, 2 errors; first error, webshop:" in proc.stderr
    assert "no WebShop server answers at http://127.0.0.1:9" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_collect_expert_sciworld_library_matches_gold(tmp_path):
    stats: dict = {}
    df = collect_expert("sciworld", "train", limit=2, workers=2, stats=stats)
    assert stats["succeeded"] == 2 and df["traj_id"].n_unique() == 2
    last = df.filter(pl.col("done"))
    assert last["reward_env"].to_list() == [1.0, 1.0]


def test_select_shard_partitions_tasks_exactly():
    from qevolve_cli.errors import QevolveError
    from qevolve_cli.shard import select_shard

    for n_tasks in (0, 1, 7, 10, 3554):
        tasks = list(range(n_tasks))
        for n in (1, 3, 4, 12):
            parts = [select_shard(tasks, f"{i}/{n}") for i in range(n)]
            assert sum(parts, []) == tasks  # contiguous, in order, no overlap, nothing lost
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    for bad in ("3/3", "-1/2", "1", "a/b", "0/0"):
        try:
            select_shard([1, 2], bad)
        except QevolveError as e:
            assert "--shard" in str(e)
        else:
            raise AssertionError(bad)


def test_expert_cli_shard_selects_its_block(tmp_path):
    out = tmp_path / "s.parquet"
    proc = run_qevolve("expert", "--env", "textcraft", "--limit", "5", "--shard", "1/2", "--out", out,
                       "--json", "--quiet", check=True)
    import json

    summary = json.loads(proc.stdout)
    assert summary["tasks"] == 2 and summary["shard"] == "1/2"
    from qevolve_cli.envs.registry import list_tasks

    want = {t.task_id for t in list_tasks("textcraft", "train", 5)[3:5]}
    assert set(read_table(out)["task_id"]) == want
