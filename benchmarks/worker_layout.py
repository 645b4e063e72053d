"""vLLM's CPU model worker in a process of its own (vLLM's choice) or inside the engine core
(our server's, server.engine.keep_cpu_worker_in_engine_core), and the engine core forked (our
server's, server.engine.choose_engine_core_start) or spawned (vLLM's CPU choice), side by side.

    .venv/bin/python benchmarks/worker_layout.py LAYOUT MAX_NUM_SEQS CONCURRENCY REQUESTS OUTPUT_LEN
    LAYOUT: uni (worker inside the engine core, which is forked) | uni-spawn (the same, the
            engine core spawned) | mp (worker in its own process, everything spawned)

Starts `python -m server --benchmark-mode` with the embedded default and `max_num_seqs`, times
spawn -> GET /health 200, then sends REQUESTS 300-token prompts of OUTPUT_LEN tokens each
(ignore_eos) at CONCURRENCY and prints one line: start seconds and output tokens per second.
Run the layouts alternately on one idle machine; the logs of the 2026-11-26 runs are
results/benchmarks/worker_layout.log (uni vs mp, before the engine core was forked) and
results/benchmarks/engine_core_fork.log (uni vs uni-spawn).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from server.config import ServerConfig, default_engine_settings

ROOT = Path(__file__).resolve().parents[1]
PORT = 8766


def main() -> int:
    layout, seqs, concurrency, requests, output_len = sys.argv[1], *map(int, sys.argv[2:6])
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if layout == "mp" else "0")
    env.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
    if layout == "uni-spawn":
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "config.yaml"
        ServerConfig(engine={**default_engine_settings(), "max_num_seqs": seqs}).write(config)
        started = time.monotonic()
        with open(Path(folder) / "server.log", "wb") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "server", "--config", str(config), "--port", str(PORT),
                 "--benchmark-mode"], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
            try:
                wait_healthy(server)
                start_s = time.monotonic() - started
                took = asyncio.run(send(concurrency, requests, output_len))
            finally:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(60)
    print(f"{layout} seqs={seqs} conc={concurrency}: start {start_s:.1f} s, {requests} req x "
          f"{output_len} tok in {took:.2f} s = {requests * output_len / took:.0f} tok/s")
    return 0


def wait_healthy(server: subprocess.Popen) -> None:
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise SystemExit("the server exited before it was healthy")
        time.sleep(0.2)


async def send(concurrency: int, requests: int, output_len: int) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        slots = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with slots:
                response = await client.post(
                    f"http://127.0.0.1:{PORT}/v1/completions",
                    json={"prompt": [5] * 300, "max_tokens": output_len, "ignore_eos": True})
                response.raise_for_status()

        started = time.monotonic()
        await asyncio.gather(*(one() for _ in range(requests)))
        return time.monotonic() - started


if __name__ == "__main__":
    sys.exit(main())
