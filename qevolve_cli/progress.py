"""Progress reporting on stderr (stdout stays for results and ``--json``)."""
from __future__ import annotations


def quiet_transformers() -> None:
    """Keep transformers' own loading bars ("Loading weights") and info/warning lines off the user's
    terminal: qevolve reports each stage's progress itself, and a model load is a line of it, not a bar."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def progress(quiet: bool = False, transient: bool = False):
    """A rich progress bar on stderr (disabled when quiet)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=stderr_console(),
        disable=quiet,
        transient=transient,
    )
