"""The replayer in several processes: one schedule, one start, one merged result (issue 17).

Real worker processes against the echo server; what is asserted is what a user of the result
would notice (every request once, its index, schedule, prompt and SLO counts as one process
would record them; a stop reaching every worker), never how fast this machine is.
"""

from __future__ import annotations

import asyncio
import multiprocessing

import httpx
import numpy as np
import pytest

from workloads.errors import WorkloadError
from workloads.replay import ReplayOptions, replay
from workloads.replay_summary import ReplaySummary, summarize
from workloads.replay_workers import (
    RATE_PER_WORKER,
    _Parent,
    _WorkerSpec,
    auto_workers,
    replay_with_workers,
)
from workloads.slo import parse_slo
from workloads.trace import Trace, TraceRequest


def trace_of(n: int, spacing_ms: float, output_length: int = 4) -> Trace:
    return Trace.from_requests(
        TraceRequest(timestamp=i * spacing_ms, input_length=8 + i % 5, output_length=output_length)
        for i in range(n)
    )


def served(url: str, tag: str) -> dict:
    return httpx.get(f"{url}/tag={tag}/stats", trust_env=False).json()


@pytest.mark.slow
def test_three_workers_send_every_request_once_as_one_process_would(echo: str) -> None:
    trace = trace_of(90, spacing_ms=10)
    slos = [parse_slo("ttft_p95_ms=1000"), parse_slo("e2el_p95_ms=5")]
    options = ReplayOptions(slos=slos)
    result = asyncio.run(replay_with_workers(trace, f"{echo}/ttft=2,itl=2,tag=w3", options, workers=3))
    single = asyncio.run(replay(trace, f"{echo}/ttft=2,itl=2,tag=w1", options))
    # Every request exactly once, under its own index and schedule, as one process records it.
    assert [r.index for r in result.records] == list(range(90))
    assert [r.scheduled_s for r in result.records] == [r.scheduled_s for r in single.records]
    assert [r.input_tokens for r in result.records] == [r.input_tokens for r in single.records]
    assert result.summary.completed == 90 and result.summary.failed == 0
    assert (result.summary.client_processes, single.summary.client_processes) == (3, 1)
    assert served(echo, "w3")["requests"] == 90
    # The same prompts as one process sends (the server saw the same set of prompt heads).
    heads = sorted(map(tuple, (t["prompt_head"] for t in served(echo, "w3")["timings"])))
    assert heads == sorted(map(tuple, (t["prompt_head"] for t in served(echo, "w1")["timings"])))
    # The merged summary is the summary of the merged records: counts, SLO misses, planned.
    again = summarize(result.records, result.summary.duration, slos)
    assert result.summary.slo_violations == again.slo_violations
    assert result.summary.request_goodput == again.request_goodput
    assert result.summary.planned == 90
    # Every E2E is at least the server's 2 + 3 x 2 = 8 ms: every request misses the 5 ms SLO.
    assert result.summary.slo_violations["e2el_p95_ms=5"] == 90


@pytest.mark.slow
def test_a_stop_from_on_progress_reaches_every_worker(echo: str) -> None:
    calls: list[ReplaySummary] = []

    def on_progress(elapsed_s: float, summary: ReplaySummary) -> bool:
        calls.append(summary)
        return True  # stop at the first call (about 1 s in)

    # 40 req/s for 10 s, each answer ~0.5 s: many in flight when the stop comes.
    trace = trace_of(400, spacing_ms=25, output_length=10)
    result = asyncio.run(replay_with_workers(trace, f"{echo}/ttft=50,itl=50,tag=stop", workers=2,
                                             on_progress=on_progress))
    assert len(calls) == 1
    summary = result.summary
    assert summary.stopped_early and summary.cancelled > 0
    assert summary.completed + summary.failed + summary.cancelled == len(result.records)
    assert len(result.records) < len(trace) / 2
    # Each worker stopped sending: what it sent is the start of its share (every 2nd request).
    for worker in (0, 1):
        sent = sorted(r.index for r in result.records if r.index % 2 == worker)
        assert sent == list(range(worker, worker + 2 * len(sent), 2))
    assert all(r.cancelled == (r.error is not None) for r in result.records)


@pytest.mark.slow
def test_duration_cuts_the_whole_schedule_across_workers(echo: str) -> None:
    trace = trace_of(20, spacing_ms=100, output_length=1)  # 0 .. 1.9 s
    result = asyncio.run(replay_with_workers(trace, f"{echo}/tag=cutw",
                                             ReplayOptions(speedup=2.0, duration_s=0.5), workers=2))
    assert [r.index for r in result.records] == list(range(10))


def test_closed_loop_and_one_worker_stay_in_this_process(echo: str) -> None:
    trace = trace_of(12, spacing_ms=0)
    result = asyncio.run(replay_with_workers(trace, f"{echo}/tag=closed",
                                             ReplayOptions(mode="concurrency=3"), workers=4))
    assert result.summary.completed == 12
    assert served(echo, "closed")["max_in_flight"] <= 3


def test_auto_workers_follow_the_rate_and_leave_half_the_cores() -> None:
    def poisson(rate: float) -> Trace:
        gaps = np.full(1000, 1000.0 / rate)
        return Trace.from_requests(TraceRequest(timestamp=float(t), input_length=8, output_length=4)
                                   for t in np.cumsum(gaps) - gaps[0])

    assert auto_workers(poisson(50), speedup=1.0, cores=16) == 1
    assert auto_workers(poisson(RATE_PER_WORKER * 3.5), speedup=1.0, cores=16) == 4
    assert auto_workers(poisson(50), speedup=20.0, cores=16) == 8  # 1,000 req/s: the measured need
    assert auto_workers(poisson(5000), speedup=1.0, cores=16) == 8  # capped at half the cores
    assert auto_workers(poisson(5000), speedup=1.0, cores=2) == 1
    assert auto_workers(trace_of(1, spacing_ms=0), speedup=1.0, cores=16) == 1


def test_bad_worker_counts_are_refused_in_one_line(echo: str) -> None:
    with pytest.raises(WorkloadError, match=r"replay workers 0: must be >= 1 or 'auto'"):
        asyncio.run(replay_with_workers(trace_of(3, 1.0), echo, workers=0))


def parent_with_a_finished_worker(sends: tuple | None):
    """A replay's parent whose one worker has already exited, having put `sends` (if any) on
    the inbox just before: that message is in the pipe, not yet read."""
    trace = trace_of(2, spacing_ms=10)
    spec = _WorkerSpec(worker=0, trace=trace, indices=np.arange(2), url="http://127.0.0.1:9", options=ReplayOptions())
    parent = _Parent([spec], (), planned=2, on_progress=None)
    context = multiprocessing.get_context("spawn")
    worker = (context.Process(target=parent.inbox.put, args=(sends,)) if sends is not None
              else context.Process(target=int))
    worker.start()
    worker.join(timeout=60)
    assert worker.exitcode == 0
    parent.processes = [worker]
    return parent


def test_a_worker_that_said_done_just_before_it_exited_has_finished() -> None:
    # Seen beside a CPU-heavy job: the worker's "done" arrived after the parent's last read and
    # before its check of the exit codes, and a finished replay was reported as a failed worker.
    parent = parent_with_a_finished_worker(("done", 0, False))
    parent._check_workers(running=True)
    assert parent.done == {0}
    parent.inbox.close()


def test_a_worker_that_exited_without_saying_done_fails_the_replay_in_one_line() -> None:
    parent = parent_with_a_finished_worker(None)
    with pytest.raises(WorkloadError, match=r"^replay worker 0 exited with code 0 before finishing its share$"):
        parent._check_workers(running=True)
    parent.inbox.close()
