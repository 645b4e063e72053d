"""Importers of public trace formats into our `Trace`.

- Azure LLM inference trace 2023/2024 CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`,
  TIMESTAMP an absolute datetime (`2023-11-16 18:15:46.6805900`, 7 fractional digits,
  optional UTC offset).
- BurstGPT CSV: `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`,
  Timestamp in seconds. Rows with 0 response tokens are failed requests: dropped, counted.
- Mooncake JSONL: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`; other keys
  of the Mooncake files are ignored.

Every importer streams its file row by row and re-bases time so that the first imported
request arrives at t=0. A bad row raises `TraceError` naming file, line and column; with
`skip_invalid=True` it is dropped and counted in the `ImportResult`.
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, Literal

import numpy as np

from workloads.errors import TraceError, WorkloadError
from workloads.trace import MAX_TOKENS, Trace, TraceBuilder
from workloads.trace_io import open_binary, parse_record

TraceFormat = Literal["azure", "burstgpt", "mooncake"]
FORMATS: tuple[TraceFormat, ...] = ("azure", "burstgpt", "mooncake")

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens")
_MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_AZURE_TIME = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"(Z|[+-]\d{2}:?\d{2})?$"
)
_KEPT_ERRORS = 20
_ROWS_PER_CHUNK = 8192


@dataclass
class ImportResult:
    """The imported trace and an account of every row that did not make it in."""

    trace: Trace
    rows_read: int
    failed_dropped: int = 0  # BurstGPT rows with 0 response tokens (failed requests)
    filtered_out: int = 0  # rows of other models (BurstGPT --model)
    invalid: int = 0  # rows skipped by skip_invalid
    errors: list[TraceError] = field(default_factory=list)  # the first few skipped rows
    reordered: bool = False  # rows were not in time order in the file (sorted on import)

    def summary(self) -> str:
        parts = [f"{len(self.trace)} requests imported from {self.rows_read} rows"]
        if self.failed_dropped:
            parts.append(f"{self.failed_dropped} failed requests (0 response tokens) dropped")
        if self.filtered_out:
            parts.append(f"{self.filtered_out} rows of other models left out")
        if self.reordered:
            parts.append("rows were not in time order and were sorted")
        if self.invalid:
            parts.append(f"{self.invalid} invalid rows skipped (first: {self.errors[0]})")
        return "; ".join(parts)


class _Rows:
    """Shared bookkeeping: rows in chunks, invalid rows raised or counted."""

    def __init__(self, path: str, skip_invalid: bool) -> None:
        self.path = path
        self.skip_invalid = skip_invalid
        self.builder = TraceBuilder()
        self.pending: list[tuple] = []
        self.invalid = 0
        self.errors: list[TraceError] = []

    def add(self, row: tuple) -> None:
        self.pending.append(row)
        if len(self.pending) >= _ROWS_PER_CHUNK:
            self.builder.add_rows(self.pending)
            self.pending = []

    def reject(self, error: TraceError) -> None:
        if not self.skip_invalid:
            raise error
        self.invalid += 1
        if len(self.errors) < _KEPT_ERRORS:
            self.errors.append(error)

    def finish(self, rows_read: int, **counts: int) -> ImportResult:
        self.builder.add_rows(self.pending)
        self.pending = []
        if self.builder.n == 0:
            detail = f"; first invalid row: {self.errors[0]}" if self.errors else ""
            raise WorkloadError(f"{self.path}: no requests could be imported{detail}")
        reordered = not self.builder.timestamps_ascending()
        trace = self.builder.build(self.path).rebased()
        return ImportResult(
            trace,
            rows_read,
            invalid=self.invalid,
            errors=self.errors,
            reordered=reordered,
            **counts,
        )


def _open_lines(path: str, rows: _Rows) -> Iterator[tuple[int, str]]:
    """(line number, text) per physical line; undecodable lines are rejected, not fatal."""
    with open_binary(
        path, missing="no such file", expected="a trace file", cannot="cannot open"
    ) as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError:
                rows.reject(TraceError(path, number, "-", raw[:40], "line is not UTF-8 text"))
                continue
            yield number, text


def _csv_rows(
    path: str, rows: _Rows, required: tuple[str, ...]
) -> Iterator[tuple[int, dict[str, str]]]:
    """CSV rows as {column: text}, with the line number each row starts on."""
    numbered = _open_lines(path, rows)
    current = [0]

    def lines() -> Iterator[str]:
        for number, text in numbered:
            current[0] = number
            if "\x00" in text:
                rows.reject(TraceError(path, number, "-", text.strip(), "line holds a NUL byte"))
                continue
            yield text

    reader = csv.reader(lines())
    header: list[str] | None = None
    while True:
        try:
            values = next(reader)
        except StopIteration:
            break
        except csv.Error as error:
            rows.reject(TraceError(path, current[0], "-", "", f"malformed CSV ({error})"))
            continue
        if not values or all(not v.strip() for v in values):
            continue
        if header is None:
            header = [v.strip() for v in values]
            lookup = {name.lower(): name for name in header}
            missing = [c for c in required if c.lower() not in lookup]
            if missing:
                raise TraceError(
                    path,
                    current[0],
                    "header",
                    ",".join(header),
                    f"missing column(s) {', '.join(missing)}; expected {','.join(required)}",
                )
            # Refer to columns by their spelling in the file, matched case-insensitively.
            canonical = {lookup[c.lower()]: c for c in required}
            continue
        if len(values) != len(header):
            rows.reject(
                TraceError(
                    path,
                    current[0],
                    "-",
                    ",".join(values),
                    f"expected {len(header)} columns ({','.join(header)}), got {len(values)}",
                )
            )
            continue
        yield (
            current[0],
            {canonical.get(h, h): v.strip() for h, v in zip(header, values, strict=True)},
        )
    if header is None:
        raise WorkloadError(f"{path}: empty file, expected a CSV header {','.join(required)}")


def _tokens(path: str, line: int, column: str, text: str, *, minimum: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        try:
            number = float(text)
        except ValueError:
            raise TraceError(path, line, column, text, "must be an integer token count") from None
        if not number.is_integer():
            raise TraceError(path, line, column, text, "must be an integer token count") from None
        value = int(number)
    if value < minimum:
        raise TraceError(path, line, column, text, f"must be >= {minimum}")
    if value > MAX_TOKENS:
        raise TraceError(path, line, column, text, f"must be <= {MAX_TOKENS}")
    return value


def _azure_time_ns(path: str, line: int, text: str) -> int:
    match = _AZURE_TIME.match(text)
    if match is None:
        raise TraceError(
            path, line, "TIMESTAMP", text, "expected a datetime like 2023-11-16 18:15:46.6805900"
        )
    year, month, day, hour, minute, second, fraction, zone = match.groups()
    tz = UTC
    if zone and zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        digits = zone[1:].replace(":", "")
        offset = timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
        tz = timezone(sign * offset)
    try:
        moment = datetime(
            int(year), int(month), int(day), int(hour), int(minute), int(second), tzinfo=tz
        )
    except ValueError as error:
        raise TraceError(path, line, "TIMESTAMP", text, f"not a valid date ({error})") from None
    nanos = int((fraction or "0").ljust(9, "0"))
    return int(moment.timestamp()) * 1_000_000_000 + nanos


def import_azure(path: str | os.PathLike[str], *, skip_invalid: bool = False) -> ImportResult:
    """Azure LLM inference trace (2023 or 2024) -> Trace, ms from the first request."""
    name = str(path)
    rows = _Rows(name, skip_invalid)
    first_ns: int | None = None
    rows_read = 0
    for line, row in _csv_rows(name, rows, _AZURE_COLUMNS):
        rows_read += 1
        try:
            time_ns = _azure_time_ns(name, line, row["TIMESTAMP"])
            input_length = _tokens(name, line, "ContextTokens", row["ContextTokens"])
            output_length = _tokens(name, line, "GeneratedTokens", row["GeneratedTokens"])
        except TraceError as error:
            rows.reject(error)
            continue
        if first_ns is None:
            first_ns = time_ns
        # Subtract in integers first: float seconds since 1970 would lose the 7th digit.
        offset_ms = (time_ns - first_ns) / 1e6
        rows.add((offset_ms, input_length, output_length, None, None, None, None, None))
    return rows.finish(rows_read)


def import_burstgpt(
    path: str | os.PathLike[str], *, model: str | None = None, skip_invalid: bool = False
) -> ImportResult:
    """BurstGPT CSV -> Trace. Failed requests (0 response tokens) are dropped and counted."""
    name = str(path)
    rows = _Rows(name, skip_invalid)
    rows_read = failed = filtered = 0
    for line, row in _csv_rows(name, rows, _BURSTGPT_COLUMNS):
        rows_read += 1
        try:
            text = row["Timestamp"]
            try:
                seconds = float(text)
            except ValueError:
                raise TraceError(
                    name, line, "Timestamp", text, "must be seconds (a number)"
                ) from None
            if not np.isfinite(seconds) or seconds < 0:
                raise TraceError(name, line, "Timestamp", text, "must be finite and >= 0")
            if model is not None and row["Model"] != model:
                filtered += 1
                continue
            input_length = _tokens(name, line, "Request tokens", row["Request tokens"])
            output_length = _tokens(
                name, line, "Response tokens", row["Response tokens"], minimum=0
            )
        except TraceError as error:
            rows.reject(error)
            continue
        if output_length == 0:
            failed += 1
            continue
        rows.add((seconds * 1000.0, input_length, output_length, None, None, None, None, None))
    if rows_read and filtered == rows_read and model is not None:
        raise WorkloadError(f"{name}: no rows for model {model!r} (the Model column differs)")
    return rows.finish(rows_read, failed_dropped=failed, filtered_out=filtered)


def import_mooncake(path: str | os.PathLike[str], *, skip_invalid: bool = False) -> ImportResult:
    """Mooncake JSONL -> Trace (hash_ids kept for prefix-sharing analysis)."""
    name = str(path)
    rows = _Rows(name, skip_invalid)
    rows_read = 0
    for line, text in _open_lines(name, rows):
        if not text.strip():
            continue
        rows_read += 1
        try:
            try:
                record: Any = json.loads(text)
            except (ValueError, RecursionError):
                raise TraceError(name, line, "-", text.strip(), "not valid JSON") from None
            if isinstance(record, dict):
                record = {k: record[k] for k in _MOONCAKE_FIELDS if k in record}
            rows.add(parse_record(name, line, record))
        except TraceError as error:
            rows.reject(error)
    return rows.finish(rows_read)


def importer(fmt: str) -> Callable[..., ImportResult]:
    """The import function for a format name (`azure`, `burstgpt`, `mooncake`)."""
    match fmt:
        case "azure":
            return import_azure
        case "burstgpt":
            return import_burstgpt
        case "mooncake":
            return import_mooncake
    raise WorkloadError(f"unknown trace format {fmt!r}; expected one of {', '.join(FORMATS)}")
