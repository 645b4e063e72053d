"""Overload: open-loop traffic at about five times what the session's server can serve, for 60 s.

The server (conftest.py: max_num_seqs=4, max_waiting_requests=2) must keep the latency of the
requests it admits bounded, refuse the rest at once with 503 + Retry-After, hold its memory,
abort the requests of clients that hang up, and serve at its normal latency afterwards.
Capacity is measured first (closed loop at max_num_seqs), so the load scales with the machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import Any

import aiohttp
import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.engine

RunningServer = Any  # conftest.RunningServer
OVERLOAD_FACTOR = 5.0
OVERLOAD_S = 60.0
PROBE_S = 8.0
MAX_REQUESTS = 6000  # the open loop's hard bound, whatever the measured capacity
MAX_RATE = 100.0  # req/s: past this the client, not the server, would be measured
PROMPT = list(range(100, 164))  # 64 tokens
OUTPUT_TOKENS = 128
DISCONNECT_EVERY = 10  # every 10th client streams a long generation and hangs up after a token
LONG = 20000


@dataclasses.dataclass
class Sample:
    started: float  # monotonic, when the request was sent
    latency_s: float
    status: int | None  # None: no HTTP answer (connection error, timeout)
    disconnect: bool = False  # a client that hung up after its first token
    retry_after: str | None = None
    error: str | None = None


def percentile(values: list[float], pct: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(pct / 100 * (len(ordered) - 1))))]


def metric_values(server: RunningServer) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def busy(server: RunningServer) -> float:
    values = metric_values(server)
    return (
        values["vllm:num_requests_running"]
        + values["vllm:num_requests_waiting"]
        + values["server_requests_in_flight"]
    )


def wait_idle(server: RunningServer, timeout_s: float) -> float:
    started = time.monotonic()
    while busy(server) > 0:
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"the server still had requests after {timeout_s} s: {metric_values(server)}")
        time.sleep(0.1)
    return time.monotonic() - started


def tree_rss_mib(pid: int) -> float:
    process = psutil.Process(pid)
    total = process.memory_info().rss
    for child in process.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


class Client:
    """One aiohttp session against the server; each method is one request."""

    def __init__(self, server: RunningServer, output_tokens: int) -> None:
        self.url = server.url + "/v1/completions"
        self.output_tokens = output_tokens
        self.headers = server.headers
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=60),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.session is not None
        await self.session.close()

    async def complete(self) -> Sample:
        assert self.session is not None
        payload = {"prompt": PROMPT, "max_tokens": self.output_tokens, "ignore_eos": True}
        started = time.monotonic()
        try:
            async with self.session.post(self.url, json=payload, headers=self.headers) as response:
                await response.read()
                return Sample(started, time.monotonic() - started, response.status,
                              retry_after=response.headers.get("Retry-After"))
        except (aiohttp.ClientError, TimeoutError) as error:
            return Sample(started, time.monotonic() - started, None, error=repr(error))

    async def hang_up_after_first_token(self) -> Sample:
        assert self.session is not None
        payload = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
        started = time.monotonic()
        try:
            async with self.session.post(self.url, json=payload, headers=self.headers) as response:
                if response.status == 200:
                    async for line in response.content:
                        if line.startswith(b"data: "):
                            break
                    response.close()  # hang up: the connection goes, not back to the pool
                else:
                    await response.read()
                return Sample(started, time.monotonic() - started, response.status, disconnect=True,
                              retry_after=response.headers.get("Retry-After"))
        except (aiohttp.ClientError, TimeoutError) as error:
            return Sample(started, time.monotonic() - started, None, disconnect=True, error=repr(error))


async def closed_loop(
    server: RunningServer, concurrency: int, seconds: float, output_tokens: int
) -> list[Sample]:
    """`concurrency` clients, each sending its next request when the last one is answered."""
    samples: list[Sample] = []
    async with Client(server, output_tokens) as client:
        deadline = time.monotonic() + seconds

        async def worker() -> None:
            while time.monotonic() < deadline:
                samples.append(await client.complete())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


async def open_loop(
    server: RunningServer,
    rate: float,
    seconds: float,
    output_tokens: int,
    rss_samples: list[tuple[float, float]],
) -> tuple[list[Sample], float]:
    """Requests at fixed intervals whatever the answers; returns them and the send lag p99."""
    count = min(int(rate * seconds), MAX_REQUESTS)
    lags: list[float] = []
    async with Client(server, output_tokens) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()
        stop_sampling = asyncio.Event()

        async def sample_memory() -> None:
            while not stop_sampling.is_set():
                rss_samples.append((loop.time() - start, tree_rss_mib(server.process.pid)))
                await asyncio.sleep(2.0)

        sampler = asyncio.create_task(sample_memory())
        tasks = []
        for index in range(count):
            due = start + index / rate
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append(loop.time() - due)
            request = (
                client.hang_up_after_first_token()
                if index % DISCONNECT_EVERY == DISCONNECT_EVERY - 1
                else client.complete()
            )
            tasks.append(asyncio.create_task(request))
        samples = await asyncio.gather(*tasks)
        stop_sampling.set()
        await sampler
    return list(samples), percentile(lags, 99)


def test_five_times_capacity_for_a_minute(server: RunningServer, reliability) -> None:
    max_num_seqs = server.config.engine["max_num_seqs"]
    limit = server.config.serving.max_waiting_requests
    reliability.start(
        "Open-loop overload at 5x capacity for 60 s",
        group="Overload",
        injected=(
            f"the session server (max_num_seqs={max_num_seqs}, max_waiting_requests={limit}) got "
            f"open-loop requests ({len(PROMPT)} prompt tokens, {OUTPUT_TOKENS} output tokens, more "
            f"where 5x would pass {MAX_RATE:g} req/s) at "
            f"{OVERLOAD_FACTOR:g}x its measured capacity for {OVERLOAD_S:g} s; every "
            f"{DISCONNECT_EVERY}th client asked for {LONG} streamed tokens and hung up after the first"
        ),
    )
    wait_idle(server, 60)
    output_tokens = OUTPUT_TOKENS
    asyncio.run(closed_loop(server, max_num_seqs, 2.0, output_tokens))  # warm-up, unmeasured
    baseline = asyncio.run(closed_loop(server, max_num_seqs, PROBE_S, output_tokens))
    capacity = len(baseline) / PROBE_S
    if OVERLOAD_FACTOR * capacity > MAX_RATE / 2:
        # A fast machine: longer requests, so that the client is not what gets measured.
        output_tokens *= math.ceil(2 * OVERLOAD_FACTOR * capacity / MAX_RATE)
        baseline = asyncio.run(closed_loop(server, max_num_seqs, PROBE_S, output_tokens))
        capacity = len(baseline) / PROBE_S
    assert all(s.status == 200 for s in baseline), {s.status for s in baseline}
    base_latency = [s.latency_s for s in baseline]
    base_p50, base_p99 = percentile(base_latency, 50), percentile(base_latency, 99)
    rate = OVERLOAD_FACTOR * capacity
    assert rate <= MAX_RATE, f"capacity {capacity:.1f} req/s: raise the output length"

    wait_idle(server, 30)
    tokens_before = metric_values(server)["vllm:generation_tokens_total"]
    rss: list[tuple[float, float]] = []
    started = time.monotonic()
    samples, send_lag_p99 = asyncio.run(open_loop(server, rate, OVERLOAD_S, output_tokens, rss))
    overload_s = time.monotonic() - started
    offered = len(samples) / OVERLOAD_S

    plain = [s for s in samples if not s.disconnect]
    admitted = [s for s in plain if s.status == 200]
    refused = [s for s in samples if s.status == 503]
    other = [s for s in samples if s.status not in (200, 503)]
    assert other == [], other[:5]  # no 5xx other than 503, no timeouts, no dropped connections
    assert refused and all(s.retry_after == "1" for s in refused)
    reliability.held(
        "every request got an answer: 200 or 503 with Retry-After: 1 (no other status, no timeout, "
        "no dropped connection)"
    )
    assert offered >= 3 * capacity, f"the client offered only {offered:.1f} req/s"
    assert len(admitted) >= 0.5 * capacity * OVERLOAD_S  # the server kept serving at capacity

    admitted_latency = [s.latency_s for s in admitted]
    p50, p99 = percentile(admitted_latency, 50), percentile(admitted_latency, 99)
    # An admitted request waits behind at most max_num_seqs running and `limit` waiting ones:
    # about two service times. Without admission control the queue would grow by
    # (offered - capacity) requests a second and latency with it, to tens of seconds.
    bound = 4 * base_p99 + 0.5
    assert p99 <= bound, (p99, bound)
    thirds = [
        [s.latency_s for s in admitted if k * OVERLOAD_S / 3 <= s.started - samples[0].started < (k + 1) * OVERLOAD_S / 3]
        for k in range(3)
    ]
    assert percentile(thirds[2], 99) <= 2 * percentile(thirds[0], 99) + 1.0, thirds
    reliability.held(
        f"admitted requests kept bounded latency: p99 {p99:.2f} s <= 4 x the unloaded p99 + 0.5 s "
        f"({bound:.2f} s), and no growth from the first 20 s to the last"
    )
    refused_latency = [s.latency_s for s in refused]
    assert percentile(refused_latency, 50) < 0.1 and percentile(refused_latency, 99) < 0.5
    reliability.held("refusals were fast: 503 p50 < 0.1 s and p99 < 0.5 s")

    warm = [mib for t, mib in rss if t >= 10.0]
    growth = warm[-1] - warm[0]
    assert growth < max(64.0, 0.05 * warm[0]), rss
    reliability.held(
        f"memory held: the server's processes' RSS moved {growth:+.0f} MiB from 10 s in to the end"
    )

    hung_up = [s for s in samples if s.disconnect]
    aborted = [s for s in hung_up if s.status == 200]
    idle_after_s = wait_idle(server, 30)
    settled = metric_values(server)["vllm:generation_tokens_total"]
    time.sleep(1.0)
    assert metric_values(server)["vllm:generation_tokens_total"] == settled
    tokens = settled - tokens_before
    # The hung-up generations were aborted: had they run, each would have made LONG tokens.
    assert tokens < len(admitted) * output_tokens + len(aborted) * LONG / 10
    reliability.held(
        f"clients that hung up left nothing running: {len(aborted)} admitted long generations were "
        f"aborted (tokens generated in all: {tokens:.0f}, far below {len(aborted)} x {LONG}); "
        f"running, waiting and in flight were back to 0 {idle_after_s:.1f} s after the last answer"
    )

    after = asyncio.run(closed_loop(server, max_num_seqs, PROBE_S, output_tokens))
    assert all(s.status == 200 for s in after)
    after_p50 = percentile([s.latency_s for s in after], 50)
    after_rate = len(after) / PROBE_S
    assert after_p50 <= 1.5 * base_p50 + 0.1 and after_rate >= 0.6 * capacity
    reliability.held(
        f"it recovered: closed-loop p50 {after_p50:.3f} s (before {base_p50:.3f} s), "
        f"{after_rate:.1f} req/s (before {capacity:.1f})"
    )

    reliability.figure("request", f"{len(PROMPT)} prompt + {output_tokens} output tokens")
    reliability.figure("capacity (closed loop at max_num_seqs)", capacity, "req/s")
    reliability.figure("unloaded latency p50 / p99", f"{base_p50:.3f} / {base_p99:.3f} s")
    reliability.figure("offered load", f"{offered:.1f} req/s ({offered / capacity:.1f}x) for {overload_s:.0f} s")
    reliability.figure("client send lag p99", send_lag_p99 * 1000, "ms")
    reliability.figure("requests sent / admitted / 503", f"{len(samples)} / {len(admitted) + len(aborted)} / {len(refused)}")
    reliability.figure("admitted throughput", len(admitted) / OVERLOAD_S, "req/s")
    reliability.figure(
        "admitted latency p50 / p99 / max",
        f"{p50:.3f} / {p99:.3f} / {max(admitted_latency):.3f} s",
    )
    reliability.figure(
        "admitted p99 by third of the run",
        " / ".join(f"{percentile(third, 99):.3f}" for third in thirds) + " s",
    )
    reliability.figure(
        "503 latency p50 / p99",
        f"{percentile(refused_latency, 50) * 1000:.1f} / {percentile(refused_latency, 99) * 1000:.1f} ms",
    )
    reliability.figure(
        "server RSS (all processes) at 10 s / end / max",
        f"{warm[0]:.0f} / {warm[-1]:.0f} / {max(mib for _, mib in rss):.0f} MiB",
    )
    reliability.figure("hung-up clients / admitted and aborted", f"{len(hung_up)} / {len(aborted)}")
    reliability.figure("busy -> idle after the run", idle_after_s, "s")
    reliability.figure("after: closed-loop p50 / throughput", f"{after_p50:.3f} s / {after_rate:.1f} req/s")
