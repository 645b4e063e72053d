"""The project's error root, and the errors a user can cause with traffic files and options.

`VllmAutotuneError` is the root of every error this project raises on purpose; each area has
its subtree: `WorkloadError` (traffic, here), `server.config.ConfigError` and
`server.protocol.RequestError` (the server), `autotune.errors.AutotuneError` and
`NothingMeasured` (the tuner). The root lives here because `workloads` is the bottom layer
that `server` and `autotune` both import. `OneLineErrorParser` is the command lines' parser:
a usage error is one line too.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

USAGE_ERROR = 2  # argparse's own status for a usage error, kept


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's parser, except that a usage error is one line on stderr, exit status 2:
    `PROG: error: MESSAGE (see `PROG --help`)`. argparse's own prints the whole
    usage block first, which pushes the one line that says what is wrong off a short terminal."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class VllmAutotuneError(Exception):
    """Root of the project's errors: a one-line message naming what is wrong (file, line,
    field, value) and how to fix it."""


class WorkloadError(VllmAutotuneError, ValueError):
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
