"""Trial servers forked from a fork server that imported vLLM once (autotune.measure.forkserver):
real fork server, real `server.__main__.main` in the child; no engine is waited for (the
`autotune run` engine tests start real servers this way)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from autotune.measure.forkserver import (
    ForkedServer,
    ForkServer,
    ForkServers,
    ForkServerSocketError,
    SharedForkServer,
)
from autotune.measure.launcher import ServerLauncher, ServerStartFailed
from autotune.measure.server_start import SERVER_NICE
from autotune.measure.servers import TrialServer
from autotune.measure.trial import TrialRunner
from autotune.pipeline import build_runner
from autotune.prepare import prepare_plan
from autotune.request import TuningRequest
from server.config import ServerConfig

SAMPLE = Path(__file__).resolve().parents[3] / "workloads" / "samples" / "translation_trace.jsonl"

pytestmark = pytest.mark.slow  # the fork server imports vLLM (~8 s on 2 cores)


@pytest.fixture(scope="module")
def forkserver(tmp_path_factory: pytest.TempPathFactory):
    server = ForkServer(stderr_path=tmp_path_factory.mktemp("forkserver") / "forkserver.log")
    yield server
    server.close()


def default_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    ServerConfig.default().write(path)
    return path


def test_a_forked_server_that_refuses_its_config_fails_with_the_reason(forkserver: ForkServer,
                                                                        tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("engine:\n  max_num_seqs: many\n")
    log = tmp_path / "server.log"
    with pytest.raises(ServerStartFailed) as failed:
        ServerLauncher(forkserver=forkserver, startup_timeout_s=120).start(config, log)
    assert failed.value.kind == "invalid_config", failed.value.detail
    assert "exited with code 2" in failed.value.detail
    text = log.read_text()
    assert f"forked by fork server {forkserver.process.pid}" in text
    assert "max_num_seqs" in text  # the server's own one-line refusal, in the trial's log


def test_a_killed_forked_server_is_seen_as_killed_in_its_own_group(forkserver: ForkServer,
                                                                   tmp_path: Path) -> None:
    launcher = ServerLauncher(forkserver=forkserver)
    server = launcher.spawn(default_config(tmp_path), tmp_path / "server.log", port=1)
    assert isinstance(server.popen, ForkedServer)
    assert psutil.Process(server.pid).ppid() == forkserver.process.pid
    assert os.getsid(server.pid) == server.pid  # leads its own session and group, as before
    # `ps` shows the command it stands for, not the fork server's.
    assert " ".join(psutil.Process(server.pid).cmdline()).startswith(f"{sys.executable} -m server --config")
    assert os.getpriority(os.PRIO_PROCESS, server.pid) == SERVER_NICE
    assert server.alive()
    os.killpg(server.pid, signal.SIGKILL)
    assert server.popen.wait(60) == -signal.SIGKILL
    assert not server.alive()
    assert "killed by SIGKILL" in server.failure().detail
    report = server.stop()
    assert report.leftover_pids == [] and report.exit_code == -signal.SIGKILL


def test_a_server_with_another_environment_starts_as_a_process_of_its_own(forkserver: ForkServer,
                                                                          tmp_path: Path) -> None:
    env = {**os.environ, "VLLM_AUTOTUNE_TEST_MARK": "1"}  # not what the fork server imported under
    assert not forkserver.accepts(env)
    assert forkserver.accepts({**os.environ, "AUTOTUNE_PARENT_PID": "1"})  # the server's own
    server = ServerLauncher(forkserver=forkserver, env=env).spawn(
        default_config(tmp_path), tmp_path / "server.log", port=1)
    try:
        assert isinstance(server.popen, subprocess.Popen)
    finally:
        assert server.stop().leftover_pids == []


def test_a_fork_server_that_died_leaves_servers_to_start_on_their_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = ForkServer(stderr_path=tmp_path / "forkserver.log")
    broken.process.kill()  # e.g. the OOM killer
    broken.process.wait()
    with caplog.at_level(logging.WARNING, logger="autotune.measure.launcher"):
        server = ServerLauncher(forkserver=broken).spawn(default_config(tmp_path), tmp_path / "server.log",
                                                         port=1)
    try:
        assert isinstance(server.popen, subprocess.Popen)
        assert "starting the server as a process of its own" in caplog.text
        assert f"the fork server ({broken.process.pid}) exited" in caplog.text
    finally:
        assert server.stop().leftover_pids == []


def test_closing_ends_the_fork_server(tmp_path: Path) -> None:
    server = ForkServer(stderr_path=tmp_path / "forkserver.log")
    server.close()  # while it still imports: it is not waited for
    assert server.process.returncode is not None
    assert not server.alive()
    sock = tmp_path / "forkserver.sock"
    shared = ForkServer(stderr_path=tmp_path / "forkserver.log", listen=sock)
    waiting = SharedForkServer(sock)
    shared.close()
    assert not waiting.wait_ready() and "closed the connection" in waiting.describe_exit()
    assert not sock.exists()


@pytest.mark.parametrize(("flag", "server", "forks"), [
    ("on", TrialServer(), True),
    ("off", TrialServer(), False),
    ("on", TrialServer(kind="vllm"), False),  # stock `vllm serve` is always its own process
])
def test_which_runs_fork_their_servers(tmp_path: Path, flag: str, server: TrialServer, forks: bool) -> None:
    plan = prepare_plan(TuningRequest(workload=str(SAMPLE), study_name="s", output_dir=tmp_path,
                                      command_line=["autotune", "run"], fork_servers=flag, server=server.kind))
    runner = build_runner(plan, registry=tmp_path / "servers.json")
    assert runner.preload_server is forks
    # A fake server command (tests') is never forked: the fork server runs our server's main.
    assert TrialRunner(preload_server=True, server_command=[sys.executable, "fake.py"]).preload_server is False


@dataclass
class Shared:
    owner: ForkServer  # started with a socket to listen on
    early: SharedForkServer  # a launcher that connected before the import was done


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory):
    """A fork server other launchers connect to (as `autotune fork-server` starts one)."""
    folder = tmp_path_factory.mktemp("shared")
    owner = ForkServer(listen=folder / "forkserver.sock", stderr_path=folder / "forkserver.log")
    # A launcher may connect as soon as the fork server is started: it waits for the import.
    early = SharedForkServer(folder / "forkserver.sock")
    yield Shared(owner, early)
    early.close()
    owner.close()
    assert not (folder / "forkserver.sock").exists()


def test_a_launcher_forks_from_a_shared_fork_server_onto_its_own_cpus(shared: Shared,
                                                                        tmp_path: Path) -> None:
    connection = shared.early
    assert connection.wait_ready() and connection.pid == shared.owner.process.pid
    before = os.sched_getaffinity(0)
    mine = {min(before)}
    os.sched_setaffinity(0, mine)  # a launcher pinned apart (as a test lane is)
    try:
        server = ServerLauncher(forkserver=connection, startup_timeout_s=300).start(
            default_config(tmp_path), tmp_path / "server.log")
    finally:
        os.sched_setaffinity(0, before)
    try:
        assert isinstance(server.popen, ForkedServer)
        assert psutil.Process(server.pid).ppid() == shared.owner.process.pid
        assert set(psutil.Process(server.pid).cpu_affinity()) == mine  # the launcher's, not the fork server's
        # As many torch (OpenMP) threads as its one CPU, as a fresh process there would have, not
        # the fork server's count: two on one CPU served 40x slower (benchmarks/forked_threads.py).
        info = httpx.get(f"http://{server.host}:{server.port}/info", timeout=30).json()
        assert info["engine"]["torch_threads"] == 1, info
        os.killpg(server.pid, signal.SIGKILL)
        assert server.popen.wait(60) == -signal.SIGKILL  # its exit comes back on this connection
    finally:
        assert server.stop().leftover_pids == []


def test_a_launcher_leaving_leaves_the_shared_fork_server_to_the_others(shared: Shared,
                                                                         tmp_path: Path) -> None:
    assert shared.owner.listen is not None
    leaving, staying = SharedForkServer(shared.owner.listen), SharedForkServer(shared.owner.listen)
    assert leaving.wait_ready() and leaving.pid == shared.owner.process.pid
    leaving.close()
    assert not leaving.alive() and "closed the connection" in leaving.describe_exit()
    config = tmp_path / "bad.yaml"
    config.write_text("engine:\n  max_num_seqs: many\n")
    with pytest.raises(ServerStartFailed) as failed:
        ServerLauncher(forkserver=staying, startup_timeout_s=120).start(config, tmp_path / "server.log")
    assert failed.value.kind == "invalid_config", failed.value.detail
    assert f"forked by fork server {shared.owner.process.pid}" in (tmp_path / "server.log").read_text()
    staying.close()
    assert shared.owner.alive()


def test_a_tuner_uses_the_shared_fork_server_only_in_its_environment(
    shared: Shared, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    assert shared.owner.listen is not None
    servers = ForkServers(shared=shared.owner.listen)
    assert isinstance(servers.for_environment(tmp_path), SharedForkServer)
    servers.close()
    assert shared.owner.alive()
    monkeypatch.setenv("VLLM_AUTOTUNE_TEST_MARK", "1")  # read by no import, but the fork server can't know
    with caplog.at_level(logging.WARNING, logger="autotune.measure.forkserver"):
        own = servers.for_environment(tmp_path)
    try:
        assert not isinstance(own, SharedForkServer)
        assert "imported under another environment (VLLM_AUTOTUNE_TEST_MARK)" in caplog.text
    finally:
        servers.close()


def test_the_fork_server_command_serves_until_stopped_and_removes_its_socket(tmp_path: Path) -> None:
    sock = tmp_path / "forkserver.sock"
    command = subprocess.Popen([sys.executable, "-m", "autotune", "fork-server", "--socket", str(sock)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert command.stdout is not None
        line = command.stdout.readline()  # once imported
        assert f"listening at {sock}" in line, command.stderr.read() if command.stderr else line
        connection = SharedForkServer(sock)
        assert connection.wait_ready() and str(connection.pid) in line
        command.send_signal(signal.SIGTERM)
        assert command.wait(60) == 128 + signal.SIGTERM
        assert connection.wait_exit(-1, 60) is None and not connection.alive()  # the end reaches it
        assert not sock.exists()
        with pytest.raises(ForkServerSocketError, match="nobody listens there"):
            SharedForkServer(sock)
    finally:
        command.kill()
        command.wait()


def test_a_launcher_that_stops_reading_is_dropped_and_the_others_are_served(shared: Shared,
                                                                            tmp_path: Path) -> None:
    assert shared.owner.listen is not None
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stuck.connect(str(shared.owner.listen))
    # Requests it never reads the answers to: more than the socket buffers hold.
    def flood() -> None:
        with contextlib.suppress(OSError):
            stuck.sendall(b"{}\n" * 50_000)

    threading.Thread(target=flood, daemon=True).start()
    staying = SharedForkServer(shared.owner.listen)
    config = tmp_path / "bad.yaml"
    config.write_text("engine:\n  max_num_seqs: many\n")
    with pytest.raises(ServerStartFailed) as failed:  # answered once the stuck one is dropped
        ServerLauncher(forkserver=staying, startup_timeout_s=120).start(config, tmp_path / "server.log")
    assert failed.value.kind == "invalid_config", failed.value.detail
    received = b""
    stuck.settimeout(120)
    while chunk := stuck.recv(1 << 20):  # ends: the fork server shut the connection
        received += chunk
    assert 0 < received.count(b"\n") < 50_000
    stuck.close()
    staying.close()
    assert shared.owner.alive()
