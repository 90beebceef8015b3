"""User-facing errors.

A user's mistake gets one :class:`HeteroError` whose message names what was wrong, where
(file and field path) and what was expected. Tracebacks are for bugs only: the CLI prints
these errors as a single message and exits 1.
"""

from __future__ import annotations

__all__ = ["HeteroError", "SchemaError", "InfeasibleError", "Described"]


class HeteroError(Exception):
    """Base class of every error caused by user input (plans, inventories, arguments)."""


class SchemaError(HeteroError, ValueError):
    """A file or mapping does not match its schema, or breaks an invariant.

    ``source`` is the file (or a description of where the data came from), ``path`` the field
    path inside it such as ``pipelines[1].stages[2].num_layers``.
    """

    def __init__(self, source: str, path: str, found: object, expected: str):
        self.source = source
        self.path = path or "<root>"
        self.found = found
        self.expected = expected
        where = f"{source}: {path}: " if path else f"{source}: "
        super().__init__(f"{where}found {_show(found)}; expected {expected}")


class InfeasibleError(HeteroError):
    """The inventory cannot host the model under any plan the search covers."""


class Described(str):
    """A description of what was found (shown as is), rather than a value (shown quoted)."""

    def __repr__(self) -> str:
        return str(self)


def _show(value: object) -> str:
    if isinstance(value, Described):  # our own words, shown whole
        return str(value)
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
