"""Policy training data: the rows each objective trains on (:func:`load_policy_table`, one table or several),
and one tokenised sequence per trajectory with per-token labels.

Each trajectory is rendered once with the shared transcript builder
(:func:`qevolve_cli.transcript.build_messages`, ending on its last action) and
the tokenizer's chat template, tokenised once (with character offsets), and
every token gets:

* ``loss_mask`` - True for tokens of an assistant message's content (the full
  model output: thought + action) and of its end-of-turn token (the template's
  ``eos_token`` right after the content). System/user prompts, observations,
  role headers and the head's in-context example with its reply ``OK``
  (:class:`qevolve_cli.transcript.Layout`) are False;
* ``step`` - the step t whose action the token belongs to (-1 elsewhere), so
  that the step advantage A_t applies to every token of that action;
* ``is_thought`` - True for content tokens before the last ``Action:`` marker
  (:func:`qevolve_cli.react.action_char_span`). Outputs with no ``Action:``
  (format errors) count as action tokens, so their penalty is not down-weighted.

Long trajectories (longer than ``max_length`` tokens) become several sequences, one per window of the
shared sliding-window rule (:func:`qevolve_cli.transcript.window_starts`, the critic's prefix index uses
it too): step t's action is trained once, after the head (system prompt, example, instruction and o_0)
and the most recent turns that fit with it, the fewest dropped turns, as the rollout shows the policy
(:func:`qevolve_cli.transcript.truncate`), or, with ``window_context`` below 1, a new window starts with
room left so that the next steps share it (fewer tokens; a step then sees at least that share of
``max_length`` as context, and at most what the rollout shows). Steps that share the dropped turns share
one sequence; the actions of older steps in it are context (no loss). A window that does not fit even
with one turn is cut at ``max_length``. DPO uses the same windows: a trajectory's log-ratio is the sum over
its windows (each action counted once). :func:`encode_trajectory` is the one-sequence alternative (the
oldest turns dropped until it fits, as the rollout shows the policy its last step; their actions are not
targets): ``benchmarks/bench_windows.py``'s baseline.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from qevolve_cli import transcript
from qevolve_cli.errors import QevolveError, TableError
from qevolve_cli.policy.config import PolicyConfig
from qevolve_cli.react import action_char_span


@dataclass
class PolicyExample:
    traj_id: str
    input_ids: np.ndarray  # (L,) int64
    loss_mask: np.ndarray  # (L,) bool, token-aligned (True: this token is a training target)
    step: np.ndarray  # (L,) int32, step of the action the token belongs to, -1 elsewhere
    is_thought: np.ndarray  # (L,) bool
    advantages: np.ndarray  # (n_steps,) float32 (zeros when the table has none)
    source: str
    dropped_turns: int = 0
    cut: bool = False
    window: int = 0  # index of this sequence within its trajectory (0 unless the trajectory is windowed)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_targets(self) -> int:
        return int(self.loss_mask.sum())


def render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def assistant_spans(tokenizer, messages: list[dict[str, str]], text: str, first: int = 0
                    ) -> list[tuple[int, int, int, int]]:
    """Character spans of the assistant messages from index ``first`` on in the rendered ``text``.

    Returns ``(message_index, content_start, content_end, turn_end)`` where
    ``turn_end`` also covers the end-of-turn token when the template puts the
    tokenizer's ``eos_token`` right after the content.
    """
    eos = tokenizer.eos_token or ""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < first:
            continue
        prefix = render(tokenizer, messages[:i], add_generation_prompt=True)
        content = m["content"]
        start = len(prefix) if text.startswith(prefix) else -1
        if start < 0 or text[start : start + len(content)] != content:
            # templates that add text between the generation prompt and the content
            guess = text.find(content, max(0, min(len(prefix), len(text))) - 64)
            if guess < 0:
                raise QevolveError(
                    "the chat template changes assistant messages when rendering a conversation; "
                    "cannot locate the action tokens (use a template that renders assistant content verbatim)"
                )
            start = guess
        end = start + len(content)
        turn_end = end
        if eos:
            k = text.find(eos, end)
            if k >= 0 and text[end:k].strip() == "":
                turn_end = k + len(eos)
        spans.append((i, start, end, turn_end))
    return spans


Encoded = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, bool]


def _encode(tokenizer, msgs: list[dict[str, str]], lay: transcript.Layout, first_step: int, owned_from: int,
            max_length: int, dropped: int) -> Encoded:
    """Tokenise rendered ``msgs`` whose assistant messages after the head are the actions of steps
    ``first_step, first_step + 1, ...``; those of steps ``>= owned_from`` are targets, earlier ones context."""
    text = render(tokenizer, msgs)
    spans = assistant_spans(tokenizer, msgs, text, first=lay.head)
    char_step = np.full(len(text) + 1, -1, dtype=np.int32)
    char_thought = np.zeros(len(text) + 1, dtype=bool)
    for j, (mi, start, _end, turn_end) in enumerate(spans):
        if first_step + j < owned_from:
            continue
        char_step[start:turn_end] = first_step + j
        span = action_char_span(msgs[mi]["content"])
        if span is not None and span[0] > 0:
            char_thought[start : start + span[0]] = True
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    offs = enc["offset_mapping"]
    L = len(ids)
    step = np.full(L, -1, dtype=np.int32)
    thought = np.zeros(L, dtype=bool)
    for k, (s, e) in enumerate(offs):
        if e <= s:
            continue
        seg = char_step[s:e]
        hit = np.nonzero(seg >= 0)[0]
        if hit.size:
            step[k] = seg[hit[0]]
            thought[k] = char_thought[s + hit[0]]
    cut = False
    if L > max_length:
        ids, step, thought, cut = ids[:max_length], step[:max_length], thought[:max_length], True
    mask = step >= 0
    return ids, mask, step, thought, dropped, cut


def encode_trajectory(tokenizer, system: str, instruction: str, observations: Sequence[str],
                      actions: Sequence[str], max_length: int, layout: transcript.Layout | bool = False,
                      example: str | None = None) -> Encoded:
    """Tokenise one trajectory as one sequence -> (ids, loss_mask, step, is_thought, dropped_turns, cut): the
    oldest turns are dropped until it fits (:func:`qevolve_cli.transcript.truncate`; their actions are not
    targets). Every objective trains on :func:`encode_windows`; this is its one-sequence baseline.

    ``example``: the environment's in-context example, needed when ``layout.example``.
    """
    n = len(actions)
    lay = transcript.as_layout(layout)
    msgs = transcript.build_messages(system, instruction, list(observations), list(actions), lay, example)
    tr = transcript.truncate(msgs, lambda m: _n_tokens(tokenizer, render(tokenizer, m)) <= max_length, lay)
    n_kept = sum(1 for m in tr.messages[lay.head:] if m["role"] == "assistant")
    return _encode(tokenizer, tr.messages, lay, n - n_kept, 0, max_length, tr.dropped_turns)


def encode_windows(tokenizer, system: str, instruction: str, observations: Sequence[str],
                   actions: Sequence[str], max_length: int, layout: transcript.Layout | bool = False,
                   example: str | None = None, window_context: float = 0.5) -> list[Encoded]:
    """Tokenise one trajectory as one sequence per window (module docstring) -> a list of (ids, loss_mask,
    step, is_thought, dropped_turns, cut); every step's action is a target in exactly one of them (unless a
    cut removed it). A trajectory that fits ``max_length`` is one sequence, the same as
    :func:`encode_trajectory`'s. ``window_context`` (PolicyConfig): a new window starts with the fewest
    dropped turns that leave its turns up to its first trained action within that share of ``max_length``
    minus the head; 1 = the fewest that fit (each step then sees the rollout's context)."""
    n = len(actions)
    lay = transcript.as_layout(layout)
    msgs = transcript.build_messages(system, instruction, list(observations), list(actions), lay, example)
    head = lay.head

    def window(j: int, b: int) -> list[dict[str, str]]:  # head + a_j, o_{j+1}, ..., o_b, a_b
        return msgs[:head] + msgs[head + 2 * j : head + 2 * b + 1]

    def length(j: int, t: int) -> int:
        return _n_tokens(tokenizer, render(tokenizer, window(j, t)))

    whole = _encode(tokenizer, msgs, lay, 0, 0, max_length, 0)
    if not whole[5]:  # not cut: it fits whole (rendered and tokenised once)
        return [whole]
    head_len = _n_tokens(tokenizer, render(tokenizer, msgs[:head]))
    js = transcript.window_starts(n, length, max_length, head_len, window_context)
    out = []
    t0 = 0
    for t in range(n):
        if t + 1 == n or js[t + 1] != js[t]:
            j = js[t]
            out.append(_encode(tokenizer, window(j, t), lay, j, t0, max_length, j))
            t0 = t + 1
    return out


def build_examples(df: pl.DataFrame, tokenizer, max_length: int, with_advantage: bool = False,
                   path: str | None = None, layout: transcript.Layout | None = None,
                   windows: bool = True, window_context: float = 0.5) -> list[PolicyExample]:
    """Tokenise every trajectory of a (validated, step-sorted) table (layout: :func:`transcript.layout_of`):
    one example per window of a long trajectory (:func:`encode_windows`; the windows of one trajectory
    share its ``advantages`` array), or with ``windows=False`` one per trajectory (:func:`encode_trajectory`,
    the oldest turns dropped: the baseline of ``benchmarks/bench_windows.py``)."""
    from qevolve_cli.envs.prompts import example_prompt, instruction_prompt
    from qevolve_cli.schema import sort_steps

    if layout is None:
        layout = transcript.layout_of(tokenizer)
    if getattr(tokenizer, "chat_template", None) is None:
        raise QevolveError("the tokenizer has no chat template (tokenizer_config.json: chat_template)")
    df = sort_steps(df)
    out: list[PolicyExample] = []
    for (traj_id,), g in df.group_by("traj_id", maintain_order=True):
        env = g["env"][0]
        try:
            system = instruction_prompt(env)
            example = example_prompt(env) if layout.example else None
        except KeyError as e:
            raise TableError(path, "env", str(e).strip("'\"")) from None
        adv = g["advantage"].to_numpy().astype(np.float32) if with_advantage else np.zeros(g.height, np.float32)
        if with_advantage and np.isnan(adv).any():
            t = int(np.nonzero(np.isnan(adv))[0][0])
            raise TableError(path, "advantage", f"null/NaN advantage in trajectory {traj_id!r} step {t} "
                             "(run `qevolve label --critic` first)")
        args = (tokenizer, system, g["instruction"][0], g["observation"].to_list(), g["action"].to_list(),
                max_length, layout, example)
        seqs = encode_windows(*args, window_context=window_context) if windows else [encode_trajectory(*args)]
        for w, (ids, mask, step, thought, dropped, cut) in enumerate(seqs):
            out.append(PolicyExample(str(traj_id), ids, mask, step, thought, adv, g["source"][0], dropped, cut, w))
    return out


def collate(examples: Sequence[PolicyExample], pad_id: int, thought_weight: float = 1.0,
            logp_old: Sequence[np.ndarray] | None = None, logp_ref: Sequence[np.ndarray] | None = None) -> dict:
    """Pad a micro-batch. Per-token tensors are *prediction-aligned*: position j scores token j+1.

    Returns ``input_ids, attention_mask`` (B, T) and ``mask, adv, is_thought,
    token_weights`` (B, T) aligned with :func:`qevolve_cli.algos.sequence_logprobs`;
    plus ``logp_old`` / ``logp_ref`` (B, T) when given (stored prediction-aligned).
    """
    import torch

    B = len(examples)
    T = max(len(e) for e in examples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    att = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.bool)
    adv = torch.zeros((B, T), dtype=torch.float32)
    thought = torch.zeros((B, T), dtype=torch.bool)
    lo = torch.zeros((B, T), dtype=torch.float32) if logp_old is not None else None
    lr = torch.zeros((B, T), dtype=torch.float32) if logp_ref is not None else None
    for b, e in enumerate(examples):
        L = len(e)
        ids[b, :L] = torch.from_numpy(e.input_ids)
        att[b, :L] = 1
        # token j+1 is predicted at position j
        mask[b, : L - 1] = torch.from_numpy(e.loss_mask[1:])
        st = e.step[1:]
        a = np.where(st >= 0, e.advantages[np.clip(st, 0, None)] if e.advantages.size else 0.0, 0.0)
        adv[b, : L - 1] = torch.from_numpy(a.astype(np.float32))
        thought[b, : L - 1] = torch.from_numpy(e.is_thought[1:])
        if lo is not None:
            lo[b, :L] = torch.from_numpy(logp_old[b])
        if lr is not None:
            lr[b, :L] = torch.from_numpy(logp_ref[b])
    tw = torch.where(thought, torch.full_like(adv, float(thought_weight)), torch.ones_like(adv))
    out = {"input_ids": ids, "attention_mask": att, "mask": mask, "adv": adv, "is_thought": thought,
           "token_weights": tw}
    if lo is not None:
        out["logp_old"] = lo
    if lr is not None:
        out["logp_ref"] = lr
    return out


# --------------------------------------------------------------------------- RFT / DPO data selection


def trajectory_rewards(df: pl.DataFrame) -> pl.DataFrame:
    """One row per trajectory: ``traj_id, env, task_id, source, reward`` (final reward = sum of ``reward_env``,
    as in evaluation), in the order the trajectories first appear."""
    return (
        df.group_by("traj_id", maintain_order=True)
        .agg(pl.col("env").first(), pl.col("task_id").first(), pl.col("source").first(),
             pl.col("reward_env").sum().cast(pl.Float64).alias("reward"))
    )


def rft_select(df: pl.DataFrame, min_reward: float = 1.0) -> tuple[pl.DataFrame, dict[str, int]]:
    """Rejection-sampling fine-tuning rows: every expert trajectory plus the self trajectories whose final
    reward is >= ``min_reward``. -> (rows, counts ``expert``, ``self_kept``, ``self_dropped``)."""
    per = trajectory_rewards(df)
    expert = per.filter(pl.col("source") == "expert")
    self_ = per.filter(pl.col("source") != "expert")
    kept = self_.filter(pl.col("reward") >= min_reward - 1e-6)
    keep_ids = pl.concat([expert["traj_id"], kept["traj_id"]])
    out = df.filter(pl.col("traj_id").is_in(keep_ids.implode()))
    return out, {"expert": expert.height, "self_kept": kept.height, "self_dropped": self_.height - kept.height}


def dpo_pairs(df: pl.DataFrame, anchor: str = "expert") -> tuple[list[tuple[str, str]], dict[str, int]]:
    """ETO's trajectory preference pairs -> ([(chosen traj_id, rejected traj_id)], counts).

    Per task (``env``, ``task_id``): the anchor is the task's expert trajectory (the first one with the
    highest final reward when there are several). Every self trajectory of the task is compared with the
    anchor by final reward (sum of ``reward_env``): lower -> (anchor, self) ("lose" in ETO's
    ``construct_preference.py``), higher -> (self, anchor) ("win"), equal -> no pair ("tie").
    Tasks without an expert trajectory give no pair (ETO) unless ``anchor == "expert_or_best"``: then
    the task's highest-reward self trajectory (the first one on ties) is the anchor and the other self
    trajectories with a strictly lower reward are its rejected partners. Counts: ``lose``, ``win``,
    ``tie``, ``no_anchor`` (self trajectories of tasks without an anchor), ``tasks_with_pairs``.
    """
    if anchor not in ("expert", "expert_or_best"):
        raise ValueError(f"unknown DPO anchor {anchor!r} (expert, expert_or_best)")
    per = trajectory_rewards(df)
    pairs: list[tuple[str, str]] = []
    counts = {"lose": 0, "win": 0, "tie": 0, "no_anchor": 0, "tasks_with_pairs": 0}
    for (_env, _task), g in per.group_by(["env", "task_id"], maintain_order=True):
        ids, src, rew = g["traj_id"].to_list(), g["source"].to_list(), g["reward"].to_list()
        experts = [i for i, s in enumerate(src) if s == "expert"]
        selfs = [i for i, s in enumerate(src) if s != "expert"]
        n0 = len(pairs)
        if experts:
            a = max(experts, key=lambda i: (rew[i], -i))
            for i in selfs:
                if rew[i] < rew[a]:
                    pairs.append((ids[a], ids[i]))
                    counts["lose"] += 1
                elif rew[i] > rew[a]:
                    pairs.append((ids[i], ids[a]))
                    counts["win"] += 1
                else:
                    counts["tie"] += 1
        elif anchor == "expert_or_best" and selfs:
            a = max(selfs, key=lambda i: (rew[i], -i))
            for i in selfs:
                if i == a:
                    continue
                if rew[i] < rew[a]:
                    pairs.append((ids[a], ids[i]))
                    counts["lose"] += 1
                else:
                    counts["tie"] += 1
        else:
            counts["no_anchor"] += len(selfs)
        counts["tasks_with_pairs"] += int(len(pairs) > n0)
    return pairs, counts


# --------------------------------------------------------------------------- tables


def data_paths(data) -> list[Path]:
    """``--data``: one table or several (a list); returned as a list of paths."""
    if isinstance(data, (str, Path)):
        return [Path(data)]
    paths = [Path(d) for d in data]
    if not paths:
        raise QevolveError("--data: no trajectory table given")
    return paths


def read_tables(data, require: tuple[str, ...] | list[str] = ()):
    """Read and validate one or several tables; several are stacked (a trajectory id may appear in one only)."""
    from qevolve_cli.schema import read_table

    paths = data_paths(data)
    frames, seen = [], set()
    for p in paths:
        df = read_table(p, require=require)
        ids = set(df["traj_id"].unique().to_list())
        dup = sorted(ids & seen)
        if dup:
            raise TableError(p, "traj_id", f"trajectory {dup[0]!r} also appears in an earlier --data table")
        seen |= ids
        frames.append(df)
    return frames[0] if len(frames) == 1 else pl.concat(frames, how="diagonal_relaxed")


def read_training_rows(cfg: PolicyConfig, data):
    """The rows every objective selects from: the tables read and validated (``advantage`` required for bppo
    and awr), crashed trajectories dropped when ``cfg.drop_failed``. -> (rows, the tables' names for errors)."""
    from qevolve_cli.schema import drop_failed

    paths = data_paths(data)
    where = paths[0] if len(paths) == 1 else ", ".join(map(str, paths))
    need = ["advantage"] if cfg.uses_advantage else []
    df = read_tables(paths, need)
    if cfg.drop_failed:
        df = drop_failed(df)
    return df, where


def load_policy_table(cfg: PolicyConfig, data):
    """Read (one or several tables) and select the training rows of ``data`` for ``cfg.objective``.

    -> (rows, info): ``info`` holds the rft counts or the dpo ``pairs`` and counts.
    """
    df, where = read_training_rows(cfg, data)
    info: dict[str, Any] = {}
    if cfg.objective == "bc" and cfg.bc_source == "expert":
        df = df.filter(pl.col("source") == "expert")
        if df.height == 0:
            raise TableError(where, "source", "no expert rows to clone (bc uses rows with source == 'expert')")
    elif cfg.objective == "rft":
        df, info = rft_select(df, cfg.rft_min_reward)
        if df.height == 0:
            raise TableError(where, "source", "no expert rows and no self trajectory with final reward >= "
                             f"{cfg.rft_min_reward} (rft trains on these)")
    elif cfg.objective == "dpo":
        pairs, info = dpo_pairs(df, cfg.dpo_pairs)
        if not pairs:
            raise TableError(where, "reward_env", f"no preference pair: no task has an {cfg.dpo_pairs.replace('_', ' ')} "
                             "trajectory and a self trajectory with a different final reward "
                             f"(tie {info['tie']}, without anchor {info['no_anchor']})")
        used = {t for pr in pairs for t in pr}
        df = df.filter(pl.col("traj_id").is_in(list(used)))
        info = {**info, "pairs": pairs}
    if df.height == 0:
        raise TableError(where, None, "no trajectories left to train on")
    if cfg.uses_advantage:  # read_training_rows required the advantage column
        # demonstrations without an advantage (label --advantage gigpo gives them none: they are in no episode
        # group) are left out of bppo / awr, as in GiGPO, which trains on its rollouts; BC has cloned them
        no_adv = (df.filter(pl.col("source") == "expert").group_by("traj_id")
                  .agg(pl.col("advantage").is_null().all().alias("none")).filter(pl.col("none")))
        if no_adv.height:
            df = df.filter(~pl.col("traj_id").is_in(no_adv["traj_id"].implode()))
            info["expert_without_advantage"] = no_adv.height
            if df.height == 0:
                raise TableError(where, "advantage", f"no advantages: only {no_adv.height} expert trajectories "
                                 "without one (label --advantage gigpo gives advantages to self-play rows only)")
        nulls = df.filter(pl.col("advantage").is_null())
        if nulls.height:
            r = nulls.row(0, named=True)
            raise TableError(where, "advantage", f"{nulls.height} null values (first at traj_id={r['traj_id']!r} "
                             f"step={r['step']}); run `qevolve label --critic` first")
    return df, info
