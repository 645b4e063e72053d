"""One real server process per test session: `python -m server --config <yaml> --benchmark-mode`,
forked from a fork server as `autotune run` forks its trial servers (make test's shared one,
else one of this process's own), in a process group of its own.

Starting a vLLM engine costs ~30 s on 2 CPU cores, so every test that needs *a* real server
(tests/server: HTTP, OpenAPI fuzz, overload, recorder, security) shares this one; under
pytest-xdist they all run on one worker (tests/plugins/engine_lanes.py groups them). Each test leaves it
idle. Its settings are chosen so that each feature can be seen: a small scheduler
(max_num_seqs=4) and admission limit (2 waiting) for the 503 and overload tests, a bearer token
for the auth tests, and the embedded default's small memory share (0.1 of the node's RAM,
a ~1.7 GiB KV cache on 24 GB: room for max_num_seqs generations of MAX_MODEL_LEN).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from autotune.cli.flags import fork_server_socket
from autotune.measure.forkserver import ForkedServer, ForkServers
from autotune.measure.server_start import free_port, yield_cpu_to_clients
from server.config import (
    RecorderSettings,
    ServerConfig,
    ServingSettings,
    default_engine_settings,
)

API_KEY = "test-token"
MAX_NUM_SEQS = 4
MAX_WAITING = 2
# Long enough that a generation is still running when a test acts on it: the tiny model makes
# over 1,000 tokens/s on 2 cores, so the model's usual 2048 would finish in about a second.
MAX_MODEL_LEN = 32768
START_TIMEOUT_S = 240


@dataclass(frozen=True)
class RunningServer:
    url: str
    process: ForkedServer
    log_path: Path
    config: ServerConfig
    answered_503_while_starting: bool

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)


def stop_process_group(process: ForkedServer | subprocess.Popen, timeout_s: float = 30) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    deadline = time.monotonic() + 10  # then every child (the engine core) must be gone too
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder = tmp_path_factory.mktemp("server")
    config = ServerConfig(
        engine={
            **default_engine_settings(),
            "max_num_seqs": MAX_NUM_SEQS,
            "max_model_len": MAX_MODEL_LEN,
        },
        api_key=API_KEY,
        serving=ServingSettings(
            max_waiting_requests=MAX_WAITING,
            # The recorder runs in every HTTP test, as in production; test_recorder_http reads it.
            recorder=RecorderSettings(directory=str(folder / "traffic"), flush_interval_s=0.2),
        ),
        provenance={"purpose": "tests/server"},
    )
    config_path = folder / "config.yaml"
    config.write(config_path)
    port = free_port()
    log_path = folder / "server.log"
    args = ["--config", str(config_path), "--port", str(port), "--benchmark-mode"]
    fork_servers = ForkServers(shared=fork_server_socket(None, os.environ))
    process = fork_servers.for_environment(folder).spawn(
        args, title="python -m server " + " ".join(args), env=dict(os.environ), log_path=log_path)
    yield_cpu_to_clients(process.pid)  # as autotune does: the tests' clients come first
    url = f"http://127.0.0.1:{port}"
    try:
        saw_503 = wait_until_healthy(url, process, log_path)
        yield RunningServer(url, process, log_path, config, saw_503)
    finally:
        stop_process_group(process)
        fork_servers.close()


def log_tail(log_path: Path, lines: int = 40) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


def wait_until_healthy(url: str, process: ForkedServer | subprocess.Popen, log_path: Path) -> bool:
    """Waits for /health 200; returns whether /health answered 503 while the engine loaded."""
    deadline = time.monotonic() + START_TIMEOUT_S
    saw_503 = False
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"server exited with {process.returncode}:\n{log_tail(log_path)}")
        try:
            status = httpx.get(url + "/health", timeout=2).status_code
        except httpx.TransportError:
            status = None
        if status == 200:
            return saw_503
        saw_503 = saw_503 or status == 503
        time.sleep(0.5)
    pytest.fail(f"server not healthy after {START_TIMEOUT_S} s:\n{log_tail(log_path)}")
