"""The one transcript builder: a trajectory -> the chat messages the policy sees.

Rollout (prompting), prefix indexing (critic positions), the critic and the
trainers all call :func:`build_messages`; nothing else builds prompts.

Layout of a trajectory with steps ``t = 0..T-1``::

    [0]       system     environment instruction prompt (paper Appendix "Prompts")
    [1]       user       "Task: <instruction>\\nObservation: <o_0>"       <- state s_0 ends here
    [2]       assistant  a_0 (full model output: thought + action)       <- (s_0, a_0) ends here
    [3]       user       "Observation: <o_1>"                           <- s_1 (= next state of step 0)
    ...
    [2t+1]    user       o_t                                            <- pos_s of step t
    [2t+2]    assistant  a_t                                            <- pos_sa of step t
    [2t+3]    user       o_{t+1}                                        <- pos_next of step t

``o_{t+1}`` of the last step is its ``next_observation``. Message indices of
the three prefixes of step t: :func:`state_end`, :func:`state_action_end`,
:func:`next_state_end` (inclusive).

Templates without a system role: ``system_in_user=True`` folds the system
prompt into the first user message (detected by :func:`needs_system_in_user`).

In-context example (:class:`Layout` ``example=True``, pretrained chat models; ETO's layout): two
messages come between the system prompt and the task, a user message with the environment's solved
example (``qevolve_cli.envs.prompts.example_prompt``) and the assistant's :data:`EXAMPLE_REPLY`::

    [0] system  instruction prompt   [1] user  example   [2] assistant  "OK"   [3] user  task + o_0  ...

so every index above moves by 2 (:attr:`Layout.first_state`). With ``system_in_user`` the system
prompt goes in front of the example. The example and the reply are never training targets (the
head; ``qevolve_cli.policy.data``). :func:`layout_of` chooses the layout from the tokenizer: the
example for every model except those trained from scratch on our tables (the tiny models, whose
chat template is :data:`qevolve_cli.tokenizer.TINY_CHAT_TEMPLATE`), which learn the format from
their demonstrations and would only pay for the longer prompt.

Truncation (rollout and prefix indexing alike): keep the head (system, example, and the first user
message with the instruction), drop the oldest (assistant, user) pairs until the prompt fits; see
:func:`truncate`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Message = dict[str, str]

EXAMPLE_REPLY = "OK"


@dataclass(frozen=True)
class Layout:
    """Where the head of a transcript puts things: the system prompt (own message, or in front of the
    first user message) and whether the in-context example (+ the reply ``OK``) comes before the task."""

    system_in_user: bool = False
    example: bool = False

    @property
    def first_state(self) -> int:
        """Index of the user message holding the task and o_0 (the state prefix s_0 ends there)."""
        return (0 if self.system_in_user else 1) + (2 if self.example else 0)

    @property
    def head(self) -> int:
        """Number of messages kept by truncation: everything up to and including the task's message."""
        return self.first_state + 1


def as_layout(layout: Layout | bool) -> Layout:
    """A :class:`Layout`; a bool is the older ``system_in_user`` flag (no example)."""
    return layout if isinstance(layout, Layout) else Layout(system_in_user=bool(layout))


def first_user_content(instruction: str, observation: str) -> str:
    return f"Task: {instruction.strip()}\nObservation: {observation.strip()}"


def observation_content(observation: str) -> str:
    return f"Observation: {observation.strip()}"


def build_messages(
    system: str,
    instruction: str,
    observations: Sequence[str],
    actions: Sequence[str],
    layout: Layout | bool = False,
    example: str | None = None,
) -> list[Message]:
    """Messages of a (possibly unfinished) trajectory.

    Observations and actions interleave o_0, a_0, o_1, a_1, ...: either
    ``len(actions) == len(observations) - 1`` (ends on a user message: the
    prompt for the next action) or ``len(actions) == len(observations)`` (ends
    on an assistant message). ``example``: the in-context example's text, needed
    when ``layout.example``.
    """
    lay = as_layout(layout)
    n_obs, n_act = len(observations), len(actions)
    if n_obs == 0:
        raise ValueError("a transcript needs at least the first observation")
    if n_act not in (n_obs, n_obs - 1):
        raise ValueError(f"observations and actions must alternate: got {n_obs} observations, {n_act} actions")
    if lay.example and not (example or "").strip():
        raise ValueError("this layout shows an in-context example: pass the environment's example text")
    msgs: list[Message] = []
    first = first_user_content(instruction, observations[0])
    if not lay.system_in_user:
        msgs.append({"role": "system", "content": system.strip()})
    if lay.example:
        ex = example.strip()  # type: ignore[union-attr]
        msgs.append({"role": "user", "content": f"{system.strip()}\n\n{ex}" if lay.system_in_user else ex})
        msgs.append({"role": "assistant", "content": EXAMPLE_REPLY})
        msgs.append({"role": "user", "content": first})
    else:
        msgs.append({"role": "user", "content": f"{system.strip()}\n\n{first}" if lay.system_in_user else first})
    for t in range(n_act):
        msgs.append({"role": "assistant", "content": actions[t].strip()})
        if t + 1 < n_obs:
            msgs.append({"role": "user", "content": observation_content(observations[t + 1])})
    return msgs


def trajectory_messages(
    system: str,
    instruction: str,
    observations: Sequence[str],
    actions: Sequence[str],
    next_observations: Sequence[str],
    layout: Layout | bool = False,
    example: str | None = None,
) -> list[Message]:
    """Messages of a whole recorded trajectory (table rows of one traj_id, in step order).

    Ends with the last step's next observation as a user message, so every
    step has a next-state prefix.
    """
    if not (len(observations) == len(actions) == len(next_observations)):
        raise ValueError("observations, actions and next_observations must have one entry per step")
    obs = list(observations) + [next_observations[-1]] if observations else []
    return build_messages(system, instruction, obs, actions, layout, example)


def state_end(t: int, layout: Layout | bool = False) -> int:
    """Index (inclusive) of the last message of the state prefix s_t."""
    return 2 * t + as_layout(layout).first_state


def state_action_end(t: int, layout: Layout | bool = False) -> int:
    return 2 * t + 1 + as_layout(layout).first_state


def next_state_end(t: int, layout: Layout | bool = False) -> int:
    return 2 * t + 2 + as_layout(layout).first_state


def window_starts(n_steps: int, length: Callable[[int, int], int], max_length: int, head_len: int = 0,
                  window_context: float = 1.0) -> list[int]:
    """The sliding-window rule shared by the critic's prefix index, the policy's training sequences and the
    planner's token counts.

    ``length(j, t)``: the tokens of the sequence holding step t with its ``j`` oldest (assistant, user) pairs
    dropped (the head included). Per step t: ``j_t``, never past ``max(t - 1, 0)`` (the pair holding o_t
    stays; when even that does not fit, ``j_t = max(t - 1, 0)`` and the caller cuts). Step t keeps
    ``j_{t-1}`` while ``length(j_{t-1}, t) <= max_length``; otherwise a new window starts at the smallest
    ``j > j_{t-1}`` whose sequence is within the head (``head_len`` tokens) plus ``window_context`` of the
    room after it. ``window_context`` 1: the fewest dropped turns that fit, which is what :func:`truncate`
    gives the rollout (for a ``length`` monotone in ``j``); lower: windows start with room left, so that
    later steps share them. Consecutive steps with the same ``j`` share one sequence.
    """
    limit = head_len + window_context * max(0, max_length - head_len)
    js, j = [], 0
    for t in range(n_steps):
        hi = max(t - 1, 0)
        j = min(j, hi)
        if j < hi and length(j, t) > max_length:
            j += 1
            while j < hi and length(j, t) > limit:
                j += 1
        js.append(j)
    return js


@dataclass
class Truncation:
    messages: list[Message]
    dropped_turns: int

    @property
    def truncated(self) -> bool:
        return self.dropped_turns > 0


def truncate(
    messages: list[Message],
    fits: Callable[[list[Message]], bool],
    layout: Layout | bool = False,
) -> Truncation:
    """Drop the oldest (assistant, user) pairs after the instruction until ``fits``.

    The head (system, example and the first user message, which carries the
    instruction: :attr:`Layout.head`) and the most recent turn are always kept;
    if even that does not fit the result is returned anyway (the caller decides
    whether to cut tokens).
    """
    head = as_layout(layout).head
    if fits(messages):
        return Truncation(messages, 0)
    body = messages[head:]
    dropped = 0
    # keep the body alternating: remove (assistant, user) pairs from the front
    while len(body) > 2:
        body = body[2:]
        dropped += 1
        cand = messages[:head] + body
        if fits(cand):
            return Truncation(cand, dropped)
    return Truncation(messages[:head] + body, dropped)


def needs_system_in_user(tokenizer) -> bool:
    """True when the tokenizer's chat template rejects or drops a system message."""
    probe = [{"role": "system", "content": "SYSPROBE"}, {"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:
        return True
    return "SYSPROBE" not in text


def layout_of(tokenizer) -> Layout:
    """The layout every stage uses with this tokenizer (rollout, labels, prefix positions, training).

    ``None`` (a served model without a local tokenizer): a system message and the example.
    """
    if tokenizer is None:
        return Layout(system_in_user=False, example=True)
    from qevolve_cli.tokenizer import is_tiny_template

    return Layout(system_in_user=needs_system_in_user(tokenizer), example=not is_tiny_template(tokenizer))
