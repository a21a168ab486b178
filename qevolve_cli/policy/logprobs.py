"""Per-token log-probs of the policy's examples: in batches (eval mode, no grad) and the statistics the summary
reports (NLL of the action tokens, per-step log-prob changes, dpo's pair margins)."""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from qevolve_cli.policy.data import PolicyExample, collate

_MASKED_OK: dict[type, bool] = {}  # model class -> whether it takes the mask (masked_logits_supported)


class Layout(NamedTuple):
    """How the log-prob forwards lay out a batch, in the order :func:`batch_logprobs` and
    :func:`compute_logprobs` take them (``*layout``): one forward per sequence (``batch_layout``), logits at
    every position (``logits: all``), the rows' shared prompt prefix computed once (``shared_prefix``, in
    either layout)."""

    per_sequence: bool = False
    all_logits: bool = False
    shared_prefix: bool = False

    @classmethod
    def of(cls, cfg: Any, device: str, model: Any = None) -> Layout:
        """From a :class:`PolicyConfig` on ``device`` for ``model``. The shared prefix needs masked logits, not
        activation checkpointing (a checkpointed model in training mode drops the cache), and a model large
        enough for it to pay (:func:`qevolve_cli.models.kv.prefix_pays`; None: assumed)."""
        from qevolve_cli.models.kv import prefix_pays
        from qevolve_cli.training.batching import per_sequence_layout

        per_seq = per_sequence_layout(cfg.batch_layout, device)
        all_logits = cfg.logits == "all"
        shared = not all_logits and cfg.shared_prefix and not cfg.gradient_checkpointing
        return cls(per_seq, all_logits, bool(shared and (model is None or prefix_pays(model))))


def masked_logits_supported(model) -> bool:
    """Whether ``model`` (or the model under a PEFT / DeepSpeed / DDP wrapper) takes ``logits_to_keep`` as a
    boolean (B, T) mask: transformers' causal LMs that slice their hidden states with ``slice_logits_to_keep``
    (transformers 5; Llama, Qwen, Mistral, ...). Others (older transformers, remote code) get every position."""
    import inspect
    import sys

    from qevolve_cli.models.kv import unwrap_pretrained

    m = unwrap_pretrained(model)
    key = type(m)
    if key not in _MASKED_OK:
        mod = sys.modules.get(key.__module__)
        try:
            takes = "logits_to_keep" in inspect.signature(key.forward).parameters
        except (TypeError, ValueError):
            takes = False
        _MASKED_OK[key] = takes and getattr(mod, "slice_logits_to_keep", None) is not None
    return _MASKED_OK[key]


def batch_logprobs(model, batch: dict, device: str, per_sequence: bool = False, all_logits: bool = False,
                   shared_prefix: bool = False):
    """Per-token log pi of the next token, (B, T) prediction-aligned, at the positions of the batch's loss
    ``mask``; the other positions hold 0 (nothing reads them: every loss, ratio and statistic is masked). A
    batch without ``mask`` gets every position.

    The output layer and the log-softmax run at the masked positions only (``logits_to_keep`` with the mask),
    where the model supports it (:func:`masked_logits_supported`) and ``all_logits`` is off; the values are
    those of the full forward. ``per_sequence``: one forward per row, cut to its own length (the batch is
    right-padded), so no padding position is computed and no attention mask is needed; the real positions hold
    the same values as the padded forward (causal attention). ``shared_prefix`` (with masked logits): the
    leading tokens every row shares before its first masked position (the system prompt and in-context
    example: :func:`qevolve_cli.models.kv.shared_prefix_len`) run once, and each row's rest (per sequence) or
    the padded batch of the rests runs on their keys and values; the same values up to rounding."""
    import torch

    from qevolve_cli.models.kv import repeat_layers, shared_prefix_len

    ids = batch["input_ids"].to(device)
    att = batch["attention_mask"]
    mask = batch.get("mask")
    keep = None if all_logits or mask is None or not masked_logits_supported(model) else mask.to(device)
    lens = att.sum(dim=1).tolist()
    P = shared_prefix_len(ids, lens, keep) if shared_prefix and keep is not None else 0
    if P and not per_sequence:  # the padded rests in one forward on the prefix's keys and values, B times
        B = ids.shape[0]
        layers = repeat_layers(_prefix_layers(model, ids[:1, :P]), B)
        lp = _logprobs(model, ids[:, P:], att.to(device), keep[:, P:], layers)
        return torch.nn.functional.pad(lp, (P, 0))
    if per_sequence and (P or min(lens) < ids.shape[1]):
        T = ids.shape[1]
        layers = _prefix_layers(model, ids[:1, :P]) if P else None
        rows = []
        for b, n in enumerate(lens):
            kb = None if keep is None else keep[b : b + 1, :n]
            if layers is None:
                lp = _logprobs(model, ids[b : b + 1, :n], None, kb)
            else:
                lp = _logprobs(model, ids[b : b + 1, P:n], None, kb[:, P:], layers)
            rows.append(torch.nn.functional.pad(lp, (P if layers is not None else 0, T - n)))
        return torch.cat(rows, dim=0)
    return _logprobs(model, ids, att.to(device), keep)


def _prefix_layers(model, ids):
    """The shared prefix's per-layer keys and values (in the graph when gradients are on); one logit is
    computed (the prefix's positions are never read: they end before every masked position)."""
    from qevolve_cli.models.kv import cache_layers, out_cache

    return cache_layers(out_cache(model(input_ids=ids, use_cache=True, logits_to_keep=1)))


def _logprobs(model, ids, att, keep, prefix=None):
    from qevolve_cli.algos import masked_logprobs, sequence_logprobs

    if prefix is not None:  # ids: the rests after the shared prefix, on a cache that starts from it; att (B, P + L)
        from qevolve_cli.models.kv import cache_kwarg, cache_of_layers

        out = model(input_ids=ids, attention_mask=att, use_cache=True, logits_to_keep=keep,
                    **{cache_kwarg(model): cache_of_layers(prefix)})
        return masked_logprobs(out.logits, ids, keep)
    if keep is None:
        return sequence_logprobs(model(input_ids=ids, attention_mask=att, use_cache=False).logits, ids)
    out = model(input_ids=ids, attention_mask=att, use_cache=False, logits_to_keep=keep)
    return masked_logprobs(out.logits, ids, keep)


def compute_logprobs(model, examples: list[PolicyExample], pad_id: int, max_tokens: int, device: str,
                     autocast=None, per_sequence: bool = False, all_logits: bool = False,
                     shared_prefix: bool = False) -> list[np.ndarray]:
    """Log-probs of every example under ``model`` (eval mode, no grad) -> one (L,) array per example, at its loss
    positions (0 elsewhere: :func:`batch_logprobs`)."""
    import contextlib

    import torch

    from qevolve_cli.training import token_budget_batches

    was_training = model.training
    model.eval()
    res: list[np.ndarray | None] = [None] * len(examples)
    with torch.no_grad():
        for idx in token_budget_batches([len(e) for e in examples], max_tokens, 0, shuffle=False):
            batch = collate([examples[i] for i in idx], pad_id)
            with autocast() if autocast else contextlib.nullcontext():
                lp = batch_logprobs(model, batch, device, per_sequence, all_logits, shared_prefix).float().cpu().numpy()
            for b, i in enumerate(idx):
                res[i] = lp[b, : len(examples[i])].copy()
    if was_training:
        model.train()
    return res  # type: ignore[return-value]


def step_logprob_stats(examples: list[PolicyExample], logps: list[np.ndarray]) -> dict[str, Any]:
    """Per-step summed action log-prob (over loss tokens) and the mean NLL per target token."""
    per_step: list[tuple[float, float]] = []  # (advantage, summed logp)
    tot, n = 0.0, 0
    for e, lp in zip(examples, logps, strict=False):
        m = e.loss_mask[1:]
        st = e.step[1:]
        v = lp[: len(e) - 1]
        tot += float(-(v[m]).sum())
        n += int(m.sum())
        for s in np.unique(st[m]):
            sel = m & (st == s)
            per_step.append((float(e.advantages[s]), float(v[sel].sum())))
    return {"nll": tot / max(1, n), "per_step": per_step, "tokens": n}


def dpo_pair_stats(examples: list[PolicyExample], pairs: list[tuple[list[int], list[int]]],
                   lp_before: list[np.ndarray], lp_after: list[np.ndarray], lp_ref: list[np.ndarray],
                   beta: float) -> dict[str, Any]:
    """Trajectory log-probs (summed over the loss tokens of the trajectory's windows, the example indices of
    each side of a pair) of the pairs before / after training.

    ``dpo_chosen_logp_delta`` / ``dpo_rejected_logp_delta``: mean change of log pi(chosen) / log pi(rejected);
    ``dpo_margin_before/after``: mean of log pi(chosen) - log pi(rejected); ``dpo_accuracy_after``: share of
    pairs whose implicit reward beta * (log-ratio to pi_ref) is higher for the chosen trajectory.
    """
    def tot(lps: list[np.ndarray], rows: list[int]) -> float:
        return float(sum(lps[i][: len(examples[i]) - 1][examples[i].loss_mask[1:]].sum() for i in rows))

    cb = np.array([tot(lp_before, c) for c, _ in pairs])
    rb = np.array([tot(lp_before, r) for _, r in pairs])
    ca = np.array([tot(lp_after, c) for c, _ in pairs])
    ra = np.array([tot(lp_after, r) for _, r in pairs])
    cref = np.array([tot(lp_ref, c) for c, _ in pairs])
    rref = np.array([tot(lp_ref, r) for _, r in pairs])
    return {
        "dpo_pairs": len(pairs),
        "dpo_chosen_logp_delta": float((ca - cb).mean()),
        "dpo_rejected_logp_delta": float((ra - rb).mean()),
        "dpo_margin_before": float((cb - rb).mean()),
        "dpo_margin_after": float((ca - ra).mean()),
        "dpo_accuracy_after": float((beta * (ca - cref) > beta * (ra - rref)).mean()),
    }
