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

Truncation (rollout and prefix indexing alike): keep the system and first user
message (instruction), drop the oldest (assistant, user) pairs until the
prompt fits; see :func:`truncate`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Message = dict[str, str]


def first_user_content(instruction: str, observation: str) -> str:
    return f"Task: {instruction.strip()}\nObservation: {observation.strip()}"


def observation_content(observation: str) -> str:
    return f"Observation: {observation.strip()}"


def build_messages(
    system: str,
    instruction: str,
    observations: Sequence[str],
    actions: Sequence[str],
    system_in_user: bool = False,
) -> list[Message]:
    """Messages of a (possibly unfinished) trajectory.

    Observations and actions interleave o_0, a_0, o_1, a_1, ...: either
    ``len(actions) == len(observations) - 1`` (ends on a user message: the
    prompt for the next action) or ``len(actions) == len(observations)`` (ends
    on an assistant message).
    """
    n_obs, n_act = len(observations), len(actions)
    if n_obs == 0:
        raise ValueError("a transcript needs at least the first observation")
    if n_act not in (n_obs, n_obs - 1):
        raise ValueError(f"observations and actions must alternate: got {n_obs} observations, {n_act} actions")
    msgs: list[Message] = []
    first = first_user_content(instruction, observations[0])
    if system_in_user:
        msgs.append({"role": "user", "content": f"{system.strip()}\n\n{first}"})
    else:
        msgs.append({"role": "system", "content": system.strip()})
        msgs.append({"role": "user", "content": first})
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
    system_in_user: bool = False,
) -> list[Message]:
    """Messages of a whole recorded trajectory (table rows of one traj_id, in step order).

    Ends with the last step's next observation as a user message, so every
    step has a next-state prefix.
    """
    if not (len(observations) == len(actions) == len(next_observations)):
        raise ValueError("observations, actions and next_observations must have one entry per step")
    obs = list(observations) + [next_observations[-1]] if observations else []
    return build_messages(system, instruction, obs, actions, system_in_user)


def _offset(system_in_user: bool) -> int:
    return 0 if system_in_user else 1


def state_end(t: int, system_in_user: bool = False) -> int:
    """Index (inclusive) of the last message of the state prefix s_t."""
    return 2 * t + _offset(system_in_user)


def state_action_end(t: int, system_in_user: bool = False) -> int:
    return 2 * t + 1 + _offset(system_in_user)


def next_state_end(t: int, system_in_user: bool = False) -> int:
    return 2 * t + 2 + _offset(system_in_user)


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
    system_in_user: bool = False,
) -> Truncation:
    """Drop the oldest (assistant, user) pairs after the instruction until ``fits``.

    The head (system + first user message, which carries the instruction) and
    the most recent turn are always kept; if even that does not fit the result
    is returned anyway (the caller decides whether to cut tokens).
    """
    head = 1 if system_in_user else 2
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
