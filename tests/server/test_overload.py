"""Overload: open-loop traffic at about five times what the session's server can serve.

The server (conftest.py: max_num_seqs=4, max_waiting_requests=2) must never hold more than
max_num_seqs + max_waiting_requests requests (so an admitted request's wait is bounded), refuse
the rest at once with 503 + Retry-After, keep serving throughout, hold its memory, abort the
requests of clients that hang up, and serve normally afterwards. Capacity is measured first
(closed loop at max_num_seqs), so the load scales with the machine.

Nothing here is judged by how fast this machine is: the bounds are the server's own
invariants (in flight, refusals counted by both sides, aborts counted by vLLM), read from its
/metrics while the load runs; latencies are compared side by side within the run (a refusal
against an admitted answer) and recorded as figures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
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
# Long enough for the admission queue to fill and drain many times over (hundreds of
# requests) and for the memory of the server to be sampled 10 times after its first 5 s.
OVERLOAD_S = 20.0
# ...and at least this many unloaded latencies (closed loop, measured just before): on a
# loaded machine one admission cycle took 5-14 s, so 20 s were only a few cycles.
OVERLOAD_LATENCIES = 8
MAX_OVERLOAD_S = 120.0
PROBE_S = 4.0
MEMORY_FROM_S = 5.0
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
        # No client timeout (how long an answer may take is the machine's business; the test
        # is bounded by pytest-timeout), and a connection per request: a kept-alive connection
        # that the server closes as idle (uvicorn: after 5 s) just as it is reused would read
        # as a dropped request.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=None),
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
    in_flight_samples: list[float],
) -> tuple[list[Sample], float]:
    """Requests at fixed intervals whatever the answers; returns them and the send lag p99.
    Once a second it samples the server's memory (RSS of all its processes) and its
    `server_requests_in_flight`."""
    count = min(int(rate * seconds), MAX_REQUESTS)
    lags: list[float] = []
    async with Client(server, output_tokens) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()
        stop_sampling = asyncio.Event()

        async def sample_memory() -> None:
            while not stop_sampling.is_set():
                rss_samples.append((loop.time() - start, tree_rss_mib(server.process.pid)))
                values = await asyncio.to_thread(metric_values, server)
                in_flight_samples.append(values["server_requests_in_flight"])
                await asyncio.sleep(1.0)

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


@pytest.mark.engine(seconds=60)
def test_five_times_capacity_overload(server: RunningServer, reliability) -> None:
    max_num_seqs = server.config.engine["max_num_seqs"]
    limit = server.config.serving.max_waiting_requests
    most_in_flight = max_num_seqs + limit
    reliability.start(
        f"Open-loop overload at 5x capacity for at least {OVERLOAD_S:g} s",
        group="Overload",
        injected=(
            f"the session server (max_num_seqs={max_num_seqs}, max_waiting_requests={limit}) got "
            f"open-loop requests ({len(PROMPT)} prompt tokens, {OUTPUT_TOKENS} output tokens, more "
            f"where 5x would pass {MAX_RATE:g} req/s) at "
            f"{OVERLOAD_FACTOR:g}x its measured capacity for {OVERLOAD_S:g} s or "
            f"{OVERLOAD_LATENCIES} of its unloaded latencies p99, whichever is longer (at most "
            f"{MAX_OVERLOAD_S:g} s); every "
            f"{DISCONNECT_EVERY}th client asked for {LONG} streamed tokens and hung up after the first"
        ),
    )
    wait_idle(server, 60)
    output_tokens = OUTPUT_TOKENS
    asyncio.run(closed_loop(server, max_num_seqs, 1.0, output_tokens))  # warm-up, unmeasured
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
    rate = min(OVERLOAD_FACTOR * capacity, MAX_RATE)
    planned_s = min(max(OVERLOAD_S, OVERLOAD_LATENCIES * base_p99), MAX_OVERLOAD_S)

    wait_idle(server, 60)
    before = metric_values(server)
    rss: list[tuple[float, float]] = []
    in_flight: list[float] = []
    started = time.monotonic()
    samples, send_lag_p99 = asyncio.run(open_loop(server, rate, planned_s, output_tokens, rss, in_flight))
    overload_s = time.monotonic() - started
    sending_s = samples[-1].started - samples[0].started  # MAX_REQUESTS may end it early
    offered = len(samples) / sending_s

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
    # The queue is bounded: never more than max_num_seqs running + the limit waiting, and the
    # load did fill it. So an admitted request waits behind at most that many, however long
    # the overload lasts; without admission control the queue would grow by the excess rate.
    # (A refusal itself shows the queue full: the server refuses only at the bound.)
    assert max(in_flight) <= most_in_flight, in_flight
    rejected = metric_values(server)["server_requests_rejected_total"] - before["server_requests_rejected_total"]
    assert rejected == len(refused)
    reliability.held(
        f"the queue stayed bounded: server_requests_in_flight sampled once a second peaked at "
        f"{max(in_flight):.0f} <= max_num_seqs + max_waiting_requests = {most_in_flight}; the server "
        f"counted exactly the {len(refused)} refusals the client saw"
    )
    # It kept serving throughout. An admitted request frees its slot at most the longest
    # admitted latency after it was sent, and at 5x capacity the next request (1/rate later,
    # a small fraction of a latency) takes that slot: so two admissions, and the run's ends
    # and its admissions, are never more than twice the longest latency apart, however slow
    # the machine (a slot leaked per request or per hang-up would leave only refusals).
    admitted_latency = [s.latency_s for s in admitted]
    p50, p99 = percentile(admitted_latency, 50), percentile(admitted_latency, 99)
    most_apart_s = 2 * max(admitted_latency)
    admitted_at = sorted(s.started for s in samples if s.status == 200)
    edges = [samples[0].started, *admitted_at, samples[-1].started]
    longest_gap_s = max(later - earlier for earlier, later in itertools.pairwise(edges))
    assert longest_gap_s <= most_apart_s, (longest_gap_s, most_apart_s, admitted_at)
    first = samples[0].started
    thirds = [
        [s.latency_s for s in admitted if k * sending_s / 3 <= s.started - first < (k + 1) * sending_s / 3]
        for k in range(3)
    ]
    refused_latency = [s.latency_s for s in refused]
    # A refusal is answered before the engine is asked anything: faster than an admitted
    # request, which waits for its generation, measured in the same run.
    assert percentile(refused_latency, 50) < p50, (percentile(refused_latency, 50), p50)
    reliability.held(
        f"it kept serving throughout: over the {sending_s:.0f} s of sending, at most "
        f"{longest_gap_s:.1f} s between two admitted requests (bound: twice the longest admitted "
        f"latency, {most_apart_s:.1f} s), and refused at once: 503 median "
        f"{percentile(refused_latency, 50) * 1000:.1f} ms against {p50 * 1000:.0f} ms for an admitted request"
    )

    warm = [mib for t, mib in rss if t >= MEMORY_FROM_S]
    growth = warm[-1] - warm[0]
    assert growth < max(64.0, 0.05 * warm[0]), rss
    reliability.held(
        f"memory held: the server's processes' RSS moved {growth:+.0f} MiB from {MEMORY_FROM_S:g} s "
        "in to the end"
    )

    hung_up = [s for s in samples if s.disconnect]
    hung_up_admitted = [s for s in hung_up if s.status == 200]
    idle_after_s = wait_idle(server, 60)
    after_values = metric_values(server)
    tokens = after_values["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    # Every admitted plain request ran to its end; every admitted client that hung up after
    # its first token left the engine without finishing (aborted): had any run on, it alone
    # would have made LONG tokens, and it would have counted as finished.
    finished = after_values["vllm:request_success_total"] - before["vllm:request_success_total"]
    assert finished == len(admitted), (finished, len(admitted), len(hung_up_admitted))
    assert tokens < len(admitted) * output_tokens + LONG
    reliability.held(
        f"clients that hung up left nothing running: vLLM finished exactly the {len(admitted)} "
        f"plain admitted requests and none of the {len(hung_up_admitted)} admitted ones whose "
        f"client hung up (tokens generated in all: {tokens:.0f}; one unaborted would have made "
        f"{LONG}); running, waiting and in flight were back to 0 {idle_after_s:.1f} s after the "
        "last answer"
    )

    after = asyncio.run(closed_loop(server, max_num_seqs, PROBE_S, output_tokens))
    assert after and all(s.status == 200 for s in after)
    after_p50 = percentile([s.latency_s for s in after], 50)
    after_rate = len(after) / PROBE_S
    reliability.held(
        f"it recovered: every request of a closed loop at max_num_seqs afterwards was served "
        f"(p50 {after_p50:.3f} s, before {base_p50:.3f} s; {after_rate:.1f} req/s, before {capacity:.1f})"
    )

    reliability.figure("request", f"{len(PROMPT)} prompt + {output_tokens} output tokens")
    reliability.figure("capacity (closed loop at max_num_seqs)", capacity, "req/s")
    reliability.figure("unloaded latency p50 / p99", f"{base_p50:.3f} / {base_p99:.3f} s")
    reliability.figure("offered load", f"{offered:.1f} req/s ({offered / capacity:.1f}x) for {overload_s:.0f} s")
    reliability.figure("client send lag p99", send_lag_p99 * 1000, "ms")
    reliability.figure("requests sent / admitted / 503", f"{len(samples)} / {len(admitted) + len(hung_up_admitted)} / {len(refused)}")
    reliability.figure("admitted throughput", len(admitted) / sending_s, "req/s")
    reliability.figure("in flight, sampled: max", f"{max(in_flight):.0f} (bound {most_in_flight})")
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
        f"server RSS (all processes) at {MEMORY_FROM_S:g} s / end / max",
        f"{warm[0]:.0f} / {warm[-1]:.0f} / {max(mib for _, mib in rss):.0f} MiB",
    )
    reliability.figure("hung-up clients / admitted and aborted", f"{len(hung_up)} / {len(hung_up_admitted)}")
    reliability.figure("busy -> idle after the run", idle_after_s, "s")
    reliability.figure("after: closed-loop p50 / throughput", f"{after_p50:.3f} s / {after_rate:.1f} req/s")
