"""Errors that the command line turns into one-line messages and exit code 2."""
from __future__ import annotations

from pathlib import Path


class QevolveError(Exception):
    """A user-facing error: bad input, bad configuration, missing resource.

    The CLI prints ``error: <message>`` on one line and exits with code 2,
    never a traceback.
    """


class TableError(QevolveError):
    """A trajectory table is unreadable or violates the schema (docs/tables.md)."""

    def __init__(self, path: str | Path | None, column: str | None, problem: str):
        self.path = str(path) if path is not None else "<table>"
        self.column = column
        self.problem = problem
        where = f"{self.path}: column '{column}'" if column else self.path
        super().__init__(f"{where}: {problem}")


class ConfigError(QevolveError):
    """A configuration file or option is invalid."""

    def __init__(self, source: str | Path | None, field: str | None, problem: str):
        self.source, self.field, self.problem = source, field, problem
        where = str(source) if source is not None else "config"
        if field:
            where += f": field '{field}'"
        super().__init__(f"{where}: {problem}")
