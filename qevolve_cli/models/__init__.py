"""Model helpers: tiny offline models (:mod:`qevolve_cli.models.tiny`), pretrained ones converted from the
package registry (:mod:`qevolve_cli.models.pretrained`)."""
from __future__ import annotations

from pathlib import Path

ADAPTER_BASE_FILE = "qevolve_adapter.json"  # beside a saved adapter: its base's path relative to it


def adapter_base(model: str | Path) -> str | None:
    """The base model of a directory that holds only a PEFT adapter (``adapter_config.json``, no ``config.json``:
    a LoRA policy of ``qevolve policy``): its ``base_model_name_or_path``, ``""`` when it names none; None for any
    other path. ``OSError`` / ``ValueError`` when ``adapter_config.json`` is not readable JSON."""
    import json

    p = Path(model)
    if not (p / "adapter_config.json").is_file() or (p / "config.json").is_file():
        return None
    base = json.loads((p / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    if base and not Path(base).exists():  # a moved run directory: the base where it lies beside the adapter now
        try:
            rel = json.loads((p / ADAPTER_BASE_FILE).read_text()).get("base_model_relative")
        except (OSError, ValueError, AttributeError):
            rel = None
        if isinstance(rel, str) and rel and (p / rel).is_dir():
            return str((p / rel).resolve())
    return base


def enable_activation_checkpointing(model, use_reentrant: bool | None = None) -> None:
    """Hugging Face activation (gradient) checkpointing on ``model`` (a transformers model or a PEFT model around
    one), by the name the installed transformers has: ``activation_checkpointing_enable`` where it exists
    (there ``gradient_checkpointing_enable`` is a deprecated alias that prints a FutureWarning on every run),
    ``gradient_checkpointing_enable`` in the versions before it. ``use_reentrant`` None: the library's default."""
    kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def record_adapter_base(adapter_dir: str | Path) -> None:
    """Beside a saved adapter, ``qevolve_adapter.json``: where its base model directory lies relative to the
    adapter. PEFT records the base's absolute path (``base_model_name_or_path``, left as it is for PEFT and
    vLLM users); when a run directory moves (another disk, another machine), :func:`adapter_base` finds the base
    through this relative path instead. Nothing is written for a Hub id."""
    import json
    import os

    p = Path(adapter_dir)
    base = json.loads((p / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    if base and Path(base).is_dir():
        rel = os.path.relpath(Path(base).resolve(), p.resolve())
        # a new file replaces the old one: a hard-linked copy of the adapter (evolve's adopted candidate) keeps its own
        tmp = p / f".{ADAPTER_BASE_FILE}.tmp"
        tmp.write_text(json.dumps({"base_model": base, "base_model_relative": rel}, indent=1) + "\n")
        os.replace(tmp, p / ADAPTER_BASE_FILE)


def random_init(model: str | Path) -> bool:
    """True for a model qevolve initialised at random (`qevolve init-model --size`: its ``qevolve_model.json``
    names a tiny size and no pretrained source), which knows nothing before training; False for anything
    else (a converted pretrained model, a user's directory, a Hub id)."""
    import json

    info = Path(model) / "qevolve_model.json"
    if not info.is_file():
        return False
    try:
        meta = json.loads(info.read_text())
    except (OSError, ValueError):
        return False
    from qevolve_cli.models.tiny import SIZES

    return isinstance(meta, dict) and "source" not in meta and meta.get("size") in SIZES
