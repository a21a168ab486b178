"""The ReAct output format ``Thought: ...\\nAction: ...`` and its one parser.

The parser is the Rust core's (``_core.parse_action``), so rollout, the
environments and retrospective labelling agree on what a format error is:
the command is the text after the *last* ``Action:`` up to the end of that
line, trimmed; no marker or an empty command is a format error (``None``).
"""
from __future__ import annotations

ACTION_MARKER = "Action:"
THOUGHT_MARKER = "Thought:"


def parse_action(text: str) -> str | None:
    """The command of a model output, or None on a format error."""
    from qevolve_cli import _core

    return _core.parse_action(text)


def parse_action_py(text: str) -> str | None:
    """Pure-Python twin of the Rust parser (reference for tests; same rule)."""
    at = text.rfind(ACTION_MARKER)
    if at < 0:
        return None
    rest = text[at + len(ACTION_MARKER) :]
    line = rest.split("\n", 1)[0]
    # Rust's str::trim strips Unicode White_Space; Python's str.strip is close enough
    # except for a few separators, which the parser tests avoid.
    cmd = line.strip()
    return cmd or None


def action_char_span(text: str) -> tuple[int, int] | None:
    """Character span of the command (after the last ``Action:``) in ``text``, or None.

    Trainers use it to tell thought tokens (before the span's ``Action:``
    marker) from action tokens.
    """
    at = text.rfind(ACTION_MARKER)
    if at < 0:
        return None
    start = at + len(ACTION_MARKER)
    end = text.find("\n", start)
    return (at, len(text) if end < 0 else end)


def format_react(thought: str, command: str) -> str:
    """Render a ReAct output. Expert trajectories use short template thoughts."""
    return f"{THOUGHT_MARKER} {thought.strip()}\n{ACTION_MARKER} {command.strip()}"


STOP = "\nObservation:"
"""ReAct's stop sequence: a model output ends before a line that starts writing the environment's answer."""


def cut_at_stop(text: str) -> str:
    """The model's turn: ``text`` up to the first :data:`STOP` (trailing whitespace trimmed).

    A chat model shown the in-context example as text (``qevolve_cli.transcript.Layout``) may go on
    after its ``Action:`` line with an invented ``Observation:`` and further steps; only the first
    step is its action (the parser takes the *last* ``Action:``, which would be an invented one).
    """
    at = text.find(STOP)
    if at < 0 and text.startswith(STOP[1:]):
        at = 0
    return text if at < 0 else text[:at].rstrip()


FORMAT_ERROR_OBSERVATION = (
    "Invalid format: no action was found. Your response must end with a line 'Action: <your next action>'."
)
"""Observation returned to the agent instead of stepping the environment on a format error."""
