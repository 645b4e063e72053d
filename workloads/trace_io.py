"""Reading and writing JSONL trace files; the format and the `Trace` are `workloads.trace`.

Loading is streaming, in chunks of lines parsed with orjson and checked a column at a time
straight into numpy arrays, so a million-line file never becomes a million pydantic objects.
A chunk with anything unusual in it is parsed again line by line (`json.loads` plus explicit
checks, `_parse_line`), which names the bad line. Both paths enforce exactly the rules of
`TraceRequest`, the per-line schema.
"""

from __future__ import annotations

import gc
import json
import math
import os
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain, islice, repeat
from types import NoneType
from typing import Any, BinaryIO

import numpy as np

from workloads.errors import TraceError, WorkloadError
from workloads.files import atomic_file
from workloads.trace import (
    _INT64_MAX,
    _INT64_MIN,
    _STRING_FIELDS,
    MAX_TOKENS,
    TRACE_FIELDS,
    HashIdColumn,
    Trace,
    TraceBuilder,
    TraceRequest,
)

try:
    import orjson
except ImportError:  # e.g. an offline GPU host's kit without it: every chunk goes line by line
    orjson = None  # type: ignore[assignment]

_ALLOWED = frozenset(TRACE_FIELDS)
_REQUIRED = frozenset(TRACE_FIELDS[:3])
# Editors on Windows (Notepad, Excel's "UTF-8" export) start a file with one; the CSV
# importers accept it too (`workloads.importers._open_lines`).
_UTF8_BOM = b"\xef\xbb\xbf"
# How many rejected lines a `TraceLoad` keeps verbatim (the count is always exact).
_KEPT_ERRORS = 20


class TraceWarning(UserWarning):
    """Something in a trace file was repaired or dropped while loading."""


@dataclass
class TraceLoad:
    """What loading a file produced: the trace plus what had to be dropped or repaired."""

    trace: Trace
    lines_read: int
    invalid: int = 0
    errors: list[TraceError] = field(default_factory=list)  # the first few rejected lines
    reordered: bool = False  # timestamps were not ascending in the file and were sorted

    def repairs(self, path: str | os.PathLike[str]) -> list[str]:
        """One line per repair, for a command to print ("PATH: timestamps were not ascending;
        requests sorted by timestamp"); none for a file read as it was."""
        lines = []
        if self.invalid:
            lines.append(f"{path}: skipped {self.invalid} invalid line(s); first: {self.errors[0]}")
        if self.reordered:
            lines.append(f"{path}: timestamps were not ascending; requests sorted by timestamp")
        return lines


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


def open_binary(
    path: str | os.PathLike[str], *, missing: str, expected: str, cannot: str
) -> BinaryIO:
    """`path` opened for reading bytes (bad UTF-8 is the caller's to report). A file that
    cannot be opened is a `WorkloadError` in the caller's words: "PATH: MISSING",
    "PATH: is a directory, expected EXPECTED", "PATH: CANNOT (reason)"."""
    try:
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    except FileNotFoundError:
        raise WorkloadError(f"{path}: {missing}") from None
    except IsADirectoryError:
        raise WorkloadError(f"{path}: is a directory, expected {expected}") from None
    except OSError as error:
        raise WorkloadError(f"{path}: {cannot} ({error.strerror})") from None


def read_trace(
    path: str | os.PathLike[str], *, skip_invalid: bool = False, chunk_lines: int = 1024
) -> TraceLoad:
    """Parse a JSONL trace in chunks of lines. Without `skip_invalid` a bad line raises
    (`TraceError`); a UTF-8 byte-order mark at the start of the file is ignored."""
    name = str(path)
    handle = open_binary(
        path,
        missing="no such trace file",
        expected="a JSONL trace file",
        cannot="cannot open trace file",
    )
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
            if lines_read == 0:
                chunk[0] = chunk[0].removeprefix(_UTF8_BOM)
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
