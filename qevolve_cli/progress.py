"""Progress reporting on stderr (stdout stays for results and ``--json``)."""
from __future__ import annotations


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
