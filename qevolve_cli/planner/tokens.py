"""Token counts of trajectories measured on tables: what the planner's wall times are made of.

The transcript a stage sees (qevolve_cli/transcript.py): the environment's system prompt, then per step
the user message (``Task: <instruction>`` with the first observation, later the observation) and the
assistant message (thought + action). Counted per trajectory:

* ``steps``: steps per trajectory;
* ``completion``: tokens the policy generates per step (the assistant message);
* ``prompt``: the whole context before a step's generation (what a server without prefix caching
  prefills), capped at the context length;
* ``new_prompt``: the tokens of that context that are new since the previous step (the observation;
  what vLLM prefills with its prefix cache on);
* ``trajectory``: the tokenised trajectory (system prompt, every message, the last next observation),
  capped at the training ``max_length``: the longest sequence a training pass holds;
* ``policy_tokens`` / ``critic_tokens``: the tokens the policy / the critic train on per trajectory: the
  whole trajectory, or the sum of its windows when it is longer than that stage's ``max_length``
  (docs/policy.md and docs/critic.md, "Long trajectories": the windows of
  :func:`qevolve_cli.transcript.window_starts` with the stage's ``window_context``; the policy's end on
  an action, the critic's on the next observation).

Tokens are counted with the model's tokenizer when its directory has one, else as characters divided by
``chars_per_token`` (stated in the result). Every chat message adds ``MESSAGE_OVERHEAD`` template tokens.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MESSAGE_OVERHEAD = 4  # <|start|>role\n ... <|end|>\n of a chat template


@dataclass
class TokenStats:
    source: str
    trajectories: int
    steps: float  # mean steps per trajectory
    completion: float  # mean tokens generated per step
    prompt: float  # mean full context per step
    new_prompt: float  # mean new context tokens per step
    trajectory: float  # mean tokens of a whole trajectory
    trajectory_max: int
    counted_with: str
    policy_tokens: float | None = None  # mean tokens the policy trains on per trajectory (None: trajectory)
    critic_tokens: float | None = None  # the same for the critic

    def __post_init__(self) -> None:
        if self.policy_tokens is None:
            self.policy_tokens = self.trajectory
        if self.critic_tokens is None:
            self.critic_tokens = self.trajectory

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def counter(model_dir: str | Path | None, chars_per_token: float = 4.0) -> tuple[Callable[[str], int], str]:
    """A token counter: the model directory's tokenizer if it has one, else characters / chars_per_token."""
    if model_dir is not None and any((Path(model_dir) / f).is_file()
                                     for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        return (lambda s: len(tok(s, add_special_tokens=False).input_ids)), f"tokenizer of {model_dir}"
    return (lambda s: int(round(len(s) / chars_per_token))), f"{chars_per_token:g} characters per token"


def shows_example(model_dir: str | Path | None, init_model: str | None = None) -> bool:
    """Whether the model's prompts carry the in-context example (``transcript.layout_of``): from its
    tokenizer when the directory has one, else from how evolve builds it (``from:NAME`` = pretrained)."""
    from qevolve_cli import transcript

    if model_dir is not None and (Path(model_dir) / "tokenizer_config.json").is_file():
        from qevolve_cli.tokenizer import load_tokenizer

        try:
            return transcript.layout_of(load_tokenizer(str(model_dir))).example
        except Exception:  # an unreadable tokenizer: the planner estimates without it
            return False
    return bool(init_model and str(init_model).startswith("from:"))


def window_tokens(head: int, user: Sequence[int], assistant: Sequence[int], max_length: int,
                  window_context: float, critic: bool) -> int:
    """Tokens of the training sequences of one trajectory of T steps: ``head`` (system prompt, example and
    the first user message), ``user[t]`` the user message after step t's action (o_{t+1}; the last one is
    the final next observation) and ``assistant[t]`` the action's message. The whole trajectory when it
    fits ``max_length`` (0: no limit), else the sum of its windows (the policy's end on an action, the
    critic's on the next observation)."""
    from qevolve_cli.transcript import window_starts

    T = len(assistant)
    tail = user[T - 1] if critic else 0

    def length(j: int, t: int) -> int:
        return head + sum(assistant[j : t + 1]) + sum(user[j:t]) + (user[t] if critic else 0)

    whole = head + sum(assistant) + sum(user[: T - 1]) + tail
    if not max_length or whole <= max_length:
        return whole
    js = window_starts(T, length, max_length, head, window_context)
    return sum(length(js[t], t) for t in range(T) if t + 1 == T or js[t + 1] != js[t])


def measure(tables: Sequence[str | Path], env: str, count: Callable[[str], int], counted_with: str,
            max_context: int = 0, max_length: int = 0, example: bool = False, window_context: float = 0.5,
            critic_max_length: int = 0, critic_window_context: float = 0.5) -> TokenStats:
    """Token statistics of the trajectories of ``tables`` (any qevolve step tables: expert, rollout).

    ``example``: the prompts carry the environment's in-context example and its reply (pretrained chat
    models, ``qevolve_cli.transcript.layout_of``). ``max_length`` / ``window_context``: the policy's;
    ``critic_max_length`` / ``critic_window_context``: the critic's (0: no limit)."""
    from qevolve_cli import schema
    from qevolve_cli.envs.prompts import example_prompt, instruction_prompt
    from qevolve_cli.errors import QevolveError

    system = count(instruction_prompt(env)) + MESSAGE_OVERHEAD
    if example:
        system += count(example_prompt(env)) + count("OK") + 2 * MESSAGE_OVERHEAD
    n_traj = 0
    steps = comp = prompt = new = traj = pol = cri = 0.0
    traj_max = 0
    for path in tables:
        df = schema.read_table(Path(path)).sort(["traj_id", "step"])
        for _, g in df.group_by("traj_id", maintain_order=True):
            obs, act, nxt = g["observation"].to_list(), g["action"].to_list(), g["next_observation"].to_list()
            inst = g["instruction"][0] or ""
            ctx = system
            users, assistants = [], []
            for t, (o, a) in enumerate(zip(obs, act, strict=True)):
                user = count((f"Task: {inst}\nObservation: " if t == 0 else "Observation: ") + (o or ""))
                user += MESSAGE_OVERHEAD
                ctx += user
                c = count(a or "") + MESSAGE_OVERHEAD
                prompt += min(ctx, max_context) if max_context else ctx
                new += user
                comp += c
                ctx += c
                users.append(user)
                assistants.append(c)
            last = count(nxt[-1] or "") + MESSAGE_OVERHEAD
            total = ctx + last
            head, turns_user = system + users[0], users[1:] + [last]  # user[t]: the message after a_t
            pol += window_tokens(head, turns_user, assistants, max_length, window_context, critic=False)
            cri += window_tokens(head, turns_user, assistants, critic_max_length, critic_window_context, critic=True)
            total = min(total, max_length) if max_length else total
            traj += total
            traj_max = max(traj_max, total)
            steps += len(obs)
            n_traj += 1
    if n_traj == 0:
        raise QevolveError(f"{', '.join(map(str, tables))}: no trajectories to count tokens on")
    n_steps = max(1.0, steps)
    return TokenStats(source=", ".join(map(str, tables)), trajectories=n_traj, steps=steps / n_traj,
                      completion=comp / n_steps, prompt=prompt / n_steps, new_prompt=new / n_steps,
                      trajectory=traj / n_traj, trajectory_max=traj_max, counted_with=counted_with,
                      policy_tokens=pol / n_traj, critic_tokens=cri / n_traj)
