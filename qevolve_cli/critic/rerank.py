"""Critic reranking at test time (the paper's "w/o PI" ablation): best-of-N by Q - V.

Given the transcript state (the chat messages up to the current observation,
built by :mod:`qevolve_cli.transcript`, ending on a user message) and N
candidate model outputs, :func:`rerank` scores each candidate with
A = min(Qbar1, Qbar2)(s, a) - V(s) and returns the index of the best one.
V(s) is the same for every candidate (one value forward on the state); the N
(state, candidate) sequences go through the delayed Q adapter in one batch.

``qevolve eval --critic DIR --candidates N`` uses :class:`CriticReranker`.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from qevolve_cli.critic.data import render_ids
from qevolve_cli.errors import QevolveError
from qevolve_cli.tokenizer import pad_id_of


class CriticReranker:
    """A loaded critic + tokenizer; call :meth:`scores` / :meth:`best` per decision."""

    def __init__(self, critic_dir: str | Path, device: str = "auto"):
        from qevolve_cli.critic.feature_critic import is_feature_critic
        from qevolve_cli.critic.score import load_critic

        if is_feature_critic(critic_dir):
            raise QevolveError(f"--critic {critic_dir}: a feature critic (kind: features) cannot rerank yet: "
                               "train a LoRA critic (kind: lora) for eval --critic (docs/critic.md, 'The feature "
                               "critic')")
        self.model, self.tokenizer = load_critic(critic_dir, device=device)
        if self.model.time_scale > 0:
            raise QevolveError(f"--critic {critic_dir}: a time-aware critic (time_input: "
                               f"{self.model.time_input}) cannot rerank yet: "
                               "the chooser does not know the episode's step index; train it with time_input: none")
        self.pad_id = pad_id_of(self.tokenizer)
        self.device = next(self.model.heads.parameters()).device

    def scores(self, messages: Sequence[dict[str, str]], candidates: Sequence[str]) -> list[float]:
        """Q - V of each candidate output appended as the assistant turn after ``messages``."""
        import torch

        if not candidates:
            raise QevolveError("rerank: no candidates")
        if not messages or messages[-1]["role"] != "user":
            raise QevolveError("rerank: the transcript state must end with a user message (the observation)")
        state = render_ids(self.tokenizer, list(messages))
        seqs = [render_ids(self.tokenizer, [*messages, {"role": "assistant", "content": c.strip()}])
                for c in candidates]
        if any(s[: len(state)] != state for s in seqs):
            raise QevolveError("rerank: the chat template does not render the state as a prefix of state + action")
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        att = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            att[i, : len(s)] = 1
        pos_sa = torch.tensor([[len(s) - 1] for s in seqs], dtype=torch.long)
        m = self.model
        with torch.no_grad():
            st = torch.tensor([state], dtype=torch.long, device=self.device)
            (h_s,) = m.pooled("value", st, torch.ones_like(st), torch.tensor([[len(state) - 1]], device=self.device))
            v = m.head("v", h_s)[0, 0]
            (h_sa,) = m.pooled("q_target", ids.to(self.device), att.to(self.device), pos_sa.to(self.device))
            q = torch.minimum(m.head("q1_target", h_sa), m.head("q2_target", h_sa))[:, 0]
        return (q - v).cpu().tolist()

    def best(self, messages: Sequence[dict[str, str]], candidates: Sequence[str]) -> int:
        s = self.scores(messages, candidates)
        return max(range(len(s)), key=lambda i: s[i])


def rerank(critic: CriticReranker | str | Path, messages: Sequence[dict[str, str]],
           candidates: Sequence[str]) -> tuple[int, list[float]]:
    """(index of the candidate with the highest Q - V, the N scores)."""
    r = critic if isinstance(critic, CriticReranker) else CriticReranker(critic)
    s = r.scores(messages, candidates)
    return max(range(len(s)), key=lambda i: s[i]), s


def make_chooser(critic_dir: str | Path, *, policy: str | None = None, env: str | None = None,
                 device: str = "auto"):
    """The rollout loop's chooser for ``qevolve eval --critic DIR --candidates N``.

    ``chooser(requests, candidates) -> [index per request]``: for each waiting
    episode (``request.messages`` = the transcript state) the candidate with the
    highest Q - V is played. ``policy`` and ``env`` are accepted for the hook's
    signature; the critic carries its own tokenizer.
    """
    del policy, env
    r = CriticReranker(critic_dir, device=device if device in ("auto", "cpu", "cuda") else "auto")

    def chooser(requests, candidates) -> list[int]:
        return [r.best(req.messages, cands) for req, cands in zip(requests, candidates, strict=True)]

    return chooser
