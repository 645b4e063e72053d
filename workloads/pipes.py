"""A command whose reader goes away (`autotune profile t.jsonl | head -1`) ends quietly.

Python ignores SIGPIPE, so a write to a pipe nobody reads raises `BrokenPipeError` (in a
`print`, or in the flush at exit) and ends in a traceback. Standard Unix tools are killed by
SIGPIPE instead and say nothing; `run_closing_quietly` gives our entry points that behaviour
(https://docs.python.org/3/library/signal.html#note-on-sigpipe).
"""

from __future__ import annotations

import os
import select
import signal
import sys
from collections.abc import Callable

# What a shell reports for a command killed by SIGPIPE (128 + the signal number).
EXIT_CLOSED_PIPE = 128 + signal.SIGPIPE


def run_closing_quietly(main: Callable[[], int]) -> int:
    """`main()`'s exit code, or EXIT_CLOSED_PIPE, without a word, when stdout's (or stderr's)
    reader closed early. A `BrokenPipeError` from anything else (a socket, a child's pipe)
    is not ours to hide and propagates."""
    try:
        try:
            return main()
        finally:
            # What is still buffered is written now, inside the try, not in the flush at exit
            # (argparse's --help, a short profile); a SystemExit is replaced if it fails.
            sys.stdout.flush()
    except BrokenPipeError:
        gone = [stream for stream in (sys.stdout, sys.stderr) if _reader_gone(stream)]
        if not gone:
            raise
        for stream in gone:
            # The interpreter flushes stdout again at exit: pointed at devnull, that cannot fail.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        return EXIT_CLOSED_PIPE


def _reader_gone(stream: object) -> bool:
    """Whether `stream` is a pipe whose read end is closed (poll reports an error on it)."""
    try:
        fd = stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False
    if not hasattr(select, "poll"):  # no poll (Windows): a broken pipe there is stdout's
        return stream is sys.stdout
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR and POLLHUP are always reported
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
