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

A handler's exception raised while the main thread runs a finalizer (an object's `__del__`, a
weakref callback: aiohttp and httpx objects have them) is printed and dropped by Python, and
the stop would be lost: the tuner ran on to the end (exit 0) in about one CI run in ten. Such
a dropped stop (Stopped, or Ctrl-C's KeyboardInterrupt) reaches `sys.unraisablehook`, which
delivers it again (`_thread.interrupt_main`, from another thread) until it lands outside the
finalizer. A stop that lands inside the hook itself is delivered again the same way: within
the block, Ctrl-C's handler (where it is Python's own) and the stop signals' handlers look
for the hook on the stack first.
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

logger = logging.getLogger("autotune")

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGHUP)
# A stop dropped in a finalizer is delivered again this long after (from a timer thread).
REDELIVER_AFTER_S = 0.01


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
    dropped: list[int] = []  # stops Python dropped in a finalizer, being delivered again

    def in_hook(frame: FrameType | None) -> bool:
        # Anywhere inside the hook, its `finally` included: a stop raised there is dropped too.
        while frame is not None:
            if frame.f_code is deliver_again.__code__:
                return True
            frame = frame.f_back
        return False

    def stop(signum: int, frame: FrameType | None) -> None:
        if in_hook(frame):  # raising here would be dropped for good: try again once the hook returned
            redeliver(signum)
            return
        if dropped:
            dropped.clear()
        elif received:
            logger.warning("%s received while stopping after %s; still stopping",
                           signal_name(signum), signal_name(received[0]))
            return
        received[:] = [signum]
        raise Stopped(signum)

    def interrupt(signum: int, frame: FrameType | None) -> None:
        """Ctrl-C, as Python's own handler raises it, except inside the hook."""
        if in_hook(frame):
            redeliver(signum)
            return
        dropped.clear()
        raise KeyboardInterrupt

    def redeliver(signum: int) -> None:
        # From another thread, a moment later, and never waited for here: threading.Timer's
        # start() waits until its thread runs, and under load the signal landed in that wait,
        # inside the hook, and was lost (1 run in 3 of the suite beside a CPU-heavy job).
        def later() -> None:
            time.sleep(REDELIVER_AFTER_S)
            _thread.interrupt_main(signum)

        _thread.start_new_thread(later, ())

    previous_hook = sys.unraisablehook

    def deliver_again(unraisable: Any) -> None:
        error = unraisable.exc_value
        if not isinstance(error, KeyboardInterrupt):
            previous_hook(unraisable)
            return
        signum = getattr(error, "signum", signal.SIGINT)
        dropped[:] = [signum]
        redeliver(signum)

    previous = {sig: signal.signal(sig, stop) for sig in signals}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # Python's own Ctrl-C
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
    sys.unraisablehook = deliver_again
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        for sig, handler in previous.items():
            signal.signal(sig, handler)
