"""Generation backends behind one small interface.

A backend turns chat transcripts (lists of messages built by
:mod:`qevolve_cli.transcript`, the project's one transcript builder) into
model outputs. Three implementations:

* :class:`HFBackend` (``hf``): transformers ``generate`` on CPU or GPU,
  batched over every prompt of the call, left padding, stops at the end of
  the assistant turn (the tokenizer's eos plus any known end-of-turn token).
  Sampling is done per request by :class:`PerRequestSampler` with its own
  ``torch.Generator`` seeded from the request's ``seed``, so a trajectory
  does not depend on which other episodes share its batch: same seed ->
  same table on CPU.
* :class:`VLLMBackend` (``vllm``): vLLM's offline ``LLM`` engine on GPU (or
  the ``vllm-cpu`` build on CPU: float32, eager, in-process engine), base model
  plus an optional PEFT LoRA adapter (``LoRARequest``); vLLM is imported
  lazily. Outputs are cut at the first stop token and decoded by the same
  tokenizer call as the hf backend, so greedy float32 tables are equal.
* :class:`OpenAIBackend` (``openai``): any OpenAI-compatible
  ``/v1/chat/completions`` server (e.g. ``vllm serve``) by base URL; it sends
  the messages and the server applies the chat template.

The prompt of the ``hf``/``vllm`` backends is the tokenizer's chat template
over the messages with ``add_generation_prompt=True``, tokenised without
extra special tokens (the template carries them).

Interface::

    backend = make_backend("hf", policy=DIR, adapter=None, ...)
    outs = backend.generate([Request(messages, seed=..., n=1), ...],
                            temperature=0.0, top_p=1.0, max_new_tokens=128)
    # -> list[list[str]]: n completions per request
    backend.fits(messages) -> bool   # prompt + max_new_tokens within the context
    backend.close()
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qevolve_cli.errors import QevolveError
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


def load_tokenizer(policy: str | Path, adapter: str | Path | None = None):
    """The policy's tokenizer (the adapter's when it ships one), with a chat template."""
    from transformers import AutoTokenizer

    src = adapter if adapter is not None and (Path(adapter) / "tokenizer_config.json").is_file() else policy
    try:
        tok = AutoTokenizer.from_pretrained(str(src), trust_remote_code=False)
    except Exception as e:
        raise QevolveError(f"{src}: cannot load the tokenizer ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if not getattr(tok, "chat_template", None):
        raise QevolveError(f"{src}: the tokenizer has no chat template (tokenizer_config.json 'chat_template')")
    return tok


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


# --------------------------------------------------------------------------- hf


class PerRequestSampler:
    """Logits processor that samples each row with its own generator.

    It returns scores that are ``-inf`` everywhere except the sampled token,
    so ``generate`` run greedily picks exactly that token. Row ``i`` draws from
    ``generators[i]``: the draw of a request depends on its seed and its own
    logits only, not on the rest of the batch.
    """

    def __init__(self, generators: list, temperature: float, top_p: float):
        self.generators = generators
        self.temperature = temperature
        self.top_p = top_p

    def __call__(self, input_ids, scores):
        import torch

        logits = scores.float() / max(self.temperature, 1e-5)
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1.0:
            sp, si = torch.sort(probs, dim=-1, descending=True)
            cum = torch.cumsum(sp, dim=-1)
            drop = cum - sp > self.top_p  # keep the smallest prefix with mass >= top_p
            sp = sp.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, si, sp)
        out = torch.full_like(scores, float("-inf"))
        for i, g in enumerate(self.generators):
            p = probs[i]
            if not torch.isfinite(p).all() or p.sum() <= 0:
                tok = int(torch.argmax(scores[i]))
            else:
                tok = int(torch.multinomial(p.cpu(), 1, generator=g))
            out[i, tok] = 0.0
        return out


def _preallocated_cache(layers: list[tuple[Any, Any]], length: int):
    """A ``DynamicCache`` whose layers write new tokens into preallocated buffers.

    ``layers``: per layer (keys, values) of shape ``(batch, heads, capacity, head_dim)`` holding
    ``length`` valid positions. ``DynamicLayer`` concatenates on every decode step (copying the
    whole cache, O(batch x length) per token); these layers write in place and return views of
    the same shape as a ``DynamicLayer`` would, so the attention masks are unchanged.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class _BufferLayer(DynamicLayer):
        def __init__(self, keys, values, n: int):
            super().__init__()
            self.buf_k, self.buf_v, self.n = keys, values, n
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True
            self._views()

        def _views(self) -> None:
            self.keys = self.buf_k[:, :, : self.n]
            self.values = self.buf_v[:, :, : self.n]

        def update(self, key_states, value_states, *args, **kwargs):
            m = key_states.shape[-2]
            self.buf_k[:, :, self.n : self.n + m] = key_states
            self.buf_v[:, :, self.n : self.n + m] = value_states
            self.n += m
            self._views()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.n

        def select_rows(self, idx) -> None:
            self.buf_k = self.buf_k.index_select(0, idx)
            self.buf_v = self.buf_v.index_select(0, idx)
            self._views()

    cache = DynamicCache()
    cache.layers = [_BufferLayer(k, v, length) for k, v in layers]
    return cache


class HFBackend(Backend):
    """transformers ``generate``: batched, left padding, stop at end of turn."""

    name = "hf"

    def __init__(self, policy: str | Path, adapter: str | Path | None = None, device: str = "auto",
                 dtype: str = "auto", max_context: int = 0, max_new_tokens: int = 256, batch_size: int = 64,
                 threads: int = 0):
        import os

        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        _check_model_dir(policy)
        _check_adapter_dir(adapter)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cpu":
            # intra-op threads: spinning threads fight the env workers for the cores (20x slower
            # generation measured on 2 busy cores with 2 threads vs 1); auto = half the cores
            torch.set_num_threads(threads if threads > 0 else max(1, (os.cpu_count() or 2) // 2))
        if dtype == "auto":
            tdtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        self.tokenizer = load_tokenizer(policy, adapter)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        try:
            model = AutoModelForCausalLM.from_pretrained(str(policy), dtype=tdtype, trust_remote_code=False,
                                                         use_safetensors=True)
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise QevolveError(f"--policy {policy}: cannot load the model ({msg})") from None
        if adapter is not None:
            from peft import PeftModel

            try:
                model = PeftModel.from_pretrained(model, str(adapter))
            except Exception as e:
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise QevolveError(f"--adapter {adapter}: cannot load the adapter ({msg})") from None
            model = model.merge_and_unload()
        self.model = model.to(self.device).eval()
        self.max_context = _model_max_context(self.model.config, self.tokenizer, max_context)
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.stop_ids = stop_token_ids(self.tokenizer)
        # CPU: prefill each prompt alone and decode the batch together (see _generate_cached);
        # GPU: transformers' padded batch generate. Models with sliding-window layers use generate.
        layer_types = getattr(self.model.config, "layer_types", None) or []
        self.per_sequence_prefill = self.device.type == "cpu" and not any("sliding" in str(t) for t in layer_types)
        self._gen_seconds = 0.0

    def _fit_ids(self, ids: list[int]) -> list[int]:
        room = self.max_context - self.max_new_tokens
        return ids[-room:] if len(ids) > room > 0 else ids

    def generate(self, requests: Sequence[Request], temperature: float, top_p: float = 1.0,
                 max_new_tokens: int | None = None) -> list[list[str]]:
        mnt = max_new_tokens or self.max_new_tokens
        rows: list[tuple[int, list[int], int]] = []  # (request index, ids, seed)
        for i, r in enumerate(requests):
            ids = self._fit_ids(self.prompt_ids(r.messages))
            for j in range(r.n):
                rows.append((i, ids, r.seed * 1000003 + j))
        texts: list[str] = []
        for b in range(0, len(rows), self.batch_size):
            chunk = rows[b : b + self.batch_size]
            t0 = time.perf_counter()
            if self.per_sequence_prefill:
                toks_list = self._generate_cached(chunk, mnt, temperature, top_p)
            else:
                toks_list = self._generate_padded(chunk, mnt, temperature, top_p)
            self._gen_seconds += time.perf_counter() - t0
            for toks in toks_list:
                cut = len(toks)
                for p, t in enumerate(toks):
                    if t in self.stop_ids:
                        cut = p
                        break
                texts.append(self.tokenizer.decode(toks[:cut], skip_special_tokens=True).strip())
        res: list[list[str]] = [[] for _ in requests]
        for (i, _, _), t in zip(rows, texts, strict=True):
            res[i].append(t)
        return res

    def _samplers(self, chunk, temperature: float, top_p: float):
        import torch

        if temperature <= 0:
            return None
        gens = []
        for _, _, seed in chunk:
            g = torch.Generator(device="cpu")
            g.manual_seed(seed & 0x7FFFFFFFFFFFFFFF)
            gens.append(g)
        return PerRequestSampler(gens, temperature, top_p)

    def _generate_padded(self, chunk, mnt: int, temperature: float, top_p: float) -> list[list[int]]:
        """``model.generate`` on the left-padded batch (GPU: one prefill for the whole batch)."""
        import torch

        pad = self.tokenizer.pad_token_id
        width = max(len(ids) for _, ids, _ in chunk)
        input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        for k, (_, ids, _) in enumerate(chunk):
            input_ids[k, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attn[k, width - len(ids) :] = 1
        kwargs: dict[str, Any] = dict(
            max_new_tokens=mnt, do_sample=False, eos_token_id=self.stop_ids, pad_token_id=pad,
            temperature=None, top_p=None, top_k=None,
        )
        sampler = self._samplers(chunk, temperature, top_p)
        if sampler is not None:
            from transformers import LogitsProcessorList

            kwargs["logits_processor"] = LogitsProcessorList([sampler])
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attn.to(self.device),
                                      **kwargs)
        return [row.tolist() for row in out[:, width:].cpu()]

    def _generate_cached(self, chunk, mnt: int, temperature: float, top_p: float) -> list[list[int]]:
        """Per-sequence prefill, then one batched decode over the left-padded KV caches.

        On CPU a padded batch prefill is several times slower than the same prompts one by one
        (the padding mask forces the materialised attention path and every row pays for the
        longest prompt: 8 SciWorld prompts of 1.8k-4.7k tokens took 3.7 s padded vs 0.54 s one
        by one), while the decode steps are what batching saves. Each prompt is therefore
        prefilled alone (no padding, the fused causal kernel), the caches are left-padded into
        one batch and the new tokens are decoded together; rows that finish leave the batch.
        Sampling is the same per-request draw as ``PerRequestSampler`` (greedy at T = 0).
        """
        import torch

        dev = self.device
        n = len(chunk)
        lens = [len(ids) for _, ids, _ in chunk]
        width = max(lens)
        cap = width + mnt
        layers: list[tuple[Any, Any]] = []
        last = []
        with torch.inference_mode():
            for k, (_, ids, _) in enumerate(chunk):
                out = self.model(input_ids=torch.tensor([ids], dtype=torch.long, device=dev), use_cache=True,
                                 logits_to_keep=1)
                last.append(out.logits[0, -1].float())
                for li, (key, val, *_rest) in enumerate(out.past_key_values):
                    if k == 0:
                        shape = (n, key.shape[1], cap, key.shape[3])
                        layers.append((key.new_zeros(shape), val.new_zeros((n, val.shape[1], cap, val.shape[3]))))
                    layers[li][0][k, :, width - lens[k] : width] = key[0]
                    layers[li][1][k, :, width - lens[k] : width] = val[0]
            cache = _preallocated_cache(layers, width)
            mask = torch.zeros((n, width), dtype=torch.long, device=dev)
            for k in range(n):
                mask[k, width - lens[k] :] = 1
            pos = torch.tensor(lens, dtype=torch.long, device=dev)
            logits = torch.stack(last)
            sampler = self._samplers(chunk, temperature, top_p)
            rows = list(range(n))  # chunk index of each batch row still decoding
            toks: list[list[int]] = [[] for _ in range(n)]
            for step in range(mnt):
                if sampler is None:
                    nxt = torch.argmax(logits, dim=-1)
                else:
                    nxt = torch.argmax(sampler(None, logits), dim=-1)
                keep = []
                for r, k in enumerate(rows):
                    t = int(nxt[r])
                    toks[k].append(t)
                    if t not in self.stop_ids:
                        keep.append(r)
                if not keep or step == mnt - 1:
                    break
                if len(keep) < len(rows):  # finished rows leave the batch
                    idx = torch.tensor(keep, dtype=torch.long, device=dev)
                    for layer in cache.layers:
                        layer.select_rows(idx)
                    nxt, mask, pos = nxt.index_select(0, idx), mask.index_select(0, idx), pos.index_select(0, idx)
                    if sampler is not None:
                        sampler = PerRequestSampler([sampler.generators[r] for r in keep], temperature, top_p)
                    rows = [rows[r] for r in keep]
                mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
                out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos[:, None],
                                 past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                pos = pos + 1
                logits = out.logits[:, -1].float()
        return toks

    def close(self) -> None:
        self.model = None


# --------------------------------------------------------------------------- vllm


def _first_line(e: BaseException) -> str:
    """One line out of an engine's exception: the last line of the message (a remote traceback ends
    with it), or the first error of a pydantic validation error, without the long lists vLLM appends."""
    import re

    lines = [ln.strip() for ln in str(e).strip().splitlines()
             if ln.strip() and not ln.strip().startswith("For further information")]
    if not lines:
        return type(e).__name__
    msg = lines[1] if len(lines) > 1 and re.match(r"\d+ validation errors? for", lines[0]) else lines[-1]
    msg = re.sub(r"\s*\[type=.*$", "", re.sub(r"^Value error, ", "", msg))
    msg = msg.split(". Supported architectures:")[0]
    return msg if len(msg) <= 300 else msg[:300] + " ..."


def vllm_cpu_defaults() -> None:
    """Environment defaults of vLLM's CPU backend (no CUDA): a 1 GiB KV cache (without it start-up
    fails on memory) and the engine in-process (``LLM(...)`` starts in ~3 s instead of ~17 s).
    Values already set in the environment win."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def vllm_quiet_logging() -> None:
    """vLLM logs INFO lines to stdout by default: results (``--json``) stay alone on stdout, vLLM's own
    messages go to stderr and only errors (on CPU its warnings repeat on every call, e.g. about
    thread binding); override with VLLM_LOGGING_LEVEL / VLLM_LOGGING_STREAM."""
    import logging
    import os

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # messages logged while vllm is being imported, before it configures its handler, go through
    # logging's last-resort handler (WARNING): the level is set on the package logger up front
    logging.getLogger("vllm").setLevel(level.upper())


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def _check_cpu_head_size(policy: str | Path) -> None:
    """vLLM's CPU attention kernels take a fixed list of head sizes; a model outside it loads and then
    fails on its first forward pass, so it is refused before the engine starts."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        return
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(str(policy))
    except Exception:
        return  # vLLM reports it
    cfg = getattr(cfg, "text_config", None) or cfg
    heads = getattr(cfg, "num_attention_heads", None)
    hd = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    if hd is not None and int(hd) not in sizes:
        raise QevolveError(f"--policy {policy}: vLLM cannot load the model (attention head size {hd}; vLLM's CPU "
                           f"kernels take {', '.join(map(str, sizes))}; e.g. `qevolve init-model --size tiny64`)")


VLLM_MISSING = ("--backend vllm: vLLM is not installed in this Python ({exe}); on a GPU node `pip install vllm`, "
                "on CPU `make vllm-venv` builds ~/.cache/qevolve/vllm-venv (docs/rollout.md, 'vLLM')")


class VLLMBackend(Backend):
    """vLLM offline engine: base model + optional LoRA adapter (GPU, or vLLM's CPU build)."""

    name = "vllm"

    def __init__(self, policy: str | Path, adapter: str | Path | None = None, max_context: int = 0,
                 max_new_tokens: int = 256, seed: int = 0, gpu_memory_utilization: float = 0.85,
                 dtype: str = "auto"):
        import importlib.util
        import sys

        _check_model_dir(policy)
        _check_adapter_dir(adapter)
        if importlib.util.find_spec("vllm") is None:
            raise QevolveError(VLLM_MISSING.format(exe=sys.executable))
        on_gpu = _cuda_available()
        if not on_gpu:
            vllm_cpu_defaults()
        vllm_quiet_logging()
        try:
            from vllm import LLM
        except ImportError as e:
            raise QevolveError(f"--backend vllm: vLLM does not import ({_first_line(e)})") from None
        self.tokenizer = load_tokenizer(policy, adapter)
        if not on_gpu:
            _check_cpu_head_size(policy)
        if dtype == "auto":  # like the hf backend: float32 on CPU (greedy output equal to hf), bf16 on GPU
            dtype = "auto" if on_gpu else "float32"
        kwargs: dict[str, Any] = dict(model=str(policy), seed=seed, trust_remote_code=False, dtype=dtype)
        if on_gpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:  # CPU: no torch.compile warm-up (35 s per engine start measured; 5 s eager)
            kwargs.update(enforce_eager=True, compilation_config={"mode": 0})
        if max_context and max_context > 0:
            kwargs["max_model_len"] = int(max_context)
        self.lora = None
        if adapter is not None:
            from vllm.lora.request import LoRARequest

            acfg = json.loads((Path(adapter) / "adapter_config.json").read_text())
            rank = int(acfg.get("r", 16))
            kwargs.update(enable_lora=True, max_lora_rank=max(8, 1 << (rank - 1).bit_length()), max_loras=1)
            self.lora = LoRARequest("policy_adapter", 1, str(Path(adapter).resolve()))
        try:
            self.llm = LLM(**kwargs)
        except Exception as e:  # vLLM raises many kinds (ValueError, RuntimeError, pydantic errors)
            raise QevolveError(f"--policy {policy}: vLLM cannot load the model ({_first_line(e)})") from None
        try:
            mml = self.llm.llm_engine.model_config.max_model_len
        except AttributeError:
            mml = None
        from transformers import AutoConfig

        self.max_context = int(mml) if mml else _model_max_context(AutoConfig.from_pretrained(str(policy)), self.tokenizer, max_context)
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_token_ids(self.tokenizer)

    def generate(self, requests: Sequence[Request], temperature: float, top_p: float = 1.0,
                 max_new_tokens: int | None = None) -> list[list[str]]:
        from vllm import SamplingParams

        mnt = max_new_tokens or self.max_new_tokens
        room = self.max_context - mnt
        prompts, params = [], []
        for r in requests:
            ids = self.prompt_ids(r.messages)
            if len(ids) > room > 0:
                ids = ids[-room:]
            prompts.append({"prompt_token_ids": ids})
            params.append(SamplingParams(
                n=r.n, temperature=max(temperature, 0.0), top_p=top_p if temperature > 0 else 1.0,
                max_tokens=mnt, seed=(r.seed & 0x7FFFFFFF) if temperature > 0 else None,
                stop_token_ids=self.stop_ids, skip_special_tokens=True,
            ))
        try:
            outs = self.llm.generate(prompts, sampling_params=params, lora_request=self.lora, use_tqdm=False)
        except Exception as e:  # an engine failure is one line (the rollout journal keeps finished episodes)
            raise QevolveError(f"--backend vllm: generation failed ({_first_line(e)})") from None
        res = []
        for o in outs:  # cut at the first stop token like the hf backend, then decode without specials
            texts = []
            for c in o.outputs:
                toks = list(c.token_ids)
                cut = next((p for p, t in enumerate(toks) if t in self.stop_ids), len(toks))
                texts.append(self.tokenizer.decode(toks[:cut], skip_special_tokens=True).strip())
            res.append(texts)
        return res

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            import gc

            del llm
            gc.collect()


# --------------------------------------------------------------------------- openai


class OpenAIBackend(Backend):
    """An OpenAI-compatible chat-completions server (``POST {base_url}/chat/completions``)."""

    name = "openai"

    def __init__(self, base_url: str, model: str, policy: str | Path | None = None, api_key: str | None = None,
                 max_context: int = 0, max_new_tokens: int = 256, timeout_s: float = 120.0,
                 concurrency: int = 16, retries: int = 2):
        import httpx

        if not base_url:
            raise QevolveError("--base-url: required with --backend openai (e.g. http://127.0.0.1:8000/v1)")
        if not base_url.startswith(("http://", "https://")):
            raise QevolveError(f"--base-url {base_url}: expected an http:// or https:// URL")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.base_url = base_url
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.retries = retries
        self.concurrency = concurrency
        self.tokenizer = None
        if policy is not None and (Path(policy) / "tokenizer_config.json").is_file():
            try:
                self.tokenizer = load_tokenizer(policy)
            except QevolveError:
                self.tokenizer = None
        cfg_max = 0
        if policy is not None and (Path(policy) / "config.json").is_file():
            cfg_max = int(json.loads((Path(policy) / "config.json").read_text()).get("max_position_embeddings") or 0)
        self.max_context = int(max_context) if max_context and max_context > 0 else (cfg_max or 4096)
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.client = httpx.Client(timeout=timeout_s, headers=headers)

    def _one(self, r: Request, temperature: float, top_p: float, mnt: int) -> list[str]:
        import httpx

        body: dict[str, Any] = {
            "model": self.model, "messages": r.messages, "max_tokens": mnt, "n": r.n,
            "temperature": max(temperature, 0.0), "seed": r.seed & 0x7FFFFFFF,
        }
        if temperature > 0 and top_p < 1.0:
            body["top_p"] = top_p
        last = ""
        for attempt in range(self.retries + 1):
            try:
                resp = self.client.post(self.url, json=body)
            except httpx.HTTPError as e:
                last = f"no OpenAI-compatible server answers at {self.base_url} ({type(e).__name__}: {e})"
                time.sleep(0.5 * (attempt + 1))
                continue
            if resp.status_code >= 500:
                last = f"server error {resp.status_code} from {self.url}: {resp.text[:200]}"
                time.sleep(0.5 * (attempt + 1))
                continue
            if resp.status_code != 200:
                raise QevolveError(f"--base-url {self.base_url}: HTTP {resp.status_code} from {self.url}: {resp.text[:300].strip()}")
            try:
                data = resp.json()
                choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
                texts = [(c["message"]["content"] or "").strip() for c in choices]
            except (ValueError, KeyError, TypeError) as e:
                raise QevolveError(f"--base-url {self.base_url}: malformed chat-completions answer ({type(e).__name__}: {e})") from None
            while len(texts) < r.n:  # servers that ignore n: ask again
                body1 = {**body, "n": 1, "seed": (body["seed"] + len(texts)) & 0x7FFFFFFF}
                texts.extend(self._one(Request(r.messages, body1["seed"], 1), temperature, top_p, mnt))
            return texts[: r.n]
        raise QevolveError(f"--base-url: {last}")

    def generate(self, requests: Sequence[Request], temperature: float, top_p: float = 1.0,
                 max_new_tokens: int | None = None) -> list[list[str]]:
        from concurrent.futures import ThreadPoolExecutor

        mnt = max_new_tokens or self.max_new_tokens
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests))) as ex:
            return list(ex.map(lambda r: self._one(r, temperature, top_p, mnt), requests))

    def close(self) -> None:
        self.client.close()


def make_backend(name: str, policy: str | Path, adapter: str | Path | None = None, *, base_url: str | None = None,
                 served_model: str | None = None, max_context: int = 0, max_new_tokens: int = 256,
                 seed: int = 0, device: str = "auto", dtype: str = "auto", batch_size: int = 64,
                 timeout_s: float = 120.0, threads: int = 0) -> Backend:
    """Build a backend by name (``hf``, ``vllm``, ``openai``)."""
    if name == "hf":
        return HFBackend(policy, adapter, device=device, dtype=dtype, max_context=max_context,
                         max_new_tokens=max_new_tokens, batch_size=batch_size, threads=threads)
    if name == "vllm":
        return VLLMBackend(policy, adapter, max_context=max_context, max_new_tokens=max_new_tokens, seed=seed,
                           dtype=dtype)
    if name == "openai":
        model = served_model or (Path(adapter).name if adapter else str(policy))
        return OpenAIBackend(base_url or "", model, policy=policy, max_context=max_context,
                             max_new_tokens=max_new_tokens, timeout_s=timeout_s)
    raise QevolveError(f"--backend: unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
