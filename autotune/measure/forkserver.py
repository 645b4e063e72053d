"""Trial servers forked from a process that has already imported vLLM and the server.

A trial server spends most of its start importing: `python -m server` imports vLLM, torch and
FastAPI before it builds anything (8-9 s of a ~15 s start of the embedded default on a 2-core
VM; 10-15 s of a 40-80 s launch on a GPU host). A tuner starts one server per trial and the
same server every time, so `ForkServer` imports that stack once in a process of its own and
forks each server from it: the child starts where the import ended, with the environment,
working folder, log file, CPU priority and CPUs the launcher asks for, and runs the server's
`main()` with the same arguments `python -m server` gets. vLLM's own API server does the same
when it forks its engine core (after importing vLLM, before CUDA is initialised).

- The fork server is a child of the launcher, reading requests (JSON lines) on its stdin and
  answering on its stdout: "ready" once imported, the pid of each server forked, and each
  server's exit status once it has reaped it. It is single-threaded (one select loop, SIGCHLD
  through a wakeup pipe), so nothing is forked while another thread holds a lock.
- A server it forked is its child, not the launcher's: `ForkedServer` stands in for
  `subprocess.Popen` (pid, poll, wait, returncode) from those answers. Each server leads its
  own session and group as before, so stopping, the stale-server registry and the server's
  lifeline (AUTOTUNE_PARENT_PID names the launcher) work unchanged.
- It ends when the launcher closes its stdin (`close()`, or the launcher's death); servers
  still running then keep their own lifeline. Ctrl-C is the tuner's: the fork server ignores
  it, and the tuner stops its servers itself.
- One fork server may serve several launchers (tuners of one host, a test suite's processes):
  started with a socket to listen on (`ForkServer(listen=PATH)`, `autotune fork-server`), it
  answers each connection as it answers its owner, and each launcher connects with
  `SharedForkServer(PATH)` (`--fork-server-socket`). The owner's stdin still decides its end.
  A server runs on its launcher's CPUs (sent with each request), as a child of the launcher
  would, not on the fork server's, with as many torch threads as those CPUs (a fresh process
  sizes its OpenMP pool from its CPUs when torch loads; a forked one inherited the fork
  server's: 2 threads on 1 CPU served 45-49x slower, results/benchmarks/forked_threads.md).
- A server's environment must be the one the fork server imported under (save the launcher's
  pid and the variables forkserver_process.configuration leaves out): vLLM and torch read some
  variables at import.
  `ForkServer.accepts(env)` says so; the launcher starts such a server the usual way, or a new
  fork server for a changed environment.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import psutil

from autotune.errors import AutotuneError
from autotune.measure.forkserver_process import ForkRequest, configuration
from autotune.measure.server_registry import _is_gone

logger = logging.getLogger(__name__)

MODULE = "autotune.measure.forkserver_process"
READY_TIMEOUT_S = 600.0  # the import on a slow, busy host; a dead fork server fails at once
LOST = 255  # the exit code of a server whose fork server died before reaping it: unknown


class ForkServerError(RuntimeError):
    """The fork server could not start a server (it died, or never finished importing)."""


class ForkServerSocketError(AutotuneError):
    """A fork server's socket path that cannot be used (taken, not a socket, nobody listening)."""


class ForkServer:
    """A process that imported the server stack once and forks trial servers from it: one this
    process started (and ends with close()); with `listen`, other launchers may use it too."""

    def __init__(self, python: str = sys.executable, *, env: Mapping[str, str] | None = None,
                 stderr_path: Path | None = None, listen: Path | None = None) -> None:
        self.listen = listen
        listener = None if listen is None else bind_socket(listen)
        self.env = configuration(os.environ if env is None else env)
        stderr: int | BinaryIO = subprocess.DEVNULL
        if stderr_path is not None:
            stderr_path.parent.mkdir(parents=True, exist_ok=True)
            stderr = open(stderr_path, "ab")  # noqa: SIM115 (closed below, once Popen has it)
        try:
            self.process = subprocess.Popen(
                [python, "-m", MODULE,
                 *([] if listener is None else ["--listen-fd", str(listener.fileno()), "--socket-path", str(listen)])],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=self.env,
                start_new_session=True,  # a Ctrl-C in the terminal is for the tuner
                pass_fds=() if listener is None else (listener.fileno(),),
            )
        finally:
            if not isinstance(stderr, int):
                stderr.close()
            if listener is not None:
                listener.close()  # the fork server's now
        self.pid: int | None = self.process.pid
        self._start_reading(self.process.stdout)

    def _start_reading(self, stream: Any) -> None:
        self._lock = threading.Condition()
        self._ready = False
        self._import_env: dict[str, str] = {}  # what importing vLLM set in the environment
        self._spawned: list[int | str] = []  # answers to spawn requests, in order
        self._exits: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, args=(stream,), name="forkserver-reader",
                                        daemon=True)
        self._reader.start()

    def accepts(self, env: Mapping[str, str]) -> bool:
        """Whether a server with environment `env` may be forked from this one (once it has
        imported: what the import itself set in the environment may be in `env` too, as it is
        in a launcher that imported vLLM since)."""
        return self.wait_ready() and self.alive() and not self.differences(env)

    def differences(self, env: Mapping[str, str]) -> list[str]:
        """The names of the variables in which `env` differs from what this one imported under."""
        wanted = {name: value for name, value in configuration(env).items()
                  if not (name not in self.env and self._import_env.get(name) == value)}
        return sorted(name for name in wanted.keys() | self.env.keys() if wanted.get(name) != self.env.get(name))

    def alive(self) -> bool:
        return self.process.poll() is None

    def spawn(self, args: Sequence[str], *, title: str, env: Mapping[str, str], log_path: Path,
              nice: int | None = None, cpus: Sequence[int] | None = None) -> ForkedServer:
        """Fork one server running `python -m server ARGS` (after waiting for the import, if
        still running); `title`: the command line `ps` shows for it. It runs on `cpus`, else on
        this process's CPUs (as a child of this process would)."""
        request = ForkRequest(args=list(args), title=title,
                              env=dict(env), cwd=os.getcwd(), log_path=str(log_path), nice=nice,
                              cpus=sorted(os.sched_getaffinity(0) if cpus is None else cpus))
        if not self.wait_ready():
            raise ForkServerError(self._gone("before it had imported the server"))
        with self._lock:
            try:
                self._send(request.model_dump_json().encode() + b"\n")
            except OSError as error:
                raise ForkServerError(self._gone(f"on a request ({error})")) from None
            while not self._spawned:
                if not self._reader.is_alive():
                    raise ForkServerError(self._gone("before it answered"))
                self._lock.wait(0.5)
            answer = self._spawned.pop(0)
        if isinstance(answer, str):
            raise ForkServerError(f"the fork server could not fork a server: {answer}")
        return ForkedServer(answer, self)

    def _send(self, data: bytes) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(data)
        self.process.stdin.flush()

    def wait_ready(self) -> bool:
        """Wait for the import to finish; False if the fork server died or took too long."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        with self._lock:
            while not self._ready:
                if not self._reader.is_alive() or time.monotonic() >= deadline:
                    return False
                self._lock.wait(0.5)
            return True

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout_s: float | None) -> int | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while pid not in self._exits and self._reader.is_alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._lock.wait(0.5 if left is None else min(left, 0.5))
            return self._exits.get(pid)

    def reporting(self) -> bool:
        """Whether exits are still reported (the fork server alive, or its last lines unread)."""
        return self._reader.is_alive()

    def close(self, timeout_s: float = 5.0) -> None:
        """End the fork server (servers it forked keep running until stopped)."""
        with contextlib.suppress(OSError):
            if self.process.stdin is not None:
                self.process.stdin.close()
        with self._lock:
            importing = not self._ready
        if importing:  # it reads its stdin only once imported: no need to wait for that
            self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.listen is not None:  # it removes its socket, unless killed before it could
            self.listen.unlink(missing_ok=True)

    def describe_exit(self) -> str:
        code = self.process.poll()
        state = "is still running" if code is None else f"exited with code {code}"
        return f"the fork server ({self.process.pid}) {state}"

    def _gone(self, when: str) -> str:
        return f"{self.describe_exit()} {when}"

    def _read(self, stream: Any) -> None:
        with contextlib.suppress(OSError):  # a connection reset: the end, as at EOF
            self._read_lines(stream)
        with self._lock:
            self._lock.notify_all()

    def _read_lines(self, stream: Any) -> None:
        for line in stream:
            try:
                message: dict[str, Any] = json.loads(line)
            except ValueError:
                logger.warning("fork server: unreadable line %r", line[:200])
                continue
            with self._lock:
                if message.get("ready"):
                    self._import_env = dict(message.get("import_env") or {})
                    self.env = dict(message.get("env") or self.env)
                    self.pid = int(message.get("server_pid") or 0) or self.pid
                    self._ready = True
                elif "pid" in message:
                    self._spawned.append(int(message["pid"]))
                elif "error" in message:
                    self._spawned.append(str(message["error"]))
                elif "exit" in message:
                    self._exits[int(message["exit"])] = int(message["code"])
                self._lock.notify_all()


class SharedForkServer(ForkServer):
    """A connection to a fork server another process started with a socket to listen on
    (`autotune fork-server`, a test session): closing it ends the connection, not the server."""

    def __init__(self, path: Path) -> None:  # not super().__init__(): that starts a process
        self.listen = path
        self.env = {}
        self.pid = None
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._socket.connect(str(path))
        except OSError as error:
            self._socket.close()
            raise ForkServerSocketError(
                f"fork server socket {path}: nobody listens there ({error.strerror or error}); "
                "start one with `autotune fork-server --socket PATH`") from None
        self._start_reading(self._socket.makefile("rb"))

    def alive(self) -> bool:
        return self._reader.is_alive()

    def _send(self, data: bytes) -> None:
        self._socket.sendall(data)

    def close(self, timeout_s: float = 5.0) -> None:
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()
        self._reader.join(timeout_s)

    def describe_exit(self) -> str:
        state = "is connected" if self.alive() else "closed the connection"
        return f"the shared fork server at {self.listen} ({self.pid or 'pid unknown'}) {state}"


def claim_socket_path(path: Path) -> None:
    """Make `path` free for a new fork server's socket: a stale socket (nobody listening) is
    removed; a live one, or anything that is not a socket, is refused in one line."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        if not path.parent.is_dir():
            raise ForkServerSocketError(f"fork server socket {path}: its folder does not exist") from None
        return
    if not stat.S_ISSOCK(mode):
        raise ForkServerSocketError(f"fork server socket {path}: the path exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink(missing_ok=True)  # left by a fork server that died
        return
    finally:
        probe.close()
    raise ForkServerSocketError(f"fork server socket {path}: a fork server already listens there")


def bind_socket(path: Path) -> socket.socket:
    """A Unix socket listening at `path` (claimed first), for this user only: a request runs code
    as us. Bound here, before the fork server imports, so that launchers may connect at once."""
    claim_socket_path(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        os.chmod(path, 0o600)  # before listening: until then nobody can connect
    except OSError as error:
        listener.close()
        raise ForkServerSocketError(f"fork server socket {path}: cannot listen there ({error.strerror or error})") from None
    listener.listen(64)
    return listener


class ForkServers:
    """The fork server for the environment servers start in now: a shared one (`shared`, a
    socket) where it imported under this environment, else one of our own, started on first use
    and again when the environment changed (the old one is closed). A tuner owns one; a test
    session may share one among its trial runners."""

    def __init__(self, python: str = sys.executable, *, shared: Path | None = None) -> None:
        self.python = python
        self.shared = shared
        self._current: ForkServer | None = None

    def for_environment(self, log_dir: Path) -> ForkServer:
        """The fork server for `os.environ` (its import then runs while the caller prepares)."""
        if self._current is None or not self._current.accepts(os.environ):
            self.close()
            self._current = self._connect() or ForkServer(self.python, stderr_path=log_dir / "forkserver.log")
        return self._current

    def _connect(self) -> ForkServer | None:
        if self.shared is None:
            return None
        try:
            server = SharedForkServer(self.shared)
        except ForkServerSocketError as error:
            logger.warning("%s; starting a fork server of our own", error)
            return None
        if not server.wait_ready():
            logger.warning("%s before it was ready; starting a fork server of our own", server.describe_exit())
        elif differences := server.differences(os.environ):
            logger.warning("the shared fork server at %s imported under another environment (%s); "
                        "starting a fork server of our own", self.shared, ", ".join(differences))
        else:
            return server
        server.close()
        return None

    def close(self) -> None:
        if self._current is not None:
            self._current.close()
            self._current = None


class ForkedServer:
    """A server forked by a ForkServer, as much of `subprocess.Popen` as the launcher uses."""

    def __init__(self, pid: int, forkserver: ForkServer) -> None:
        self.pid = pid
        self._forkserver = forkserver
        self._process = _process(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self._forkserver.exit_code(self.pid)
            if code is None and not self._forkserver.reporting() and not self._running():
                code = LOST  # reaped by someone else: the status is gone with the fork server
            self.returncode = code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            self._forkserver.wait_exit(self.pid, timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired([MODULE], timeout or 0.0)
        return code

    def _running(self) -> bool:
        # is_running(): the same process, not a later one given the same pid.
        return self._process is not None and self._process.is_running() and not _is_gone(self._process)


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
