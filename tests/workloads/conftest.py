"""Fixtures shared by the replayer tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from autotune.measure.server_start import yield_cpu_to_clients

ECHO_SERVER = Path(__file__).with_name("echo_server.py")


@pytest.fixture(scope="module")
def echo() -> Iterator[str]:
    """The echo server (tests/workloads/echo_server.py) in its own process: its base URL."""
    process = subprocess.Popen(
        [sys.executable, str(ECHO_SERVER), "--port", "0"], stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    yield_cpu_to_clients(process.pid)  # like a launched server: the replayer under test first
    try:
        line = process.stdout.readline() if process.stdout else ""
        assert line.startswith("PORT "), f"echo server did not start: {line!r}"
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        process.terminate()
        process.wait(timeout=10)
