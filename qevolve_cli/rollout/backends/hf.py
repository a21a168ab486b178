"""The ``hf`` backend: transformers on CPU or GPU (see :mod:`qevolve_cli.rollout.backends`)."""
from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qevolve_cli.errors import QevolveError
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
