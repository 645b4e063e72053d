"""ServerLauncher / ServerProcess / reap_stale_servers against real subprocesses (a fake server)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import psutil
import pytest

import autotune.measure.launcher as launcher_module
from autotune.measure.launcher import ServerLauncher, ServerStartFailed
from autotune.measure.server_registry import StaleServerRegistry, reap_stale_servers
from autotune.measure.server_start import (
    IPC_ENV,
    SERVER_NICE,
    classify_exit,
    free_port,
    headline,
    private_ipc_folder,
)

FAKE_SERVER = Path(__file__).resolve().parents[1] / "fake_server.py"


def behaviour_file(tmp_path: Path, **behaviour: object) -> Path:
    path = tmp_path / "behaviour.json"
    path.write_text(json.dumps(behaviour))
    return path


def launcher(tmp_path: Path, **kwargs: object) -> ServerLauncher:
    kwargs.setdefault("startup_timeout_s", 10.0)
    return ServerLauncher(
        command=[sys.executable, str(FAKE_SERVER)],
        registry=StaleServerRegistry(tmp_path / "servers.json"),
        study="s1",
        **kwargs,
    )


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def child_pids_from_log(log: Path) -> list[int]:
    return [int(line.split()[-1]) for line in log.read_text().splitlines() if line.startswith("child pid")]


def test_ready_server_answers_then_stop_ends_whole_group(tmp_path: Path) -> None:
    config = behaviour_file(tmp_path, ready_after_s=0.5, spawn_child=True)
    log = tmp_path / "server.log"
    server = launcher(tmp_path).start(config, log, trial="trial-0001")
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        assert server.spawned_at + 0.5 <= time.monotonic()
        entries = StaleServerRegistry(tmp_path / "servers.json").entries()
        assert [(e.pid, e.pgid, e.study, e.trial) for e in entries] == [
            (server.pid, server.pid, "s1", "trial-0001")
        ]
        children = child_pids_from_log(log)
        assert len(children) == 1 and alive(children[0])
    finally:
        report = server.stop()
    assert report.strongest_signal == "SIGTERM"
    assert report.exit_code == -signal.SIGTERM
    assert report.leftover_pids == []
    assert not alive(server.pid) and not alive(children[0])
    assert StaleServerRegistry(tmp_path / "servers.json").entries() == []
    assert "--benchmark-mode" in log.read_text().splitlines()[0]


def test_the_server_and_the_processes_it_starts_yield_the_cpu_to_the_load_client(tmp_path: Path) -> None:
    """On a shared host the replayer must not queue for a CPU behind the server it measures:
    the server, the children it starts (vLLM's engine core and worker) and its session's
    autogroup (which CPU time is shared by first) all run at SERVER_NICE."""
    config = behaviour_file(tmp_path, spawn_child=True)
    log = tmp_path / "server.log"
    own_nice = psutil.Process().nice()
    server = launcher(tmp_path).start(config, log)
    try:
        child = psutil.Process(child_pids_from_log(log)[0])
        assert psutil.Process(server.pid).nice() == child.nice() == SERVER_NICE > own_nice
        autogroup = Path(f"/proc/{server.pid}/autogroup")
        if autogroup.exists():
            assert autogroup.read_text().split()[-1] == str(SERVER_NICE)
            assert autogroup.read_text() != Path("/proc/self/autogroup").read_text()
    finally:
        server.stop()


@pytest.mark.slow  # a server holding 3 GiB, up to three times
def test_stop_sees_the_servers_memory_come_back(tmp_path: Path) -> None:
    config = behaviour_file(tmp_path, allocate_mib=3072, spawn_child=True)
    # Available memory is a machine-wide reading: what other processes gain in resident
    # memory meanwhile is counted back (next test), but not page cache or kernel memory, so a
    # busy machine still gets three attempts; a server that really kept its memory fails all.
    # On a fresh clone's run beside two other test workers, a 1 GiB server's recovery was read
    # ~430 MiB short three times running (2026-11-27): 3 GiB held against a 1 GiB tolerance
    # leaves room for that noise and still needs two thirds of the memory back.
    reports = []
    for attempt in range(3):
        # Touching 3 GiB takes a loaded 2-core machine a while: the wait is for /health, not a race.
        server = launcher(tmp_path, startup_timeout_s=60.0).start(config, tmp_path / f"server-{attempt}.log")
        report = server.stop(memory_tolerance_bytes=1024 * 2**20)
        assert 3072 <= report.memory_held_mib < 3400
        assert report.leftover_pids == []
        reports.append(report)
        if report.memory_recovered:
            break
    assert reports[-1].memory_recovered, reports


def test_an_engine_starting_elsewhere_during_stop_is_not_blamed_on_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process takes 2 GiB while the server stops (as a CPU engine starting beside a
    test does): available memory falls, yet the server's own memory came back."""
    real_available = launcher_module._memory_available
    readings = {"outside": 0}
    other = 2 * 2**30

    def outside(pids: set[int]) -> int:
        # The real neighbours' resident memory moves by kilobytes between readings; a fixed
        # base keeps the figure exact. The first reading is at stop, before the other grows.
        readings["outside"] += 1
        return 2**30 + (other if readings["outside"] > 1 else 0)

    def available() -> int:
        return real_available() - (other if readings["outside"] > 1 else 0)

    config = behaviour_file(tmp_path, allocate_mib=256)
    server = launcher(tmp_path).start(config, tmp_path / "server.log")
    monkeypatch.setattr(launcher_module, "_resident_outside", outside)
    monkeypatch.setattr(launcher_module, "_memory_available", available)
    report = server.stop(memory_tolerance_bytes=128 * 2**20)
    assert report.leftover_pids == []
    assert report.memory_taken_by_others_mib == 2048
    assert report.memory_recovered, report


@pytest.mark.slow
def test_start_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    config = behaviour_file(tmp_path, ready_after_s=None, spawn_child=True)
    log = tmp_path / "server.log"
    started = time.monotonic()
    with pytest.raises(ServerStartFailed) as raised:
        launcher(tmp_path, startup_timeout_s=2.0).start(config, log)
    assert raised.value.kind == "start_timeout"
    assert "2 s" in raised.value.detail
    assert time.monotonic() - started >= 2.0  # it waited out the deadline it was given
    children = child_pids_from_log(log)
    assert len(children) == 1 and not alive(children[0])
    assert raised.value.teardown is not None and raised.value.teardown.leftover_pids == []
    assert StaleServerRegistry(tmp_path / "servers.json").entries() == []


@pytest.mark.slow
def test_server_ignoring_sigterm_is_killed(tmp_path: Path) -> None:
    config = behaviour_file(tmp_path, ignore_sigterm=True, spawn_child=True)
    log = tmp_path / "server.log"
    server = launcher(tmp_path).start(config, log)
    server.track_children()
    report = server.stop(grace_s=1.0)
    assert report.strongest_signal == "SIGKILL"
    assert report.exit_code == -signal.SIGKILL
    assert report.leftover_pids == []
    assert all(not alive(pid) for pid in [server.pid, *child_pids_from_log(log)])


def test_crash_before_ready_is_classified_with_the_log_line(tmp_path: Path) -> None:
    config = behaviour_file(
        tmp_path,
        ready_after_s=None,
        exit_after_s=0.3,
        exit_code=1,
        message="RuntimeError: model weights not found at /nowhere",
    )
    with pytest.raises(ServerStartFailed) as raised:
        launcher(tmp_path).start(config, tmp_path / "server.log")
    assert raised.value.kind == "crash"
    assert "code 1" in raised.value.detail
    assert "RuntimeError: model weights not found at /nowhere" in raised.value.detail
    assert any("model weights not found" in line for line in raised.value.log_tail)


def test_vllm_kv_cache_error_is_classified_as_oom(tmp_path: Path) -> None:
    message = (
        "ValueError: To serve at least one request with the model's max seq len (4096), "
        "(0.5 GiB KV cache is needed, which is larger than the available KV cache memory "
        "(0.1 GiB)."
    )
    config = behaviour_file(tmp_path, ready_after_s=None, exit_after_s=0.2, message=message)
    with pytest.raises(ServerStartFailed) as raised:
        launcher(tmp_path).start(config, tmp_path / "server.log")
    assert raised.value.kind == "oom"


def test_an_oom_s_detail_leads_with_the_memory_line_even_when_an_error_line_follows(tmp_path: Path) -> None:
    """Our server's own last line ("server: error: the engine failed to start: ...") names no
    cause: the one line a user reads says what ran out first."""
    from autotune.measure.server_start import memory_problem

    tail = ["ValueError: ... larger than the available KV cache memory (0.1 GiB).",
            "server: error: the engine failed to start: RuntimeError: Engine core initialization failed."]
    assert memory_problem(tail) == tail[0]
    assert memory_problem(["server: error: something else"]) is None


def test_death_by_sigkill_is_classified_as_oom(tmp_path: Path) -> None:
    config = behaviour_file(tmp_path, ready_after_s=None, exit_after_s=0.2, exit_code=-9)
    with pytest.raises(ServerStartFailed) as raised:
        launcher(tmp_path).start(config, tmp_path / "server.log")
    assert raised.value.kind == "oom"
    assert "code -9" in raised.value.detail


@pytest.mark.parametrize(
    ("returncode", "line", "kind"),
    [
        (1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
        (1, "OSError: [Errno 12] Cannot allocate memory", "oom"),
        (1, "ValueError: No available memory for the cache blocks. Try increasing", "oom"),
        (1, "RuntimeError: Engine core initialization failed. See root cause above. "
            "Failed core proc(s): {'EngineCore_DP0': -9}", "oom"),
        (1, "RuntimeError: Engine core initialization failed. See root cause above. "
            "Failed core proc(s): {'EngineCore_DP0': 1}", "crash"),
        (1, "ERROR:    [Errno 98] error while attempting to bind on address "
            "('127.0.0.1', 8000): address already in use", "port_in_use"),
        (2, "server: error: bad.yaml: key 'max_num_seqs' = 0: must be >= 1", "invalid_config"),
        (1, "pydantic_core._pydantic_core.ValidationError: 1 validation error for "
            "SchedulerConfig", "invalid_config"),
        (1, "RuntimeError: something unexpected", "crash"),
    ],
)
def test_classify_exit_reads_vllm_messages(returncode: int, line: str, kind: str) -> None:
    assert classify_exit(returncode, ["INFO starting", line]) == kind


def start_foreign_server(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """Another program (not ours) serving /health 200 on some port."""
    port = free_port()
    foreign = subprocess.Popen(
        [sys.executable, str(FAKE_SERVER), "--config", str(behaviour_file(tmp_path)), "--port", str(port)],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return foreign, port
        except httpx.HTTPError:
            time.sleep(0.05)
    foreign.kill()
    raise AssertionError("foreign server did not come up")


def test_port_taken_by_another_process_moves_to_a_free_port(tmp_path: Path) -> None:
    foreign, taken = start_foreign_server(tmp_path)
    try:
        config = behaviour_file(tmp_path, ready_after_s=0)
        server = launcher(tmp_path).start(config, tmp_path / "server.log", port=taken)
        try:
            assert server.port != taken
            assert httpx.get(server.url + "/health").status_code == 200
        finally:
            server.stop()
    finally:
        foreign.kill()
        foreign.wait()


def test_foreign_health_answer_is_not_taken_for_ours(tmp_path: Path) -> None:
    # Lost race: the port was free when picked, a stranger took it before our bind.
    foreign, taken = start_foreign_server(tmp_path)
    try:
        config = behaviour_file(tmp_path, ready_after_s=0)
        server = launcher(tmp_path).spawn(config, tmp_path / "server.log", port=taken)
        try:
            with pytest.raises(ServerStartFailed) as raised:
                server.wait_ready(10.0)
            assert raised.value.kind == "port_in_use"
        finally:
            server.stop()
    finally:
        foreign.kill()
        foreign.wait()


def test_headline_names_the_reason_vllm_gave() -> None:
    tail = [
        "INFO starting",
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for SchedulerConfig",
        "  Value error, max_num_batched_tokens (32) must be greater than or equal to "
        "max_num_seqs (64). [type=value_error]",
        "    For further information visit https://errors.pydantic.dev/2.12/v/value_error",
    ]
    assert headline(tail).startswith("Value error, max_num_batched_tokens (32)")
    assert headline(["a", "RuntimeError: boom", "cleanup done"]) == "RuntimeError: boom"
    assert headline([]) == "(empty log)"


def test_port_race_lost_twice_is_classified_port_in_use(tmp_path: Path) -> None:
    # The server itself reports the bind failure (as uvicorn does) on both attempts.
    message = (
        "ERROR:    [Errno 98] error while attempting to bind on address "
        "('127.0.0.1', 1234): address already in use"
    )
    config = behaviour_file(tmp_path, ready_after_s=None, exit_after_s=0.1, message=message)
    log = tmp_path / "server.log"
    with pytest.raises(ServerStartFailed) as raised:
        launcher(tmp_path).start(config, log)
    assert raised.value.kind == "port_in_use"
    assert log.read_text().count("# autotune") == 2  # tried twice


TUNER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from autotune.measure.launcher import ServerLauncher
    from autotune.measure.server_registry import StaleServerRegistry
    fake, config, log, registry = sys.argv[1:5]
    launcher = ServerLauncher(command=[sys.executable, fake],
                              registry=StaleServerRegistry(Path(registry)), study="s1")
    server = launcher.start(Path(config), Path(log))
    print(server.pid, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.slow
def test_reap_after_the_tuner_was_sigkilled(tmp_path: Path) -> None:
    registry = tmp_path / "servers.json"
    log = tmp_path / "server.log"
    config = behaviour_file(tmp_path, spawn_child=True)
    tuner = subprocess.Popen(
        [sys.executable, "-c", TUNER_SCRIPT, str(FAKE_SERVER), str(config), str(log), str(registry)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert tuner.stdout is not None
    server_pid = int(tuner.stdout.readline())
    tuner.send_signal(signal.SIGKILL)
    tuner.wait()
    child_pid = child_pids_from_log(log)[0]
    assert alive(server_pid) and alive(child_pid)  # the server outlived its tuner

    assert reap_stale_servers(registry) == sorted([server_pid, child_pid])
    assert not alive(server_pid) and not alive(child_pid)
    assert StaleServerRegistry(registry).entries() == []
    assert reap_stale_servers(registry) == []


@pytest.mark.slow
def test_reap_finds_children_of_a_sigkilled_server(tmp_path: Path) -> None:
    registry = tmp_path / "servers.json"
    log = tmp_path / "server.log"
    server = launcher(tmp_path).start(behaviour_file(tmp_path, spawn_child=True), log)
    child_pid = child_pids_from_log(log)[0]
    os.kill(server.pid, signal.SIGKILL)
    server.popen.wait()
    assert alive(child_pid)

    assert reap_stale_servers(registry) == [child_pid]
    assert not alive(child_pid)


def test_reap_leaves_a_recycled_pid_alone(tmp_path: Path) -> None:
    # A registry entry whose pid now belongs to an unrelated process (different create_time).
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        registry = StaleServerRegistry(tmp_path / "servers.json")
        from autotune.measure.server_registry import RegisteredServer

        created = psutil.Process(bystander.pid).create_time()
        registry.add(RegisteredServer(pid=bystander.pid, pgid=bystander.pid, create_time=created + 100))
        assert reap_stale_servers(registry.path) == []
        assert bystander.poll() is None
        assert registry.entries() == []
    finally:
        bystander.kill()
        bystander.wait()


def test_ipc_sockets_go_to_a_folder_of_the_run_and_go_with_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(IPC_ENV, raising=False)
    with private_ipc_folder() as folder:
        assert folder is not None and folder.is_dir() and os.environ[IPC_ENV] == str(folder)
        (folder / "left-by-a-killed-engine").write_text("")
    assert not folder.exists() and IPC_ENV not in os.environ
    # A folder the user chose is theirs: used as it is, and kept.
    monkeypatch.setenv(IPC_ENV, str(tmp_path))
    with private_ipc_folder() as folder:
        assert folder is None and os.environ[IPC_ENV] == str(tmp_path)
    assert tmp_path.is_dir() and os.environ[IPC_ENV] == str(tmp_path)
