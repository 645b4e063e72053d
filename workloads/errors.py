"""Errors a user can cause with traffic files and traffic options."""

from __future__ import annotations

from typing import Any


class WorkloadError(ValueError):
    """Bad traffic input: the message names what is wrong and how to fix it."""


class TraceError(WorkloadError):
    """One bad line (or record) of a trace file."""

    def __init__(self, path: str, line: int, field: str, value: Any, reason: str) -> None:
        self.path = path
        self.line = line
        self.field = field
        self.value = value
        self.reason = reason
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"{path}:{line}: field '{field}' = {shown}: {reason}")
