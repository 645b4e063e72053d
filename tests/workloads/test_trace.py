"""The JSONL trace format: loading, validation messages, repairs, writing."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workloads import trace_io
from workloads.errors import TraceError, WorkloadError
from workloads.trace import Trace, TraceRequest
from workloads.trace_io import TraceWarning, load_trace, read_trace, write_trace


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_loads_fields_and_optional_columns(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "t.jsonl",
        [
            '{"timestamp": 1500, "input_length": 20, "output_length": 30, "source_lang": "en", '
            '"target_lang": "de", "session_id": "a"}',
            '{"output_length": 5, "input_length": 7, "timestamp": 2500.5, "hash_ids": [1, 2]}',
            '{"timestamp": 3000, "input_length": 9, "output_length": 1, "latency_ms": 120.5}',
        ],
    )
    trace = load_trace(path)
    assert len(trace) == 3
    # The first request need not arrive at 0: times are kept as recorded.
    assert trace.timestamps_ms.tolist() == [1500.0, 2500.5, 3000.0]
    assert trace.input_lengths.tolist() == [20, 7, 9]
    assert trace.output_lengths.tolist() == [30, 5, 1]
    assert trace.source_langs == ["en", None, None]
    assert trace.hash_ids is not None and list(trace.hash_ids) == [None, [1, 2], None]
    assert trace.latencies_ms is not None and np.isnan(trace.latencies_ms[0])
    assert trace.latencies_ms[2] == 120.5
    assert trace.duration_s() == 1.5
    assert trace.request(1) == TraceRequest(
        timestamp=2500.5, input_length=7, output_length=5, hash_ids=[1, 2]
    )
    assert trace.source_langs is not None
    # No line had target_lang in lines 2-3, but line 1 did: the column exists with None.
    assert trace.target_langs == ["de", None, None]
    assert trace.session_ids == ["a", None, None]


@pytest.mark.parametrize(
    ("line", "field", "reason"),
    [
        ('{"timestamp": 0, "input_length": 0, "output_length": 3}', "input_length", ">= 1"),
        ('{"timestamp": -1, "input_length": 2, "output_length": 3}', "timestamp", ">= 0"),
        ('{"timestamp": 0, "input_length": 2.5, "output_length": 3}', "input_length", "integer"),
        ('{"timestamp": 0, "input_length": "12", "output_length": 3}', "input_length", "integer"),
        ('{"timestamp": 0, "input_length": true, "output_length": 3}', "input_length", "integer"),
        ('{"timestamp": NaN, "input_length": 2, "output_length": 3}', "timestamp", "finite"),
        ('{"timestamp": 0, "input_length": 2}', "output_length", "missing"),
        (
            '{"timestamp": 0, "input_length": 2, "output_length": 3, "prompt": "x"}',
            "prompt",
            "unknown",
        ),
        (
            '{"timestamp": 0, "input_length": 2, "output_length": 3, "hash_ids": [1, "a"]}',
            "hash_ids",
            "integers",
        ),
        (
            '{"timestamp": 0, "input_length": 2, "output_length": 3, "source_lang": 5}',
            "source_lang",
            "string",
        ),
        ('{"timestamp": 0, "input_length": 2, "output_length": 3', "-", "not valid JSON"),
        ("[1, 2, 3]", "-", "JSON object"),
    ],
)
def test_bad_line_names_file_line_field_and_value(
    tmp_path: Path, line: str, field: str, reason: str
) -> None:
    good = '{"timestamp": 0, "input_length": 2, "output_length": 3}'
    path = write_lines(tmp_path / "bad.jsonl", [good, good, line, good])
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    error = caught.value
    assert (error.path, error.line, error.field) == (str(path), 3, field)
    assert reason in error.reason
    assert str(error).startswith(f"{path}:3: field '{field}' = ")


def test_skip_invalid_drops_bad_lines_and_reports_the_count(tmp_path: Path) -> None:
    good = '{"timestamp": %d, "input_length": 2, "output_length": 3}'
    path = write_lines(
        tmp_path / "t.jsonl",
        [
            good % 0,
            "not json",
            good % 10,
            '{"timestamp": 20, "input_length": 0, "output_length": 1}',
        ],
    )
    loaded = read_trace(path, skip_invalid=True)
    assert len(loaded.trace) == 2
    assert loaded.invalid == 2
    assert [e.line for e in loaded.errors] == [2, 4]
    with pytest.warns(TraceWarning, match="skipped 2 invalid line"):
        load_trace(path, skip_invalid=True)


def test_unsorted_timestamps_are_sorted_with_a_warning(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "t.jsonl",
        [
            '{"timestamp": 30, "input_length": 3, "output_length": 1}',
            '{"timestamp": 10, "input_length": 1, "output_length": 1}',
            '{"timestamp": 20, "input_length": 2, "output_length": 1}',
        ],
    )
    with pytest.warns(TraceWarning, match="not in ascending order"):
        trace = load_trace(path)
    assert trace.timestamps_ms.tolist() == [10, 20, 30]
    # Rows move with their timestamps.
    assert trace.input_lengths.tolist() == [1, 2, 3]


def test_empty_and_missing_files_give_clear_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(WorkloadError, match="no requests"):
        load_trace(empty)
    with pytest.raises(WorkloadError, match="no such trace file"):
        load_trace(tmp_path / "absent.jsonl")
    only_bad = write_lines(tmp_path / "bad.jsonl", ["{}", "{}"])
    with pytest.raises(WorkloadError, match="all 2 non-empty lines are invalid"):
        load_trace(only_bad, skip_invalid=True)


def test_line_straddling_objects_cannot_sneak_through_the_fast_path(tmp_path: Path) -> None:
    # Joined, lines 1-2 would read as one valid object and line 3 as two: the loader must
    # still judge each line on its own.
    path = write_lines(
        tmp_path / "t.jsonl",
        [
            '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1',
            "2]}",
            '{"timestamp": 1, "input_length": 1, "output_length": 1},'
            '{"timestamp": 2, "input_length": 1, "output_length": 1}',
        ],
    )
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    assert caught.value.line == 1


def test_write_is_atomic_and_round_trips(tmp_path: Path) -> None:
    requests = [
        TraceRequest(timestamp=0, input_length=10, output_length=20, source_lang="en"),
        TraceRequest(timestamp=12.5, input_length=11, output_length=21, hash_ids=[3, 4]),
    ]
    path = tmp_path / "out" / "t.jsonl"
    write_trace(path, requests)
    assert [p.name for p in path.parent.iterdir()] == ["t.jsonl"]  # no temp file left
    assert list(load_trace(path)) == requests
    # Writing a Trace (the columnar path) gives the same file.
    again = tmp_path / "again.jsonl"
    write_trace(again, Trace.from_requests(requests))
    assert again.read_text() == path.read_text()
    assert json.loads(path.read_text().splitlines()[0]) == {
        "timestamp": 0.0,
        "input_length": 10,
        "output_length": 20,
        "source_lang": "en",
    }


def test_slice_subset_and_rebase() -> None:
    trace = Trace(
        [1000.0, 2000.0, 3000.0, 4000.0],
        [1, 2, 3, 4],
        [5, 6, 7, 8],
        session_ids=["a", "b", "c", "d"],
        hash_ids=[[1], None, [2, 3], [4]],
    )
    window = trace.slice_time(1500, 3500)
    assert window.timestamps_ms.tolist() == [500.0, 1500.0]
    assert window.session_ids == ["b", "c"]
    assert window.hash_ids is not None and list(window.hash_ids) == [None, [2, 3]]
    picked = trace.subset([3, 0])
    assert picked.timestamps_ms.tolist() == [1000.0, 4000.0]  # kept in time order
    assert picked.hash_ids is not None and list(picked.hash_ids) == [[1], [4]]
    assert trace.rebased().timestamps_ms.tolist() == [0.0, 1000.0, 2000.0, 3000.0]


requests_strategy = st.builds(
    TraceRequest,
    timestamp=st.floats(min_value=0, max_value=1e9, allow_nan=False).map(lambda x: round(x, 3)),
    input_length=st.integers(1, 2**31 - 1),
    output_length=st.integers(1, 2**31 - 1),
    hash_ids=st.none() | st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5),
    source_lang=st.none() | st.text(max_size=5),
    target_lang=st.none() | st.sampled_from(["en", "de"]),
    session_id=st.none() | st.text(max_size=8),
    latency_ms=st.none() | st.floats(min_value=0, max_value=1e7, allow_nan=False),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests=st.lists(requests_strategy, min_size=1, max_size=20))
def test_valid_requests_round_trip(tmp_path: Path, requests: list[TraceRequest]) -> None:
    path = tmp_path / "rt.jsonl"
    write_trace(path, requests)
    expected = sorted(requests, key=lambda r: r.timestamp)  # stable, like the loader
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        fast = load_trace(path)
        # One line per chunk forces the line-by-line parser; both must agree.
        slow = read_trace(path, chunk_lines=1).trace
    assert list(fast) == expected
    assert list(slow) == expected


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.binary(max_size=400)
    | st.lists(
        st.text(max_size=60)
        | st.sampled_from(
            [
                '{"timestamp": 0, "input_length": 1, "output_length": 1}',
                '{"timestamp": 1e400, "input_length": 1, "output_length": 1}',
                '{"timestamp": 0, "input_length": 99999999999999999999999, "output_length": 1}',
                '{"timestamp": 0, "input_length": 1, "output_length": 1, "latency_ms": -1}',
                "[" * 5000,
                "\x00",
            ]
        ),
        max_size=8,
    ).map(lambda lines: "\n".join(lines).encode("utf-8", "surrogatepass")),
    skip=st.booleans(),
)
def test_arbitrary_input_raises_only_workload_errors(
    tmp_path: Path, reliability, data: bytes, skip: bool
) -> None:
    reliability.start(
        "Trace loader (JSONL): arbitrary bytes",
        group="Bad input",
        injected=(
            "hypothesis: arbitrary bytes, and mixes of good, huge, nested, NUL and non-JSON lines, "
            "loaded with and without --skip-invalid"
        ),
    )
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(data)
    reliability.count("arbitrary files loaded")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        try:
            trace = load_trace(path, skip_invalid=skip)
        except TraceError as error:
            assert_names_file_line_field(error, path, data)
            reliability.count("refused naming file, line and field")
            reliability.held(ARBITRARY_HELD)
            return
        except WorkloadError as error:
            assert str(path) in str(error) and "\n" not in str(error)
            reliability.count("refused as a whole file (empty, all lines invalid)")
            reliability.held(ARBITRARY_HELD)
            return
    reliability.count("loaded (valid lines)")
    # Whatever loaded is valid: lengths >= 1, times finite and sorted.
    assert len(trace) >= 1
    assert np.all(trace.input_lengths >= 1) and np.all(trace.output_lengths >= 1)
    assert np.all(np.isfinite(trace.timestamps_ms)) and np.all(np.diff(trace.timestamps_ms) >= 0)
    reliability.held(ARBITRARY_HELD)


ARBITRARY_HELD = (
    "arbitrary input raised nothing but WorkloadError: a bad line names the file, an existing "
    "line and the field in one line; a whole-file problem names the file; what loads is valid"
)


def assert_names_file_line_field(error: TraceError, path: Path, data: bytes) -> None:
    """The one-line message a user gets: `{path}:{line}: field '{field}' = ...`, for a line
    that exists in the file."""
    assert error.path == str(path)
    assert 1 <= error.line <= data.count(b"\n") + 1
    assert error.field
    assert str(error).startswith(f"{path}:{error.line}: field '{error.field}' = ")
    assert "\n" not in str(error)


GOOD_VALUES = {
    "timestamp": "1000",
    "input_length": "20",
    "output_length": "7",
    "hash_ids": "[1, 2]",
    "source_lang": '"en"',
    "latency_ms": "12.5",
}
BAD_VALUES = {
    "timestamp": ['"soon"', "-1", "null", "1e999", "true", "[]", "{}"],
    "input_length": ['"12"', "0", "-4", "1.5", "null", "false", "1e999", str(2**40)],
    "output_length": ['"7"', "0", "-1", "2.5", "null", "true", "[7]", str(2**40)],
    "hash_ids": ['"abc"', '[1, "x"]', "[true]", "[1e3]", "{}", str([2**64])],
    "source_lang": ["5", "[]", "{}", "true"],
    "latency_ms": ["-3", '"fast"', "1e999", "[]"],
}


def jsonl_line(values: dict[str, str]) -> str:
    return "{" + ", ".join(f'"{name}": {value}' for name, value in values.items()) + "}"


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.integers(1, 12),
    data=st.data(),
    field=st.sampled_from(sorted(BAD_VALUES)),
    missing=st.booleans(),
)
def test_one_bad_value_is_reported_with_its_file_line_and_field(
    tmp_path: Path, reliability, rows: int, data: st.DataObject, field: str, missing: bool
) -> None:
    reliability.start(
        "Trace loader (JSONL): one bad value in a valid trace",
        group="Bad input",
        injected=(
            "hypothesis: valid traces of 1-12 lines with one value of one line made wrong "
            "(type, sign, range, NaN/inf, missing required field)"
        ),
    )
    bad_row = data.draw(st.integers(0, rows - 1), label="bad row")
    missing = missing and field in ("timestamp", "input_length", "output_length")
    lines = []
    for row in range(rows):
        values = {**GOOD_VALUES, "timestamp": str(1000 * row)}
        if row == bad_row:
            if missing:
                del values[field]
            else:
                values[field] = data.draw(st.sampled_from(BAD_VALUES[field]), label="bad value")
        lines.append(jsonl_line(values))
    path = write_lines(tmp_path / "one-bad.jsonl", lines)
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    error = caught.value
    assert (error.path, error.line, error.field) == (str(path), bad_row + 1, field)
    assert_names_file_line_field(error, path, path.read_bytes())
    reliability.count("files with one bad value")
    reliability.held(
        "one bad value anywhere in a valid trace: TraceError naming exactly that file, line and "
        "field (`{path}:{line}: field '{field}' = {value!r}: {reason}`)"
    )


# Values the fast (orjson, columnar) path and the careful (json, per-line) path might read
# differently: integers beyond 64 bits, long and exponent floats, -0, NaN/Infinity (json
# only), lone surrogates (json only), escapes, duplicate keys, nulls, bools.
TRICKY_NUMBERS = [
    *"0 -0 -0.0 -1 -2.5 -1e-300 1 1.0 2.5 1e3 1E+2 0.1e1 1e-400 1e400 4.9e-324".split(),
    *'123456789.123456789123 9007199254740993 NaN -Infinity true null "7" []'.split(),
    *map(str, [2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**64 + 1, -(2**63) - 1]),
]
TRICKY_STRINGS = ['"en"', '"\\u00e9\\n"', '"\\ud800"', '"\\ud83d\\ude00"', '""', "null", "1"]
TRICKY_HASH_IDS = [
    *"[] null [0,-1] [1.0] [true] [[1]] {}".split(),
    *(f"[{ids}]" for ids in (f"{2**63 - 1},{-(2**63)}", 2**63, 2**64 + 1)),
]
TRICKY = {
    "timestamp": TRICKY_NUMBERS,
    "input_length": TRICKY_NUMBERS,
    "output_length": TRICKY_NUMBERS,
    "hash_ids": TRICKY_HASH_IDS,
    "source_lang": TRICKY_STRINGS,
    "session_id": TRICKY_STRINGS,
    "latency_ms": TRICKY_NUMBERS,
}
TRICKY_VALUES = [(name, value) for name, values in TRICKY.items() for value in values]


@st.composite
def tricky_line(draw: st.DrawFn) -> str:
    """A valid line with up to two fields given a tricky value, sometimes a field missing,
    a field twice (json keeps the last), an unknown field or a broken frame."""
    fields = {"timestamp": "5", "input_length": "3", "output_length": "4"}
    optional = {
        "hash_ids": "[1, 2]",
        "source_lang": '"en"',
        "session_id": '"s1"',
        "latency_ms": "12.5",
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), unique=True)):
        fields[name] = optional[name]
    for name, value in draw(st.lists(st.sampled_from(TRICKY_VALUES), max_size=2)):
        fields[name] = value
    items = [f'"{name}": {value}' for name, value in fields.items()]
    change = draw(st.sampled_from(["none"] * 8 + ["drop", "twice", "unknown"]))
    if change == "drop":
        del items[draw(st.integers(0, 2))]
    elif change == "twice":
        name = draw(st.sampled_from(sorted(TRICKY)))
        items.append(f'"{name}": {draw(st.sampled_from(TRICKY[name]))}')
    elif change == "unknown":
        items.append('"prompt": "hi"')
    frame = draw(st.sampled_from(["{%s}"] * 8 + [" {%s} \r", "[{%s}]", "{%s"]))
    return frame % ", ".join(items)


GOOD_LINE = '{"timestamp": %d, "input_length": 3, "output_length": 4, "source_lang": "de"}'


def careful_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every chunk miss the fast path, so each line goes through `_parse_line`."""
    monkeypatch.setattr(trace_io, "_parse_chunk", lambda lines: None)


def outcome(path: Path, skip: bool, chunk_lines: int) -> tuple:
    """Everything a user can see of a load: the columns, the counts, or the error."""
    try:
        loaded = read_trace(path, skip_invalid=skip, chunk_lines=chunk_lines)
    except WorkloadError as error:
        return ("error", type(error).__name__, str(error))
    trace = loaded.trace
    return (
        trace.timestamps_ms.tolist(),
        trace.input_lengths.tolist(),
        trace.output_lengths.tolist(),
        None if trace.hash_ids is None else list(trace.hash_ids),
        trace.source_langs,
        trace.session_ids,
        None if trace.latencies_ms is None else [repr(x) for x in trace.latencies_ms.tolist()],
        loaded.lines_read,
        loaded.invalid,
        [str(error) for error in loaded.errors],
        loaded.reordered,
    )


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lines=st.lists(
        tricky_line() | st.integers(0, 9).map(lambda t: GOOD_LINE % t) | st.just("  "),
        min_size=1,
        max_size=10,
    ),
    skip=st.booleans(),
)
def test_fast_path_and_careful_path_give_the_same_result(
    tmp_path: Path, lines: list[str], skip: bool
) -> None:
    # Any chunk the fast path accepts must load exactly as the careful path would load it,
    # and a chunk it refuses must still report the careful path's error for the right line.
    path = tmp_path / "tricky.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        # Chunks of one line judge each line alone; chunks of four mix lines.
        fast = [outcome(path, skip, chunk_lines) for chunk_lines in (1, 4)]
        with pytest.MonkeyPatch.context() as monkeypatch:
            careful_only(monkeypatch)
            careful = outcome(path, skip, 4)
    assert fast == [careful, careful]


@pytest.mark.parametrize(("name", "value"), TRICKY_VALUES)
def test_each_tricky_value_loads_as_the_careful_path_loads_it(
    tmp_path: Path, name: str, value: str
) -> None:
    line = '{"timestamp": 5, "input_length": 3, "output_length": 4, "%s": %s}' % (name, value)
    path = write_lines(tmp_path / "one.jsonl", [GOOD_LINE % 1, line, GOOD_LINE % 9])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        fast = {(skip, n): outcome(path, skip, n) for skip in (False, True) for n in (1, 3)}
        with pytest.MonkeyPatch.context() as monkeypatch:
            careful_only(monkeypatch)
            careful = {skip: outcome(path, skip, 3) for skip in (False, True)}
    assert fast == {(skip, n): careful[skip] for skip, n in fast}


def test_well_formed_chunks_take_the_fast_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Speed depends on it: a valid file (blank lines, big timestamps, nulls included) must
    # not fall back to line-by-line parsing.
    lines = [GOOD_LINE % t for t in range(10)]
    lines[3] = '{"timestamp": %d, "input_length": 3, "output_length": 4}' % 2**64
    lines[5] = '{"timestamp": 5, "input_length": 3, "output_length": 4, "hash_ids": null}'
    lines.insert(6, "")
    path = write_lines(tmp_path / "t.jsonl", lines)
    took_fast_path: list[bool] = []
    fast = trace_io._parse_chunk

    def spy(chunk: list[bytes]) -> tuple | None:
        columns = fast(chunk)
        took_fast_path.append(columns is not None)
        return columns

    monkeypatch.setattr(trace_io, "_parse_chunk", spy)
    with pytest.warns(TraceWarning, match="not in ascending order"):
        trace = load_trace(path)
    assert len(trace) == 10 and took_fast_path == [True]
    assert trace.timestamps_ms[-1] == float(2**64)


def test_without_orjson_a_trace_loads_the_same_line_by_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # orjson only speeds loading up; a host without it (an offline kit) loads every trace.
    lines = [GOOD_LINE % t for t in range(10)]
    lines[4] = '{"timestamp": 4, "input_length": 3, "output_length": 4, "latency_ms": 12.5}'
    path = write_lines(tmp_path / "t.jsonl", lines)
    with_orjson = outcome(path, False, 4)
    monkeypatch.setattr(trace_io, "orjson", None)
    assert outcome(path, False, 4) == with_orjson
    bad = write_lines(tmp_path / "bad.jsonl", [GOOD_LINE % 0, '{"timestamp": 1, "input_length": 0, "output_length": 4}'])
    assert outcome(bad, False, 4)[2].endswith("bad.jsonl:2: field 'input_length' = 0: must be >= 1 token")


def test_nan_latency_is_reported_on_its_line(tmp_path: Path) -> None:
    good = '{"timestamp": 0, "input_length": 2, "output_length": 3, "latency_ms": 5}'
    bad = '{"timestamp": 0, "input_length": 2, "output_length": 3, "latency_ms": NaN}'
    path = write_lines(tmp_path / "t.jsonl", [good, good, bad, good])
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    assert str(caught.value) == f"{path}:3: field 'latency_ms' = nan: must be finite"
