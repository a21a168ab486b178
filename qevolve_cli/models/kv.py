"""Key/value caches across transformers releases, and the shared prompt prefix of a training batch.

Rollouts (``rollout/backends/hf.py``) keep an episode's cache between steps; the trainers (the policy's
log-probs, the critic's pooled states) compute the prompt prefix that every row of a batch shares once and
run each row's remainder on top of it (:func:`shared_prefix_len`, :func:`cache_of_layers`). The layout
of the prompts makes that prefix long: the system prompt and the environment's in-context example come
first in every trajectory (docs/rollout.md, "Prompt layout"; 455 of 495 tokens of a first lamps prompt
with SmolLM2's chat template).
"""
from __future__ import annotations

from typing import Any

#: fewest tokens the rows of a batch must share for the trainers to compute the prefix once
SHARED_PREFIX_MIN_TOKENS = 32
#: fewest parameters of a model for the shared prefix to pay: on the 205 k-parameter tiny llama a token costs
#: less than the extra forward call and the caches it takes (a critic epoch 0.68x as fast with it), on
#: SmolLM2-135M it saves 1.2-1.5x (docs/performance.md, "The shared prompt prefix in training")
SHARED_PREFIX_MIN_PARAMS = 20_000_000


def prefix_pays(model: Any) -> bool:
    """Whether the trainers compute a batch's shared prefix once for ``model`` (wrapped or not): it has at
    least :data:`SHARED_PREFIX_MIN_PARAMS` parameters (below that the extra forward call costs more than it
    saves) and no sliding-window attention layers (a cache built from plain layers would hold their keys
    past the window; such models keep one whole forward per row, as rollouts do)."""
    m = unwrap_pretrained(model)
    layer_types = getattr(getattr(m, "config", None), "layer_types", None) or []
    if any("sliding" in str(t) for t in layer_types):
        return False
    return m.num_parameters() >= SHARED_PREFIX_MIN_PARAMS


def unwrap_pretrained(model: Any) -> Any:
    """The transformers model under a PEFT / DeepSpeed engine / DDP wrapper (``model`` itself if none)."""
    import torch
    from transformers import PreTrainedModel

    m = model
    for _ in range(4):  # PEFT -> the base model; DeepSpeed engine / DDP -> .module
        if isinstance(m, PreTrainedModel):
            break
        if hasattr(m, "get_base_model"):
            m = m.get_base_model()
        elif isinstance(getattr(m, "module", None), torch.nn.Module):
            m = m.module
        else:
            break
    return m


def cache_kwarg(model: Any) -> str:
    """The name under which the model's ``forward`` takes the KV cache: ``cache`` in current transformers
    (``past_key_values`` is deprecated there, with a FutureWarning on every call), ``past_key_values``
    in the older releases the vLLM venv pins. A wrapped model (PEFT, DeepSpeed) is asked through its
    transformers model, whose ``forward`` receives the keyword."""
    import inspect

    return "cache" if "cache" in inspect.signature(unwrap_pretrained(model).forward).parameters else "past_key_values"


def out_cache(out: Any) -> Any:
    """The KV cache of a forward pass's output (``cache``, or ``past_key_values`` in older transformers)."""
    c = getattr(out, "cache", None)
    return c if c is not None else out.past_key_values


def cache_layers(cache: Any) -> list[tuple[Any, Any]]:
    """Per layer (keys, values) of a cache, each ``(batch, heads, length, head_dim)``."""
    return [(k, v) for k, v, *_ in cache]


def repeat_layers(layers: list[tuple[Any, Any]], batch: int) -> list[tuple[Any, Any]]:
    """Per layer (keys, values) of one sequence ``(1, heads, length, head_dim)`` as views for ``batch`` rows
    (``expand``: no copy; gradients of every row flow back into the one sequence's tensors)."""
    return [(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)) for k, v in layers]


def cache_of_layers(layers: list[tuple[Any, Any]]) -> Any:
    """A fresh ``DynamicCache`` that starts from ``layers`` (per layer (keys, values)), without copying them.

    Each forward on it concatenates its new keys and values into new tensors (``DynamicLayer.update``), so
    the given tensors are never written: one prefix's layers can start any number of caches, and gradients
    flow back into the forward that made them."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache()
    out = []
    for k, v in layers:
        layer = DynamicLayer()
        layer.dtype, layer.device = k.dtype, k.device
        layer.keys, layer.values = k, v
        layer.is_initialized = True
        out.append(layer)
    cache.layers = out
    return cache


def shared_prefix_len(input_ids: Any, lengths: list[int], keep: Any = None,
                      min_tokens: int = SHARED_PREFIX_MIN_TOKENS) -> int:
    """How many leading tokens every row of a right-padded batch shares, to be computed once: 0 when it is
    fewer than ``min_tokens`` or the batch has one row.

    input_ids (B, T); ``lengths``: each row's real length. At least one token of every row is left to its
    own forward (the prefix is shorter than the shortest row). ``keep`` (B, T) bool, optional: the positions
    whose outputs are read (the policy's loss mask, prediction-aligned); the prefix ends at the first of them
    in any row, so that every read position is computed by a row's own forward."""
    B = int(input_ids.shape[0])
    if B < 2:
        return 0
    n = min(lengths) - 1
    if keep is not None:
        hits = keep[:, :n].any(dim=0).nonzero()
        if len(hits):
            n = int(hits[0])
    if n < min_tokens:
        return 0
    same = (input_ids[:, :n] == input_ids[:1, :n]).all(dim=0)
    diff = (~same).nonzero()
    p = int(diff[0]) if len(diff) else n
    return p if p >= min_tokens else 0

