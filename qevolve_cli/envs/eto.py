"""ETO / ShareGPT SFT JSON -> step table (``qevolve import --format eto``).

Accepted records (a JSON list, or JSON Lines with one record per line)::

    {"id": "...", "conversations": [{"from": "human"|"gpt"|"system", "value": "..."}, ...]}
    {"id": "...", "messages"|"conversations": [{"role": "user"|"assistant"|"system", "content": "..."}]}

Conversion: leading turns before the first assistant turn that has an ``Action:`` line
(the instruction prompt, in-context examples and ETO's ``OK`` replies) are dropped; the
user turn just before it is o_0. Then every assistant turn is one step: ``action`` = the
full text (thought kept), ``command`` = the parsed ``Action:`` (null on a format error),
``next_observation`` = the following user turn (empty after the last action). The
instruction is taken from o_0 (ALFWorld ``Your task is to: ...``, SciWorld ``Task
Description: ...``, WebShop ``Instruction: [SEP] ... [SEP]``; else o_0 itself). A leading
``Observation:`` marker is stripped from user turns. ETO SFT data holds successful expert
trajectories, so the last step gets ``reward_env`` = the record's ``reward`` field when
present, else ``default_reward`` (1.0).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import polars as pl

from qevolve_cli.errors import QevolveError
from qevolve_cli.react import parse_action

_USER = {"human", "user"}
_ASSISTANT = {"gpt", "assistant", "model", "bot"}
_SYSTEM = {"system"}


def _instruction(env: str, obs: str) -> str:
    m = re.search(r"Your task is to:\s*(.+)", obs)
    if m:
        return m.group(1).strip()
    m = re.search(r"Task Description:\s*(.+?)(?:\n\n|$)", obs, re.S)
    if m:
        return m.group(1).strip()
    m = re.search(r"Instruction:\s*\[SEP\]\s*(.+?)\s*\[SEP\]", obs, re.S)
    if m:
        return m.group(1).strip()
    return obs.strip()


def _strip_obs(text: str) -> str:
    t = text.strip()
    return t[len("Observation:"):].strip() if t.startswith("Observation:") else t


def _load_records(path: Path) -> list[Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise QevolveError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if len(lines) > 1:  # JSON Lines?
            out = []
            for i, ln in enumerate(lines):
                try:
                    out.append(json.loads(ln))
                except json.JSONDecodeError as e2:
                    raise QevolveError(f"{path}: not valid JSON or JSON Lines (line {i + 1}: {e2.msg})") from None
            return out
        raise QevolveError(f"{path}: not valid JSON (line {e.lineno} column {e.colno}: {e.msg})") from None
    if isinstance(data, dict):
        for k in ("data", "records", "conversations"):
            if isinstance(data.get(k), list) and k != "conversations":
                return data[k]
        return [data]
    if not isinstance(data, list):
        raise QevolveError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
    return data


def _messages(path: Path, i: int, rec: Any) -> tuple[str, list[tuple[str, str]]]:
    where = f"{path}: record {i}"
    if not isinstance(rec, dict):
        raise QevolveError(f"{where}: expected an object with 'conversations', got {type(rec).__name__}")
    rid = rec.get("id", rec.get("game_file", i))
    where += f" (id {rid!r})"
    conv = rec.get("conversations", rec.get("messages"))
    if not isinstance(conv, list) or not conv:
        raise QevolveError(f"{where}: missing or empty 'conversations' (or 'messages') list")
    msgs = []
    for j, m in enumerate(conv):
        if not isinstance(m, dict):
            raise QevolveError(f"{where}: conversations[{j}] is not an object")
        role = m.get("from", m.get("role"))
        text = m.get("value", m.get("content"))
        if not isinstance(role, str):
            raise QevolveError(f"{where}: conversations[{j}] has no 'from'/'role'")
        if not isinstance(text, str):
            raise QevolveError(f"{where}: conversations[{j}] has no string 'value'/'content'")
        r = role.lower()
        if r in _USER:
            r = "user"
        elif r in _ASSISTANT:
            r = "assistant"
        elif r in _SYSTEM:
            r = "system"
        else:
            raise QevolveError(f"{where}: conversations[{j}] has unknown role {role!r}")
        msgs.append((r, text))
    return str(rid), msgs


def import_eto(path: str | Path, env: str, split: str = "train", source: str = "expert", iteration: int = 0,
               default_reward: float = 1.0) -> pl.DataFrame:
    """Read an ETO/ShareGPT SFT file into a step table (docs/tables.md) (see the module docstring)."""
    from qevolve_cli.schema import BASE_COLUMNS, EXTRA_COLUMNS

    path = Path(path)
    if not path.is_file():
        raise QevolveError(f"{path}: no such file")
    records = _load_records(path)
    if not records:
        raise QevolveError(f"{path}: no records")
    rows: list[dict] = []
    seen: set[str] = set()
    for i, rec in enumerate(records):
        rid, msgs = _messages(path, i, rec)
        start = next((j for j, (r, t) in enumerate(msgs) if r == "assistant" and parse_action(t) is not None), None)
        if start is None:
            raise QevolveError(f"{path}: record {i} (id {rid!r}): no assistant turn with an 'Action:' line")
        prev_user = [j for j in range(start) if msgs[j][0] == "user"]
        if not prev_user:
            raise QevolveError(f"{path}: record {i} (id {rid!r}): no user turn (observation) before the first action")
        obs = _strip_obs(msgs[prev_user[-1]][1])
        instruction = _instruction(env, obs)
        task_id = rid if rid.startswith(env + ":") else f"{env}:{rid}"
        traj_id = f"{source}:{task_id}"
        if traj_id in seen:
            traj_id = f"{traj_id}#{i}"
        seen.add(traj_id)
        reward = rec.get("reward", default_reward) if isinstance(rec, dict) else default_reward
        try:
            reward = float(reward)
        except (TypeError, ValueError):
            raise QevolveError(f"{path}: record {i} (id {rid!r}): 'reward' is not a number: {reward!r}") from None
        steps = []
        j = start
        while j < len(msgs):
            role, text = msgs[j]
            if role != "assistant":
                j += 1
                continue
            nxt = msgs[j + 1][1] if j + 1 < len(msgs) and msgs[j + 1][0] == "user" else ""
            steps.append((text.strip(), _strip_obs(nxt)))
            j += 1
        for t, (action, next_obs) in enumerate(steps):
            last = t == len(steps) - 1
            rows.append({
                "traj_id": traj_id, "env": env, "task_id": task_id, "split": split, "source": source,
                "iteration": iteration, "step": t, "instruction": instruction, "observation": obs,
                "action": action, "command": parse_action(action), "next_observation": next_obs,
                "reward_env": reward if last else 0.0, "done": last, "task_type": None,
            })
            obs = next_obs
    schema = {**BASE_COLUMNS, "task_type": EXTRA_COLUMNS["task_type"]}
    return pl.DataFrame(rows, schema=schema)
