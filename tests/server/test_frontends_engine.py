"""`python -m server --api-processes 2`: two front-end processes on one real engine core.

One engine start for the whole file: the same server answers on both processes, its /metrics
adds up what both served, and SIGTERM to the main process leaves none of its processes behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from autotune.measure.process_cpu import role_of
from autotune.measure.scraper import parse_metrics
from autotune.measure.server_start import free_port
from server.config import ServerConfig, default_engine_settings
from server.engine import RUNNING_METRICS, TTFT_METRICS, WAITING_METRICS

pytestmark = pytest.mark.engine

PROCESSES = 2
REQUESTS = 12
# Safety nets for a hung start or stop, not measured durations.
START_TIMEOUT_S = 300
GONE_TIMEOUT_S = 60


def log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_until_healthy(url: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"server exited with {process.returncode}:\n{log_tail(log_path)}")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass  # the front ends accept once the engine is ready
        time.sleep(0.5)
    pytest.fail(f"server not healthy after {START_TIMEOUT_S} s:\n{log_tail(log_path)}")


async def complete(url: str, index: int) -> int:
    """One streamed completion on its own connection (so the kernel may give it to either
    process); returns the completion tokens the final usage event reports."""
    body = {"prompt": [1, 2, 3, 4 + index], "max_tokens": 8, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers={"Connection": "close"}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[len("data: "):]).get("usage")
                    tokens = usage["completion_tokens"] if usage else tokens
    return tokens


def pids_answering(url: str, tries: int) -> set[int]:
    """The process ids /info reports over `tries` fresh connections (stops once all seen)."""
    seen: set[int] = set()
    for _ in range(tries):
        with httpx.Client(timeout=30, trust_env=False) as client:
            info = client.get(url + "/info", headers={"Connection": "close"}).json()
        assert info["process"]["count"] == PROCESSES
        seen.add(info["process"]["pid"])
        if len(seen) == PROCESSES:
            break
    return seen


@pytest.mark.engine(seconds=52)
def test_two_front_ends_share_one_engine(tmp_path: Path) -> None:
    config = ServerConfig(engine=default_engine_settings())
    config_path = tmp_path / "config.yaml"
    config.write(config_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "server", "--config", str(config_path), "--port", str(port),
             "--benchmark-mode", "--api-processes", str(PROCESSES)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_until_healthy(url, process, log_path)
        group = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        # The main process, the engine core and both front ends (and vLLM's helpers).
        assert len(group) >= 2 + PROCESSES, [p.name() for p in group]

        # Both front ends accept on the one port.
        front_ends = pids_answering(url, tries=200)
        assert len(front_ends) == PROCESSES, log_tail(log_path)
        assert front_ends <= {p.pid for p in group}
        # Each front end's own diagnostics reach the server log (a spawned process has no handler
        # unless it sets one up): which front end it is, with its pid.
        logged = log_path.read_text(errors="replace")
        assert all(f"of {PROCESSES} (pid {pid})" in logged for pid in front_ends), log_tail(log_path)
        # The tuner's per-process CPU accounting tells them apart by their titles.
        roles = {p.pid: role_of(p, process.pid) for p in group}
        assert {roles[pid] for pid in front_ends} == {f"front end {i}" for i in range(PROCESSES)}
        assert roles[process.pid] == "main"
        assert "engine core" in roles.values(), roles

        async def send_all() -> list[int]:
            return await asyncio.gather(*(complete(url, i) for i in range(REQUESTS)))

        assert asyncio.run(send_all()) == [8] * REQUESTS

        # vLLM's metrics from both processes, read as the tuner reads them: every request's
        # TTFT counted once, and the scheduler gauges back at 0 once all have finished.
        deadline = time.monotonic() + 60
        while True:
            text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
            snapshot = parse_metrics(text)
            running = snapshot.value(RUNNING_METRICS)
            if running == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert running == 0, text
        assert snapshot.value(WAITING_METRICS) == 0
        ttft = snapshot.histogram(TTFT_METRICS)
        assert ttft is not None and ttft.count == REQUESTS, text
        # ... and ours, summed over the processes.
        assert snapshot.scalars.get("server_requests_in_flight") == 0
        assert 'server_requests_total{route="/v1/completions",status="200"} 12.0' in text

        # SIGTERM to the main process alone: it stops its front ends and engine core.
        process.send_signal(signal.SIGTERM)
        assert process.wait(GONE_TIMEOUT_S) == 0, log_tail(log_path)
        _, alive = psutil.wait_procs(group, timeout=GONE_TIMEOUT_S)
        assert alive == [], [p.pid for p in alive]
    finally:  # whatever is left of the group after a failure
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
