"""A real `python -m server --config FILE` process for the tests that are about how the
server reads a file (a deployed config, a config without a model): started, waited on until
/health answers, stopped."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx

from autotune.measure.server_start import free_port


@contextlib.contextmanager
def config_server(config: Path, log: Path, *, cwd: Path, env: dict[str, str] | None = None) -> Iterator[httpx.Client]:
    """`python -m server --config CONFIG` in its own process, output to LOG: a client on it once
    /health answers 200, the server stopped after. A server that exits first fails the test
    with its log's last lines."""
    port = free_port()
    with log.open("wb") as sink:
        server = subprocess.Popen([sys.executable, "-m", "server", "--config", str(config), "--port", str(port)],
                                  stdout=sink, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            while True:
                assert server.poll() is None, log.read_text()[-3000:]
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                try:
                    server.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
            yield client
    finally:
        server.terminate()
        server.wait(timeout=60)
