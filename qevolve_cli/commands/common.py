"""Shared option types and helpers of the command modules.

Conventions every command follows:
* wrap the body with :func:`run_command` so QevolveError (and friends) become
  ``error: <one line>`` on stderr with exit code 2 — never a traceback;
* progress on stderr (:func:`progress`), results on stdout, ``--json`` prints
  one JSON object for scripts (:func:`emit_json`);
* import torch / transformers inside the command, not at module level.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from qevolve_cli.env_names import ENV_NAMES as ENVS  # noqa: E402 - one list of environments
from qevolve_cli.errors import QevolveError
from qevolve_cli.progress import progress, stderr_console  # noqa: F401 - handed on to the commands

SPLITS = ("train", "test_seen", "test_unseen", "test")

EnvOpt = Annotated[str, typer.Option("--env", help=f"Environment: {', '.join(ENVS)}.")]
SplitOpt = Annotated[str, typer.Option("--split", help=f"Task split: {', '.join(SPLITS)}.")]
OutOpt = Annotated[Path, typer.Option("--out", "-o", help="Output path (written atomically).")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config file (see configs/).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one machine-readable JSON object on stdout.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed.")]
WorkersOpt = Annotated[int, typer.Option("--workers", "-w", help="Parallel environment worker processes.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress output on stderr.")]
ShardOpt = Annotated[str | None, typer.Option("--shard", help="Only shard I of N (I/N, 0-based): one of N disjoint, "
                                              "contiguous blocks of the run's work (tasks for expert, (task, sample) "
                                              "pairs for rollout and eval), to split one run across nodes.")]
# training commands (critic, policy): overrides of the stage config
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override a config field: KEY=VALUE (repeatable).")]
PrecisionOpt = Annotated[str | None, typer.Option("--precision", help="fp32 or bf16 (default auto: bf16 on GPU and on "
                                               "CPUs with avx512_bf16/AMX, else fp32; docs/performance.md).")]
PrintConfigOpt = Annotated[bool, typer.Option("--print-config", help="Print every resolved config value and the "
                                              "layer that set it (default, YAML file, preset, --config, --set, "
                                              "flag), then exit without running (docs/commands.md).")]
EpochsOpt = Annotated[int | None, typer.Option("--epochs", help="Override epochs.")]
LrOpt = Annotated[float | None, typer.Option("--lr", help="Override the learning rate.")]

R = TypeVar("R")


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def restore_gc(keep_off: bool = False) -> None:
    """Turn the cyclic garbage collector back on if the entry point turned it off for start-up
    (``qevolve_cli/__main__.py``); ``keep_off``: a short command that allocates few Python objects
    finishes without it. Library and test callers never had it turned off: nothing changes for them."""
    import gc

    import qevolve_cli

    if getattr(qevolve_cli, "_gc_off_for_startup", False) and not keep_off:
        qevolve_cli._gc_off_for_startup = False
        gc.enable()


def run_command(fn: Callable[[], R], keep_gc_off: bool = False) -> R:
    """Run a command body, mapping user errors to one-line messages and exit 2.

    ``keep_gc_off``: see :func:`restore_gc` (only for short commands without model code)."""
    restore_gc(keep_gc_off)
    try:
        result = fn()
        training = sys.modules.get("qevolve_cli.training")
        if training is not None:  # a distributed rank: its work is done, the exit may wait for its peers
            training.mark_completed()
        return result
    except QevolveError as e:
        raise fail(str(e)) from None
    except FileNotFoundError as e:
        raise fail(f"{e.filename}: no such file") from None
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130) from None


def check_choice(value: str, choices: tuple[str, ...], option: str) -> str:
    if value not in choices:
        raise QevolveError(f"{option}: unknown value {value!r} (choose from {', '.join(choices)})")
    return value


def precision_dtype(precision: str | None) -> str | None:
    """``--precision`` -> the ``dtype`` field of rollout/eval/critic configs (None: not given, auto: the rule)."""
    if precision is None:
        return None
    check_choice(precision, ("auto", "fp32", "bf16"), "--precision")
    return {"auto": "auto", "fp32": "float32", "bf16": "bfloat16"}[precision]


def parse_sets(sets: list[str] | None) -> dict[str, Any]:
    """``--set KEY=VALUE`` overrides (values parsed as YAML: numbers, booleans, lists)."""
    import yaml

    from qevolve_cli.errors import ConfigError

    out: dict[str, Any] = {}
    for s in sets or []:
        if "=" not in s:
            raise ConfigError("--set", s, "expected KEY=VALUE")
        k, v = s.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
    return out


def naming_flags(build: Callable[[], R], given: dict[str, str]) -> R:
    """Run ``build()`` (which resolves a config); blame a bad value on the flag the user typed.

    ``given`` maps the config keys set on the command line to their flag (``{"lr": "--lr"}``,
    ``{"gamma": "--set gamma"}``). A :class:`ConfigError` about one of those keys (or a field
    under it) is re-raised as ``--lr: must be > 0, got -1.0`` instead of naming the
    defaults or the config file the value did not come from.
    """
    from qevolve_cli.errors import ConfigError

    try:
        return build()
    except ConfigError as e:
        key = (e.field or "").split(".")[0].split("[")[0]
        if key in given:
            sub = e.field[len(key):].lstrip(".") if e.field else ""
            raise ConfigError(given[key], sub or None, e.problem) from None
        raise


def flag_names(values: dict[str, Any], sets: dict[str, Any] | None = None,
               rename: dict[str, str] | None = None) -> dict[str, str]:
    """Config key -> the flag that set it, for :func:`naming_flags` (``None`` values were not given).

    Keys from ``--set KEY=VALUE`` map to ``--set KEY``; a flag given explicitly wins over ``--set``
    (as it does in the merged overrides). ``rename`` gives flags not spelled ``--key-with-dashes``.
    """
    out = {k: f"--set {k}" for k in (sets or {})}
    for k, v in values.items():
        if v is not None:
            out[k] = (rename or {}).get(k, "--" + k.replace("_", "-"))
    return out


def require(given: dict[str, Any]) -> None:
    """The options a run needs that ``--print-config`` does not (``{"--data": data}``): one line naming the first
    one missing, exit code 2."""
    for flag, value in given.items():
        if value is None or value == []:
            raise QevolveError(f"missing option {flag} (required unless --print-config)")


def print_config(rows: list[tuple[str, Any, str]], title: str, json_out: bool = False) -> None:
    """``--print-config``: one line per field (name, resolved value, the layer that set it) on stdout; with
    ``--json`` one object ``{"config": {...}, "origin": {...}}``. Rows whose field is ``"# ..."`` head a section."""
    if json_out:
        cfg: dict[str, Any] = {}
        origin: dict[str, Any] = {}
        section = None
        for name, value, layer in rows:
            if name.startswith("# "):
                section = name[2:]
                cfg[section], origin[section] = {}, {}
                continue
            (cfg[section] if section else cfg)[name] = value
            (origin[section] if section else origin)[name] = layer
        emit_json({"config": cfg, "origin": origin})
        return
    width = max((len(n) for n, _, _ in rows if not n.startswith("# ")), default=0)
    vwidth = min(max((len(repr(v)) for n, v, _ in rows if not n.startswith("# ")), default=0), 28)
    lines = [title]
    for name, value, layer in rows:
        if name.startswith("# "):
            lines.append(f"[{name[2:]}]")
            continue
        lines.append(f"  {name:<{width}}  {value!r:<{vwidth}}  {layer}")
    typer.echo("\n".join(lines))


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()
