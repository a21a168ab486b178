"""The backend interface and what every backend shares: :class:`Request`, :class:`Backend` (prompt
token ids, context fitting), model/adapter directory checks, the tokenizer loader and the stop tokens."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qevolve_cli.errors import QevolveError
from qevolve_cli.tokenizer import load_tokenizer  # noqa: F401 - the one loader, handed on to the backends
from qevolve_cli.transcript import Message

BACKENDS = ("hf", "vllm", "openai")

# End-of-turn tokens of common chat templates (added to the stop set when present).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


@dataclass
class Request:
    """One prompt: the transcript so far; ``seed`` makes its sampling reproducible."""

    messages: list[Message]
    seed: int = 0
    n: int = 1
    # the episode this prompt belongs to: backends that keep per-episode state between calls (the hf
    # backend's KV cache) use it; None = nothing is kept
    key: Any = None


class Backend:
    """Base class: token counting and context fitting shared by all backends."""

    name = "base"
    tokenizer: Any = None
    max_context: int = 4096
    max_new_tokens: int = 256

    _IDS_CACHE_SIZE = 1024

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of the rendered prompt (with the generation prompt).

        The rollout loop asks twice per turn (``fits`` while truncating, then ``generate``); the
        ids of the last prompts are kept, keyed by the (role, content) pairs, so each transcript
        is rendered and tokenised once.
        """
        key = tuple((m["role"], m["content"]) for m in messages)
        cache = self.__dict__.setdefault("_ids_cache", {})
        ids = cache.get(key)
        if ids is None:
            text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if len(cache) >= self._IDS_CACHE_SIZE:
                cache.pop(next(iter(cache)))  # oldest first (dicts keep insertion order)
            cache[key] = ids
        return list(ids)

    def prompt_len(self, messages: Sequence[Message]) -> int:
        if self.tokenizer is None:  # no local tokenizer: ~4 characters per token
            return sum(len(m["content"]) + 8 for m in messages) // 4 + 8
        return len(self.prompt_ids(messages))

    def fits(self, messages: Sequence[Message]) -> bool:
        return self.prompt_len(messages) + self.max_new_tokens <= self.max_context

    def generate(self, requests: Sequence[Request], temperature: float, top_p: float = 1.0,
                 max_new_tokens: int | None = None) -> list[list[str]]:
        raise NotImplementedError

    def end_episode(self, key: Any) -> None:
        """The episode ``key`` will not be continued: state kept for it may be dropped."""

    def counters(self) -> dict[str, int]:
        """Running totals of the backend's work (the hf backend: prompt tokens, tokens computed, KV
        cache reuse); the rollout loop reports the difference over a run."""
        return {}

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_model_dir(policy: str | Path, what: str = "--policy") -> None:
    p = Path(policy)
    if p.exists() and not (p / "config.json").is_file():
        raise QevolveError(f"{what} {p}: not a Hugging Face model directory (no config.json)")
    if not p.exists() and (str(policy).startswith((".", "/")) or p.suffix):
        raise QevolveError(f"{what} {p}: no such directory")


def _check_adapter_dir(adapter: str | Path | None) -> None:
    if adapter is None:
        return
    p = Path(adapter)
    if not p.is_dir():
        raise QevolveError(f"--adapter {p}: no such directory")
    if not (p / "adapter_config.json").is_file():
        raise QevolveError(f"--adapter {p}: not a PEFT adapter (no adapter_config.json)")


def stop_token_ids(tokenizer, extra: Sequence[int] = ()) -> list[int]:
    """The eos id plus every end-of-turn token the vocabulary knows."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for t in END_OF_TURN_TOKENS:
        if t in vocab and t != tokenizer.pad_token:
            ids.append(int(vocab[t]))
    ids.extend(int(i) for i in extra)
    return sorted(set(ids))


def _model_max_context(config: Any, tokenizer: Any, override: int) -> int:
    if override and override > 0:
        return int(override)
    cands = [getattr(config, "max_position_embeddings", None)]
    tml = getattr(tokenizer, "model_max_length", None)
    if tml and tml < 10**8:
        cands.append(tml)
    cands = [int(c) for c in cands if c]
    return min(cands) if cands else 4096
