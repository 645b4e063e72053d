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
- A server's environment must be the one the fork server imported under (save the launcher's
  pid and IMPORT_FREE_PREFIXES): vLLM and torch read some variables at import.
  `ForkServer.accepts(env)` says so; the launcher starts such a server the usual way, or a new
  fork server for a changed environment.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import psutil
from pydantic import BaseModel

from autotune.measure.server_registry import _is_gone
from autotune.measure.server_start import yield_cpu_to_clients

logger = logging.getLogger(__name__)

MODULE = "autotune.measure.forkserver"
READY_TIMEOUT_S = 600.0  # the import on a slow, busy host; a dead fork server fails at once
LOST = 255  # the exit code of a server whose fork server died before reaping it: unknown
# Variables no import reads, so a server may differ from the fork server in them (the child gets
# its whole environment all the same): ours (the server reads the launcher's pid, AUTOTUNE_PARENT_PID,
# when it starts; the tuner reads the others), and the name of the test pytest is running.
IMPORT_FREE_PREFIXES = ("AUTOTUNE_", "PYTEST_CURRENT_TEST")


class ForkRequest(BaseModel):
    """One server to fork (launcher -> fork server)."""

    args: list[str]  # what follows `python -m server`
    title: str  # the process title `ps` shows: the command line the server stands for
    env: dict[str, str]
    cwd: str
    log_path: str
    nice: int | None = None
    cpus: list[int] | None = None


class ForkServerError(RuntimeError):
    """The fork server could not start a server (it died, or never finished importing)."""


class ForkServer:
    """A process that imported the server stack once and forks trial servers from it."""

    def __init__(self, python: str = sys.executable, *, env: Mapping[str, str] | None = None,
                 stderr_path: Path | None = None) -> None:
        self.env = _configuration(os.environ if env is None else env)
        stderr: int | BinaryIO = subprocess.DEVNULL
        if stderr_path is not None:
            stderr_path.parent.mkdir(parents=True, exist_ok=True)
            stderr = open(stderr_path, "ab")  # noqa: SIM115 (closed below, once Popen has it)
        try:
            self.process = subprocess.Popen(
                [python, "-m", MODULE],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=self.env,
                start_new_session=True,  # a Ctrl-C in the terminal is for the tuner
            )
        finally:
            if not isinstance(stderr, int):
                stderr.close()
        self._lock = threading.Condition()
        self._ready = False
        self._import_env: dict[str, str] = {}  # what importing vLLM set in the environment
        self._spawned: list[int | str] = []  # answers to spawn requests, in order
        self._exits: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    def accepts(self, env: Mapping[str, str]) -> bool:
        """Whether a server with environment `env` may be forked from this one (once it has
        imported: what the import itself set in the environment may be in `env` too, as it is
        in a launcher that imported vLLM since)."""
        if not self.wait_ready():
            return False
        wanted = {name: value for name, value in _configuration(env).items()
                  if not (name not in self.env and self._import_env.get(name) == value)}
        return self.alive() and wanted == self.env

    def alive(self) -> bool:
        return self.process.poll() is None

    def spawn(self, args: Sequence[str], *, title: str, env: Mapping[str, str], log_path: Path,
              nice: int | None = None, cpus: Sequence[int] | None = None) -> ForkedServer:
        """Fork one server running `python -m server ARGS` (after waiting for the import, if
        still running); `title`: the command line `ps` shows for it."""
        request = ForkRequest(args=list(args), title=title,
                              env=dict(env), cwd=os.getcwd(), log_path=str(log_path),
                              nice=nice, cpus=None if cpus is None else sorted(cpus))
        if not self.wait_ready():
            raise ForkServerError(self._gone("before it had imported the server"))
        with self._lock:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(request.model_dump_json().encode() + b"\n")
                self.process.stdin.flush()
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

    def describe_exit(self) -> str:
        code = self.process.poll()
        state = "is still running" if code is None else f"exited with code {code}"
        return f"the fork server ({self.process.pid}) {state}"

    def _gone(self, when: str) -> str:
        return f"{self.describe_exit()} {when}"

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                message: dict[str, Any] = json.loads(line)
            except ValueError:
                logger.warning("fork server: unreadable line %r", line[:200])
                continue
            with self._lock:
                if message.get("ready"):
                    self._import_env = dict(message.get("import_env") or {})
                    self._ready = True
                elif "pid" in message:
                    self._spawned.append(int(message["pid"]))
                elif "error" in message:
                    self._spawned.append(str(message["error"]))
                elif "exit" in message:
                    self._exits[int(message["exit"])] = int(message["code"])
                self._lock.notify_all()
        with self._lock:
            self._lock.notify_all()


class ForkServers:
    """The fork server for the environment servers start in now: started on first use, and
    again when the environment changed (the old one is closed). A tuner owns one; a test
    session may share one among its trial runners."""

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python
        self._current: ForkServer | None = None

    def for_environment(self, log_dir: Path) -> ForkServer:
        """The fork server for `os.environ` (its import then runs while the caller prepares)."""
        if self._current is None or not self._current.accepts(os.environ):
            self.close()
            self._current = ForkServer(self.python, stderr_path=log_dir / "forkserver.log")
        return self._current

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


def _configuration(env: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if not name.startswith(IMPORT_FREE_PREFIXES)}


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


# -- the fork server's own process ------------------------------------------------------------


def _answer(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


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


def _set_title(title: str) -> None:
    try:
        import setproctitle  # vLLM's dependency; without it, titles stay as they are
    except ImportError:
        return
    setproctitle.setproctitle(title)


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _answer({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def serve() -> int:
    """The fork server's loop: import, answer "ready", then fork on each request until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from server.__main__ import preload

    before = dict(os.environ)
    preload()
    import_env = {name: value for name, value in os.environ.items() if before.get(name) != value}
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select loop through the pipe
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    private = (wake_read, wake_write, selector.fileno())  # type: ignore[attr-defined]
    _answer({"ready": True, "import_env": import_env})
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fd == wake_read:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_read, 4096):
                        pass
                _reap()
                continue
            data = os.read(0, 65536)
            if not data:  # the launcher closed our stdin, or is gone
                _reap()
                return 0
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    request = ForkRequest.model_validate_json(line)
                    _answer({"pid": _fork(request, private)})
                except Exception as error:  # a bad request or a failed fork: say so, go on
                    _answer({"error": f"{type(error).__name__}: {error}"})
        _reap()


if __name__ == "__main__":
    sys.exit(serve())
