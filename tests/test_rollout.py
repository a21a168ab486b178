"""`qevolve rollout`: real rollouts of a tiny model on TextCraft and ScienceWorld (subprocess CLI runs),
seeded reproducibility, resume after a kill, context truncation, the OpenAI-compatible backend
against a local server, and vLLM on GPU."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import polars as pl
import pytest

from tests.conftest import ROOT, qevolve_env, run_qevolve, send_json

FAST = ["--max-new-tokens", "24", "--workers", "2", "--envs-per-worker", "2", "-q"]


def _react_model(tmp_path_factory, tiny_model_dir: Path) -> Path:
    """The tiny model taught the ReAct format (so rollouts really step the envs); built once per session."""
    out = tmp_path_factory.getbasetemp() / "react_model"
    if not (out / "config.json").exists():
        from qevolve_cli.rollout.warm import react_tune

        react_tune(tiny_model_dir, out, ["textcraft", "sciworld"])
    return out


@pytest.fixture(scope="session")
def react_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    return _react_model(tmp_path_factory, tiny_model_dir)


def _check_table(path: Path, env: str, n_traj: int, max_steps: int, iteration: int) -> pl.DataFrame:
    from qevolve_cli import schema
    from qevolve_cli.react import FORMAT_ERROR_OBSERVATION

    df = schema.read_table(path)  # validates: contiguous steps, done only last, no duplicates
    assert schema.schema_version(path) == schema.SCHEMA_VERSION
    assert df["traj_id"].n_unique() == n_traj
    assert set(df["env"]) == {env} and set(df["source"]) == {"self"} and set(df["iteration"]) == {iteration}
    per = df.group_by("traj_id").agg(pl.len().alias("n"), pl.col("done").last().alias("last_done"),
                                     pl.col("done").sum().alias("n_done"))
    assert per["n"].max() <= max_steps
    assert per["last_done"].all() and (per["n_done"] == 1).all(), "every episode ends with exactly one done"
    # format errors never reach the env; parsed commands do
    fmt = df.filter(pl.col("command").is_null())
    assert (fmt["next_observation"] == FORMAT_ERROR_OBSERVATION).all()
    stepped = df.filter(pl.col("command").is_not_null())
    assert stepped.height > 0, "the ReAct-tuned model should produce parsable actions"
    assert (stepped["next_observation"] != FORMAT_ERROR_OBSERVATION).all()
    # observation of step t+1 is next_observation of step t
    for _, g in df.sort(["traj_id", "step"]).group_by("traj_id"):
        assert g["observation"].to_list()[1:] == g["next_observation"].to_list()[:-1]
    # rewards are episodic: zero before the last step
    assert (df.filter(~pl.col("done"))["reward_env"] == 0).all()
    assert df["error"].null_count() == df.height
    # the turns left before the step limit (the time input of a critic with time_input steps_left)
    assert df["steps_left"].dtype == pl.Int32 and (df["steps_left"] == max_steps - df["step"]).all()
    return df


@pytest.fixture(scope="module")
def textcraft_run(tmp_path_factory, react_model_dir) -> Path:
    out = tmp_path_factory.mktemp("tc") / "self.parquet"
    run_qevolve("rollout", "--env", "textcraft", "--policy", react_model_dir, "--split", "train", "--max-tasks", "3",
                "--n-per-task", "2", "--max-steps", "4", "--seed", "7", "--iteration", "2", "--temperature", "1.0",
                "--out", out, *FAST, check=True)
    return out


def test_rollout_textcraft_table(textcraft_run: Path) -> None:
    df = _check_table(textcraft_run, "textcraft", n_traj=6, max_steps=4, iteration=2)
    assert set(df["split"]) == {"train"}
    assert sorted(df["sample"].unique().to_list()) == [0, 1]
    assert df.group_by("task_id").agg(pl.col("traj_id").n_unique())["traj_id"].to_list() == [2, 2, 2]
    assert not df["truncated"].any()
    # the instruction is the env's task (TextCraft "craft ..." goal), shared by all steps of a trajectory
    assert (df.group_by("traj_id").agg(pl.col("instruction").n_unique())["instruction"] == 1).all()
    cfg = (textcraft_run.parent / "self.parquet.config.yaml").read_text()
    assert "seed: 7" in cfg and "temperature_used: 1.0" in cfg
    assert not (textcraft_run.parent / "self.parquet.partial").exists()


def test_rollout_same_seed_same_table(textcraft_run: Path, react_model_dir: Path, tmp_path: Path) -> None:
    again, other = tmp_path / "again.parquet", tmp_path / "other.parquet"
    common = ["rollout", "--env", "textcraft", "--policy", react_model_dir, "--split", "train", "--max-tasks", "3",
              "--n-per-task", "2", "--max-steps", "4", "--iteration", "2", "--temperature", "1.0", *FAST]
    # a different batch layout (1 worker x 1 env: one episode at a time) must not change a seeded trajectory
    run_qevolve(*common, "--seed", "7", "--out", again, "--workers", "1", "--envs-per-worker", "1", check=True)
    run_qevolve(*common, "--seed", "8", "--out", other, check=True)
    a, b, c = (pl.read_parquet(p).sort(["traj_id", "step"]) for p in (textcraft_run, again, other))
    assert a.equals(b), "same seed -> same table"
    assert a["action"].to_list() != c["action"].to_list(), "another seed samples other actions"


def test_rollout_shards_merge_to_the_unsharded_run(textcraft_run: Path, react_model_dir: Path, tmp_path: Path) -> None:
    """Two `--shard I/2` runs (another worker layout) = the unsharded run row for row: same trajectory ids,
    seeds (sampled actions), observations and rewards; `label` of the shards = `label` of the whole run."""
    from qevolve_cli.labeling import label_tables

    full = pl.read_parquet(textcraft_run)
    shards = [tmp_path / f"shard_{i}.parquet" for i in range(2)]
    for i, out in enumerate(shards):
        res = run_qevolve("rollout", "--env", "textcraft", "--policy", react_model_dir, "--split", "train",
                          "--max-tasks", "3", "--n-per-task", "2", "--max-steps", "4", "--seed", "7",
                          "--iteration", "2", "--temperature", "1.0", "--shard", f"{i}/2", "--out", out, "--json",
                          "--max-new-tokens", "24", "--workers", "1", "--envs-per-worker", "3", "-q", check=True)
        summary = json.loads(res.stdout)
        assert summary["shard"] == f"{i}/2" and summary["trajectories"] == 3 and summary["stats"]["total"] == 3
        assert f"shard: {i}/2" in (tmp_path / f"shard_{i}.parquet.config.yaml").read_text()
    parts = [pl.read_parquet(p) for p in shards]
    assert not set(parts[0]["traj_id"]) & set(parts[1]["traj_id"])
    assert pl.concat(parts).equals(full), "the shards, concatenated in shard order, are the unsharded table"
    merged = run_qevolve("label", *shards, "--out", tmp_path / "merged.parquet", "--json", check=True)
    assert json.loads(merged.stdout)["trajectories"] == 6
    label_tables([textcraft_run], tmp_path / "whole.parquet")
    a, b = (pl.read_parquet(tmp_path / n) for n in ("merged.parquet", "whole.parquet"))
    assert a.columns == b.columns and a.height == full.height
    assert a.equals(b), "label of the shards = label of the unsharded rollout, row for row"


def test_rollout_resume_after_kill(react_model_dir: Path, tmp_path: Path) -> None:
    from qevolve_cli import schema

    out = tmp_path / "r.parquet"
    journal = tmp_path / "r.parquet.partial" / "journal.jsonl"
    args = ["rollout", "--env", "textcraft", "--policy", str(react_model_dir), "--split", "train", "--max-tasks", "8",
            "--n-per-task", "2", "--max-steps", "6", "--seed", "3", "--out", str(out), "--max-new-tokens", "24",
            "--workers", "1", "--envs-per-worker", "2", "-q"]
    proc = subprocess.Popen([sys.executable, "-m", "qevolve_cli", *args], cwd=ROOT, env=qevolve_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 120
    n_before = 0
    while time.time() < deadline and proc.poll() is None:
        if journal.exists():
            n_before = sum(1 for line in journal.read_text().splitlines() if '"kind": "episode"' in line)
            if n_before >= 3:
                break
        time.sleep(0.2)
    assert proc.poll() is None, f"rollout ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    # frozen (not ended) while the second process starts: on a busy machine the second one's start-up took
    # longer than the first one's remaining episodes, and the first finished before it could be refused
    os.killpg(proc.pid, signal.SIGSTOP)
    # a second `rollout --resume` on the same output is refused at once, naming the holder; the journal is kept
    second = run_qevolve(*args, "--resume")
    assert proc.poll() is None, "the first rollout ended while the second one started"
    assert second.returncode == 2 and second.stderr.strip().startswith(
        f"error: {out}: in use by another qevolve process (pid {proc.pid};"), second.stderr[-2000:]
    assert "\n" not in second.stderr.strip()
    n_now = sum(1 for line in journal.read_text().splitlines() if '"kind": "episode"' in line)
    assert n_now >= n_before and journal.read_text().startswith('{"kind": "header"')
    os.killpg(proc.pid, signal.SIGKILL)  # the whole group: the CLI and its env workers
    proc.wait(timeout=30)
    assert not out.exists(), "no half-written table after a kill"
    before = {}
    for line in journal.read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "episode":
            before[rec["traj_id"]] = rec["rows"]
    assert 3 <= len(before) < 16
    with open(journal, "a") as f:  # a torn record, as if killed in the middle of a write
        f.write('{"kind": "episode", "traj_id": "train/it1/s0/textcr')
    res = run_qevolve(*args, "--resume", "--json", check=True)
    summary = json.loads(res.stdout)
    assert summary["stats"]["resumed"] == len(before)
    assert summary["stats"]["done"] == 16
    df = schema.read_table(out)  # validates: no duplicate (traj_id, step)
    assert df["traj_id"].n_unique() == 16
    assert df.select("task_id", "sample").unique().height == 16
    for tid, rows in before.items():  # nothing lost: finished episodes kept exactly
        got = df.filter(pl.col("traj_id") == tid).sort("step")
        assert got["action"].to_list() == [r["action"] for r in rows]
        assert got["next_observation"].to_list() == [r["next_observation"] for r in rows]
    assert not journal.parent.exists()  # OUT.partial/ goes with the finished stage
    # resuming a complete rollout is a no-op
    res2 = run_qevolve(*args, "--resume", "--json", check=True)
    assert json.loads(res2.stdout)["stats"]["done"] == 16


def test_rollout_sciworld(react_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "sw.parquet"
    res = run_qevolve("rollout", "--env", "sciworld", "--policy", react_model_dir, "--split", "train",
                      "--max-tasks", "2", "--n-per-task", "1", "--max-steps", "3", "--out", out, "--json", *FAST,
                      check=True)
    summary = json.loads(res.stdout)
    assert summary["trajectories"] == 2 and summary["env"] == "sciworld"
    df = _check_table(out, "sciworld", n_traj=2, max_steps=3, iteration=1)
    assert df["task_id"].str.starts_with("sciworld:").all()
    assert df["task_type"].null_count() == 0


def test_truncation_keeps_instruction(react_model_dir: Path, tmp_path: Path) -> None:
    """A context too small for the whole transcript: oldest turns dropped, instruction kept, step flagged."""
    from qevolve_cli.envs.prompts import instruction_prompt
    from qevolve_cli.envs.splits import list_tasks
    from qevolve_cli.rollout.backends import HFBackend
    from qevolve_cli.rollout.config import RolloutConfig
    from qevolve_cli.rollout.loop import run_rollout

    class Recording(HFBackend):
        prompts: list = []

        def generate(self, requests, *a, **kw):
            self.prompts.extend(r.messages for r in requests)
            return super().generate(requests, *a, **kw)

    from qevolve_cli import transcript
    from qevolve_cli.envs.registry import make_env

    be = Recording(react_model_dir, max_new_tokens=16, threads=1)
    tasks = list_tasks("textcraft", "train", limit=1)
    env = make_env("textcraft")
    obs0 = env.reset(tasks[0])
    system = instruction_prompt("textcraft")
    head = transcript.build_messages(system, env.instruction, [obs0], [])
    be.max_context = be.prompt_len(head) + 16 + 60  # the head and about one turn fit, five turns do not
    cfg = RolloutConfig(env="textcraft", n_per_task=1, max_steps=5, workers=1, envs_per_worker=1,
                        max_new_tokens=16, temperature=1.0)
    res = run_rollout(cfg, react_model_dir, tmp_path / "t.parquet", backend=be, tasks=tasks)
    df = res.table.sort("step")
    assert df.height == 5
    assert not df["truncated"][0] and df["truncated"].any()
    assert res.stats.truncated_steps == int(df["truncated"].sum())
    assert len(be.prompts) == 5
    for t, (msgs, tr) in enumerate(zip(be.prompts, df["truncated"], strict=True)):
        assert msgs[:2] == head, "system prompt and instruction are always kept"
        assert msgs[-1]["role"] == "user"
        full = 2 + 2 * t
        assert (len(msgs) < full) == tr, f"step {t}: truncated flag matches the dropped turns"
        if tr and len(msgs) > 4:
            assert be.fits(msgs)
        if t > 0:  # the most recent turn is kept
            assert msgs[-2] == {"role": "assistant", "content": df["action"][t - 1].strip()}


# --------------------------------------------------------------------------- openai backend


class _LocalServer:
    """A stdlib HTTP server on a free loopback port, serving ``handler`` in a thread; ``url`` ends in /v1."""

    def _serve(self, handler: type) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class _ChatServer(_LocalServer):
    """A minimal OpenAI-compatible /v1/chat/completions server (stdlib) running the tiny model on CPU."""

    def __init__(self, model_dir: Path):
        from qevolve_cli.rollout.backends import HFBackend, Request

        self.backend = HFBackend(model_dir, max_new_tokens=24, threads=1)
        self.requests: list[dict] = []
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                if self.path != "/v1/chat/completions":
                    self.send_error(404)
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    outer.requests.append(body)
                    outs = outer.backend.generate([Request(body["messages"], seed=body.get("seed", 0), n=body.get("n", 1))],
                                                  temperature=body.get("temperature", 1.0),
                                                  max_new_tokens=body.get("max_tokens", 24))[0]
                send_json(self, 200, {"id": "x", "object": "chat.completion", "model": body["model"],
                                       "choices": [{"index": i, "message": {"role": "assistant", "content": t},
                                                    "finish_reason": "stop"} for i, t in enumerate(outs)]})

        self._serve(Handler)


def test_openai_backend_against_local_server(react_model_dir: Path, tmp_path: Path) -> None:
    from qevolve_cli.envs.prompts import example_prompt, instruction_prompt

    server = _ChatServer(react_model_dir)
    try:
        out = tmp_path / "oa.parquet"
        run_qevolve("rollout", "--env", "textcraft", "--policy", "tiny-served", "--backend", "openai",
                    "--base-url", server.url, "--split", "train", "--max-tasks", "2", "--n-per-task", "1",
                    "--max-steps", "3", "--out", out, *FAST, check=True)
        df = _check_table(out, "textcraft", n_traj=2, max_steps=3, iteration=1)
        assert len(server.requests) == df.height  # one request per step
        first = server.requests[0]
        assert first["model"] == "tiny-served" and first["max_tokens"] == 24
        assert first["messages"][0] == {"role": "system", "content": instruction_prompt("textcraft").strip()}
        # a served model (no local tokenizer) is a pretrained chat model: the in-context example, "OK", the task
        assert first["messages"][1] == {"role": "user", "content": example_prompt("textcraft")}
        assert first["messages"][2] == {"role": "assistant", "content": "OK"}
        assert first["messages"][3]["content"].startswith("Task: ")
        # the transcript sent at step t carries the actions the table records for steps < t
        longest = max(server.requests, key=lambda r: len(r["messages"]))
        sent_actions = [m["content"] for m in longest["messages"][4:] if m["role"] == "assistant"]
        assert sent_actions and all(a in set(df["action"]) for a in sent_actions)
    finally:
        server.close()


def test_openai_backend_no_server_is_one_line_error(tmp_path: Path) -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    out = tmp_path / "x.parquet"
    res = run_qevolve("rollout", "--env", "textcraft", "--policy", "m", "--backend", "openai", "--base-url",
                      f"http://127.0.0.1:{port}/v1", "--max-tasks", "1", "--n-per-task", "1", "--out", out, "-q")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "no OpenAI-compatible server answers" in lines[0]
    assert not out.exists()


class _KeyedChatServer(_LocalServer):
    """A stdlib OpenAI-compatible /v1/chat/completions server that wants ``Authorization: Bearer KEY`` (as
    ``vllm serve --api-key KEY`` does): 401 otherwise, with a body that echoes the key it got (as hosted
    endpoints do: "Incorrect API key provided: ..."). Every answer is one canned ReAct step."""

    def __init__(self, key: str):
        self.auth: list[str | None] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                got = self.headers.get("Authorization")
                outer.auth.append(got)
                if self.path != "/v1/chat/completions":
                    self.send_error(404)
                    return
                if got != f"Bearer {key}":
                    status, data = 401, {"error": {"message": f"Incorrect API key provided: {got}",
                                                   "type": "invalid_request_error", "code": "invalid_api_key"}}
                else:
                    status, data = 200, {"id": "x", "object": "chat.completion", "model": body["model"], "choices": [
                        {"index": i, "message": {"role": "assistant", "content": "Thought: light it.\nAction: turn on lamp"},
                         "finish_reason": "stop"} for i in range(body.get("n", 1))]}
                send_json(self, status, data)

        self._serve(Handler)


def _files_holding(root: Path, needle: str) -> list[str]:
    return [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file() and needle.encode() in p.read_bytes()]


def test_openai_backend_sends_the_key_of_its_variable_and_writes_it_nowhere(tmp_path: Path) -> None:
    """`rollout --backend openai` against a server that wants a key: with OPENAI_API_KEY (or the variable that
    --api-key-env names) it plays; with a wrong key or none it stops with one line naming the URL and the
    variable. The key is in no file the runs wrote (table, config, journal, --json summary), nor in what they
    printed. HOME and the cache point into the test's directory, so a file written there would be seen too."""
    import secrets

    key = "sk-qevolve-test-" + secrets.token_hex(12)
    server = _KeyedChatServer(key)
    work = tmp_path / "work"
    (work / "home").mkdir(parents=True)
    iso = {"HOME": str(work / "home"), "XDG_CACHE_HOME": str(work / "home" / ".cache"),
           "QEVOLVE_CACHE": str(work / "home" / "qevolve")}
    base = ["rollout", "--env", "lamps", "--policy", "served-model", "--backend", "openai", "--base-url", server.url,
            "--split", "train", "--max-tasks", "2", "--n-per-task", "1", "--max-steps", "2", "--workers", "1",
            "--envs-per-worker", "2", "-q"]
    printed = []
    try:
        ok = run_qevolve(*base, "--out", work / "ok.parquet", "--json", cwd=work, env={**iso, "OPENAI_API_KEY": key})
        printed.append(ok.stdout + ok.stderr)
        assert ok.returncode == 0, ok.stderr[-3000:]
        assert json.loads(ok.stdout)["steps"] == 4 and len(server.auth) == 4  # 2 tasks x 2 steps, one request each
        assert set(server.auth) == {f"Bearer {key}"}
        df = pl.read_parquet(work / "ok.parquet")
        assert set(df["command"]) == {"turn on lamp"}
        cfg_text = (work / "ok.parquet.config.yaml").read_text()
        assert "api_key_env: OPENAI_API_KEY" in cfg_text  # the variable's name only

        # another variable, named by the flag (OPENAI_API_KEY unset in the child)
        env = {k: v for k, v in qevolve_env().items() if k != "OPENAI_API_KEY"}
        other = run_qevolve(*base, "--api-key-env", "MY_ENDPOINT_KEY", "--out", work / "other.parquet", cwd=work,
                            env={**env, **iso, "MY_ENDPOINT_KEY": key})
        printed.append(other.stdout + other.stderr)
        assert other.returncode == 0, other.stderr[-3000:]
        assert "api_key_env: MY_ENDPOINT_KEY" in (work / "other.parquet.config.yaml").read_text()

        refused = {}
        for name, extra in (("wrong", {"OPENAI_API_KEY": key[:-4] + "xxxx"}), ("missing", {"OPENAI_API_KEY": ""})):
            res = run_qevolve(*base, "--out", work / f"{name}.parquet", cwd=work, env={**iso, **extra})
            printed.append(res.stdout + res.stderr)
            assert res.returncode == 2, res.stderr
            lines = res.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: --base-url "), res.stderr
            assert f"{server.url}/chat/completions" in lines[0] and "HTTP 401" in lines[0]
            assert "$OPENAI_API_KEY" in lines[0]
            assert key[:-4] not in lines[0] and "Incorrect API key" not in lines[0]  # the echoing body is not quoted
            assert not (work / f"{name}.parquet").exists()
            refused[name] = lines[0]
        assert "was refused" in refused["wrong"] and "is not set" in refused["missing"]
        assert server.auth[-1] is None  # no key, no header
    finally:
        server.close()
    written = sorted(p.relative_to(work).as_posix() for p in work.rglob("*") if p.is_file())
    assert {"ok.parquet", "ok.parquet.config.yaml", "other.parquet", "other.parquet.config.yaml"} <= set(written)
    assert any(w.startswith("wrong.parquet.partial/") for w in written)  # the refused run's journal, checked too
    assert _files_holding(work, key) == [] and _files_holding(work, key[:-4]) == [], written
    assert not any(key[:-4] in text for text in printed)


def test_api_key_env_is_a_variable_name_and_the_value_is_never_echoed(tmp_path: Path) -> None:
    pasted = "sk-" + "0123456789abcdef" * 2  # a key pasted where the variable's name goes
    res = run_qevolve("rollout", "--env", "lamps", "--policy", "m", "--backend", "openai", "--base-url",
                      "http://127.0.0.1:9/v1", "--api-key-env", pasted, "--out", tmp_path / "x.parquet", "-q")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --api-key-env: must be the name of an environment variable"), res.stderr
    assert pasted not in res.stderr + res.stdout and not list(tmp_path.iterdir())
    shown = run_qevolve("rollout", "--backend", "openai", "--base-url", "http://127.0.0.1:9/v1", "--print-config",
                        env={"OPENAI_API_KEY": pasted})
    assert shown.returncode == 0 and "OPENAI_API_KEY" in shown.stdout and pasted not in shown.stdout + shown.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--policy", "/nonexistent/model"], "--policy /nonexistent/model: no such directory"),
        (["--backend", "tgi"], "backend"),
        (["--n-per-task", "0"], "--n-per-task: must be >= 1, got 0"),
        (["--split", "validation"], "split"),
        (["--backend", "openai"], "base_url"),
        (["--shard", "3/2"], "--shard: need N >= 1 and 0 <= I < N, got '3/2'"),
    ],
)
def test_rollout_bad_input(args, needle, tiny_model_dir: Path, tmp_path: Path) -> None:
    if "--policy" not in args:
        args = ["--policy", str(tiny_model_dir), *args]
    out = tmp_path / "bad.parquet"
    res = run_qevolve("rollout", "--env", "textcraft", *args, "--max-tasks", "1", "--out", out, "-q")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines
    assert not out.exists()


def test_rollout_adapter_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "notadapter").mkdir()
    res = run_qevolve("rollout", "--env", "textcraft", "--policy", tiny_model_dir, "--adapter",
                      tmp_path / "notadapter", "--max-tasks", "1", "--out", tmp_path / "o.parquet", "-q")
    assert res.returncode == 2 and "not a PEFT adapter" in res.stderr


# --------------------------------------------------------------------------- vllm (GPU)


def _has_cuda_vllm() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch missing"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vLLM is not installed (pip install 'qevolve[gpu]')"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_has_cuda_vllm() is not None, reason=str(_has_cuda_vllm()))
def test_vllm_backend_rollout(react_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "v.parquet"
    res = run_qevolve("rollout", "--env", "textcraft", "--policy", react_model_dir, "--backend", "vllm",
                      "--split", "train", "--max-tasks", "2", "--n-per-task", "2", "--max-steps", "3",
                      "--temperature", "0", "--out", out, "--json", *FAST, check=True)
    assert json.loads(res.stdout)["trajectories"] == 4
    df = _check_table(out, "textcraft", n_traj=4, max_steps=3, iteration=1)
    # greedy: the two samples of a task are identical
    a = df.filter(pl.col("sample") == 0).sort(["task_id", "step"])["action"].to_list()
    b = df.filter(pl.col("sample") == 1).sort(["task_id", "step"])["action"].to_list()
    assert a == b


def test_lane_sizes_split_capacity_evenly() -> None:
    from qevolve_cli.rollout.loop import lane_sizes

    assert lane_sizes(8, 2) == [4, 4] and lane_sizes(7, 2) == [4, 3] and lane_sizes(5, 3) == [2, 2, 1]
    assert lane_sizes(1, 2) == [1]  # never an empty lane
    for cap in range(1, 20):
        for n in range(1, 6):
            sizes = lane_sizes(cap, n)
            assert sum(sizes) == cap and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_cpu_cached_decode_equals_padded_generate(react_model_dir: Path) -> None:
    """Per-sequence prefill + batched decode over padded KV caches gives exactly the tokens of
    transformers' generate on the left-padded batch, and of one-at-a-time generation."""
    from qevolve_cli.envs import list_tasks, make_env
    from qevolve_cli.envs.prompts import instruction_prompt
    from qevolve_cli.rollout.backends import HFBackend, Request
    from qevolve_cli.transcript import build_messages

    b = HFBackend(react_model_dir, max_new_tokens=24)
    assert b.per_sequence_prefill  # CPU default
    env = make_env("textcraft")
    reqs = []
    for i, t in enumerate(list_tasks("textcraft", "train", limit=5)):
        obs = [env.reset(t)]
        acts = []
        for _ in range(i):  # prompts of different lengths -> real padding in the batch
            acts.append("Thought: check.\nAction: inventory")
            obs.append(env.step("inventory")[0])
        reqs.append(Request(build_messages(instruction_prompt("textcraft"), env.instruction, obs, acts, False),
                            seed=11 * i + 1))
    env.close()
    assert len({len(b.prompt_ids(r.messages)) for r in reqs}) == len(reqs)
    for temp in (0.0, 1.0):
        outs = {}
        for mode in (True, False):
            b.per_sequence_prefill = mode
            outs[(mode, "batch")] = b.generate(reqs, temperature=temp)
            outs[(mode, "single")] = [b.generate([r], temperature=temp)[0] for r in reqs]
        first = outs[(False, "single")]
        assert all(o == first for o in outs.values()), temp
        assert any(o[0] for o in first)  # something was generated
    b.per_sequence_prefill = True
    # greedy decoding stops at the end-of-turn token: no output contains the stop text
    assert all("<|im_end|>" not in o[0] for o in b.generate(reqs, temperature=0.0))


# --------------------------------------------------------------------------- KV cache reuse (hf, CPU)


def test_kv_store_prefix_outcomes_and_eviction() -> None:
    """KVStore: the reused length is the common prefix of token ids (at least one token left to
    compute), each outcome is counted, and the memory cap evicts the least recently used entry."""
    import torch

    from qevolve_cli.rollout.backends import KVStore, common_prefix_len

    assert common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_len([], [1]) == 0 and common_prefix_len([7, 8], [7, 8]) == 2

    def kv(n: int) -> list:  # 2 layers, 1 head, n positions, dim 4, float32: 2 * 2 * n * 4 * 4 bytes
        return [(torch.zeros(1, 1, n, 4), torch.zeros(1, 1, n, 4)) for _ in range(2)]

    st = KVStore(cap_bytes=2 * 2 * 10 * 4 * 4)  # room for 10 positions
    assert st.lookup("a", [1, 2, 3]) == (0, None)  # no entry: full prefill
    st.put("a", [1, 2, 3], kv(3))
    n, layers = st.lookup("a", [1, 2, 3, 4, 5])  # extends the cached ids: hit, 2 tokens computed
    assert n == 3 and layers is not None
    assert st.lookup("a", [1, 2, 9, 9])[0] == 2  # re-tokenised boundary: the common prefix is reused
    assert st.lookup("a", [1, 2, 3])[0] == 2  # the whole prompt cached: its last token is recomputed
    assert st.lookup("a", [5, 6])[0] == 0  # nothing shared: full re-prefill
    assert st.lookup(None, [1, 2, 3])[0] == 0  # no key: nothing kept
    c = st.counts
    assert (c["kv_new"], c["kv_hits"], c["kv_partial"], c["kv_fallbacks"]) == (2, 1, 2, 1)
    assert c["prompts"] == 6 and c["prompt_tokens"] == 3 + 5 + 4 + 3 + 2 + 3
    assert c["prefill_tokens"] == 3 + 2 + 2 + 1 + 2 + 3
    st.put("b", [1] * 4, kv(4))
    assert st.bytes == 2 * 2 * 7 * 16 and c["kv_evictions"] == 0
    st.lookup("a", [1, 2, 3, 4])  # "a" used last: "b" is now the oldest
    st.put("c", [2] * 5, kv(5))  # 3 + 4 + 5 > 10 positions: "b" goes
    assert list(st.entries) == ["a", "c"] and c["kv_evictions"] == 1
    st.put("d", [3] * 11, kv(11))  # larger than the cap: not kept, counted
    assert "d" not in st.entries and c["kv_evictions"] == 2
    st.drop("a")
    assert list(st.entries) == ["c"] and st.bytes == 2 * 2 * 5 * 16


def test_kv_prefill_from_cache_matches_full_prefill(react_model_dir: Path) -> None:
    """Prefilling only the tokens past a kept cache gives the logits and keys/values of a full
    prefill up to float noise (tolerance 1e-4 on logits of magnitude ~10 in float32)."""
    import torch

    from qevolve_cli.rollout.backends import HFBackend

    b = HFBackend(react_model_dir, max_new_tokens=8, threads=1)
    ids = b.prompt_ids([{"role": "user", "content": "Craft a wooden planks. Inventory: oak log, stick, stick."}])
    with torch.inference_mode():
        full_logits, full_kv = b._prefill(ids, None)
        b.kv.put("e", ids[:-7], [(k[:, :, :-7].clone(), v[:, :, :-7].clone()) for k, v in full_kv])
        part_logits, part_kv = b._prefill(ids, "e")
    assert b.kv.counts["kv_hits"] == 1 and b.kv.counts["prefill_tokens"] == len(ids) + 7
    assert torch.allclose(part_logits, full_logits, atol=1e-4, rtol=0)
    assert int(part_logits.argmax()) == int(full_logits.argmax())
    for (k0, v0), (k1, v1) in zip(full_kv, part_kv, strict=True):
        assert k1.shape == k0.shape and torch.allclose(k1, k0, atol=1e-4) and torch.allclose(v1, v0, atol=1e-4)


def test_kv_store_first_prompts_start_from_the_shared_entry() -> None:
    """An episode without a kept cache reuses the common prefix of the last prompt prefilled from nothing (the
    shared entry) when it is at least SHARED_MIN_TOKENS long; its own kept cache comes first; no key, no sharing."""
    import torch

    from qevolve_cli.rollout.backends.hf import SHARED_MIN_TOKENS, KVStore

    def kv(n: int) -> list:
        return [(torch.full((1, 1, n, 4), float(n)), torch.zeros(1, 1, n, 4)) for _ in range(2)]

    head = list(range(SHARED_MIN_TOKENS))
    st = KVStore(cap_bytes=1 << 20)
    a = [*head, 100, 101]
    assert st.lookup("a", a) == (0, None) and st.counts["kv_new"] == 1  # nothing shared yet
    st.put_shared(a, kv(len(a)))
    n, layers = st.lookup("b", [*head, 200])  # a new episode: the system prompt and example come from "a"
    assert n == SHARED_MIN_TOKENS and layers is st.shared[1] and st.counts["kv_shared"] == 1
    assert st.lookup("c", [*head[:-1], 7, 7])[0] == 0  # one token short of the minimum: a full prefill
    assert st.lookup("d", a)[0] == len(a) - 1  # the same prompt (best-of-N's samples): its last token computed
    assert st.lookup(None, a)[0] == 0  # no key (kv_reuse off): nothing kept, nothing shared
    st.put("e", a[:5], kv(5))
    assert st.lookup("e", a)[0] == 5 and st.counts["kv_hits"] == 1  # the episode's own cache comes first
    c = st.counts
    assert (c["kv_new"], c["kv_shared"]) == (3, 2)
    # a: all; b: its last token; c: all; d: its last token; None: all; e: past its own 5
    assert c["prefill_tokens"] == len(a) + 1 + (len(head) + 1) + 1 + len(a) + (len(a) - 5)
    assert st.bytes == 2 * 2 * 5 * 16  # the shared entry is held beside the capped entries


def test_kv_prefill_from_the_shared_entry_matches_full_prefill(react_model_dir: Path) -> None:
    """A first prompt prefilled from another task's (the shared entry's) common prefix gives the logits and keys/values
    of its own full prefill (tolerance 1e-4, float32)."""
    import torch

    from qevolve_cli.rollout.backends import HFBackend

    b = HFBackend(react_model_dir, max_new_tokens=8, threads=1)
    sys_msg = {"role": "system", "content": "You craft items in Minecraft. " * 12}
    ids_a = b.prompt_ids([sys_msg, {"role": "user", "content": "Craft a wooden planks. Inventory: oak log."}])
    ids_b = b.prompt_ids([sys_msg, {"role": "user", "content": "Craft a stick. Inventory: oak planks, oak planks."}])
    with torch.inference_mode():
        b._prefill(ids_a, "task a")  # fresh: becomes the shared entry
        part_logits, part_kv = b._prefill(ids_b, "task b")
        full_logits, full_kv = b._prefill(ids_b, None)
    n = b.kv.counts["prefill_tokens"] - len(ids_a) - len(ids_b)  # computed for task b from the shared entry
    assert b.kv.counts["kv_shared"] == 1 and 0 < n < len(ids_b) / 2
    assert torch.allclose(part_logits, full_logits, atol=1e-4, rtol=0)
    for (k0, v0), (k1, v1) in zip(full_kv, part_kv, strict=True):
        assert k1.shape == k0.shape and torch.allclose(k1, k0, atol=1e-4) and torch.allclose(v1, v0, atol=1e-4)


@pytest.mark.parametrize("env", ["lamps", "textcraft"])
def test_kv_reuse_keeps_greedy_actions(react_model_dir: Path, tmp_path: Path, env: str) -> None:
    """Greedy rollouts with the KV cache kept across environment steps play exactly the actions of
    the re-prefill path, on episodes of different lengths in one batch, while computing a fraction
    of the prompt tokens; finished episodes leave no cache behind."""
    from qevolve_cli.envs.splits import list_tasks
    from qevolve_cli.rollout.backends import HFBackend
    from qevolve_cli.rollout.config import RolloutConfig
    from qevolve_cli.rollout.loop import run_rollout

    be = HFBackend(react_model_dir, max_new_tokens=24, threads=1)
    tasks = list_tasks(env, "train", limit=4)
    cfg = RolloutConfig(env=env, n_per_task=1, max_steps=6, workers=1, envs_per_worker=4, lanes=1,
                        max_new_tokens=24, temperature=0.0)
    runs = {}
    for reuse in (False, True):
        be.kv_reuse = reuse
        r = run_rollout(cfg, react_model_dir, tmp_path / f"{reuse}.parquet", backend=be, tasks=tasks)
        runs[reuse] = (r.table.sort(["traj_id", "step"])["action"].to_list(), r.stats.backend, r.stats.steps)
    assert runs[True][0] == runs[False][0]
    off, on = runs[False][1], runs[True][1]
    steps = runs[True][2]
    assert steps > len(tasks)  # episodes went on past their first step
    assert off["prefill_tokens"] == off["prompt_tokens"] and off["kv_hits"] + off["kv_partial"] == 0
    # the first episode prefills its whole prompt; the others start from its common prefix (system prompt, example)
    assert on["prompt_tokens"] == off["prompt_tokens"] and (on["kv_new"], on["kv_shared"]) == (1, len(tasks) - 1)
    assert off["kv_shared"] == 0
    assert on["kv_hits"] + on["kv_partial"] == steps - len(tasks) and on["kv_fallbacks"] == 0
    assert on["prefill_tokens"] < off["prefill_tokens"] / 2
    assert not be.kv.entries and be.kv.bytes == 0  # every episode ended: its cache was dropped


def test_steps_left_counts_down_to_the_tasks_own_budget(tiny_model_dir: Path, tmp_path: Path) -> None:
    """lamps-habit ends a task at its own step budget when that is tighter than the run's limit: a rollout's
    steps_left counts down from min(limit, budget) to 1 (the untrained model never succeeds, so every episode
    runs to its limit), and `label --step-limit` gives the expert demonstrations of the same tasks the same
    start (registry.episode_limit), not the run's limit."""
    from qevolve_cli import schema
    from qevolve_cli.envs.builtin import budget_of, parse_task_id
    from qevolve_cli.envs.expert import collect_expert
    from qevolve_cli.envs.registry import episode_limit

    env, limit = "lamps-habit", 15
    out = tmp_path / "r.parquet"
    run_qevolve("rollout", "--env", env, "--policy", tiny_model_dir, "--split", "train", "--max-tasks", "6",
                "--n-per-task", "1", "--max-steps", str(limit), "--out", out, *FAST, check=True)
    df = schema.read_table(out)
    budgets = {t: budget_of(*parse_task_id(t, env), env) for t in df["task_id"].unique().to_list()}
    assert min(budgets.values()) < limit < max(budgets.values())  # some tasks tighter than the run, some looser
    for (tid,), g in df.group_by("task_id"):
        want = min(limit, budgets[tid])
        assert episode_limit(env, tid, limit) == want
        assert g.height == want and g["steps_left"].to_list() == list(range(want, 0, -1)), tid
    expert = tmp_path / "e.parquet"
    schema.write_table(collect_expert(env, "train", limit=6), expert)
    lab = tmp_path / "l.parquet"
    run_qevolve("label", expert, out, "--step-limit", str(limit), "--out", lab, "-q", check=True)
    t = schema.read_table(lab)
    e = t.filter(pl.col("source") == "expert")
    assert any(episode_limit(env, tid, limit) < limit for tid in e["task_id"].unique())  # a budget the fill must see
    want = [episode_limit(env, tid, limit) - s for tid, s in zip(e["task_id"], e["step"], strict=True)]
    assert e["steps_left"].to_list() == want
    s = t.filter(pl.col("source") == "self")
    assert s["steps_left"].to_list() == df["steps_left"].to_list()  # the rollout's own values, kept
