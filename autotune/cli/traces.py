"""What the trace commands (`convert`, `profile`, `generate`, `window`, `drift`) share: their
--help layout, the TRACE argument, and reading a trace with a note on what was skipped.

Each command raises WorkloadError on bad input; autotune.cli.exit_status prints it and exits 2.
"""

from __future__ import annotations

import argparse
import sys

from workloads.trace import Trace
from workloads.trace_io import read_trace


def describe_trace_command(
    parser: argparse.ArgumentParser, description: str | None = None, *, trace: bool = False
) -> None:
    """Gives a trace command's parser its description and its --help layout (defaults shown);
    with `trace`, its first argument is the TRACE file."""
    parser.description = description
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    if trace:
        parser.add_argument("trace", metavar="TRACE", help="JSONL trace file")


def note(message: str) -> None:
    """One `autotune: ...` line on stderr, beside the command's output."""
    print(f"autotune: {message}", file=sys.stderr)


def load(path: str, skip_invalid: bool = False) -> Trace:
    """The trace at `path`, with a note on the lines skipped (`skip_invalid`) or re-sorted."""
    loaded = read_trace(path, skip_invalid=skip_invalid)
    for line in loaded.repairs(path):
        note(line)
    return loaded.trace


def first_error(error: ValueError) -> str:
    """A bad option's message: the first of a pydantic ValidationError's errors, else the
    error itself."""
    errors = getattr(error, "errors", None)
    if callable(errors):
        first = errors()[0]
        return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return str(error)
