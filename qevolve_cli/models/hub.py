"""Model names on the command line: a local directory or a Hugging Face Hub id.

:func:`resolve_model` turns ``--model`` / ``--policy`` / ``--ref`` values into a local directory:

* an existing path is used as it is (the commands check that it is a model directory);
* an id such as ``Qwen/Qwen2.5-7B-Instruct`` (``owner/name``, optionally ``@revision``) is looked up
  in the Hugging Face cache (``$HF_HOME/hub``, ``$HF_HUB_CACHE``) through ``huggingface_hub`` and
  downloaded into it when the machine is online (weights as safetensors, config, tokenizer files);
* offline (``HF_HUB_OFFLINE=1``) and not cached: one line saying how to fetch it.
"""
from __future__ import annotations

import re
from pathlib import Path

from qevolve_cli.errors import QevolveError

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?$")
# what a causal LM / PEFT adapter needs; not *.bin / *.pth duplicates of the safetensors
ALLOW = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py", "tokenizer*", "*.tiktoken"]


def is_hub_id(name: str | Path) -> bool:
    s = str(name)
    return not Path(s).exists() and not s.startswith((".", "/", "~")) and bool(HUB_ID.match(s))


def hub_cache_dir() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except ImportError:
        return "~/.cache/huggingface/hub"


def resolve_model(name: str | Path | None, option: str = "--model", required: bool = True) -> str | None:
    """A local directory for ``name`` (unchanged when it is not a Hub id).

    ``required=False`` (``--backend openai``, where ``--policy`` may just name the served model) returns
    the name unchanged when it cannot be resolved instead of failing.
    """
    if name is None:
        return None
    if not is_hub_id(name):
        return str(name)
    repo, _, rev = str(name).partition("@")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        if not required:
            return str(name)
        raise QevolveError(f"{option} {name}: not a local directory, and huggingface_hub is not installed to "
                           "resolve it as a Hugging Face Hub id") from None
    try:
        return snapshot_download(repo, revision=rev or None, allow_patterns=ALLOW)
    except LocalEntryNotFoundError:
        if not required:
            return str(name)
        raise QevolveError(
            f"{option} {name}: not a local directory and not in the Hugging Face cache ({hub_cache_dir()}), and "
            f"the Hub cannot be reached (offline: HF_HUB_OFFLINE=1 or no network); on a machine with network run "
            f"`hf download {repo}` (same HF_HOME), or pass a local model directory") from None
    except GatedRepoError:
        raise QevolveError(f"{option} {name}: gated model on the Hugging Face Hub: accept its licence on the "
                           "Hub and log in (`hf auth login`) first") from None
    except RepositoryNotFoundError:
        if not required:
            return str(name)
        raise QevolveError(f"{option} {name}: no such model on the Hugging Face Hub (and no such local "
                           "directory)") from None
    except RevisionNotFoundError:
        raise QevolveError(f"{option} {name}: the Hub model has no revision {rev!r}") from None
    except OSError as e:
        raise QevolveError(f"{option} {name}: cannot fetch it from the Hugging Face Hub ({e})") from None
