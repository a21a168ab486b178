"""Model helpers: tiny offline models (:mod:`qevolve_cli.models.tiny`), pretrained ones converted from the
package registry (:mod:`qevolve_cli.models.pretrained`)."""
from __future__ import annotations

from pathlib import Path


def adapter_base(model: str | Path) -> str | None:
    """The base model of a directory that holds only a PEFT adapter (``adapter_config.json``, no ``config.json``:
    a LoRA policy of ``qevolve policy``): its ``base_model_name_or_path``, ``""`` when it names none; None for any
    other path. ``OSError`` / ``ValueError`` when ``adapter_config.json`` is not readable JSON."""
    import json

    p = Path(model)
    if not (p / "adapter_config.json").is_file() or (p / "config.json").is_file():
        return None
    return json.loads((p / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""


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
