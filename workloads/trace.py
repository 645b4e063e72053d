"""The trace: one request per JSONL line, held in memory as numpy columns.

The file format follows Mooncake / vLLM `timed_trace` / AIPerf field names so that traces
move between those tools and this one:

    {"timestamp": 0.0, "input_length": 52, "output_length": 61, "source_lang": "en", ...}

`timestamp` is milliseconds from trace start. Loading is streaming, in chunks of lines
parsed with orjson and checked a column at a time straight into numpy arrays, so a
million-line file never becomes a million pydantic objects. A chunk with anything unusual
in it is parsed again line by line (`json.loads` plus explicit checks, `_parse_line`),
which names the bad line. `TraceRequest` is the per-line schema (and what iterating a
`Trace` yields); both paths enforce exactly the same rules.
"""

from __future__ import annotations

import gc
import json
import math
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain, islice, repeat
from types import NoneType
from typing import Any, overload

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from workloads.errors import TraceError, WorkloadError
from workloads.files import atomic_file

try:
    import orjson
except ImportError:  # e.g. an offline GPU host's kit without it: every chunk goes line by line
    orjson = None  # type: ignore[assignment]

# Token counts beyond this are certainly a unit mistake, and they keep int64 sums safe.
MAX_TOKENS = 2**31 - 1
TRACE_FIELDS = (
    "timestamp",
    "input_length",
    "output_length",
    "hash_ids",
    "source_lang",
    "target_lang",
    "session_id",
    "latency_ms",
)
_ALLOWED = frozenset(TRACE_FIELDS)
_REQUIRED = frozenset(TRACE_FIELDS[:3])
_STRING_FIELDS = ("source_lang", "target_lang", "session_id")
# How many rejected lines a `TraceLoad` keeps verbatim (the count is always exact).
_KEPT_ERRORS = 20


class TraceWarning(UserWarning):
    """Something in a trace file was repaired or dropped while loading."""


class TraceRequest(BaseModel):
    """One request of a trace (one JSONL line)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    timestamp: float = Field(ge=0, description="milliseconds from trace start")
    input_length: int = Field(ge=1, le=MAX_TOKENS, description="prompt tokens")
    output_length: int = Field(ge=1, le=MAX_TOKENS, description="generated tokens")
    hash_ids: list[int] | None = Field(
        default=None, description="prefix-sharing block ids (512-token blocks, Mooncake)"
    )
    source_lang: str | None = None
    target_lang: str | None = None
    session_id: str | None = None
    latency_ms: float | None = Field(default=None, ge=0, description="recorded end-to-end latency")

    @field_validator("timestamp", "latency_ms", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        if isinstance(value, bool) or isinstance(value, str):
            raise ValueError("must be a number")
        return value

    @field_validator("input_length", "output_length", mode="before")
    @classmethod
    def _token_count(cls, value: Any) -> Any:
        # bool and "12" would pass pydantic's lax int; the JSONL fast path rejects them too.
        if isinstance(value, bool) or isinstance(value, str):
            raise ValueError("must be an integer")
        return value

    @field_validator("hash_ids", mode="before")
    @classmethod
    def _block_ids(cls, value: Any) -> Any:
        if isinstance(value, list) and any(
            isinstance(v, bool) or not isinstance(v, int) or not _INT64_MIN <= v <= _INT64_MAX
            for v in value
        ):
            raise ValueError("must be a list of 64-bit integers")
        return value


_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


class HashIdColumn(Sequence):
    """Every request's `hash_ids` in two flat arrays (values + offsets), not a list per request.

    A Mooncake-style trace carries ~15 block ids per request; as Python lists a million
    requests would cost ~0.5 GB. Indexing gives back `list[int]` (or None where a request
    had no hash_ids), so it reads like `list[list[int] | None]`.
    """

    def __init__(self, values: np.ndarray, offsets: np.ndarray, present: np.ndarray) -> None:
        self.values = np.asarray(values, dtype=np.int64)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.present = np.asarray(present, dtype=bool)
        if len(self.offsets) != len(self.present) + 1:
            raise ValueError("offsets must have one entry more than present")

    @classmethod
    def from_lists(cls, rows: Iterable[Sequence[int] | None]) -> HashIdColumn:
        values: list[int] = []
        offsets = [0]
        present: list[bool] = []
        for row in rows:
            if row is not None:
                values.extend(row)
            offsets.append(len(values))
            present.append(row is not None)
        return cls(np.array(values, dtype=np.int64), np.array(offsets), np.array(present))

    @classmethod
    def concat(cls, columns: Sequence[HashIdColumn]) -> HashIdColumn:
        values, offsets, present = [], [np.zeros(1, dtype=np.int64)], []
        base = 0
        for column in columns:
            values.append(column.values)
            offsets.append(column.offsets[1:] + base)
            present.append(column.present)
            base += int(column.offsets[-1])
        return cls(
            np.concatenate(values) if values else np.zeros(0, dtype=np.int64),
            np.concatenate(offsets),
            np.concatenate(present) if present else np.zeros(0, dtype=bool),
        )

    def __len__(self) -> int:
        return len(self.present)

    @overload
    def __getitem__(self, index: int) -> list[int] | None: ...
    @overload
    def __getitem__(self, index: slice) -> HashIdColumn: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return self.take(np.arange(len(self))[index])
        if not self.present[index]:
            return None
        return self.values[self.offsets[index] : self.offsets[index + 1]].tolist()

    def take(self, indices: np.ndarray) -> HashIdColumn:
        indices = np.asarray(indices, dtype=np.int64)
        starts = self.offsets[:-1][indices]
        sizes = self.offsets[1:][indices] - starts
        offsets = np.zeros(len(indices) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        # Gather every block id of the chosen rows in one vectorised step.
        gather = np.repeat(starts - offsets[:-1], sizes) + np.arange(offsets[-1])
        return HashIdColumn(self.values[gather], offsets, self.present[indices])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"HashIdColumn({len(self)} rows, {len(self.values)} ids)"


class Trace:
    """A trace as columns, sorted by arrival time. Cheap to slice, subset and profile."""

    def __init__(
        self,
        timestamps_ms: Any,
        input_lengths: Any,
        output_lengths: Any,
        *,
        hash_ids: HashIdColumn | Sequence[Sequence[int] | None] | None = None,
        source_langs: Sequence[str | None] | None = None,
        target_langs: Sequence[str | None] | None = None,
        session_ids: Sequence[str | None] | None = None,
        latencies_ms: Any = None,
        source: str = "",
    ) -> None:
        self.timestamps_ms = np.asarray(timestamps_ms, dtype=np.float64)
        self.input_lengths = np.asarray(input_lengths, dtype=np.int64)
        self.output_lengths = np.asarray(output_lengths, dtype=np.int64)
        if hash_ids is not None and not isinstance(hash_ids, HashIdColumn):
            hash_ids = HashIdColumn.from_lists(hash_ids)
        self.hash_ids: HashIdColumn | None = hash_ids
        self.source_langs = None if source_langs is None else list(source_langs)
        self.target_langs = None if target_langs is None else list(target_langs)
        self.session_ids = None if session_ids is None else list(session_ids)
        self.latencies_ms = (
            None if latencies_ms is None else np.asarray(latencies_ms, dtype=np.float64)
        )
        self.source = source
        n = len(self.timestamps_ms)
        for name, column in self._columns().items():
            if len(column) != n:
                raise ValueError(f"column {name} has {len(column)} rows, timestamps have {n}")
        if n and not bool(np.all(np.diff(self.timestamps_ms) >= 0)):
            # Stable, so requests recorded at the same instant keep their file order.
            order = np.argsort(self.timestamps_ms, kind="stable")
            self._reorder(order)

    def _columns(self) -> dict[str, Any]:
        columns: dict[str, Any] = {
            "timestamps_ms": self.timestamps_ms,
            "input_lengths": self.input_lengths,
            "output_lengths": self.output_lengths,
        }
        for name in ("hash_ids", "source_langs", "target_langs", "session_ids", "latencies_ms"):
            value = getattr(self, name)
            if value is not None:
                columns[name] = value
        return columns

    def _reorder(self, order: np.ndarray) -> None:
        picked = self._take_columns(order)
        for name, value in picked.items():
            setattr(self, name, value)

    def _take_columns(self, indices: np.ndarray) -> dict[str, Any]:
        taken: dict[str, Any] = {}
        for name, column in self._columns().items():
            if isinstance(column, np.ndarray | HashIdColumn):
                taken[name] = (
                    column[indices] if isinstance(column, np.ndarray) else column.take(indices)
                )
            else:
                taken[name] = [column[i] for i in indices.tolist()]
        return taken

    def replace(self, *, timestamps_ms: Any = None, source: str | None = None) -> Trace:
        """A copy with new arrival times (re-sorted if needed) and/or a new source label."""
        columns = self._columns()
        if timestamps_ms is not None:
            columns["timestamps_ms"] = timestamps_ms
        return Trace(**columns, source=self.source if source is None else source)

    def __len__(self) -> int:
        return len(self.timestamps_ms)

    def __repr__(self) -> str:
        return f"Trace({len(self)} requests, {self.duration_s():.1f} s, source={self.source!r})"

    def duration_s(self) -> float:
        """Seconds from the first to the last arrival (0 for fewer than two requests)."""
        if len(self) < 2:
            return 0.0
        return float(self.timestamps_ms[-1] - self.timestamps_ms[0]) / 1000.0

    def request(self, i: int) -> TraceRequest:
        latency = None
        if self.latencies_ms is not None and not math.isnan(self.latencies_ms[i]):
            latency = float(self.latencies_ms[i])
        # Columns were validated on the way in: construct without re-validating.
        return TraceRequest.model_construct(
            timestamp=float(self.timestamps_ms[i]),
            input_length=int(self.input_lengths[i]),
            output_length=int(self.output_lengths[i]),
            hash_ids=None if self.hash_ids is None else self.hash_ids[i],
            source_lang=None if self.source_langs is None else self.source_langs[i],
            target_lang=None if self.target_langs is None else self.target_langs[i],
            session_id=None if self.session_ids is None else self.session_ids[i],
            latency_ms=latency,
        )

    def __iter__(self) -> Iterator[TraceRequest]:
        for i in range(len(self)):
            yield self.request(i)

    def subset(self, indices: Any) -> Trace:
        """The requests at `indices` (ints or a boolean mask), timestamps unchanged."""
        index_array = np.asarray(indices)
        if index_array.dtype == bool:
            index_array = np.flatnonzero(index_array)
        index_array = index_array.astype(np.int64, copy=False)
        return Trace(**self._take_columns(index_array), source=self.source)

    def slice_time(self, start_ms: float, end_ms: float) -> Trace:
        """Requests arriving in [start_ms, end_ms), re-based so `start_ms` becomes 0."""
        lo = int(np.searchsorted(self.timestamps_ms, start_ms, side="left"))
        hi = int(np.searchsorted(self.timestamps_ms, end_ms, side="left"))
        window = self.subset(np.arange(lo, hi))
        window.timestamps_ms = window.timestamps_ms - start_ms
        window.source = f"{self.source}[{start_ms / 1000:g}s:{end_ms / 1000:g}s]"
        return window

    def repeated(self, copies: int, period_ms: float) -> Trace:
        """The trace `copies` times end to end, copy k shifted by k * `period_ms`."""
        if copies < 1 or period_ms <= 0:
            raise ValueError(f"repeated({copies}, {period_ms}): need copies >= 1, period > 0")
        indices = np.tile(np.arange(len(self), dtype=np.int64), copies)
        columns = self._take_columns(indices)
        offsets = np.repeat(np.arange(copies, dtype=np.float64) * period_ms, len(self))
        columns["timestamps_ms"] = columns["timestamps_ms"] + offsets
        return Trace(**columns, source=self.source)

    def rebased(self) -> Trace:
        """A copy whose first request arrives at t=0."""
        if not len(self):
            return self.replace()
        return self.replace(timestamps_ms=self.timestamps_ms - self.timestamps_ms[0])

    @classmethod
    def from_requests(cls, requests: Iterable[TraceRequest], source: str = "") -> Trace:
        builder = TraceBuilder()
        builder.add_rows(
            [
                (
                    float(r.timestamp),
                    r.input_length,
                    r.output_length,
                    r.hash_ids,
                    r.source_lang,
                    r.target_lang,
                    r.session_id,
                    r.latency_ms,
                )
                for r in requests
            ]
        )
        return builder.build(source)


class TraceBuilder:
    """Collects validated rows chunk by chunk; optional columns appear on first use.

    Rows are tuples (timestamp_ms, input_length, output_length, hash_ids, source_lang,
    target_lang, session_id, latency_ms), as `parse_record` returns them.
    """

    def __init__(self) -> None:
        self.n = 0
        self.timestamps: list[np.ndarray] = []
        self.inputs: list[np.ndarray] = []
        self.outputs: list[np.ndarray] = []
        self.hash_chunks: list[HashIdColumn] | None = None
        self.strings: dict[str, list[str | None] | None] = dict.fromkeys(_STRING_FIELDS)
        self.latencies: list[np.ndarray] | None = None
        # Interning repeated strings (language codes, sessions) keeps 1M rows small.
        self.interned: dict[str | None, str | None] = {}

    def add_rows(self, rows: Sequence[tuple]) -> None:
        """Rows as `_parse_line` returns them."""
        if not rows:
            return
        ts, ins, outs, hashes, src, tgt, sess, lat = zip(*rows, strict=True)
        self.add_columns(
            np.array(ts, dtype=np.float64),
            np.array(ins, dtype=np.int64),
            np.array(outs, dtype=np.int64),
            None if hashes.count(None) == len(hashes) else HashIdColumn.from_lists(hashes),
            {"source_lang": list(src), "target_lang": list(tgt), "session_id": list(sess)},
            None if lat.count(None) == len(lat) else np.array(lat, dtype=np.float64),
        )

    def add_columns(
        self,
        timestamps: np.ndarray,
        inputs: np.ndarray,
        outputs: np.ndarray,
        hash_ids: HashIdColumn | None,
        strings: dict[str, list[str | None]],
        latencies: np.ndarray | None,
    ) -> None:
        """One chunk of validated columns; latencies NaN where unknown."""
        n, size = self.n, len(timestamps)
        self.timestamps.append(timestamps)
        self.inputs.append(inputs)
        self.outputs.append(outputs)
        if hash_ids is not None and self.hash_chunks is None:
            self.hash_chunks = [HashIdColumn.from_lists([None] * n)]
        if self.hash_chunks is not None:
            self.hash_chunks.append(hash_ids or HashIdColumn.from_lists([None] * size))
        for name in _STRING_FIELDS:
            values = strings.get(name)
            if values is not None and all(value is None for value in values):
                values = None
            column = self.strings[name]
            if values is not None and column is None:
                column = self.strings[name] = [None] * n
            if column is not None:
                if values is None:
                    column.extend([None] * size)
                else:
                    column.extend(map(self.interned.setdefault, values, values))
        if latencies is not None and self.latencies is None:
            self.latencies = [np.full(n, np.nan)]
        if self.latencies is not None:
            self.latencies.append(np.full(size, np.nan) if latencies is None else latencies)
        self.n = n + size

    def timestamps_ascending(self) -> bool:
        if not self.timestamps:
            return True
        return bool(np.all(np.diff(np.concatenate(self.timestamps)) >= 0))

    def build(self, source: str) -> Trace:
        def joined(chunks: list[np.ndarray], dtype: Any) -> np.ndarray:
            return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)

        return Trace(
            joined(self.timestamps, np.float64),
            joined(self.inputs, np.int64),
            joined(self.outputs, np.int64),
            hash_ids=None if self.hash_chunks is None else HashIdColumn.concat(self.hash_chunks),
            source_langs=self.strings["source_lang"],
            target_langs=self.strings["target_lang"],
            session_ids=self.strings["session_id"],
            latencies_ms=None if self.latencies is None else np.concatenate(self.latencies),
            source=source,
        )


@dataclass
class TraceLoad:
    """What loading a file produced: the trace plus what had to be dropped or repaired."""

    trace: Trace
    lines_read: int
    invalid: int = 0
    errors: list[TraceError] = field(default_factory=list)  # the first few rejected lines
    reordered: bool = False  # timestamps were not ascending in the file and were sorted


def _number(path: str, line: int, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError(path, line, name, value, "must be a number")
    try:
        number = float(value)
    except OverflowError:
        raise TraceError(path, line, name, value, "must be finite") from None
    if not math.isfinite(number):
        raise TraceError(path, line, name, value, "must be finite")
    if number < 0:
        raise TraceError(path, line, name, value, "must be >= 0")
    return number


def _token_count(path: str, line: int, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError(path, line, name, value, "must be an integer number of tokens")
    if isinstance(value, float):
        if not value.is_integer():
            raise TraceError(path, line, name, value, "must be an integer number of tokens")
        value = int(value)
    if value < 1:
        raise TraceError(path, line, name, value, "must be >= 1 token")
    if value > MAX_TOKENS:
        raise TraceError(path, line, name, value, f"must be <= {MAX_TOKENS} tokens")
    return value


def _parse_line(path: str, line: int, raw: bytes) -> tuple:
    """One JSONL line -> a row for `TraceBuilder.add_rows`; TraceError naming the field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(path, line, "-", raw[:40], "line is not UTF-8 text") from None
    try:
        record = json.loads(text)
    except (ValueError, RecursionError) as error:
        reason = str(error).split(":")[0] if isinstance(error, ValueError) else "nested too deep"
        raise TraceError(path, line, "-", text.strip(), f"not valid JSON ({reason})") from None
    return parse_record(path, line, record)


def parse_record(path: str, line: int, record: Any) -> tuple:
    """A decoded JSON value -> a row for `TraceBuilder.add_rows`, or TraceError naming the field."""
    if not isinstance(record, dict):
        raise TraceError(path, line, "-", record, "each line must be one JSON object")
    if not record.keys() <= _ALLOWED:
        unknown = sorted(set(record) - _ALLOWED)[0]
        raise TraceError(
            path,
            line,
            unknown,
            record[unknown],
            f"unknown field; allowed: {', '.join(TRACE_FIELDS)}",
        )
    for required in ("timestamp", "input_length", "output_length"):
        if required not in record:
            raise TraceError(path, line, required, None, "required field is missing")
    timestamp = _number(path, line, "timestamp", record["timestamp"])
    input_length = _token_count(path, line, "input_length", record["input_length"])
    output_length = _token_count(path, line, "output_length", record["output_length"])
    hash_ids = record.get("hash_ids")
    if hash_ids is not None:
        if not isinstance(hash_ids, list) or any(
            isinstance(v, bool) or not isinstance(v, int) or not _INT64_MIN <= v <= _INT64_MAX
            for v in hash_ids
        ):
            raise TraceError(path, line, "hash_ids", hash_ids, "must be a list of 64-bit integers")
    strings = []
    for name in _STRING_FIELDS:
        value = record.get(name)
        if value is not None and not isinstance(value, str):
            raise TraceError(path, line, name, value, "must be a string")
        strings.append(value)
    latency = record.get("latency_ms")
    if latency is not None:
        latency = _number(path, line, "latency_ms", latency)
    return (timestamp, input_length, output_length, hash_ids, *strings, latency)


_NUMBER_TYPES = frozenset({int, float})


def _parse_chunk(lines: list[bytes]) -> tuple | None:
    """Fast path: parse a chunk of non-blank lines with orjson and check them as columns.

    Returns the columns as `TraceBuilder.add_columns` takes them, or None when anything is
    unusual; the caller then parses the chunk line by line with `_parse_line`, which finds
    and names the bad line. What this accepts loads exactly as `_parse_line` would load it.

    orjson is stricter than `json` (no NaN/Infinity, no lone surrogates, no nesting past
    1024: such chunks fall back) and gives the same values where both accept, except that
    an integer beyond 64 bits comes back as a float of the same value: fine for a
    timestamp or latency, and a float where a count or block id belongs falls back.
    """
    if orjson is None:
        return None
    try:
        records = list(map(orjson.loads, lines))
    except orjson.JSONDecodeError:
        return None
    if set(map(type, records)) != {dict}:
        return None
    keys = set().union(*records)
    if not _REQUIRED <= keys <= _ALLOWED:
        return None
    # A missing field reads as None: the required fields' type checks turn it away.
    columns = {name: list(map(dict.get, records, repeat(name))) for name in keys}
    types = {name: set(map(type, values)) for name, values in columns.items()}
    if not types["timestamp"] <= _NUMBER_TYPES:
        return None
    if types["input_length"] != {int} or types["output_length"] != {int}:
        return None
    try:
        timestamps = np.array(columns["timestamp"], dtype=np.float64)
        inputs = np.array(columns["input_length"], dtype=np.int64)
        outputs = np.array(columns["output_length"], dtype=np.int64)
    except OverflowError:
        return None
    if not (np.all(np.isfinite(timestamps)) and np.all(timestamps >= 0)):
        return None
    if not (np.all(inputs >= 1) and np.all(inputs <= MAX_TOKENS)):
        return None
    if not (np.all(outputs >= 1) and np.all(outputs <= MAX_TOKENS)):
        return None
    # An optional field that is null (or absent) on every line is no column, as in
    # `TraceBuilder.add_rows`.
    optional = {name for name in keys - _REQUIRED if types[name] != {NoneType}}
    hash_ids = None
    if "hash_ids" in optional:
        if not types["hash_ids"] <= {list, NoneType}:
            return None
        hash_ids = _hash_id_chunk(columns["hash_ids"], NoneType in types["hash_ids"])
        if hash_ids is None:
            return None
    strings: dict[str, list[str | None]] = {}
    for name in _STRING_FIELDS:
        if name in optional:
            if not types[name] <= {str, NoneType}:
                return None
            strings[name] = columns[name]
    latencies = None
    if "latency_ms" in optional:
        if not types["latency_ms"] <= {int, float, NoneType}:
            return None
        try:
            # None -> NaN (unknown). orjson reads no NaN, so every NaN here was a None.
            latencies = np.array(columns["latency_ms"], dtype=np.float64)
        except OverflowError:
            return None
        known = latencies[~np.isnan(latencies)]
        if not (np.all(np.isfinite(known)) and np.all(known >= 0)):
            return None
    return timestamps, inputs, outputs, hash_ids, strings, latencies


def _hash_id_chunk(rows: list[list[Any] | None], some_absent: bool) -> HashIdColumn | None:
    """The `hash_ids` of a chunk as a column, or None unless all are 64-bit integers."""
    present = np.ones(len(rows), dtype=bool)
    if some_absent:
        present[:] = [row is not None for row in rows]
        rows = [row or [] for row in rows]
    ids = list(chain.from_iterable(rows))
    if ids and set(map(type, ids)) != {int}:
        return None
    try:
        values = np.array(ids, dtype=np.int64)
    except OverflowError:
        return None
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, rows), dtype=np.int64, count=len(rows)), out=offsets[1:])
    return HashIdColumn(values, offsets, present)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the (process-wide) cyclic garbage collector while loading.

    Parsing allocates millions of short-lived dicts and lists, which keeps triggering full
    collections that walk every live object, the columns built so far included: their cost
    grows with the file (about 40% of the loading time at 1M lines). Reference counting
    frees what the loader drops; the collector catches up once loading ends.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def read_trace(
    path: str | os.PathLike[str], *, skip_invalid: bool = False, chunk_lines: int = 1024
) -> TraceLoad:
    """Parse a JSONL trace in chunks of lines. Without `skip_invalid` a bad line raises."""
    name = str(path)
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below; bytes so bad UTF-8 is ours to report
    except FileNotFoundError:
        raise WorkloadError(f"{name}: no such trace file") from None
    except IsADirectoryError:
        raise WorkloadError(f"{name}: is a directory, expected a JSONL trace file") from None
    except OSError as error:
        raise WorkloadError(f"{name}: cannot open trace file ({error.strerror})") from None
    builder = TraceBuilder()
    invalid = 0
    errors: list[TraceError] = []
    lines_read = 0

    def flush(first_number: int, chunk: list[bytes]) -> None:
        nonlocal invalid
        if not chunk[-1].endswith(b"\n"):
            chunk[-1] += b"\n"  # the file's last line: messages show it like the others
        lines = [line for line in chunk if not line.isspace()]
        if not lines:
            return
        columns = _parse_chunk(lines)
        if columns is not None:
            builder.add_columns(*columns)
            return
        rows = []
        for number, raw in enumerate(chunk, start=first_number):
            if raw.isspace():
                continue
            try:
                rows.append(_parse_line(name, number, raw))
            except TraceError as error:
                if not skip_invalid:
                    raise
                invalid += 1
                if len(errors) < _KEPT_ERRORS:
                    errors.append(error)
        builder.add_rows(rows)

    with handle, _gc_paused():
        while chunk := list(islice(handle, chunk_lines)):
            flush(lines_read + 1, chunk)
            lines_read += len(chunk)
    if builder.n == 0:
        if invalid:
            raise WorkloadError(
                f"{name}: all {invalid} non-empty lines are invalid; first: {errors[0]}"
            )
        raise WorkloadError(
            f"{name}: no requests (expected one JSON object per line with timestamp, "
            "input_length, output_length)"
        )
    reordered = not builder.timestamps_ascending()
    return TraceLoad(builder.build(name), lines_read, invalid, errors, reordered)


def load_trace(path: str | os.PathLike[str], *, skip_invalid: bool = False) -> Trace:
    """Load a JSONL trace. Repairs (sorting, dropped lines) are reported as `TraceWarning`."""
    loaded = read_trace(path, skip_invalid=skip_invalid)
    if loaded.invalid:
        warnings.warn(
            f"{path}: skipped {loaded.invalid} invalid line(s); first: {loaded.errors[0]}",
            TraceWarning,
            stacklevel=2,
        )
    if loaded.reordered:
        warnings.warn(
            f"{path}: timestamps were not in ascending order; requests were sorted by timestamp",
            TraceWarning,
            stacklevel=2,
        )
    return loaded.trace


def _request_line(request: TraceRequest) -> str:
    row = request.model_dump(exclude_none=True)
    row["timestamp"] = round(row["timestamp"], 3)
    return json.dumps(row, separators=(",", ":"))


def write_trace(
    path: str | os.PathLike[str], trace_or_requests: Trace | Iterable[TraceRequest]
) -> None:
    """Write JSONL atomically (temp file in the same folder, then `os.replace`); timestamps
    are written to microsecond precision."""
    with atomic_file(path, shared=True) as out:  # a trace is an ordinary shared file
        if isinstance(trace_or_requests, Trace):
            _write_columns(out, trace_or_requests)
        else:
            for request in trace_or_requests:
                out.write(_request_line(request))
                out.write("\n")


def _write_columns(out: Any, trace: Trace) -> None:
    # Straight from the columns: building TraceRequests for 1M rows would dominate the time.
    # Microsecond precision: exact enough for replay, and it keeps lines short.
    timestamps = np.round(trace.timestamps_ms, 3).tolist()
    inputs = trace.input_lengths.tolist()
    outputs = trace.output_lengths.tolist()
    latencies = None if trace.latencies_ms is None else trace.latencies_ms.tolist()
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    for i in range(len(trace)):
        row: dict[str, Any] = {
            "timestamp": timestamps[i],
            "input_length": inputs[i],
            "output_length": outputs[i],
        }
        if trace.hash_ids is not None:
            ids = trace.hash_ids[i]
            if ids is not None:
                row["hash_ids"] = ids
        for name, column in (
            ("source_lang", trace.source_langs),
            ("target_lang", trace.target_langs),
            ("session_id", trace.session_ids),
        ):
            if column is not None and column[i] is not None:
                row[name] = column[i]
        if latencies is not None and not math.isnan(latencies[i]):
            row["latency_ms"] = latencies[i]
        out.write(dumps(row))
        out.write("\n")
