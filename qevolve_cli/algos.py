"""Pure torch loss functions for Q-Evolve (policy and critic), shapes documented.

Conventions (like verl's ``core_algos.py``):
  * ``B`` = batch size, ``T`` = sequence length (tokens).
  * ``mask`` is a ``(B, T)`` float/bool tensor: 1 where a token contributes to the loss.
  * Functions are stateless and free of model code so that they can be tested
    against plain reference loops.
"""

from __future__ import annotations

import torch

from qevolve_cli.rewards import CRITIC_REDUCTIONS  # torch-free names shared with the configs

# ---- policy losses ----
#
# Shapes: logp, logp_old, logp_ref, advantages, token_weights, mask: (B, T),
# aligned per *predicted* token (position j holds log pi(x_{j+1} | x_{<=j}) or,
# equivalently, whatever alignment the caller uses consistently).
# Reduction ("token-mean"): sum over unmasked tokens of weight * term, divided by
# the number of unmasked tokens. Token weights therefore scale exactly their own
# token's contribution; masked positions are replaced by 0 with torch.where so
# that even NaN/inf there has no effect on the value or the gradient.


def fill_masked(x: torch.Tensor, mask: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """``x`` with masked-out positions replaced by ``value`` (so NaN/inf there cannot leak into gradients)."""
    return torch.where(mask.bool(), x, torch.full((), value, dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is non-zero -> scalar."""
    m = mask.bool()
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over unmasked positions -> scalar (0 when nothing is unmasked)."""
    n = mask.bool().sum().clamp(min=1)
    return masked_sum(x, mask) / n


def _weighted(x: torch.Tensor, token_weights: torch.Tensor | None) -> torch.Tensor:
    return x if token_weights is None else x * token_weights


def thought_token_weights(is_thought: torch.Tensor, thought_weight: float) -> torch.Tensor:
    """Per-token weights: ``thought_weight`` on thought tokens, 1 elsewhere. (B, T) -> (B, T) float."""
    ones = torch.ones(is_thought.shape, dtype=torch.float32, device=is_thought.device)
    return torch.where(is_thought.bool(), ones * float(thought_weight), ones)


def token_nll(logp: torch.Tensor, mask: torch.Tensor, token_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Behaviour cloning: masked token-mean negative log-likelihood -> scalar.

    ``-sum_j m_j w_j logp_j / sum_j m_j`` (``w = 1`` without token weights).
    """
    if token_weights is not None:
        token_weights = fill_masked(token_weights, mask)
    return -masked_mean(_weighted(fill_masked(logp, mask), token_weights), mask)


def bppo_surrogate(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                   eps_low: float = 0.8, eps_high: float = 0.4) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped behaviour-proximal surrogate (to be *maximised*).

    ``eta = exp(logp - logp_old)``;
    ``obj = min(eta * A, clip(eta, 1 - eps_low, 1 + eps_high) * A)``.
    For A > 0 the objective is flat (zero gradient) once eta > 1 + eps_high;
    for A < 0 once eta < 1 - eps_low. Returns ``(obj, clipped)`` both (B, T);
    ``clipped`` is True where the clipped branch is active (zero gradient).
    """
    eta = torch.exp(logp - logp_old)
    unclipped = eta * advantages
    clipped_eta = torch.clamp(eta, 1.0 - eps_low, 1.0 + eps_high)
    clipped = clipped_eta * advantages
    obj = torch.minimum(unclipped, clipped)
    is_clipped = (clipped < unclipped) & (clipped_eta != eta)
    return obj, is_clipped


def kl_estimate(logp: torch.Tensor, logp_ref: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probs of the data tokens. (B, T).

    With ``r = logp_ref - logp`` (Schulman's estimators, as in GRPO):
    ``k1 = -r`` (unbiased, can be negative), ``k2 = r^2 / 2`` (biased, low
    variance), ``k3 = exp(r) - r - 1`` (unbiased for tokens drawn from pi,
    always >= 0, zero with zero gradient when pi == pi_ref). Default: k3.
    The ratio is clamped to exp(+-20) for numerical safety.
    """
    r = torch.clamp(logp_ref - logp, -20.0, 20.0)
    if kind == "k1":
        return -r
    if kind == "k2":
        return 0.5 * r * r
    if kind == "k3":
        return torch.exp(r) - r - 1.0
    raise ValueError(f"unknown KL estimator {kind!r} (k1, k2, k3)")


def bppo_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              token_weights: torch.Tensor | None = None, eps_low: float = 0.8, eps_high: float = 0.4,
              logp_ref: torch.Tensor | None = None, kl_coef: float = 0.0,
              kl_kind: str = "k3") -> tuple[torch.Tensor, dict[str, float]]:
    """BPPO loss to *minimise* -> (scalar, stats).

    ``loss = -token_mean(w * min(eta A, clip(eta) A)) + kl_coef * token_mean(w * KL_hat)``
    where ``A`` is the step advantage broadcast to every token of that step's
    action and ``w`` the token weights (thought tokens down-weighted).
    Stats: ``pg_loss``, ``kl``, ``clip_frac``, ``ratio_mean`` (floats, masked).
    """
    logp, logp_old, advantages = fill_masked(logp, mask), fill_masked(logp_old, mask), fill_masked(advantages, mask)
    if token_weights is not None:
        token_weights = fill_masked(token_weights, mask)
    if logp_ref is not None:
        logp_ref = fill_masked(logp_ref, mask)
    obj, is_clipped = bppo_surrogate(logp, logp_old, advantages, eps_low, eps_high)
    pg_loss = -masked_mean(_weighted(obj, token_weights), mask)
    loss = pg_loss
    kl_val = torch.zeros((), device=logp.device)
    if logp_ref is not None and kl_coef > 0:
        kl_val = masked_mean(_weighted(kl_estimate(logp, logp_ref, kl_kind), token_weights), mask)
        loss = loss + kl_coef * kl_val
    with torch.no_grad():
        m = mask.bool()
        n = m.sum().clamp(min=1)
        stats = {
            "pg_loss": float(pg_loss.detach()),
            "kl": float(kl_val.detach()),
            "clip_frac": float((is_clipped & m).sum() / n),
            "ratio_mean": float(masked_mean(torch.exp(logp - logp_old).detach(), mask)),
        }
    return loss, stats


def awr_weights(advantages: torch.Tensor, beta: float = 1.0, max_weight: float = 20.0) -> torch.Tensor:
    """AWR weights ``min(exp(A / beta), max_weight)`` (no gradient). Same shape as ``advantages``.

    The exponent is clamped before exp so large advantages never overflow.
    """
    with torch.no_grad():
        import math

        z = torch.clamp(advantages / beta, max=math.log(max_weight))
        return torch.exp(z)


def awr_loss(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             token_weights: torch.Tensor | None = None, beta: float = 1.0,
             max_weight: float = 20.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantage-weighted regression: ``-token_mean(w * min(exp(A/beta), max_w) * logp)`` -> (scalar, stats)."""
    logp, advantages = fill_masked(logp, mask), fill_masked(advantages, mask)
    if token_weights is not None:
        token_weights = fill_masked(token_weights, mask)
    aw = awr_weights(advantages, beta, max_weight)
    loss = -masked_mean(_weighted(aw * logp, token_weights), mask)
    with torch.no_grad():
        stats = {"awr_weight_mean": float(masked_mean(aw, mask)), "nll": float(-masked_mean(logp.detach(), mask))}
    return loss, stats


def sequence_logratio(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor,
                      token_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sequence log-ratio ``sum_j m_j w_j (logp_j - logp_ref_j)``: (B, T) -> (B,).

    With ``mask`` on the assistant tokens of a whole trajectory this is
    ``log pi(trajectory actions) - log pi_ref(trajectory actions)`` (ETO's
    trajectory-level log-ratio). Masked positions are replaced by 0 first, so
    NaN/inf there has no effect on the value or the gradient.
    """
    d = fill_masked(logp, mask) - fill_masked(logp_ref, mask).detach()
    if token_weights is not None:
        d = d * fill_masked(token_weights, mask)
    return fill_masked(d, mask).sum(dim=-1)


def trajectory_logratio(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, owner: torch.Tensor,
                        n: int) -> torch.Tensor:
    """Per-trajectory log-ratio of trajectories split over several rows (windows): (B, T) x 3, owner (B,) -> (n,).

    Row b belongs to trajectory ``owner[b]`` (in ``0..n-1``); entry i is the sum of
    :func:`sequence_logratio` over its rows. With windows in which every action is a target exactly
    once (``policy.data.encode_windows``) this is ``log pi(trajectory actions) - log pi_ref(...)`` of
    the whole trajectory, each action scored in its window's context. Masked positions have no
    effect (:func:`sequence_logratio`).
    """
    rows = sequence_logratio(logp, logp_ref, mask)
    return torch.zeros(n, dtype=rows.dtype, device=rows.device).index_add(0, owner.to(rows.device), rows)


def dpo_loss(logratio_chosen: torch.Tensor, logratio_rejected: torch.Tensor,
             beta: float = 0.1) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO (Rafailov et al. 2023; ETO: trajectory pairs) to *minimise* -> (scalar, stats).

    ``loss = mean_p -log sigmoid(beta * (logratio_chosen_p - logratio_rejected_p))`` over the
    P pairs; inputs (P,) from :func:`sequence_logratio`. Stats (floats): ``reward_chosen`` /
    ``reward_rejected`` (mean implicit rewards ``beta * logratio``), ``reward_margin`` and
    ``reward_accuracy`` (share of pairs with chosen reward > rejected reward).
    """
    z = beta * (logratio_chosen - logratio_rejected)
    loss = -torch.nn.functional.logsigmoid(z).mean()
    with torch.no_grad():
        rc, rr = beta * logratio_chosen.detach(), beta * logratio_rejected.detach()
        stats = {
            "reward_chosen": float(rc.mean()),
            "reward_rejected": float(rr.mean()),
            "reward_margin": float((rc - rr).mean()),
            "reward_accuracy": float((rc > rr).float().mean()),
        }
    return loss, stats


def dpo_nll_loss(logratio_chosen: torch.Tensor, logratio_rejected: torch.Tensor, logp_chosen: torch.Tensor,
                 mask_chosen: torch.Tensor, beta: float = 0.1,
                 nll_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO plus an NLL term on the chosen trajectories (RPO, Pang et al. 2024; TRL's ``rpo_alpha``) -> (scalar, stats).

    ``loss = dpo_loss(logratio_chosen, logratio_rejected, beta) + nll_weight * NLL_chosen`` with
    ``NLL_chosen = -sum_{p,j} m_pj logp_chosen_pj / sum_{p,j} m_pj``: the token-mean negative
    log-likelihood of the chosen trajectories' action tokens over the batch (TRL's RPO term: the
    cross-entropy of the chosen half, averaged over its label tokens). ``logp_chosen`` and
    ``mask_chosen`` are (P, T), aligned with the rows that gave ``logratio_chosen`` (P,). The NLL
    term keeps the chosen trajectories likely while the preference margin grows (plain DPO can lower
    both sides' likelihood: docs/compare.md, ETO). Masked positions have no effect (replaced by 0).
    ``nll_weight = 0`` is :func:`dpo_loss` exactly. Stats: those of :func:`dpo_loss`, ``dpo_loss``
    and ``nll_chosen``.
    """
    loss, stats = dpo_loss(logratio_chosen, logratio_rejected, beta)
    nll = token_nll(logp_chosen, mask_chosen)
    stats = {**stats, "dpo_loss": float(loss.detach()), "nll_chosen": float(nll.detach())}
    if nll_weight:
        loss = loss + nll_weight * nll
    return loss, stats


def sequence_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token. logits (B, T, V), input_ids (B, T) -> (B, T).

    Position j holds ``log pi(x_{j+1} | x_{<=j})``; the last position is 0
    (nothing to predict). Computed with cross-entropy in float32 (no (B, T, V)
    log-softmax copy kept beyond the kernel's own).
    """
    B, T, V = logits.shape
    out = torch.zeros((B, T), dtype=torch.float32, device=logits.device)
    if T < 2:
        return out
    lp = -torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, V).float(), input_ids[:, 1:].reshape(-1), reduction="none"
    ).view(B, T - 1)
    return torch.cat([lp, out[:, :1]], dim=1)


def masked_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """:func:`sequence_logprobs` from the logits of the kept positions only. logits (N, V): one row per True of
    ``keep`` (B, T) bool, in row-major order (what transformers returns for ``logits_to_keep=keep``); input_ids
    (B, T) -> (B, T): position j holds ``log pi(x_{j+1} | x_{<=j})`` where ``keep`` is True, 0 elsewhere. The
    last position has no next token: ``keep`` must be False there (``policy.data.collate``'s mask is). With no
    kept position the result is all 0 and still part of the graph."""
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=logits.device)
    nxt = torch.roll(input_ids, shifts=-1, dims=1)[keep]  # the last column would wrap: keep is False there
    lp = -torch.nn.functional.cross_entropy(logits.float(), nxt, reduction="none")
    return out.masked_scatter(keep, lp)


# ---- critic losses ----
# Weighted IQL (docs/critic.md, paper Appendix "Critic Model Structure"). Tensors of
# per-step quantities have shape (B, K): B trajectories x K sampled steps
# (right-padded); ``step_mask`` is 1 on real steps. Padded entries may hold
# anything (even NaN): they are selected away with ``torch.where`` and never
# reach the loss or its gradient.



def expectile_loss(diff: torch.Tensor, m: float) -> torch.Tensor:
    """Asymmetric squared loss L2^m(x) = |m - 1(x < 0)| * x^2, elementwise.

    ``diff`` = target - prediction (paper: Qbar - V). m = 0.5 gives x^2 / 2.
    """
    w = torch.where(diff < 0, 1.0 - m, m).to(diff.dtype)
    return w * diff.square()


def td_target(reward: torch.Tensor, done: torch.Tensor, next_value: torch.Tensor, gamma: float) -> torch.Tensor:
    """y = r + gamma * (1 - d) * V(s'); ``done`` bool or 0/1. No gradient flows into ``next_value``."""
    not_done = 1.0 - done.to(next_value.dtype)
    return reward.to(next_value.dtype) + gamma * not_done * next_value.detach()


def critic_reduce(per_step: torch.Tensor, weight: torch.Tensor, step_mask: torch.Tensor,
                  reduction: str = "traj_sum") -> torch.Tensor:
    """Weighted, masked reduction of a (B, K) per-step loss to a scalar.

    * ``traj_sum`` (default, the paper's Algorithm "Critic optimization"): sum of
      w_t * loss over each trajectory's sampled steps, averaged over the B
      trajectories of the batch;
    * ``sum``: sum over all real steps;
    * ``mean``: sum of w_t * loss divided by the number of real steps.
    """
    mask = step_mask.bool()
    x = torch.where(mask, weight.to(per_step.dtype) * per_step, torch.zeros((), dtype=per_step.dtype,
                                                                              device=per_step.device))
    total = x.sum()
    if reduction == "sum":
        return total
    if reduction == "traj_sum":
        return total / max(per_step.shape[0], 1)
    if reduction == "mean":
        return total / mask.sum().clamp(min=1).to(per_step.dtype)
    raise ValueError(f"unknown reduction {reduction!r} (choose from {', '.join(CRITIC_REDUCTIONS)})")


def critic_q_loss(q1: torch.Tensor, q2: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
                  step_mask: torch.Tensor, reduction: str = "traj_sum") -> torch.Tensor:
    """L_Q = sum_t w_t [(Q1 - y)^2 + (Q2 - y)^2] (Double-Q TD regression); ``target`` is detached."""
    y = target.detach()
    mask = step_mask.bool()
    zero = torch.zeros((), dtype=q1.dtype, device=q1.device)
    # zero padded entries *before* squaring so NaN/inf there cannot leak into gradients
    d1 = torch.where(mask, q1 - y, zero)
    d2 = torch.where(mask, q2 - y, zero)
    return critic_reduce(d1.square() + d2.square(), weight, step_mask, reduction)


def critic_v_loss(v: torch.Tensor, q1_target: torch.Tensor, q2_target: torch.Tensor, weight: torch.Tensor,
                  step_mask: torch.Tensor, m: float, reduction: str = "traj_sum") -> torch.Tensor:
    """L_V = sum_t w_t L2^m(min(Qbar1, Qbar2) - V) (weighted expectile regression); Qbar detached."""
    qbar = torch.minimum(q1_target, q2_target).detach()
    mask = step_mask.bool()
    diff = torch.where(mask, qbar - v, torch.zeros((), dtype=v.dtype, device=v.device))
    return critic_reduce(expectile_loss(diff, m), weight, step_mask, reduction)


@torch.no_grad()
def ema_update_(target: list[torch.Tensor], online: list[torch.Tensor], lam: float) -> None:
    """In place: target <- (1 - lam) * target + lam * online, pairwise (paper Eq. "EMA delayed Q")."""
    if len(target) != len(online):
        raise ValueError(f"EMA: {len(target)} target tensors but {len(online)} online tensors")
    for t, o in zip(target, online, strict=True):
        if t.shape != o.shape:
            raise ValueError(f"EMA: shape mismatch {tuple(t.shape)} vs {tuple(o.shape)}")
        t.mul_(1.0 - lam).add_(o.detach().to(t.dtype), alpha=lam)
