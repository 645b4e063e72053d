"""The replayer: send a trace to an OpenAI-compatible server and measure every request.

(Over ~400 lines, because one run's timing loop, stream parsing and stop rules are read and
changed together: `ReplayRun` is that loop. Records and their statistics live in
workloads.replay_summary.)

Two modes (`ReplayMode`):

- `timed` (open loop): request i is sent at `timestamp_i / speedup` seconds after the start,
  whatever the server is doing, as production traffic would arrive. Deadlines are absolute
  (one start on the monotonic clock, which is what asyncio's `loop.time()` reads), so
  sleeps never accumulate drift. Times are read with `time.monotonic()` itself rather than
  `loop.time()`: same clock, but never the millisecond-cached one some loops (uvloop) keep.
- `concurrency=N` (closed loop): N requests in flight at all times, in trace order; a slot
  sends its next request the moment its previous one finishes.

Per request we record the scheduled and actual send time (their difference is the
client's own lag: if it grows, the client, not the server, is the bottleneck), TTFT, the
inter-token gaps, E2E latency, token counts, HTTP status and an error string. Errors are
recorded, never raised: a server that fails half its requests is a measurement.

Timing rules (the same as `vllm bench serve` unless said otherwise):
- Clocks start when the request is handed to the HTTP client (`sent_s`), so TTFT and E2E
  include connection set-up when a new connection is needed, and exclude client lag.
- TTFT: arrival of the first chunk that carries a token (non-empty `text`, or non-empty
  `token_ids` when the server returns them). Empty chunks are not tokens.
- Inter-token gaps: one gap per token after the first. A chunk whose token count is known
  (`token_ids` in the chunk) and is k > 1 spreads its gap evenly: k gaps of gap/k. Extra
  tokens bundled into the *first* chunk arrived with it and count as gaps of 0. When a
  server bundles tokens without saying how many, each chunk counts as one token for the
  gaps (as `vllm bench serve` does) and only `output_tokens` (from `usage`) is exact.
- E2E: from send to the end of the stream (`[DONE]`).
- Output tokens: `usage.completion_tokens` when the server sends usage, else the tokens
  counted from chunks. Each record keeps both counts (`usage_tokens`, `chunk_tokens`) so
  that `workloads.reconcile` can tell a run whose counts cannot be trusted.

HTTP client: one pooled `aiohttp.ClientSession` (HTTP/1.1 keep-alive; closed loop: N
connections; timed: unbounded, so the pool never queues a request unseen). httpx was the
first choice; `benchmarks/replayer_rate.py` measured both against the same server: httpx's
connection pool costs client CPU per request that grows with the connections it holds
(1.1-1.6 ms per streamed request at 16 in flight, 13-16 ms at 256) against 0.2-0.3 ms for
aiohttp at both, so under overload, exactly the trials that matter, httpx would make the
client the bottleneck.

Event loop: asyncio's default. uvloop was measured against it by the same benchmark and
sustained the same rate within 2 ms send-lag p99 (800 req/s each in the recorded run,
1000 each in an earlier one), so it is not worth a dependency; see
`results/benchmarks/replayer_rate.json`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
import numpy as np
from pydantic import BaseModel, ConfigDict

from workloads.errors import WorkloadError
from workloads.gc_pauses import heap_frozen
from workloads.prompts import PromptFactory
from workloads.replay_summary import (
    CLIENT_LAG_LIMIT_MS,
    CLIENT_LAG_WARN_MS,
    ReplayResult,
    ReplaySummary,
    RequestRecord,
    Tally,
)
from workloads.slo import SLO
from workloads.trace import Trace

logger = logging.getLogger(__name__)

CLIENT_KEEPALIVE_S = 2.0  # below the 5 s after which uvicorn / `vllm serve` drop idle connections
# How much of an error response body goes into the record (one line, bounded).
_ERROR_BODY_CHARS = 300

ProgressCallback = Callable[[float, "ReplaySummary"], bool | None]


class ReplayMode(BaseModel):
    """`timed` (recorded arrival times) or `concurrency=N` (closed loop with N in flight)."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["timed", "concurrency"]
    concurrency: int | None = None

    @classmethod
    def parse(cls, text: str | ReplayMode) -> ReplayMode:
        if isinstance(text, ReplayMode):
            return text
        spec = text.strip()
        if spec == "timed":
            return cls(kind="timed")
        name, sep, value = spec.partition("=")
        if name == "concurrency" and sep:
            try:
                n = int(value)
            except ValueError:
                n = 0
            if n >= 1:
                return cls(kind="concurrency", concurrency=n)
        raise WorkloadError(
            f"replay mode {text!r}: expected 'timed' or 'concurrency=N' with N >= 1, "
            "e.g. concurrency=16"
        )

    def __str__(self) -> str:
        return "timed" if self.kind == "timed" else f"concurrency={self.concurrency}"


@dataclass(frozen=True)
class ReplayOptions:
    """How one replay runs: everything but the trace, the server's URL and the progress
    callback. `replay` and `replay_with_workers` (workloads.replay_workers) take the same
    options; a bad value raises WorkloadError when the options are made."""

    # A string ("timed", "concurrency=8") is parsed into a ReplayMode.
    mode: ReplayMode = ReplayMode(kind="timed")
    speedup: float = 1.0  # timed mode: the recorded arrivals compressed by this factor
    duration_s: float | None = None  # timed mode: send only what is due before this
    slos: tuple[SLO, ...] = ()  # judged per request and for the run (`ReplaySummary.slo_met`)
    model: str | None = None  # the request's `model` field (None: the server's only model)
    benchmark_mode: bool = True  # send ignore_eos / min_tokens: exact output lengths
    api_token: str | None = None  # bearer token
    timeout_s: float = 600  # per request
    prompts: PromptFactory = field(default_factory=PromptFactory)  # the token ids sent
    # A tuner does not score a run whose send-lag p99 exceeds this (None: a tenth of the
    # tightest TTFT / E2E threshold, at least CLIENT_LAG_LIMIT_MS): `send_lag_limit_ms`.
    max_send_lag_ms: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", ReplayMode.parse(self.mode))
        object.__setattr__(self, "slos", tuple(self.slos))
        if not self.speedup > 0:
            raise WorkloadError(f"replay speedup {self.speedup!r}: must be > 0")
        if self.duration_s is not None and not self.duration_s > 0:
            raise WorkloadError(f"replay duration {self.duration_s!r} s: must be > 0")
        if not self.timeout_s > 0:
            raise WorkloadError(f"replay timeout {self.timeout_s!r} s: must be > 0")
        if self.max_send_lag_ms is not None and not self.max_send_lag_ms > 0:
            raise WorkloadError(f"client lag limit {self.max_send_lag_ms!r} ms: must be > 0")

    def send_lag_limit_ms(self) -> float:
        """The send-lag p99 above which a run shows the client, not only the server: a tenth
        of the tightest TTFT or E2E threshold (the latencies it would distort), and never less
        than CLIENT_LAG_LIMIT_MS (an SLO of a few ms, set to make every config miss, must not
        make every run unscored instead)."""
        if self.max_send_lag_ms is not None:
            return self.max_send_lag_ms
        judged = [slo.threshold_ms / 10.0 for slo in self.slos if slo.metric in ("ttft", "e2el")]
        return max(min(judged, default=CLIENT_LAG_LIMIT_MS), CLIENT_LAG_LIMIT_MS)

    def planned(self, trace: Trace) -> int:
        """How many requests of `trace` a run may send (timed mode: within `duration_s`)."""
        n = len(trace)
        if self.mode.kind == "timed" and self.duration_s is not None:
            cutoff_ms = self.duration_s * 1000.0 * self.speedup
            n = int(np.searchsorted(trace.timestamps_ms, cutoff_ms, side="left"))
        return n


@dataclass(slots=True)
class _Stream:
    """What one streamed answer delivered, gathered while reading it."""

    first_token_s: float | None = None
    last_token_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    chunk_tokens: int = 0
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    done: bool = False
    end_s: float | None = None
    error: str | None = None

    def add_chunk(self, now: float, chunk: dict) -> None:
        # vLLM reports a failure after the headers as an error event: {"error": {...}} in
        # recent versions, {"object": "error", "message": ...} in older ones.
        if ("error" in chunk or chunk.get("object") == "error") and not chunk.get("choices"):
            self.error = f"server error in stream: {_one_line(json.dumps(chunk))}"
            return
        choices = chunk.get("choices") or ()
        if choices:
            choice = choices[0]
            token_ids = choice.get("token_ids")
            tokens = len(token_ids) if token_ids else (1 if choice.get("text") else 0)
            if tokens:
                if self.first_token_s is None:
                    self.first_token_s = now
                    self.gaps_s.extend([0.0] * (tokens - 1))
                else:
                    gap = (now - self.last_token_s) / tokens
                    self.gaps_s.extend([gap] * tokens)
                self.last_token_s = now
                self.chunk_tokens += tokens
        usage = chunk.get("usage")
        if usage:
            self.usage_prompt_tokens = usage.get("prompt_tokens", self.usage_prompt_tokens)
            self.usage_completion_tokens = usage.get(
                "completion_tokens", self.usage_completion_tokens
            )


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _ERROR_BODY_CHARS else flat[: _ERROR_BODY_CHARS - 3] + "..."


class ReplayRun:
    """One replay run: the schedule, the requests in flight and the records so far.

    Over ~250 lines for the module's reason: the timing loop, the in-flight bookkeeping and
    the records share one start clock."""

    def __init__(
        self,
        trace: Trace,
        session: aiohttp.ClientSession,
        endpoint: str,
        options: ReplayOptions,
        *,
        on_progress: ProgressCallback | None = None,
        indices: np.ndarray | None = None,
        on_record: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        self.trace = trace
        # A worker process's share of a bigger trace (workloads.replay_workers): request i
        # here is request indices[i] there, and each record is also handed to on_record.
        self.indices = indices
        self.on_record = on_record
        self.session = session
        self.endpoint = endpoint
        self.options = options
        self.on_progress = on_progress
        self.records: list[RequestRecord] = []
        self.tally = Tally(options.slos)
        self.in_flight: set[asyncio.Task] = set()
        # Requests sent and not yet recorded: send time and stream (for late counts).
        self.open: dict[int, tuple[float, _Stream]] = {}
        self.stop_requested = asyncio.Event()
        self.t0 = 0.0

    # -- building and sending one request ------------------------------------------------

    def index_of(self, i: int) -> int:
        """Request i's index in the whole trace (a worker replays a share of it)."""
        return i if self.indices is None else int(self.indices[i])

    def body(self, i: int) -> bytes:
        trace = self.trace
        out = int(trace.output_lengths[i])
        hash_ids = None if trace.hash_ids is None else trace.hash_ids[i]
        payload: dict = {
            "prompt": self.options.prompts.prompt(self.index_of(i), int(trace.input_lengths[i]), hash_ids),
            "max_tokens": out,
            "stream": True,
            "stream_options": {"include_usage": True},
            # Each chunk's token ids (stock vLLM sends them only when asked): the gaps are then
            # exact, and a token that decodes to no text still counts (first token included).
            "return_token_ids": True,
            "temperature": 0,
        }
        if self.options.benchmark_mode:
            payload["ignore_eos"] = True
            payload["min_tokens"] = out
        if self.options.model is not None:
            payload["model"] = self.options.model
        return json.dumps(payload, separators=(",", ":")).encode()

    async def send(self, i: int, scheduled_s: float, body: bytes) -> None:
        sent = time.monotonic()
        stream = _Stream()
        self.open[i] = (sent, stream)
        status: int | None = None
        error: str | None = None
        try:
            async with asyncio.timeout(self.options.timeout_s):
                async with self.session.post(self.endpoint, data=body) as response:
                    status = response.status
                    if status != 200:
                        text = (await response.read()).decode("utf-8", "replace")
                        error = f"HTTP {status}: {_one_line(text)}"
                    else:
                        await self._read_stream(response.content, stream)
                        error = stream.error
        except asyncio.CancelledError:
            self._record(i, scheduled_s, sent, stream, status, "cancelled: replay stopped", True)
            raise
        except TimeoutError:
            error = f"timeout: no complete answer within {self.options.timeout_s:g} s"
        except aiohttp.ClientConnectorError as exc:
            error = f"connection failed: {_one_line(str(exc)) or type(exc).__name__}"
        except aiohttp.ClientError as exc:  # dropped connection, malformed HTTP, cut body
            error = f"{type(exc).__name__}: {_one_line(str(exc)) or 'no detail'}"
        except (OSError, ValueError) as exc:  # socket errors; undecodable JSON in the stream
            error = f"{type(exc).__name__}: {_one_line(str(exc))}"
        if error is None and stream.first_token_s is None:
            error = "stream ended without any token"
        elif error is None and not stream.done:
            error = "stream ended before [DONE]"
        self._record(i, scheduled_s, sent, stream, status, error, False)

    async def _read_stream(self, content: aiohttp.StreamReader, stream: _Stream) -> None:
        async for line in content:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, `event:` lines
            data = line[5:].strip()
            now = time.monotonic()
            if data == b"[DONE]":
                # Keep reading to the end of the body: a connection is only reused once
                # its response was read to the end.
                stream.done = True
                stream.end_s = now
                continue
            stream.add_chunk(now, json.loads(data))
            if stream.error is not None:
                break

    def _record(
        self,
        i: int,
        scheduled_s: float,
        sent: float,
        stream: _Stream,
        status: int | None,
        error: str | None,
        cancelled: bool,
    ) -> None:
        self.open.pop(i, None)
        end = time.monotonic() if stream.end_s is None else stream.end_s
        ttft = None if stream.first_token_s is None else (stream.first_token_s - sent) * 1e3
        output_tokens = (
            stream.usage_completion_tokens
            if stream.usage_completion_tokens is not None
            else stream.chunk_tokens
        )
        input_tokens = (
            stream.usage_prompt_tokens
            if stream.usage_prompt_tokens is not None
            else int(self.trace.input_lengths[i])
        )
        sent_s = sent - self.t0
        # Our own values, already the right types: skip re-validation on the hot path.
        record = RequestRecord.model_construct(
            index=self.index_of(i),
            scheduled_s=scheduled_s,
            sent_s=sent_s,
            lag_ms=(sent_s - scheduled_s) * 1e3,
            ttft_ms=ttft,
            itl_ms=[gap * 1e3 for gap in stream.gaps_s],
            e2e_ms=None if error is not None else (end - sent) * 1e3,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            usage_tokens=stream.usage_completion_tokens,
            chunk_tokens=stream.chunk_tokens,
            status=status,
            error=error,
            failed_after_ms=(end - sent) * 1e3 if error is not None and not cancelled else None,
            cancelled=cancelled,
        )
        self.records.append(record)
        self.tally.add(record)
        if self.on_record is not None:
            self.on_record(record)

    # -- schedules ------------------------------------------------------------------------

    def _last_index(self) -> int:
        return self.options.planned(self.trace)

    def _launch(self, i: int, scheduled_s: float, body: bytes) -> None:
        task = asyncio.create_task(self.send(i, scheduled_s, body))
        self.in_flight.add(task)
        task.add_done_callback(self.in_flight.discard)

    async def _timed(self, first_body: bytes | None) -> None:
        offsets_s = self.trace.timestamps_ms / 1000.0 / self.options.speedup
        last = self._last_index()
        body = first_body
        for i in range(last):
            scheduled_s = float(offsets_s[i])
            # Built while waiting for the previous deadline, not after this one.
            if body is None:
                body = self.body(i)
            delay = self.t0 + scheduled_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self._launch(i, scheduled_s, body)
            body = None
            # Let the request just launched start before building the next one, unless the
            # next is already due: when behind (a burst, a stall), launch every due request
            # in one go rather than one per loop turn, or the backlog never drains.
            if i + 1 < last and self.t0 + float(offsets_s[i + 1]) > time.monotonic():
                await asyncio.sleep(0)
        while self.in_flight:
            await asyncio.wait(list(self.in_flight))

    async def _closed_loop(self) -> None:
        next_index = iter(range(self._last_index()))

        async def slot() -> None:
            for i in next_index:  # shared iterator: each slot takes the next request
                scheduled_s = time.monotonic() - self.t0
                if self.options.duration_s is not None and scheduled_s >= self.options.duration_s:
                    return
                await self.send(i, scheduled_s, self.body(i))

        assert self.options.mode.concurrency is not None
        slots = [asyncio.create_task(slot()) for _ in range(self.options.mode.concurrency)]
        self.in_flight.update(slots)
        for task in slots:
            task.add_done_callback(self.in_flight.discard)
        await asyncio.gather(*slots)

    async def _progress(self) -> None:
        await each_second(self.t0, self._tick)

    async def _tick(self, elapsed: float) -> bool:
        # Percentiles over every token gap so far and the callback (which may write to
        # storage: Optuna's trial.report) run in a worker thread, off the loop that times
        # sends; numpy releases the GIL for the heavy part. The snapshot is taken on the loop.
        late = self.late_counts()
        if await asyncio.to_thread(self._report, elapsed, self.tally.copy(), late):
            self.stop_requested.set()
            return True
        return False

    def late_counts(self) -> list[int]:
        """Per SLO, requests in flight that already miss it: no first token (TTFT) or no end
        (E2E) although sent longer ago than the threshold. O(requests in flight)."""
        now = time.monotonic()
        late = [0] * len(self.options.slos)
        for k, slo in enumerate(self.options.slos):
            if slo.metric not in ("ttft", "e2el"):
                continue
            limit_s = slo.threshold_ms / 1000.0
            for sent, stream in self.open.values():
                if now - sent > limit_s and (slo.metric == "e2el" or stream.first_token_s is None):
                    late[k] += 1
        return late

    def _report(self, elapsed: float, tally: Tally, late: list[int]) -> bool:
        assert self.on_progress is not None
        summary = tally.summary(elapsed, planned=self._last_index(), late=late)
        return bool(self.on_progress(elapsed, summary))

    # -- the run --------------------------------------------------------------------------

    async def run(self, start_at: float | None = None) -> ReplayResult:
        """`start_at`: the start instant on the monotonic clock (processes sharing one start),
        else now."""
        # The first request is due at once: build it before the clock starts.
        first_body = self.body(0) if len(self.trace) else None
        with heap_frozen():  # no full garbage collection stalls the schedule (gc_pauses)
            return await self._run(first_body, start_at)

    async def _run(self, first_body: bytes | None, start_at: float | None) -> ReplayResult:
        self.t0 = time.monotonic() if start_at is None else start_at
        if self.options.mode.kind == "timed":
            schedule = self._timed(first_body)
        else:
            schedule = self._closed_loop()
        work = asyncio.create_task(schedule)
        stop = asyncio.create_task(self.stop_requested.wait())
        progress = asyncio.create_task(self._progress()) if self.on_progress else None
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
            stopped_early = not work.done()
            if stopped_early:
                logger.info("replay stopped early by on_progress; cancelling in-flight requests")
            end = time.monotonic()
        finally:
            for task in (work, stop, progress, *self.in_flight):
                if task is not None:
                    task.cancel()
            pending = [t for t in (work, stop, progress, *self.in_flight) if t is not None]
            await asyncio.gather(*pending, return_exceptions=True)
        if not stopped_early:
            work.result()  # a bug in the schedule itself should not pass silently
        records = sorted(self.records, key=lambda r: r.index)
        summary = self.tally.summary(
            end - self.t0, stopped_early=stopped_early, planned=self._last_index()
        )
        return ReplayResult.model_construct(records=records, summary=summary)


def warn_if_lagging(summary: ReplaySummary) -> None:
    """Say when the client, not only the server, shaped a run."""
    if summary.client_lagging:
        logger.warning(
            "replayer lagging: send lag p99 %.1f ms > %.0f ms; the client, not only the "
            "server, shaped this run (lower the rate or run the replayer elsewhere)",
            summary.send_lag_p99_ms,
            CLIENT_LAG_WARN_MS,
        )


def client_session(mode: ReplayMode, api_token: str | None) -> aiohttp.ClientSession:
    """The replayer's HTTP client (use as `async with`)."""
    headers = {"Content-Type": "application/json"}
    if api_token:
        headers["Authorization"] = f"Bearer {api_token}"
    # Closed loop: exactly N connections, kept alive. Open loop: never let the pool hold a
    # request back (that would be unmeasured client-side queueing): no limit (0).
    # Idle connections are dropped after 2 s, before the server drops them (uvicorn and
    # `vllm serve` close idle keep-alive connections after 5 s; aiohttp keeps them 15 s):
    # a request sent on a connection the server is closing fails as "Server disconnected".
    connector = aiohttp.TCPConnector(limit=mode.concurrency or 0, limit_per_host=0,
                                     keepalive_timeout=CLIENT_KEEPALIVE_S)
    return aiohttp.ClientSession(
        connector=connector,
        headers=headers,
        # The per-request limit is enforced around the whole request (asyncio.timeout).
        timeout=aiohttp.ClientTimeout(total=None),
        # A load client talks straight to the server: no proxies from the environment.
        trust_env=False,
        auto_decompress=False,
    )


async def each_second(t0: float, tick: Callable[[float], Awaitable[bool]]) -> None:
    """Await `tick(seconds since t0)` about once a second (t0 on time.monotonic) until it
    returns True; the progress loop of a replay and of a multi-process replay alike."""
    due = 1
    while True:
        await asyncio.sleep(max(t0 + due - time.monotonic(), 0.0))
        elapsed = time.monotonic() - t0
        due = int(elapsed) + 1
        if await tick(elapsed):
            return


async def replay(
    trace: Trace,
    url: str,
    options: ReplayOptions | None = None,
    *,
    on_progress: ProgressCallback | None = None,
) -> ReplayResult:
    """Send `trace` to `url` (`{url}/v1/completions`, streaming) and measure it, as
    `options` says (default: `ReplayOptions()`, the recorded schedule at speed 1).

    `on_progress(elapsed_s, summary_so_far)` is called about once a second (in a worker
    thread, so a slow callback does not delay sends); returning True stops the replay:
    no new requests, in-flight ones cancelled (recorded with `cancelled=True`), and the
    result covers what was measured up to then.
    """
    options = options or ReplayOptions()
    async with client_session(options.mode, options.api_token) as session:
        run = ReplayRun(trace, session, url.rstrip("/") + "/v1/completions", options,
                        on_progress=on_progress)
        result = await run.run()
    warn_if_lagging(result.summary)
    return result
