"""The replayer in several processes on one start clock, for rates one event loop cannot keep.

One asyncio loop sends about 300 streamed requests/s with send-lag p99 under 2 ms
(`benchmarks/replayer_rate.py`); a small model on a GPU carries more. `replay_with_workers`
deals the trace round-robin to N worker processes (request i to worker i mod N, so every
worker sends an even share of every burst), each running the single-loop replayer
(`workloads.replay.ReplayRun`) with its own event loop and HTTP client on its share, with the
trace's own request indices and schedule. They start at one instant of the monotonic clock,
which on Linux (CLOCK_MONOTONIC) is the same in every process of the host. Records stream back
to the parent as they finish; the parent keeps the run's tally, calls `on_progress` about once
a second as the single-loop replayer does (with the in-flight late counts the workers report),
and a stop it returns reaches every worker, which cancels what it has in flight.

Workers are spawned (not forked: the parent runs an event loop and threads), so each costs a
Python start-up before the run; `auto_workers` asks for more than one only at rates a single
loop would not keep.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import os
import queue
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Literal

import numpy as np

from workloads.errors import WorkloadError
from workloads.gc_pauses import freeze_heap, heap_frozen
from workloads.replay import (
    ProgressCallback,
    ReplayOptions,
    ReplayRun,
    client_session,
    each_second,
    replay,
    warn_if_lagging,
)
from workloads.replay_summary import ReplayResult, Tally
from workloads.slo import SLO
from workloads.trace import Trace

logger = logging.getLogger(__name__)

# What one worker is asked to send. Measured on the H100 host's 16 cores (results/benchmarks/
# replayer_rate_gpu_host.md): at 1,000 req/s send-lag p99 was 33-41 ms with one process,
# 23-27 with two, 5-9 with four and 2.0-2.7 with eight (one per 125 req/s).
RATE_PER_WORKER = 125.0
# A client on CPUs of its own sends from one process only up to this rate. Against real
# servers the echo figure above is optimistic: each answer streams one event per token (65
# here), most of all behind several front ends that keep up token by token. H200, client on 4
# CPUs of its own (results/benchmarks/frontends-cpu-accounting/): send-lag p99 5.9 ms from one
# process at 105 req/s, up to 15.8 ms from two at 137-200 req/s against four front ends.
PINNED_SINGLE_RATE = 62.5
# Between the last worker saying "ready" and the common start: time for the start instant to
# reach every worker before its first deadline.
START_MARGIN_S = 0.1
# How often a worker reports its late in-flight requests and looks for a stop.
WORKER_TICK_S = 0.2
READY_TIMEOUT_S = 120.0


def auto_workers(trace: Trace, speedup: float, cores: int | None = None,
                 client_cpus: int | None = None) -> int:
    """Worker processes for replaying `trace` at `speedup`.

    Sharing the host with the server: one per RATE_PER_WORKER req/s of its mean rate, at most
    half the host's `cores` (the server and engine need the rest). With CPUs of its own
    (`client_cpus`, autotune.measure.cpu_split): one per such CPU as soon as one process would
    carry more than PINNED_SINGLE_RATE, since a CPU reserved for the client helps nobody idle.
    """
    if len(trace) < 2:
        return 1
    span_s = float(trace.timestamps_ms[-1] - trace.timestamps_ms[0]) / 1000.0 / speedup
    rate = (len(trace) - 1) / span_s if span_s > 0 else math.inf
    if client_cpus:
        return client_cpus if rate > PINNED_SINGLE_RATE else 1
    limit = max(1, (cores or os.cpu_count() or 1) // 2)
    return max(1, min(limit, math.ceil(rate / RATE_PER_WORKER)))


def own_cpus() -> int | None:
    """How many CPUs this thread is pinned to, when fewer than the host's (a client given CPUs
    of its own); None when it may run anywhere."""
    mine = len(os.sched_getaffinity(0))
    return mine if mine < (os.cpu_count() or mine) else None


@dataclass(frozen=True)
class _WorkerSpec:
    """Everything one worker needs (pickled into the spawned process)."""

    worker: int
    trace: Trace  # this worker's share, timestamps unchanged
    indices: np.ndarray  # the share's request indices in the whole trace
    url: str
    options: ReplayOptions


async def replay_with_workers(
    trace: Trace,
    url: str,
    options: ReplayOptions | None = None,
    *,
    workers: int | Literal["auto"] = "auto",
    on_progress: ProgressCallback | None = None,
) -> ReplayResult:
    """`workloads.replay.replay` spread over `workers` processes (`auto`: `auto_workers`).
    The closed-loop mode and one worker run in this process, as `replay` does."""
    options = options or ReplayOptions()
    count = (auto_workers(trace, options.speedup, client_cpus=own_cpus()) if workers == "auto"
             else int(workers))
    if count < 1:
        raise WorkloadError(f"replay workers {workers!r}: must be >= 1 or 'auto'")
    planned = options.planned(trace)
    count = min(count, max(planned, 1))
    if count == 1 or options.mode.kind != "timed":
        return await replay(trace, url, options, on_progress=on_progress)
    specs = [
        _WorkerSpec(worker=k, trace=trace.subset(share), indices=share, url=url, options=options)
        for k in range(count)
        if (share := np.arange(k, planned, count, dtype=np.int64)).size
    ]
    logger.info("replaying %d requests with %d worker processes", planned, len(specs))
    return await _Parent(specs, options.slos, planned, on_progress).run()


class _Parent:
    """Starts the workers, merges what they send, and stops them."""

    def __init__(self, specs: list[_WorkerSpec], slos: tuple[SLO, ...], planned: int,
                 on_progress: ProgressCallback | None) -> None:
        self.specs = specs
        self.slos = slos
        self.planned = planned
        self.on_progress = on_progress
        context = multiprocessing.get_context("spawn")
        self.inbox: Any = context.Queue()
        self.stop = context.Event()
        self.starts: list[Connection] = []
        self.processes: list[Any] = []
        for spec in specs:
            receive, send = context.Pipe(duplex=False)
            self.starts.append(send)
            self.processes.append(context.Process(
                target=_worker_main, args=(spec, self.inbox, receive, self.stop),
                name=f"replay-worker-{spec.worker}", daemon=True,
            ))
        self.records: list[Any] = []
        self.tally = Tally(slos)
        self.late: dict[int, list[int]] = {}
        self.done: set[int] = set()
        self.stopped_early = False
        self.t0 = 0.0

    async def run(self) -> ReplayResult:
        for process in self.processes:
            process.start()
        with heap_frozen():  # the merging loop must not stall either (workloads.gc_pauses)
            return await self._run()

    async def _run(self) -> ReplayResult:
        try:
            await self._start_together()
            progress = asyncio.create_task(self._progress()) if self.on_progress else None
            try:
                while len(self.done) < len(self.specs):
                    for message in await asyncio.to_thread(self._next_messages):
                        self._take(message)
                    self._check_workers(running=True)
            finally:
                if progress is not None:
                    progress.cancel()
                    await asyncio.gather(progress, return_exceptions=True)
            end = time.monotonic()
        finally:
            self._stop_workers()
        self.records.sort(key=lambda r: r.index)
        summary = self.tally.summary(end - self.t0, stopped_early=self.stopped_early, planned=self.planned)
        summary = summary.model_copy(update={"client_processes": len(self.specs)})
        warn_if_lagging(summary)
        return ReplayResult.model_construct(records=self.records, summary=summary)

    async def _start_together(self) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(ready) < len(self.specs):
            for message in await asyncio.to_thread(self._next_messages):
                if message[0] != "ready":
                    raise WorkloadError(f"replay worker {message[1]}: {message[0]} before the start: {message[2:]}")
                ready.add(message[1])
            self._check_workers()
            if time.monotonic() > deadline:
                raise WorkloadError(f"replay workers: {len(ready)} of {len(self.specs)} ready after "
                                    f"{READY_TIMEOUT_S:g} s")
        self.t0 = time.monotonic() + START_MARGIN_S
        for start in self.starts:
            start.send(self.t0)

    def _next_messages(self) -> list[tuple]:
        """Whatever the workers sent: waits up to a tick for the first message, then drains."""
        try:
            messages = [self.inbox.get(timeout=WORKER_TICK_S)]
        except queue.Empty:
            return []
        return messages + self._waiting_messages()

    def _waiting_messages(self) -> list[tuple]:
        messages = []
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                return messages

    def _take(self, message: tuple) -> None:
        kind, worker = message[0], message[1]
        if kind == "records":
            for record in message[2]:
                self.records.append(record)
                self.tally.add(record)
        elif kind == "late":
            self.late[worker] = message[2]
        elif kind == "done":
            self.done.add(worker)
            self.stopped_early = self.stopped_early or message[2]
        elif kind == "error":
            raise WorkloadError(f"replay worker {worker} failed: {message[2]}")

    def _check_workers(self, *, running: bool = False) -> None:
        """A worker that exited without saying it is done failed. While the replay runs, its
        last messages ("done" among them) may have reached the inbox after the last read: a
        process that has exited has flushed everything it sent, so they are read first."""
        def gone() -> list[tuple[int, int]]:
            return [(spec.worker, process.exitcode) for spec, process in zip(self.specs, self.processes, strict=True)
                    if spec.worker not in self.done and process.exitcode is not None]

        if running and gone():
            for message in self._waiting_messages():
                self._take(message)
        if failed := gone():
            worker, exitcode = failed[0]
            raise WorkloadError(f"replay worker {worker} exited with code {exitcode} before finishing its share")

    async def _progress(self) -> None:
        await each_second(self.t0, self._tick)

    async def _tick(self, elapsed: float) -> bool:
        assert self.on_progress is not None
        late = [sum(column) for column in zip(*self.late.values(), strict=True)] if self.late else []
        summary = self.tally.copy().summary(elapsed, planned=self.planned, late=late)
        if await asyncio.to_thread(self.on_progress, elapsed, summary):
            self.stop.set()
            return True
        return False

    def _stop_workers(self) -> None:
        self.stop.set()
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        self.inbox.close()


# -- in the worker process ----------------------------------------------------------------------


def _worker_main(spec: _WorkerSpec, outbox: Any, start: Connection, stop: Any) -> None:
    try:
        asyncio.run(_worker(spec, outbox, start, stop))
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises it
        outbox.put(("error", spec.worker, f"{type(error).__name__}: {error}"))
        raise


async def _worker(spec: _WorkerSpec, outbox: Any, start: Connection, stop: Any) -> None:
    batch: list[Any] = []
    async with client_session(spec.options.mode, spec.options.api_token) as session:
        run = ReplayRun(spec.trace, session, spec.url.rstrip("/") + "/v1/completions", spec.options,
                        indices=spec.indices, on_record=batch.append)
        freeze_heap()  # before "ready": the collection it runs must not eat the start margin
        outbox.put(("ready", spec.worker))
        start_at = await asyncio.to_thread(start.recv)
        reporter = asyncio.create_task(_report(spec.worker, run, batch, outbox, stop))
        try:
            result = await run.run(start_at=start_at)
        finally:
            reporter.cancel()
            await asyncio.gather(reporter, return_exceptions=True)
        _flush(spec.worker, batch, outbox)
        outbox.put(("done", spec.worker, result.summary.stopped_early))


async def _report(worker: int, run: ReplayRun, batch: list[Any], outbox: Any, stop: Any) -> None:
    """Every tick: the records finished since the last, the late in-flight counts; a stop the
    parent asked for stops this worker's run."""
    while True:
        await asyncio.sleep(WORKER_TICK_S)
        _flush(worker, batch, outbox)
        outbox.put(("late", worker, run.late_counts()))
        if stop.is_set():
            run.stop_requested.set()
            return


def _flush(worker: int, batch: list[Any], outbox: Any) -> None:
    if batch:
        outbox.put(("records", worker, list(batch)))
        batch.clear()
