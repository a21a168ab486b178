"""``qevolve import --format eto``: ETO / ShareGPT conversations -> step table (thoughts kept)."""
from __future__ import annotations

import json

from qevolve_cli.schema import read_table
from tests.conftest import run_qevolve

PROMPT = "Interact with a household to solve a task. ... Thought: ...\nAction: ..."
RECORD = {
    "id": "pick_and_place_simple-Book-None-Desk-310/trial_1",
    "conversations": [
        {"from": "human", "value": PROMPT},
        {"from": "gpt", "value": "OK"},
        {"from": "human", "value": "Observation: You are in the middle of a room. You see a desk 1.\n"
                                   "Your task is to: put a book in desk."},
        {"from": "gpt", "value": "Thought: The book may be on the shelf.\nAction: go to shelf 1"},
        {"from": "human", "value": "Observation: On the shelf 1, you see a book 1."},
        {"from": "gpt", "value": "I will take it"},  # a format error is kept, command null
        {"from": "human", "value": "Observation: Invalid format: no action was found."},
        {"from": "gpt", "value": "Thought: Take the book.\nAction: take book 1 from shelf 1"},
    ],
}


def test_import_sharegpt_keeps_thoughts_and_chains_observations(tmp_path):
    src = tmp_path / "sft.json"
    src.write_text(json.dumps([RECORD]))
    out = tmp_path / "t.parquet"
    run_qevolve("import", "--format", "eto", src, "--env", "alfworld", "--out", out, check=True)
    df = read_table(out).sort("step")
    assert df.height == 3 and set(df["source"]) == {"expert"}
    assert df["task_id"][0] == "alfworld:pick_and_place_simple-Book-None-Desk-310/trial_1"
    assert df["instruction"][0] == "put a book in desk."
    assert df["observation"][0].startswith("You are in the middle of a room")
    assert df["action"][0] == "Thought: The book may be on the shelf.\nAction: go to shelf 1"
    assert df["command"].to_list() == ["go to shelf 1", None, "take book 1 from shelf 1"]
    assert df["next_observation"][0] == "On the shelf 1, you see a book 1."
    assert df["observation"][1] == df["next_observation"][0]
    assert df["done"].to_list() == [False, False, True] and df["reward_env"].to_list() == [0.0, 0.0, 1.0]


def test_import_role_content_variant_matches(tmp_path):
    conv = [{"role": {"human": "user", "gpt": "assistant"}[m["from"]], "content": m["value"]}
            for m in RECORD["conversations"]]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([RECORD]))
    b.write_text(json.dumps([{"id": RECORD["id"], "messages": conv}]))
    run_qevolve("import", a, "--env", "alfworld", "--out", tmp_path / "a.parquet", check=True)
    run_qevolve("import", b, "--env", "alfworld", "--out", tmp_path / "b.parquet", check=True)
    assert read_table(tmp_path / "a.parquet").equals(read_table(tmp_path / "b.parquet"))


def test_import_bad_json_names_file_and_record(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"id": 1, "conversations": [')
    out = tmp_path / "o.parquet"
    p = run_qevolve("import", bad, "--env", "alfworld", "--out", out)
    assert p.returncode == 2 and "bad.json: not valid JSON" in p.stderr and p.stderr.count("\n") == 1
    bad.write_text(json.dumps([RECORD, {"id": "x7", "conversations": [{"from": "human"}]}]))
    p = run_qevolve("import", bad, "--env", "alfworld", "--out", out)
    assert p.returncode == 2 and "record 1 (id 'x7'): conversations[0]" in p.stderr and not out.exists()
    bad.write_text(json.dumps([{"id": "y", "conversations": [{"from": "human", "value": "hi"}]}]))
    p = run_qevolve("import", bad, "--env", "alfworld", "--out", out)
    assert p.returncode == 2 and "record 0 (id 'y'): no assistant turn" in p.stderr and not out.exists()
