"""Model helpers: tiny offline models (:mod:`qevolve_cli.models.tiny`), pretrained ones converted from the
package registry (:mod:`qevolve_cli.models.pretrained`)."""
from __future__ import annotations

from pathlib import Path


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
