"""A server started by a tuner stops when its tuner is gone.

The tuner stops its trial servers itself (process group SIGTERM, then SIGKILL), also on
Ctrl-C, SIGTERM and SIGHUP. What it cannot survive is SIGKILL (or the OOM killer, or a crash
of the interpreter): its server and the vLLM engine it started would go on running, holding
their memory, until a later `--resume` ends them. So the launcher names itself in the
environment of every server it starts (`AUTOTUNE_PARENT_PID`), and the server watches that
process: once it is gone, the server stops its own process group (itself and its engine core)
as the tuner would have: SIGTERM, then SIGKILL to whatever is left after a grace period.

Watching rather than Linux's parent-death signal (prctl PR_SET_PDEATHSIG): that signal fires
when the *thread* that spawned the server ends, not the process, and only for the direct
parent; polling works for any process named, on every OS. Detection takes at most one poll
interval (a quarter second).

A server started without the variable (production: systemd, Kubernetes, a shell) is not
tied to anything. The variable is removed from the environment once read, so the engine core
and anything else the server starts do not inherit it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, MutableMapping

import psutil

PARENT_PID_ENV = "AUTOTUNE_PARENT_PID"
POLL_S = 0.25
# SIGTERM to SIGKILL: a graceful stop takes 2-5 s (uvicorn's 5 s graceful timeout, the engine
# core's shutdown); the tuner's own stop waits 20 s, but nobody waits on an orphan.
GRACE_S = 8.0

logger = logging.getLogger("server")


class ParentWatch:
    """Polls whether process `pid` still exists; when it is gone, stops this process group."""

    def __init__(
        self,
        pid: int,
        *,
        poll_s: float = POLL_S,
        grace_s: float = GRACE_S,
        on_gone: Callable[[], None] | None = None,
    ) -> None:
        self.pid = pid
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.on_gone = on_gone or self.stop_own_group
        self.gone = threading.Event()
        self._direct = os.getppid() == pid
        self._create_time = _create_time(pid)
        self._thread = threading.Thread(target=self._watch, name="parent-watch", daemon=True)

    def parent_alive(self) -> bool:
        if self._direct:
            # Our parent exited: we were handed to init (or a subreaper). Exact, immediate,
            # and blind to pid reuse; a parent that is a zombie already counts as gone.
            return os.getppid() == self.pid
        try:
            process = psutil.Process(self.pid)
            if self._create_time is not None and abs(process.create_time() - self._create_time) > 0.05:
                return False  # the pid was reused by another process
            return process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def start(self) -> ParentWatch:
        gone_already = not self._direct and self._create_time is None
        if gone_already or not self.parent_alive():
            self._fire()  # gone before we looked: nobody else will stop this server
            return self
        self._thread.start()
        return self

    def _watch(self) -> None:
        while self.parent_alive():
            time.sleep(self.poll_s)
        self._fire()

    def _fire(self) -> None:
        if self.gone.is_set():
            return
        self.gone.set()
        logger.warning("the process that started this server (pid %d) is gone; stopping", self.pid)
        self.on_gone()

    def stop_own_group(self) -> None:
        """What the tuner's own stop does: SIGTERM to our process group (or, not leading one,
        to us and our descendants); SIGKILL to whatever is left after the grace period.

        The server normally exits well within the grace period, ending this (daemon) thread
        before it gets to the SIGKILL.
        """
        me = os.getpid()
        leader = os.getpgrp() == me
        _signal(me, leader, _descendants(), signal.SIGTERM)
        time.sleep(self.grace_s)
        _signal(me, leader, _descendants(), signal.SIGKILL)


def watch_parent_from_env(environ: MutableMapping[str, str] | None = None) -> ParentWatch | None:
    """Start watching the process `AUTOTUNE_PARENT_PID` names (and unset it); None if unset."""
    environ = os.environ if environ is None else environ
    raw = environ.pop(PARENT_PID_ENV, None)
    if raw is None or not raw.strip():
        return None
    try:
        pid = int(raw)
    except ValueError:
        logger.warning("%s=%r is not a process id; not watching a parent", PARENT_PID_ENV, raw)
        return None
    return ParentWatch(pid).start()


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal(me: int, leader: bool, processes: list[psutil.Process], sig: signal.Signals) -> None:
    # Children first, ourselves last: SIGKILL to ourselves ends this thread too.
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process.send_signal(sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if leader:
            os.killpg(me, sig)
        else:
            os.kill(me, sig)
