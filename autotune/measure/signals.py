"""Hard stops: SIGTERM and SIGHUP end a tuner exactly as Ctrl-C does.

Ctrl-C raises KeyboardInterrupt wherever the tuner is; every path that holds a server (the
trial runner, the launcher, the gate) already stops the server's process group and closes its
trial on the way out. `kill PID`, a closed terminal, systemd stopping a unit or Kubernetes
deleting a pod send SIGTERM or SIGHUP instead, whose default action ends the tuner on the spot
and leaves the trial's server running. Inside `stop_signals_as_interrupt()` those signals
raise `Stopped` (a KeyboardInterrupt) instead, so the same clean-up runs; the CLI then exits
with 128 + the signal number, as a shell reports a process ended by that signal.

A second stop signal while the first is being handled is logged and ignored: the clean-up
under way (stopping a server takes seconds) must not be cut short. SIGKILL cannot be caught;
for that case the server watches its parent (server.lifeline) and stops itself.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator, Sequence
from types import FrameType

logger = logging.getLogger("autotune")

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """A stop signal other than SIGINT, raised where the tuner happened to be."""

    def __init__(self, signum: int):
        super().__init__(signal_name(signum))
        self.signum = signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def stop_reason(error: BaseException) -> str:
    """What stopped the tuner, for messages: "Ctrl-C" or the signal's name."""
    signum = getattr(error, "signum", None)
    return "Ctrl-C" if signum is None else signal_name(signum)


def exit_code(error: BaseException) -> int:
    """128 + the signal number (130 for Ctrl-C), as shells report a signalled process."""
    return 128 + int(getattr(error, "signum", signal.SIGINT))


@contextlib.contextmanager
def stop_signals_as_interrupt(signals: Sequence[signal.Signals] = STOP_SIGNALS) -> Iterator[None]:
    """Within the block, `signals` raise `Stopped` in the main thread (once; repeats are
    ignored while the first is handled). Outside the main thread this does nothing: Python
    delivers signals to the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        if received:
            logger.warning("%s received while stopping after %s; still stopping",
                           signal_name(signum), signal_name(received[0]))
            return
        received.append(signum)
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
