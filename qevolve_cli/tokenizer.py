"""Tokenizers: the one loader every stage uses, and the pad id.

:func:`load_tokenizer` takes a local directory (loaded offline) or a Hugging Face Hub id (the cache, or
the Hub when the machine is online), never runs remote code, and fails with one line naming the path.
:func:`chat_template` is the single place that decides a tokenizer's chat template: today every model
qevolve builds or loads ships its own in ``tokenizer_config.json`` and the stages that render
prompts require it; handling for pretrained models whose template must be supplied or adjusted goes
there, and nowhere else.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from qevolve_cli.errors import QevolveError


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def load_tokenizer(source: Any, *, what: str = "", adapter: str | Path | None = None,
                   require_chat_template: bool = False, require_fast: bool = False, fill_pad: bool = False):
    """A Hugging Face tokenizer.

    ``source``: a local directory or a Hub id (``owner/name``, looked up by transformers in the Hugging
    Face cache, or on the Hub when online); a tokenizer object is returned as it is.
    ``adapter``: a PEFT adapter directory whose own tokenizer, when it ships one, wins over ``source``'s.
    ``what``: the option that named it (``--model``), put at the front of error lines.
    ``require_chat_template``: the stage renders prompts (see :func:`chat_template`).
    ``require_fast``: a fast tokenizer (``tokenizer.json``) is needed (prefix indexing).
    ``fill_pad``: a tokenizer without a pad token gets the end-of-sequence token as its pad token (a
    trainer that saves the tokenizer with its model); batches use :func:`pad_id_of` either way.
    """
    if not isinstance(source, (str, Path)):
        return source
    if adapter is not None and (Path(adapter) / "tokenizer_config.json").is_file():
        source = adapter
    p = Path(source)
    name = f"{what} {source}" if what else str(source)
    local = p.is_dir()
    if not local and (p.exists() or str(source).startswith((".", "/", "~"))):  # a path, not a Hub id
        raise QevolveError(f"{name}: no such tokenizer directory")
    if local and require_fast and not (p / "tokenizer.json").is_file():
        raise QevolveError(f"{name}: no tokenizer.json (a fast tokenizer directory is required)")
    try:
        from transformers import AutoTokenizer

        kw = {"local_files_only": True} if local else {}
        tok = AutoTokenizer.from_pretrained(str(source), trust_remote_code=False, **kw)
    except Exception as e:  # noqa: BLE001 - one line for the user
        raise QevolveError(f"{name}: cannot load the tokenizer ({_first_line(e)})") from None
    if require_fast and not getattr(tok, "is_fast", False):
        raise QevolveError(f"{name}: no tokenizer.json (a fast tokenizer directory is required)")
    if fill_pad and tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return chat_template(tok, name, required=require_chat_template)


def chat_template(tok: Any, name: str, required: bool = False):
    """The tokenizer with the chat template the stages render prompts with.

    The one place for chat-template handling: a model's own template (``tokenizer_config.json``
    ``chat_template``) is used as it is; a stage that renders prompts (``required``) refuses a
    tokenizer without one.
    """
    if required and not getattr(tok, "chat_template", None):
        raise QevolveError(f"{name}: the tokenizer has no chat template (tokenizer_config.json 'chat_template')")
    return tok


TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The ChatML template of the models qevolve builds from scratch (``qevolve init-model``, models/tiny.py)."""


def is_tiny_template(tok: Any) -> bool:
    """True for a tokenizer whose chat template is :data:`TINY_CHAT_TEMPLATE` (a model trained from scratch on
    our tables: it is shown no in-context example, ``qevolve_cli.transcript.layout_of``)."""
    return getattr(tok, "chat_template", None) == TINY_CHAT_TEMPLATE


def pad_id_of(tok: Any) -> int:
    """The id batches are padded with: the pad token, else the end-of-sequence token, else 0."""
    pid = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return int(pid if pid is not None else 0)
