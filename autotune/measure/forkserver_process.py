"""The fork server's own process (`python -m autotune.measure.forkserver_process`):
import the server stack once, then fork a server on each request (autotune.measure.forkserver
is the launcher's side and says why).

It reads JSON lines from its owner on stdin and answers on stdout: "ready" once imported (with
the environment it imported under), the pid of each server forked, and each server's exit status
once it has reaped it. Given a listening Unix socket (`--listen-fd`) it also accepts connections and
answers each the same way (each server's exit goes to the connection that asked for it). It is
single-threaded (one select loop, SIGCHLD through a wakeup pipe), so nothing is forked while
another thread holds a lock; it ends when its owner closes its stdin, and removes its socket.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from autotune.measure.server_start import yield_cpu_to_clients

# Variables no import reads, so a server may differ from the fork server in them (the child gets
# its whole environment all the same): ours (the server reads the launcher's pid, AUTOTUNE_PARENT_PID,
# when it starts; the tuner reads the others), pytest's (the test running, the xdist worker), and
# the terminal's size (read when printing; xdist workers set it).
IMPORT_FREE_PREFIXES = ("AUTOTUNE_", "PYTEST_")
# VLLM_RPC_BASE_PATH: vLLM reads it when an engine connects, never on import (autotune.measure.server_start.private_ipc_folder).
IMPORT_FREE_NAMES = frozenset({"COLUMNS", "LINES", "VLLM_RPC_BASE_PATH"})
SEND_TIMEOUT_S = 10.0  # a socket client that reads none of its answers for this long is dropped


class ForkRequest(BaseModel):
    """One server to fork (launcher -> fork server)."""

    args: list[str]  # what follows `python -m server`
    title: str  # the process title `ps` shows: the command line the server stands for
    env: dict[str, str]
    cwd: str
    log_path: str
    nice: int | None = None
    cpus: list[int] | None = None


def configuration(env: Mapping[str, str]) -> dict[str, str]:
    """The part of an environment that imports may read (what must match to share a fork server)."""
    return {name: value for name, value in env.items()
            if not (name.startswith(IMPORT_FREE_PREFIXES) or name in IMPORT_FREE_NAMES)}


class _Connection:
    """A launcher talking to this fork server: its owner (stdin/stdout) or a socket client."""

    def __init__(self, read_fd: int, write_fd: int, sock: socket.socket | None = None) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd
        self.socket = sock  # kept so the fd stays open while connected
        self.pending = b""
        self.open = True

    def answer(self, message: dict[str, Any]) -> None:
        if not self.open:
            return
        data = (json.dumps(message) + "\n").encode()
        try:
            if self.socket is not None:
                self.socket.sendall(data)  # within SEND_TIMEOUT_S (see _ForkLoop.run)
            else:
                while data:
                    data = data[os.write(self.write_fd, data):]
        except OSError:  # the launcher is gone (or stopped reading): its servers are still reaped, unreported
            self.open = False
            if self.socket is not None:  # it sees the end, not a half-written answer
                with contextlib.suppress(OSError):
                    self.socket.shutdown(socket.SHUT_RDWR)

    def read(self) -> bytes:
        """What the launcher sent (b"" once it has closed its end, or is gone)."""
        try:
            return self.socket.recv(65536) if self.socket is not None else os.read(self.read_fd, 65536)
        except OSError:
            return b""

    def close(self) -> None:
        self.open = False
        if self.socket is not None:
            self.socket.close()


def _fork(request: ForkRequest, private_fds: Sequence[int]) -> int:
    """Fork one server and return its pid once it leads its own session and group (so the
    launcher's first signal to the group reaches it) with its priority, CPUs and process title
    set; in the child, never returns."""
    settled_read, settled_write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(settled_write)
        os.read(settled_read, 1)  # EOF: the child closed its end, settled (or died)
        os.close(settled_read)
        return pid
    code = 1
    try:
        os.close(settled_read)
        os.setsid()
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        if request.nice is not None:
            yield_cpu_to_clients(os.getpid(), request.nice)
        if request.cpus is not None:
            os.sched_setaffinity(0, request.cpus)
            _size_threads_to(len(request.cpus), request.env)
        # The title before the environment is swapped: setproctitle finds the memory it rewrites
        # through the environment as the process started, so afterwards neither this nor vLLM's
        # own titles (VLLM::EngineCore, which our CPU accounting reads) would take.
        _set_title(request.title)
        os.close(settled_write)
        log = os.open(request.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in (log, null, *private_fds):
            with contextlib.suppress(OSError):
                os.close(fd)
        os.write(1, f"# forked by fork server {os.getppid()}: vLLM and the server already imported\n".encode())
        os.environ.clear()
        os.environ.update(request.env)
        os.chdir(request.cwd)
        sys.argv = ["server", *request.args]
        from server.__main__ import main

        code = main(request.args)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _size_threads_to(cpus: int, env: Mapping[str, str]) -> None:
    """Give the server (and the engine core it forks) as many OpenMP threads as it has CPUs, as a
    fresh process gets when torch loads: this one inherited the count from the fork server's
    CPUs at its import. Two threads on one CPU wait on each other at every parallel region: a
    lane test's tuner, forked onto 1 of 2 cores from a fork server imported on both, took 266 s
    against 102 s. OMP_NUM_THREADS, where set, already sized it (the environments match)."""
    torch = sys.modules.get("torch")
    if torch is not None and "OMP_NUM_THREADS" not in env:
        torch.set_num_threads(cpus)


def _set_title(title: str) -> None:
    try:
        import setproctitle  # vLLM's dependency; without it, titles stay as they are
    except ImportError:
        return
    setproctitle.setproctitle(title)


class _ForkLoop:
    """The select loop: requests from the owner and any socket client, SIGCHLD, new clients."""

    def __init__(self, hello: dict[str, Any], listener: socket.socket | None) -> None:
        self.hello = hello
        self.listener = listener
        self.selector = selectors.DefaultSelector()
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        os.set_blocking(self.wake_write, False)
        signal.set_wakeup_fd(self.wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select loop through the pipe
        self.selector.register(self.wake_read, selectors.EVENT_READ)
        if listener is not None:
            self.selector.register(listener, selectors.EVENT_READ)
        self.owner = self._add(_Connection(0, 1))
        self.asked_by: dict[int, _Connection] = {}  # server pid -> the launcher that asked

    def _add(self, connection: _Connection) -> _Connection:
        self.selector.register(connection.read_fd, selectors.EVENT_READ, connection)
        connection.answer(self.hello)
        return connection

    def private_fds(self) -> list[int]:
        """What a forked server must not keep: this loop's descriptors."""
        fds = [self.wake_read, self.wake_write, self.selector.fileno()]  # type: ignore[attr-defined]
        if self.listener is not None:
            fds.append(self.listener.fileno())
        fds += [key.data.read_fd for key in self.selector.get_map().values()
                if isinstance(key.data, _Connection) and key.data is not self.owner]
        return fds

    def run(self) -> int:
        while True:
            for key, _ in self.selector.select():
                if key.fd == self.wake_read:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self.wake_read, 4096):
                            pass
                elif self.listener is not None and key.fd == self.listener.fileno():
                    with contextlib.suppress(OSError):
                        client, _ = self.listener.accept()
                        # A launcher that stops reading must not stall the others' forks.
                        client.settimeout(SEND_TIMEOUT_S)
                        self._add(_Connection(client.fileno(), client.fileno(), client))
                elif not self._serve(key.data):
                    return 0
            self._reap()

    def _serve(self, connection: _Connection) -> bool:
        """Read and answer `connection`'s requests; False once the owner has gone."""
        data = connection.read()
        if not data:  # the launcher closed its end, or is gone
            self.selector.unregister(connection.read_fd)
            if connection is self.owner:
                self._reap()
                return False
            connection.close()
            return True
        connection.pending += data
        while b"\n" in connection.pending:
            line, connection.pending = connection.pending.split(b"\n", 1)
            try:
                request = ForkRequest.model_validate_json(line)
                pid = _fork(request, self.private_fds())
                self.asked_by[pid] = connection
                connection.answer({"pid": pid})
            except Exception as error:  # a bad request or a failed fork: say so, go on
                connection.answer({"error": f"{type(error).__name__}: {error}"})
        return True

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            connection = self.asked_by.pop(pid, self.owner)
            connection.answer({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(listen_fd: int | None = None, socket_path: str | None = None) -> int:
    """The fork server's loop: import, answer "ready", then fork on each request until its owner
    closes stdin; with `listen_fd` (a Unix socket its owner bound at `socket_path`, so that a
    launcher may connect at once and wait for "ready" as the owner does), also for each client
    of that socket, which it removes when it ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    listener = None if listen_fd is None else socket.socket(fileno=listen_fd)
    try:
        from server.__main__ import preload

        before = dict(os.environ)
        preload()
        hello = {"ready": True, "server_pid": os.getpid(), "env": configuration(before),
                 "import_env": {name: value for name, value in os.environ.items() if before.get(name) != value}}
        return _ForkLoop(hello, listener).run()
    finally:
        if listener is not None:
            listener.close()
        if socket_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(socket_path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autotune.measure.forkserver_process")
    parser.add_argument("--listen-fd", type=int, metavar="FD",
                        help="also serve launchers connecting to this listening Unix socket")
    parser.add_argument("--socket-path", metavar="PATH", help="where that socket is (removed at the end)")
    args = parser.parse_args(argv)
    return serve(args.listen_fd, args.socket_path)


if __name__ == "__main__":
    sys.exit(main())
