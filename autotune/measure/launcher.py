"""Start one server under test in its own process group, wait until it is ready, stop it.

Every start is recorded in a stale-server registry (a JSON file) until the whole process
group is confirmed gone, so that a later run can end servers a killed tuner left behind.

One module because starting, waiting and stopping share `ServerProcess`'s state (the process
group, its registry entry, the memory free before the spawn); what a start needs besides
that state lives in `server_start.py`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import httpx
import psutil
from pydantic import BaseModel

from autotune.measure.cpu_split import CpuSplit
from autotune.measure.forkserver import ForkedServer, ForkServer, ForkServerError
from autotune.measure.process_cpu import CpuReading, read_cpu
from autotune.measure.server_registry import (
    RegisteredServer,
    StaleServerRegistry,
    _group_members,
    _is_gone,
    _signal_all,
)
from autotune.measure.server_start import (
    SERVER_NICE,
    StartFailureKind,
    classify_exit,
    environment_problem,
    free_port,
    headline,
    log_tail,
    memory_problem,
    port_is_free,
    yield_cpu_to_clients,
)
from server.lifeline import PARENT_PID_ENV

logger = logging.getLogger(__name__)


class ServerStartFailed(Exception):
    """The server did not become ready; `kind` says why, `detail` is one line for humans."""

    def __init__(self, kind: StartFailureKind, detail: str, log_tail: Sequence[str] = ()):
        super().__init__(detail)
        self.kind: StartFailureKind = kind
        self.detail = detail
        self.log_tail = list(log_tail)
        self.teardown: TeardownReport | None = None  # set once the failed server is stopped


class TeardownReport(BaseModel):
    """What stopping a server took and what was seen afterwards."""

    seconds: float  # stop signal -> group gone and memory back (or waits given up)
    strongest_signal: Literal["none", "SIGTERM", "SIGKILL"]  # what it took to end the group
    exit_code: int | None  # of the server's main process
    leftover_pids: list[int]  # still alive after SIGKILL (should be empty)
    memory_available_before_mib: float  # just before the server was started
    memory_held_mib: float  # unique memory (USS) of the server's processes when stopped
    memory_available_at_stop_mib: float
    memory_available_after_mib: float
    # Resident memory other processes gained during the wait (an engine starting elsewhere):
    # counted back before judging recovery, so their growth is not blamed on the server.
    memory_taken_by_others_mib: float = 0.0
    # Available memory (plus what others took meanwhile) came back, within a tolerance, to its
    # pre-start level, or rose by what the server held. Recorded, not enforced.
    memory_recovered: bool




def _memory_available() -> int:
    return psutil.virtual_memory().available


def _unique_memory(processes: Sequence[psutil.Process]) -> int:
    """Bytes the processes hold that their exit frees (USS; RSS where USS is unreadable)."""
    total = 0
    for process in processes:
        try:
            total += process.memory_full_info().uss
        except psutil.AccessDenied:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _resident_outside(pids: set[int]) -> int:
    """Resident bytes of every process but `pids` (RSS: cheap to read for all of them)."""
    total = 0
    for process in psutil.process_iter(["pid", "memory_info"]):
        memory = process.info["memory_info"]
        if process.info["pid"] not in pids and memory is not None:
            total += memory.rss
    return total



class ServerProcess:
    """A running server: its process group, its port, its log; `stop()` ends all of it."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes] | ForkedServer,
        *,
        host: str,
        port: int,
        log_path: Path,
        spawned_at: float,
        memory_before: int,
        registry: StaleServerRegistry | None,
    ):
        self.popen = popen
        self.pid = popen.pid
        self.pgid = popen.pid  # start_new_session=True: the server leads its own group
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"
        self.log_path = log_path
        self.spawned_at = spawned_at  # time.monotonic() just before the spawn
        self.launched_at = time.monotonic()  # the process exists
        self.ready_at: float | None = None  # /health answered 200
        self.memory_before = memory_before
        self._registry = registry
        self._process = psutil.Process(popen.pid)
        self.create_time = self._process.create_time()
        self._known: dict[int, psutil.Process] = {popen.pid: self._process}

    def alive(self) -> bool:
        return self.popen.poll() is None

    def track_children(self) -> None:
        """Remember every descendant now alive, so `stop()` can check them even after they
        leave the group or lose their parent."""
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in self._process.children(recursive=True):
                self._known.setdefault(child.pid, child)

    def cpu_reading(self) -> CpuReading:
        """CPU counters of every server process alive now (diffed per step: process_cpu)."""
        self.track_children()
        return read_cpu(list(self._known.values()), self.pid, time.monotonic())

    def known_pids(self) -> list[int]:
        return sorted(self._known)

    def listens_on_port(self) -> bool:
        """Whether one of our processes holds the listening socket (not a stranger)."""
        for process in list(self._known.values()):
            try:
                connections = process.net_connections(kind="tcp")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            for conn in connections:
                if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == self.port:
                    return True
        return False

    def failure(self) -> ServerStartFailed:
        """Describe why the (exited) server is not serving."""
        tail = log_tail(self.log_path)
        code = self.popen.poll()
        kind = classify_exit(code, tail)
        how = f"server exited with code {code}"
        if code is not None and code < 0:
            # A signal, not the server's own exit: its last log line is then only what it
            # happened to be doing, so name the signal first.
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            how += f" (killed by {name}"
            if -code == signal.SIGKILL:
                how += ": the kernel's OOM killer, or another process"
            how += ")"
        what = headline(tail)
        problem = (environment_problem(tail) if kind == "environment"
                   else memory_problem(tail) if kind == "oom" else None)
        if problem is not None and problem not in what:
            what = f"{problem}; {what}"  # the module or error first: what the user must fix
        return ServerStartFailed(kind, f"{how}: {what}", log_tail=tail)

    def wait_ready(self, timeout_s: float, *, poll_s: float = 0.25) -> float:
        """Block until `/health` answers 200; return seconds since spawn.

        Raises ServerStartFailed: "start_timeout" after `timeout_s`, or the classified exit
        ("crash", "oom", "port_in_use", "invalid_config", "environment") as soon as the process
        dies.
        """
        deadline = self.spawned_at + timeout_s
        # trust_env=False: a proxy from the environment must not stand between us and it.
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                self.track_children()
                if not self.alive():
                    raise self.failure()
                try:
                    response = client.get(self.url + "/health")
                except httpx.HTTPError:
                    response = None
                if response is not None and response.status_code == 200:
                    if self.listens_on_port():
                        self.ready_at = time.monotonic()
                        return self.ready_at - self.spawned_at
                    # Someone else answers on our port; ours will fail to bind and exit.
                now = time.monotonic()
                if now >= deadline:
                    tail = log_tail(self.log_path)
                    raise ServerStartFailed(
                        "start_timeout",
                        f"/health not 200 after {timeout_s:g} s; last log line: {headline(tail)}",
                        log_tail=tail,
                    )
                time.sleep(min(poll_s, max(0.0, deadline - now)))

    def stop(
        self,
        *,
        grace_s: float = 20.0,
        # Returns as soon as the group is gone; the long bound is for a process that sits in
        # the kernel (page faults on a machine under heavy load) and takes a while to die.
        kill_wait_s: float = 30.0,
        memory_wait_s: float = 10.0,
        memory_tolerance_bytes: int | None = None,
    ) -> TeardownReport:
        """SIGTERM the group, SIGKILL what is left after `grace_s`, confirm all gone.

        Then wait (at most `memory_wait_s`) until available memory is back within the
        tolerance (default: 2% of RAM, at least 256 MiB) of its level before the start, or
        has risen by what the server's processes held when stopped; what other processes
        gained in resident memory meanwhile counts as come back.
        """
        started = time.monotonic()
        self.track_children()
        signal_used: Literal["none", "SIGTERM", "SIGKILL"] = "none"
        members = self._members()
        member_pids = {process.pid for process in members}
        held = _unique_memory(members)
        available_at_stop = _memory_available()
        others_at_stop = _resident_outside(member_pids)
        if members:
            signal_used = "SIGTERM"
            _signal_all(self._live_pgid(), members, signal.SIGTERM)
            members = self._wait_gone(grace_s)
        if members:
            signal_used = "SIGKILL"
            _signal_all(self._live_pgid(), members, signal.SIGKILL)
            self._wait_gone(kill_wait_s)
        leftovers = sorted(p.pid for p in self._members())

        if memory_tolerance_bytes is None:
            memory_tolerance_bytes = max(256 * 2**20, psutil.virtual_memory().total // 50)
        target = min(self.memory_before, available_at_stop + held) - memory_tolerance_bytes
        memory_deadline = time.monotonic() + memory_wait_s

        def others_took() -> int:
            return max(0, _resident_outside(member_pids) - others_at_stop)

        available, taken = _memory_available(), others_took()
        while available + taken < target and time.monotonic() < memory_deadline:
            time.sleep(0.25)
            available, taken = _memory_available(), others_took()

        if not leftovers and self._registry is not None:
            self._registry.remove(self.pid)
        return TeardownReport(
            seconds=time.monotonic() - started,
            strongest_signal=signal_used,
            exit_code=self.popen.returncode,
            leftover_pids=leftovers,
            memory_available_before_mib=self.memory_before / 2**20,
            memory_held_mib=held / 2**20,
            memory_available_at_stop_mib=available_at_stop / 2**20,
            memory_available_after_mib=available / 2**20,
            memory_taken_by_others_mib=taken / 2**20,
            memory_recovered=available + taken >= target,
        )

    def _live_pgid(self) -> int | None:
        """Our group id while the group verifiably still exists, else None."""
        if self.popen.poll() is None or _group_members(self.pgid, self.create_time):
            return self.pgid
        return None

    def _wait_gone(self, timeout_s: float) -> list[psutil.Process]:
        """Poll until none of our processes is alive; return those still alive at timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            members = self._members()
            if not members or time.monotonic() >= deadline:
                return members
            time.sleep(0.05)

    def _members(self) -> list[psutil.Process]:
        """Our processes still alive: the server, tracked descendants, anything in our group.

        The server itself is our child: Popen reaps it (keeping its exit code), and it counts
        as alive until then, zombie or not.
        """
        alive: dict[int, psutil.Process] = {}
        if self.popen.poll() is None:
            alive[self.pid] = self._process
        for process in self._known.values():
            if process.pid != self.pid and not _is_gone(process):
                alive[process.pid] = process
        for process in _group_members(self.pgid, self.create_time):
            if process.pid != self.pid:
                alive.setdefault(process.pid, process)
        return list(alive.values())



class ServerLauncher:
    """Starts `python -m server --config FILE --port P --benchmark-mode` and waits for it.

    `command` replaces `[python, "-m", "server"]` (tests use a fake server script); the
    `--config/--port` arguments and `extra_args` are always appended. Every server is told
    this process's pid (`AUTOTUNE_PARENT_PID`), so that ours stops by itself, engine included,
    should this process die without stopping it (SIGKILL): see server.lifeline.
    """

    def __init__(
        self,
        *,
        python: str = sys.executable,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 300.0,
        registry: StaleServerRegistry | None = None,
        study: str = "",
        command: Sequence[str] | None = None,
        extra_args: Sequence[str] = ("--benchmark-mode",),
        env: dict[str, str] | None = None,
        cpu_split: CpuSplit | None = None,
        forkserver: ForkServer | None = None,
    ):
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.registry = registry
        self.study = study
        self.command = list(command) if command is not None else [python, "-m", "server"]
        self.extra_args = list(extra_args)
        self.env = env
        self.cpu_split = cpu_split  # the server's own CPUs, apart from the client's
        # Forks the server with vLLM already imported (autotune.measure.forkserver): runs
        # `python -m server`'s main, so only for that command; and only for servers with the
        # environment it imported under (else, or if it failed, the server starts as usual).
        self.forkserver = forkserver

    def start(
        self, config_path: Path, log_path: Path, *, trial: str = "", port: int | None = None
    ) -> ServerProcess:
        """Spawn the server and return it once `/health` is 200.

        Tries `port` (or a free one), and once more on a fresh free port if the first is
        taken. On failure the process group is stopped before ServerStartFailed is raised.
        """
        attempts = 2
        for attempt in range(1, attempts + 1):
            if port is None or not port_is_free(self.host, port):
                port = free_port(self.host)
            server = self.spawn(config_path, log_path, port=port, trial=trial)
            try:
                server.wait_ready(self.startup_timeout_s)
                return server
            except ServerStartFailed as failure:
                failure.teardown = server.stop()
                if failure.kind != "port_in_use" or attempt == attempts:
                    raise
                port = None
            except BaseException:
                server.stop()
                raise
        raise AssertionError("unreachable")

    def spawn(self, config_path: Path, log_path: Path, *, port: int, trial: str = "") -> ServerProcess:
        """Start the process (own session and group) without waiting for readiness."""
        argv = [*self.command, "--config", str(config_path), "--port", str(port), *self.extra_args]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if self.env is None else self.env)
        env[PARENT_PID_ENV] = str(os.getpid())
        memory_before = _memory_available()
        with open(log_path, "ab") as log:
            stamp = dt.datetime.now().isoformat(timespec="seconds")
            log.write(f"# autotune {stamp}: starting {' '.join(argv)}\n".encode())
            log.flush()
            spawned_at = time.monotonic()
            popen = self._fork(argv, env, log_path)
            if popen is None:
                popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=env,
                )
                yield_cpu_to_clients(popen.pid)
                if self.cpu_split is not None:
                    self.cpu_split.pin_server(popen.pid)
        server = ServerProcess(
            popen,
            host=self.host,
            port=port,
            log_path=log_path,
            spawned_at=spawned_at,
            memory_before=memory_before,
            registry=self.registry,
        )
        if self.registry is not None:
            self.registry.add(
                RegisteredServer(
                    pid=server.pid,
                    pgid=server.pgid,
                    create_time=server.create_time,
                    study=self.study,
                    trial=trial,
                    port=port,
                    started=dt.datetime.now().isoformat(timespec="seconds"),
                )
            )
        return server

    def _fork(self, argv: list[str], env: dict[str, str], log_path: Path) -> ForkedServer | None:
        """The server forked from the fork server (priority and CPUs set in the child, before
        it starts any thread), or None where it must start as a process of its own."""
        if self.forkserver is None:
            return None
        if not self.forkserver.accepts(env):
            if not self.forkserver.alive():
                logger.warning("%s; starting the server as a process of its own",
                               self.forkserver.describe_exit())
            return None
        try:
            return self.forkserver.spawn(
                argv[len(self.command):], title=" ".join(argv), env=env, log_path=log_path, nice=SERVER_NICE,
                cpus=None if self.cpu_split is None else self.cpu_split.server)
        except ForkServerError as error:
            logger.warning("%s; starting the server as a process of its own", error)
            return None
