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
  capped at the training ``max_length``: what one training / scoring pass runs over.

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


def measure(tables: Sequence[str | Path], env: str, count: Callable[[str], int], counted_with: str,
            max_context: int = 0, max_length: int = 0, example: bool = False) -> TokenStats:
    """Token statistics of the trajectories of ``tables`` (any qevolve step tables: expert, rollout).

    ``example``: the prompts carry the environment's in-context example and its reply (pretrained chat
    models, ``qevolve_cli.transcript.layout_of``)."""
    from qevolve_cli import schema
    from qevolve_cli.envs.prompts import example_prompt, instruction_prompt
    from qevolve_cli.errors import QevolveError

    system = count(instruction_prompt(env)) + MESSAGE_OVERHEAD
    if example:
        system += count(example_prompt(env)) + count("OK") + 2 * MESSAGE_OVERHEAD
    n_traj = 0
    steps = comp = prompt = new = traj = 0.0
    traj_max = 0
    for path in tables:
        df = schema.read_table(Path(path)).sort(["traj_id", "step"])
        for _, g in df.group_by("traj_id", maintain_order=True):
            obs, act, nxt = g["observation"].to_list(), g["action"].to_list(), g["next_observation"].to_list()
            inst = g["instruction"][0] or ""
            ctx = system
            for t, (o, a) in enumerate(zip(obs, act, strict=True)):
                user = count((f"Task: {inst}\nObservation: " if t == 0 else "Observation: ") + (o or ""))
                user += MESSAGE_OVERHEAD
                ctx += user
                c = count(a or "") + MESSAGE_OVERHEAD
                prompt += min(ctx, max_context) if max_context else ctx
                new += user
                comp += c
                ctx += c
            total = ctx + count(nxt[-1] or "") + MESSAGE_OVERHEAD
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
                      trajectory=traj / n_traj, trajectory_max=traj_max, counted_with=counted_with)
