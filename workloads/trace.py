"""The trace: one request per JSONL line, held in memory as numpy columns.

The file format follows Mooncake / vLLM `timed_trace` / AIPerf field names so that traces
move between those tools and this one:

    {"timestamp": 0.0, "input_length": 52, "output_length": 61, "source_lang": "en", ...}

`timestamp` is milliseconds from trace start. `TraceRequest` is the per-line schema (and
what iterating a `Trace` yields); reading and writing the files is `workloads.trace_io`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

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
_STRING_FIELDS = ("source_lang", "target_lang", "session_id")


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

    @field_validator("timestamp", "latency_ms", "input_length", "output_length", mode="before")
    @classmethod
    def _strict_number(cls, value: Any, info: ValidationInfo) -> Any:
        # bool and "12" would pass pydantic's lax float/int; the JSONL fast path rejects them too.
        if isinstance(value, bool | str):
            counts = info.field_name in ("input_length", "output_length")
            raise ValueError("must be an integer" if counts else "must be a number")
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
