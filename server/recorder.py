"""The traffic recorder: the serving server writes its own requests as a trace.

Each finished generation becomes one line of our JSONL trace format (`workloads.trace`):

    {"timestamp": 1234.5, "input_length": 57, "output_length": 31,
     "source_lang": "en", "target_lang": "de", "latency_ms": 812.4}

`timestamp` is the request's arrival in milliseconds since the recorder started; the files of
one run share that time base and their names carry its wall-clock start, so `read_recording`
can put several runs (server restarts) on one time line. Token counts only: what users wrote
is never kept unless `record_text` is on, and then it goes to a `.text.jsonl` file beside the
trace (same line order), so the trace itself stays a plain trace every tool reads.

Cost on the request path: `begin()` and `finish()` append to in-memory structures and never
touch the disk. A background task hands the buffered lines to a worker thread every
`flush_interval_s` (or once `flush_lines` are waiting), which serializes them, appends them to
the current file, rotates files at `max_file_bytes` and deletes the oldest files beyond
`max_total_bytes`. `stop()` writes what is left.

Lines are written in arrival order: a finished request is held back while an earlier-arriving
request is still in flight (up to `HOLD_LIMIT_S`), so a file loads without re-sorting.
Requests that fail, are refused, or whose client leaves are not recorded (no output length).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import re
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from server.config import RecorderSettings
from workloads.errors import WorkloadError
from workloads.trace import Trace, TraceBuilder
from workloads.trace_io import TraceWarning, read_trace

logger = logging.getLogger("server.recorder")

# A request in flight longer than this no longer holds back the lines of later arrivals (a
# stuck stream must not keep the buffer growing); its own line may then land out of order,
# which `load_trace` repairs (sorting, with a TraceWarning).
HOLD_LIMIT_S = 60.0
# `traffic-<wall-clock start, epoch ms>-<file number>.jsonl` (+ `.text.jsonl` beside it).
FILE_NAME = re.compile(r"^traffic-(?P<start>\d{13})-(?P<number>\d{6})(?P<text>\.text)?\.jsonl$")


def segment_name(start_ms: int, number: int, *, text: bool = False) -> str:
    return f"traffic-{start_ms:013d}-{number:06d}{'.text' if text else ''}.jsonl"


@dataclass(frozen=True)
class Segment:
    """One trace file of a recording (and its text file, if any)."""

    start_ms: int  # wall-clock start of the recorder run that wrote it (epoch ms)
    number: int
    path: Path
    text_path: Path | None

    @property
    def key(self) -> tuple[int, int]:
        return (self.start_ms, self.number)


def list_segments(directory: str | os.PathLike[str]) -> list[Segment]:
    """The recording's trace files, oldest first (other files in the folder are ignored)."""
    traces: dict[tuple[int, int], Path] = {}
    texts: dict[tuple[int, int], Path] = {}
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        match = FILE_NAME.match(entry.name)
        if match is None or not entry.is_file():
            continue
        key = (int(match["start"]), int(match["number"]))
        (texts if match["text"] else traces)[key] = Path(entry.path)
    keys = sorted(set(traces) | set(texts))
    directory = Path(directory)
    return [
        Segment(key[0], key[1], traces.get(key) or directory / segment_name(*key), texts.get(key))
        for key in keys
    ]


class SegmentWriter:
    """Appends lines to the current file, rotates, and keeps the folder within its budget.

    Runs in a worker thread (one flush at a time); never on the event loop.
    """

    def __init__(self, settings: RecorderSettings, start_ms: int) -> None:
        self.settings = settings
        self.directory = Path(settings.directory)
        self.start_ms = start_ms
        self.number = 0
        self.size = 0  # bytes in the current trace file
        self.text_size = 0

    @property
    def current(self) -> Path:
        return self.directory / segment_name(self.start_ms, self.number)

    @property
    def current_text(self) -> Path:
        return self.directory / segment_name(self.start_ms, self.number, text=True)

    def write(self, rows: list[dict[str, Any]]) -> None:
        """Writes `rows` (trace fields, plus "text" when recorded) in order."""
        if not rows:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        limit = self.settings.max_file_bytes
        dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
        lines: list[bytes] = []
        texts: list[bytes] = []
        size, text_size = self.size, self.text_size  # the current files once `lines` are in
        for row in rows:
            text = row.pop("text", None)
            line = (dumps(row) + "\n").encode("utf-8")
            text_line = b""
            if self.settings.record_text:  # one text line per trace line, null for none
                text_line = (dumps({"timestamp": row["timestamp"], "text": text}) + "\n").encode()
            too_big = size + len(line) > limit or text_size + len(text_line) > limit
            if too_big and size > 0:  # a line longer than the limit still gets a file
                self._append(lines, texts)
                lines, texts = [], []
                self._rotate()
                size, text_size = 0, 0
            lines.append(line)
            size += len(line)
            if text_line:
                texts.append(text_line)
                text_size += len(text_line)
        self._append(lines, texts)
        self.enforce_budget()

    def _append(self, lines: list[bytes], texts: list[bytes]) -> None:
        if not lines:
            return
        self.size += append_bytes(self.current, b"".join(lines))
        if texts:
            self.text_size += append_bytes(self.current_text, b"".join(texts))

    def _rotate(self) -> None:
        self.number += 1
        self.size = 0
        self.text_size = 0

    def enforce_budget(self) -> list[Path]:
        """Deletes the oldest files (trace and text together) until the folder's recording
        fits `max_total_bytes`; the file being written is never deleted. Returns what went."""
        segments = list_segments(self.directory)
        sizes = {segment.key: segment_bytes(segment) for segment in segments}
        total = sum(sizes.values())
        deleted: list[Path] = []
        current = (self.start_ms, self.number)
        for segment in segments:
            if total <= self.settings.max_total_bytes:
                break
            if segment.key == current:
                continue
            for path in (segment.path, segment.text_path):
                if path is not None:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                        deleted.append(path)
            total -= sizes[segment.key]
        return deleted


def append_bytes(path: Path, data: bytes) -> int:
    """Appends `data` with O_APPEND (whole lines per call, so a reader never sees a torn line
    unless the machine dies mid-write); returns the bytes written."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
    finally:
        os.close(fd)
    return len(data)


def segment_bytes(segment: Segment) -> int:
    total = 0
    for path in (segment.path, segment.text_path):
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_size
    return total


@dataclass(slots=True, eq=False, repr=False)
class Pending:
    """One request being recorded: `finish()` once it has its result, or `drop()` it."""

    recorder: TrafficRecorder
    ident: int
    arrival_ms: float
    source_lang: str | None
    target_lang: str | None
    text: str | None

    def finish(self, input_length: int, output_length: int) -> None:
        self.recorder._finish(self, input_length, output_length)

    def drop(self) -> None:
        """The request ended without a result (or `finish` ran already): record nothing."""
        self.recorder.in_flight.pop(self.ident, None)


class TrafficRecorder:
    """Buffers records on the event loop and writes them from a worker thread.

    `start()` and `stop()` run in the app's lifespan; `begin()` when a request is admitted.
    """

    def __init__(
        self,
        settings: RecorderSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.started = clock()
        self.writer = SegmentWriter(settings, start_ms=int(wall_clock() * 1000))
        self._ids = itertools.count()
        self.in_flight: dict[int, float] = {}  # ident -> arrival ms, until finished or dropped
        self._ready: list[dict[str, Any]] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        # One worker thread: writes never overlap, even if a flush's awaiter is cancelled.
        self._executor: ThreadPoolExecutor | None = None
        self.recorded = 0  # lines handed to the writer
        self.write_errors = 0

    # -- the request path (event loop, no I/O) ------------------------------------------------

    def now_ms(self) -> float:
        return (self.clock() - self.started) * 1000.0

    def begin(
        self,
        *,
        source_lang: str | None = None,
        target_lang: str | None = None,
        text: str | None = None,
    ) -> Pending:
        ident = next(self._ids)
        arrival = self.now_ms()
        self.in_flight[ident] = arrival
        kept_text = text if self.settings.record_text else None
        return Pending(self, ident, arrival, source_lang, target_lang, kept_text)

    def _finish(self, pending: Pending, input_length: int, output_length: int) -> None:
        if self.in_flight.pop(pending.ident, None) is None:
            return  # finished or dropped already
        row: dict[str, Any] = {
            "timestamp": round(pending.arrival_ms, 3),
            "input_length": int(input_length),
            # A request that stopped at once still cost a decode step; traces need >= 1.
            "output_length": max(1, int(output_length)),
        }
        if pending.source_lang is not None:
            row["source_lang"] = pending.source_lang
        if pending.target_lang is not None:
            row["target_lang"] = pending.target_lang
        row["latency_ms"] = round(self.now_ms() - pending.arrival_ms, 3)
        if pending.text is not None:
            row["text"] = pending.text
        self._ready.append(row)
        if len(self._ready) >= self.settings.flush_lines:
            self._wake.set()

    # -- background writing ---------------------------------------------------------------------

    async def start(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="traffic-recorder")
        await self._in_worker(Path(self.settings.directory).mkdir, parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._flush_loop(), name="traffic-recorder")

    async def stop(self) -> None:
        """Ends the flush loop after its current write, then writes every finished request
        still buffered (requests still in flight are not recorded)."""
        if self._task is not None:
            self._closing = True
            self._wake.set()
            await self._task
            self._task = None
        await self.flush(everything=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    async def _flush_loop(self) -> None:
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.flush_interval_s)
            self._wake.clear()
            await self.flush()

    async def _in_worker(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(function, *args, **kwargs))

    def take_batch(self, *, everything: bool = False) -> list[dict[str, Any]]:
        """The buffered rows that can be written now, in arrival order; the rest stay."""
        if not self._ready:
            return []
        now = self.now_ms()
        oldest_allowed = now - HOLD_LIMIT_S * 1000.0
        waiting_on = [a for a in self.in_flight.values() if a >= oldest_allowed]
        watermark = float("inf") if everything or not waiting_on else min(waiting_on)
        if watermark == float("inf"):
            batch, self._ready = self._ready, []
        else:
            batch = [row for row in self._ready if row["timestamp"] <= watermark]
            self._ready = [row for row in self._ready if row["timestamp"] > watermark]
        batch.sort(key=lambda row: row["timestamp"])
        return batch

    async def flush(self, *, everything: bool = False) -> None:
        batch = self.take_batch(everything=everything)
        if not batch:
            return
        try:
            await self._in_worker(self.writer.write, batch)
        except OSError as error:
            # A full or read-only disk must not take serving down: count, log, go on.
            self.write_errors += 1
            logger.warning("traffic recorder: %d lines lost: %s", len(batch), error)
            return
        self.recorded += len(batch)


def read_recording(directory: str | os.PathLike[str]) -> Trace:
    """Every trace file in a recorder folder as one trace, oldest run first.

    Runs (server restarts) are placed by their wall-clock start, so a gap between runs stays
    a gap. A torn last line (the machine died mid-write) is skipped with a TraceWarning.
    """
    segments = [s for s in list_segments(directory) if s.path.is_file()]
    if not segments:
        raise WorkloadError(
            f"{directory}: no recorded traffic (expected traffic-*.jsonl files from the "
            "server's recorder)"
        )
    first = segments[0].start_ms
    builder = TraceBuilder()
    skipped = 0
    for segment in segments:
        try:
            loaded = read_trace(segment.path, skip_invalid=True)
        except WorkloadError:
            continue  # an empty file (a run that recorded nothing)
        skipped += loaded.invalid
        trace = loaded.trace
        offset = float(segment.start_ms - first)
        builder.add_columns(
            trace.timestamps_ms + offset,
            trace.input_lengths,
            trace.output_lengths,
            trace.hash_ids,
            {
                "source_lang": trace.source_langs,  # type: ignore[dict-item]
                "target_lang": trace.target_langs,  # type: ignore[dict-item]
                "session_id": trace.session_ids,  # type: ignore[dict-item]
            },
            trace.latencies_ms,
        )
    if builder.n == 0:
        raise WorkloadError(f"{directory}: the recorder's files hold no requests yet")
    if skipped:
        warnings.warn(
            f"{directory}: skipped {skipped} unreadable line(s) in the recording",
            TraceWarning,
            stacklevel=2,
        )
    return builder.build(str(directory))
