"""The ``hf`` backend: transformers on CPU or GPU (see :mod:`qevolve_cli.rollout.backends`)."""
from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qevolve_cli.errors import QevolveError
from qevolve_cli.models.kv import cache_kwarg, out_cache
from qevolve_cli.precision import resolve_dtype
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



def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token id sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


KV_COUNTERS = ("prompts", "prompt_tokens", "prefill_tokens", "kv_hits", "kv_partial", "kv_fallbacks", "kv_new",
               "kv_shared", "kv_evictions", "generated_tokens")
#: fewest tokens an episode without a cache must share with the last fresh prompt to start from its cache
SHARED_MIN_TOKENS = 32


class KVStore:
    """Per-episode KV caches kept between environment steps, bounded in bytes.

    An entry is the token ids an episode's model state was computed on and, per layer, the keys
    and values of those positions (``(1, kv_heads, len, head_dim)``). :meth:`lookup` compares the
    next prompt's **token ids** with the entry's (a chat template can re-tokenise the boundary, so
    text is not compared): the positions of the longest common prefix are reused (keys and values
    of a position depend only on the tokens up to it) and only the rest is computed. Outcomes,
    counted in :attr:`counts`:

    * ``kv_hits``: the cached ids are a prefix of the prompt (only the new tokens are computed);
    * ``kv_partial``: they share a shorter prefix (the cache is cut there; e.g. the model's own
      tokens for its action differ from the re-tokenised action, or the transcript was shortened);
    * ``kv_fallbacks``: an entry exists but shares no token: a full re-prefill;
    * ``kv_shared``: no entry, but the prompt shares at least :data:`SHARED_MIN_TOKENS` leading tokens with
      the **shared entry** (:meth:`put_shared`: the last prompt prefilled without any cache): those are
      reused. An episode's first prompt is the system prompt, the in-context example and the task
      (455 of 495 tokens are common to two lamps tasks with SmolLM2's template), and the N samples of
      one task (best-of-N, ``n_per_task``) start from the same prompt, so most first steps compute
      only what differs;
    * ``kv_new``: no entry and nothing shared (the first episode, reuse off): a full prefill.

    Entries beyond ``cap_bytes`` are evicted least recently used first (``kv_evictions``); the shared
    entry (one prompt's keys and values) is held beside them.
    """

    def __init__(self, cap_bytes: int):
        from collections import OrderedDict

        self.cap_bytes = int(cap_bytes)
        self.entries: OrderedDict[Any, tuple[list[int], list[tuple[Any, Any]], int]] = OrderedDict()
        self.bytes = 0
        self.counts = dict.fromkeys(KV_COUNTERS, 0)
        self.shared: tuple[list[int], list[tuple[Any, Any]]] | None = None
        self.shared_min = SHARED_MIN_TOKENS  # a benchmark's baseline sets it out of reach

    def lookup(self, key: Any, ids: Sequence[int]) -> tuple[int, list[tuple[Any, Any]] | None]:
        """(positions to reuse, per-layer keys/values) for a prompt ``ids`` of episode ``key``;
        at least one token is left to compute (its logits start the generation)."""
        self.counts["prompts"] += 1
        self.counts["prompt_tokens"] += len(ids)
        ent = self.entries.get(key) if key is not None else None
        if ent is None:
            if key is not None and self.shared is not None:
                n = min(common_prefix_len(self.shared[0], ids), len(ids) - 1)
                if n >= self.shared_min:
                    self.counts["kv_shared"] += 1
                    self.counts["prefill_tokens"] += len(ids) - n
                    return n, self.shared[1]
            self.counts["kv_new"] += 1
            self.counts["prefill_tokens"] += len(ids)
            return 0, None
        cached, layers, _ = ent
        n = min(common_prefix_len(cached, ids), len(ids) - 1)
        if n <= 0:
            self.counts["kv_fallbacks"] += 1
            self.counts["prefill_tokens"] += len(ids)
            return 0, None
        self.counts["kv_hits" if n == len(cached) else "kv_partial"] += 1
        self.counts["prefill_tokens"] += len(ids) - n
        self.entries.move_to_end(key)
        return n, layers

    def put(self, key: Any, ids: list[int], layers: list[tuple[Any, Any]]) -> None:
        """Keep ``layers`` (computed on ``ids``) for episode ``key``, evicting the oldest beyond the cap."""
        self.drop(key)
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        if nbytes > self.cap_bytes:
            self.counts["kv_evictions"] += 1
            return
        while self.entries and self.bytes + nbytes > self.cap_bytes:
            self.drop(next(iter(self.entries)))
            self.counts["kv_evictions"] += 1
        self.entries[key] = (list(ids), layers, nbytes)
        self.bytes += nbytes

    def put_shared(self, ids: list[int], layers: list[tuple[Any, Any]]) -> None:
        """Keep ``layers`` (computed on ``ids`` from no cache) as the shared entry, replacing the last one."""
        self.shared = (list(ids), layers)

    def drop(self, key: Any) -> None:
        ent = self.entries.pop(key, None)
        if ent is not None:
            self.bytes -= ent[2]


class HFBackend(Backend):
    """transformers ``generate``: batched, left padding, stop at end of turn."""

    name = "hf"

    def __init__(self, policy: str | Path, adapter: str | Path | None = None, device: str = "auto",
                 dtype: str = "auto", max_context: int = 0, max_new_tokens: int = 256, batch_size: int = 64,
                 threads: int = 0, kv_reuse: bool = True, kv_cache_mb: int = 2048):
        import os

        import torch
        from transformers import AutoModelForCausalLM

        from qevolve_cli.progress import quiet_transformers

        quiet_transformers()
        _check_model_dir(policy)
        _check_adapter_dir(adapter)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cpu":
            # intra-op threads: spinning threads fight the env workers for the cores (20x slower
            # generation measured on 2 busy cores with 2 threads vs 1); auto = half the cores
            torch.set_num_threads(threads if threads > 0 else max(1, (os.cpu_count() or 2) // 2))
        # auto: bf16 weights on CUDA and on CPUs with native bf16, fp32 elsewhere (qevolve_cli/precision.py)
        tdtype = resolve_dtype(dtype, self.device.type)
        self.dtype = str(tdtype).removeprefix("torch.")
        self.tokenizer = load_tokenizer(policy, adapter=adapter, require_chat_template=True)
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
        # KV caches kept between the steps of an episode (Request.key); CPU path only (see _generate_cached)
        self.kv_reuse = bool(kv_reuse)
        self._cache_kw = cache_kwarg(self.model)
        self.kv = KVStore(int(kv_cache_mb) << 20)

    def end_episode(self, key: Any) -> None:
        self.kv.drop(key)

    def counters(self) -> dict[str, int]:
        return dict(self.kv.counts, kv_cached_mb=self.kv.bytes >> 20)

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
        self._requests = requests
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
                self.kv.counts["generated_tokens"] += cut
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

        for _, ids, _ in chunk:  # no reuse on this path: every prompt token is computed
            self.kv.counts["prompts"] += 1
            self.kv.counts["prompt_tokens"] += len(ids)
            self.kv.counts["prefill_tokens"] += len(ids)
            self.kv.counts["kv_new"] += 1

        pad = self.tokenizer.pad_token_id
        width = max(len(ids) for _, ids, _ in chunk)
        input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        for k, (_, ids, _) in enumerate(chunk):
            input_ids[k, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attn[k, width - len(ids) :] = 1
        kwargs: dict[str, Any] = dict(
            max_new_tokens=mnt, do_sample=False, eos_token_id=self.stop_ids, pad_token_id=pad,
            temperature=None, top_p=None, top_k=None, stop_strings=[STOP], tokenizer=self.tokenizer,
        )
        sampler = self._samplers(chunk, temperature, top_p)
        if sampler is not None:
            from transformers import LogitsProcessorList

            kwargs["logits_processor"] = LogitsProcessorList([sampler])
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attn.to(self.device),
                                      **kwargs)
        return [row.tolist() for row in out[:, width:].cpu()]

    def _prefill(self, ids: list[int], key: Any):
        """Logits of the last prompt position and per-layer ``(1, heads, len(ids), dim)`` keys/values,
        computing only the positions the episode's kept cache does not already hold."""
        import torch

        dev = self.device
        n, past = self.kv.lookup(key, ids) if self.kv_reuse else self.kv.lookup(None, ids)
        if past is None:
            out = self.model(input_ids=torch.tensor([ids], dtype=torch.long, device=dev), use_cache=True,
                             logits_to_keep=1)
            layers = [(k, v) for k, v, *_ in out_cache(out)]
            if self.kv_reuse and key is not None:
                self.kv.put_shared(ids, layers)  # later episodes' first prompts start from its common prefix
            return out.logits[0, -1].float(), layers
        cap = len(ids)
        bufs = []
        for k, v in past:
            bk = k.new_empty((1, k.shape[1], cap, k.shape[3]))
            bv = v.new_empty((1, v.shape[1], cap, v.shape[3]))
            bk[:, :, :n] = k[:, :, :n]
            bv[:, :, :n] = v[:, :, :n]
            bufs.append((bk, bv))
        cache = _preallocated_cache(bufs, n)
        pos = torch.arange(n, cap, dtype=torch.long, device=dev)[None]
        out = self.model(input_ids=torch.tensor([ids[n:]], dtype=torch.long, device=dev), position_ids=pos,
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[0, -1].float(), bufs

    def _generate_cached(self, chunk, mnt: int, temperature: float, top_p: float) -> list[list[int]]:
        """Per-sequence prefill, then one batched decode over the left-padded KV caches.

        On CPU a padded batch prefill is several times slower than the same prompts one by one
        (the padding mask forces the materialised attention path and every row pays for the
        longest prompt: 8 SciWorld prompts of 1.8k-4.7k tokens took 3.7 s padded vs 0.54 s one
        by one), while the decode steps are what batching saves. Each prompt is therefore
        prefilled alone (no padding, the fused causal kernel), the caches are left-padded into
        one batch and the new tokens are decoded together; rows that finish (a stop token, or ReAct's
        text stop ``react.STOP``) leave the batch.
        Sampling is the same per-request draw as ``PerRequestSampler`` (greedy at T = 0).

        KV reuse (``kv_reuse``): a request with a ``key`` continues that episode's kept cache
        (:class:`KVStore`: only the tokens past the common prefix of token ids are prefilled), and
        the cache of prompt + generated tokens is kept for the episode's next step (for ``n > 1``
        the prompt's only: which candidate is played is not known here). Rows of one request share
        one prefill.
        """
        import torch

        dev = self.device
        n = len(chunk)
        reqs = getattr(self, "_requests", None) or []
        keys = [reqs[i].key if i < len(reqs) else None for i, _, _ in chunk]
        nreq = [reqs[i].n if i < len(reqs) else 1 for i, _, _ in chunk]
        lens = [len(ids) for _, ids, _ in chunk]
        width = max(lens)
        cap = width + mnt
        layers: list[tuple[Any, Any]] = []
        last = []
        with torch.inference_mode():
            prev = None  # (request index, logits, kv) of the row before: rows of one request share it
            for k, (i, ids, _) in enumerate(chunk):
                if prev is not None and prev[0] == i:
                    logit, kv = prev[1], prev[2]
                else:
                    logit, kv = self._prefill(ids, keys[k])
                    prev = (i, logit, kv)
                    if self.kv_reuse and keys[k] is not None and nreq[k] > 1:
                        self.kv.put(keys[k], ids, kv)
                last.append(logit)
                for li, (key, val) in enumerate(kv):
                    if k == 0:
                        shape = (n, key.shape[1], cap, key.shape[3])
                        layers.append((key.new_zeros(shape), val.new_zeros((n, val.shape[1], cap, val.shape[3]))))
                    layers[li][0][k, :, width - lens[k] : width] = key[0, :, : lens[k]]
                    layers[li][1][k, :, width - lens[k] : width] = val[0, :, : lens[k]]
            del prev, kv
            cache = _preallocated_cache(layers, width)
            mask = torch.zeros((n, width), dtype=torch.long, device=dev)
            for k in range(n):
                mask[k, width - lens[k] :] = 1
            pos = torch.tensor(lens, dtype=torch.long, device=dev)
            logits = torch.stack(last)
            sampler = self._samplers(chunk, temperature, top_p)
            rows = list(range(n))  # chunk index of each batch row still decoding
            toks: list[list[int]] = [[] for _ in range(n)]

            def stopped(k: int) -> bool:
                """Row ``k`` wrote ReAct's stop (``react.STOP``): the rest would be an invented observation."""
                return "Observation:" in self.tokenizer.decode(toks[k][-8:]) and STOP in self.tokenizer.decode(toks[k])

            def keep_cache(r: int, k: int, fed: int) -> None:
                """Keep row ``r`` (chunk row ``k``): its prompt and the ``fed`` generated tokens decoded so far."""
                if not self.kv_reuse or keys[k] is None or nreq[k] > 1:
                    return
                a, b = width - lens[k], width + fed
                kv = [(ly.buf_k[r : r + 1, :, a:b].clone(), ly.buf_v[r : r + 1, :, a:b].clone()) for ly in cache.layers]
                self.kv.put(keys[k], list(chunk[k][1]) + toks[k][:fed], kv)

            for step in range(mnt):
                if sampler is None:
                    nxt = torch.argmax(logits, dim=-1)
                else:
                    nxt = torch.argmax(sampler(None, logits), dim=-1)
                keep = []
                for r, k in enumerate(rows):
                    t = int(nxt[r])
                    toks[k].append(t)
                    if t not in self.stop_ids and not stopped(k):
                        keep.append(r)
                if not keep or step == mnt - 1:
                    for r, k in enumerate(rows):
                        keep_cache(r, k, step)
                    break
                if len(keep) < len(rows):  # finished rows leave the batch
                    kept = set(keep)
                    for r, k in enumerate(rows):
                        if r not in kept:
                            keep_cache(r, k, step)
                    idx = torch.tensor(keep, dtype=torch.long, device=dev)
                    for layer in cache.layers:
                        layer.select_rows(idx)
                    nxt, mask, pos = nxt.index_select(0, idx), mask.index_select(0, idx), pos.index_select(0, idx)
                    if sampler is not None:
                        sampler = PerRequestSampler([sampler.generators[r] for r in keep], temperature, top_p)
                    rows = [rows[r] for r in keep]
                mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
                out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos[:, None],
                                 use_cache=True, **{self._cache_kw: cache})
                cache = out_cache(out)
                pos = pos + 1
                logits = out.logits[:, -1].float()
        return toks

    def close(self) -> None:
        self.model = None
