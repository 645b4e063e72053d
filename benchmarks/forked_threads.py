"""A server forked onto fewer CPUs than its fork server imported on, side by side with one
forked from a fork server imported on the server's own CPUs.

    .venv/bin/python benchmarks/forked_threads.py [--requests 20] [--rounds 2]

torch sizes its OpenMP thread pool from the CPUs a process may use when it loads, so a server
forked from a fork server inherits the fork server's count. Here every server runs on the
first allowed CPU; "wide" is forked from a fork server that imported on every allowed CPU (a
shared fork server, or `--client-cpus` on a CPU host), "narrow" from one that imported on that
CPU alone (as a fresh `python -m server` there would be sized). Each round starts one of each
(order alternating), times N sequential completions (420-token prompt, 32 tokens forced with
ignore_eos) and reports the median seconds per request, the ratio wide / narrow, and the
torch threads each server's /info reports. The fork server sizes a forked server's threads to
its CPUs since 5be385e; before, wide was 40x slower on 2 cores.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from autotune.measure.forkserver import ForkServer
from autotune.measure.launcher import ServerLauncher
from server.config import ServerConfig
from workloads.errors import OneLineErrorParser

PROMPT = "Der Zug nach Hamburg " * 20


def fork_server(cpus: set[int], log: Path) -> ForkServer:
    """A fork server that imported with `cpus` as its CPUs."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        server = ForkServer(stderr_path=log)
        if not server.wait_ready():
            raise SystemExit(f"{server.describe_exit()} before it imported the server")
        return server
    finally:
        os.sched_setaffinity(0, before)


def measure(forkserver: ForkServer, cpu: int, folder: Path, requests: int) -> tuple[float, int | None]:
    config = folder / "config.yaml"
    ServerConfig.default().write(config)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})  # the server runs on its launcher's CPUs
    try:
        server = ServerLauncher(forkserver=forkserver, startup_timeout_s=300).start(config, folder / "server.log")
    finally:
        os.sched_setaffinity(0, before)
    try:
        url = f"http://{server.host}:{server.port}"
        threads = httpx.get(url + "/info", timeout=30).json()["engine"].get("torch_threads")
        seconds = []
        for _ in range(requests):
            start = time.monotonic()
            response = httpx.post(url + "/v1/completions", timeout=300, json={
                "prompt": PROMPT, "max_tokens": 32, "ignore_eos": True, "model": "any"})
            response.raise_for_status()
            seconds.append(time.monotonic() - start)
        return statistics.median(seconds), threads
    finally:
        server.stop()


def main() -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    print(f"allowed CPUs {sorted(allowed)}; every server on CPU {cpu}", flush=True)
    with tempfile.TemporaryDirectory(prefix="forked-threads-") as tmp:
        root = Path(tmp)
        servers = {"wide": fork_server(allowed, root / "wide.log"), "narrow": fork_server({cpu}, root / "narrow.log")}
        try:
            for round_ in range(1, args.rounds + 1):
                order = ["wide", "narrow"] if round_ % 2 else ["narrow", "wide"]
                result = {}
                for name in order:
                    folder = root / f"{name}-{round_}"
                    result[name] = measure(servers[name], cpu, folder, args.requests)
                    print(f"round {round_} {name}: median {result[name][0]:.3f} s per request, "
                          f"torch threads {result[name][1]}", flush=True)
                print(f"round {round_}: wide / narrow = {result['wide'][0] / result['narrow'][0]:.2f}x", flush=True)
        finally:
            for server in servers.values():
                server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
