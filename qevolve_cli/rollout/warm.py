"""Teach a tiny model the ReAct output format in seconds (tests, benchmarks, CPU demos).

A freshly initialised tiny model (``qevolve init-model``) emits noise, so every
turn is a format error and the environment is never stepped. :func:`react_tune`
fine-tunes it for a few dozen steps on chat transcripts (built by the one
transcript builder + the chat template) whose assistant turns are
``Thought: ...\\nAction: <command>`` with commands that the environment
understands, so rollouts really step the environment. It is a plain causal-LM
fine-tune of the real model (no mocking); the result is a normal HF directory.
"""
from __future__ import annotations

import os
import random
import shutil
from collections.abc import Sequence
from pathlib import Path

from qevolve_cli import transcript
from qevolve_cli.atomic import atomic_dir

COMMANDS = {
    "textcraft": ["inventory", "get 1 oak log", "get 2 oak planks", "craft 4 oak planks using 1 oak log",
                  "get 1 stick"],
    "sciworld": ["look around", "inventory", "teleport to kitchen", "look around", "teleport to hallway",
                 "open door to kitchen"],
    "alfworld": ["look", "inventory", "go to countertop 1", "go to cabinet 1", "open cabinet 1"],
    "webshop": ["search[shirt]", "click[back to search]"],
    "lamps": ["go east", "go west", "turn on lamp", "go east", "turn on lamp"],
    "lamps-hard": ["go east", "go west", "turn on lamp", "go east", "turn on lamp"],
    "lamps-habit": ["go east", "go west", "turn on lamp", "look", "go east", "turn on lamp"],
}


def react_tune(src: str | Path, out: str | Path, envs: str | Sequence[str], steps: int = 200, seed: int = 0,
               lr: float = 3e-3) -> Path:
    """Fine-tune the model in ``src`` to answer in ReAct format with commands of ``envs``; write to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qevolve_cli.envs.prompts import instruction_prompt

    prev_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # see HFBackend: busy cores + spinning threads
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(str(src))
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    envs = [envs] if isinstance(envs, str) else list(envs)
    data = []
    for i in range(16):
        env = envs[i % len(envs)]
        system, cmds = instruction_prompt(env), COMMANDS[env]
        obs = [f"observation {rng.randint(0, 99)}" for _ in range(1 + i % 2)]
        acts = [f"Thought: I should {c}.\nAction: {c}" for c in (rng.choice(cmds) for _ in range(len(obs)))]
        msgs = transcript.build_messages(system, f"task {i}", obs, acts)
        ids = tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
        labels = [-100] * len(ids)
        for k, m in enumerate(msgs):  # loss on the assistant turns only (content + end of turn)
            if m["role"] != "assistant":
                continue
            a = len(tok(tok.apply_chat_template(msgs[:k], tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)["input_ids"])
            b = len(tok(tok.apply_chat_template(msgs[: k + 1], tokenize=False), add_special_tokens=False)["input_ids"])
            labels[a:b] = ids[a:b]
        data.append((torch.tensor([ids]), torch.tensor([labels])))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for s in range(steps):
        ids, labels = data[s % len(data)]
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    torch.set_num_threads(prev_threads)
    out = Path(out)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        for extra in ("qevolve_model.json",):
            if (Path(src) / extra).exists():
                shutil.copy(Path(src) / extra, Path(tmp) / extra)
    return out
