"""Importers of public trace formats: the real Azure file, small fixtures, malformed input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workloads.errors import TraceError, WorkloadError
from workloads.importers import import_azure, import_burstgpt, import_mooncake, importer
from workloads.trace_io import load_trace, write_trace

FIXTURES = Path(__file__).parent / "fixtures"
# ../shared/traces relative to the repository root; never copied into the repository.
SHARED_TRACES = Path(__file__).parents[2].parent / "shared" / "traces"
AZURE_CONV = SHARED_TRACES / "azure_conv_2023.csv"


def test_real_azure_conversation_trace(tmp_path: Path) -> None:
    if not AZURE_CONV.is_file():
        pytest.skip(f"real Azure trace not found at {AZURE_CONV} (kept outside the repository)")
    result = import_azure(AZURE_CONV)
    trace = result.trace
    assert len(trace) == result.rows_read == 19366
    assert trace.timestamps_ms[0] == 0.0
    # First rows: 18:15:46.6805900, 18:15:50.9951690 -> 4314.579 ms, exact to 100 ns.
    assert trace.timestamps_ms[1] == pytest.approx(4314.579, abs=1e-4)
    assert trace.input_lengths[:2].tolist() == [374, 396]
    assert trace.output_lengths[:2].tolist() == [44, 109]
    # The shared README's published figures for this file.
    assert trace.duration_s() == pytest.approx(3502, abs=1)
    assert np.median(trace.input_lengths) == 1020
    assert np.median(trace.output_lengths) == 129
    assert trace.input_lengths.max() == 14050
    # And it survives our own format.
    write_trace(tmp_path / "azure.jsonl", trace)
    again = load_trace(tmp_path / "azure.jsonl")
    assert again.input_lengths.tolist() == trace.input_lengths.tolist()
    assert np.allclose(again.timestamps_ms, trace.timestamps_ms, atol=1e-3)


def test_azure_2024_format_with_utc_offset_and_seven_digits() -> None:
    trace = import_azure(FIXTURES / "azure_small.csv").trace
    # 00:00:00.0097991 -> 00:00:00.0098017 is 2.6 microseconds: the 7th digit survives.
    assert trace.timestamps_ms.tolist() == pytest.approx([0.0, 0.0026, 1490.2009, 59990.2008])
    assert trace.input_lengths.tolist() == [4808, 3180, 110, 7433]


def test_azure_bad_row_names_line_and_column(tmp_path: Path) -> None:
    with pytest.raises(TraceError) as caught:
        import_azure(FIXTURES / "azure_malformed.csv")
    assert (caught.value.line, caught.value.field) == (4, "TIMESTAMP")
    assert "2023-13-16" in str(caught.value)
    result = import_azure(FIXTURES / "azure_malformed.csv", skip_invalid=True)
    assert (len(result.trace), result.invalid) == (3, 1)


def test_azure_wrong_header(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(TraceError, match="missing column"):
        import_azure(path)


def test_burstgpt_drops_failures_and_filters_model() -> None:
    result = import_burstgpt(FIXTURES / "burstgpt_small.csv")
    assert result.rows_read == 7
    assert result.failed_dropped == 2  # the two rows with 0 response tokens
    assert len(result.trace) == 5
    # Seconds -> ms, re-based to the first kept request (t=5 s).
    assert result.trace.timestamps_ms.tolist() == [0.0, 113000.0, 117000.0, 125000.0, 195500.0]
    assert "2 failed requests" in result.summary()

    gpt4 = import_burstgpt(FIXTURES / "burstgpt_small.csv", model="GPT-4")
    assert (len(gpt4.trace), gpt4.failed_dropped, gpt4.filtered_out) == (1, 1, 5)
    assert gpt4.trace.input_lengths.tolist() == [417]
    with pytest.raises(WorkloadError, match="no rows for model 'Claude'"):
        import_burstgpt(FIXTURES / "burstgpt_small.csv", model="Claude")


def test_burstgpt_bad_row() -> None:
    with pytest.raises(TraceError) as caught:
        import_burstgpt(FIXTURES / "burstgpt_malformed.csv")
    assert (caught.value.line, caught.value.field, caught.value.value) == (
        3,
        "Request tokens",
        "many",
    )
    skipped = import_burstgpt(FIXTURES / "burstgpt_malformed.csv", skip_invalid=True)
    assert (len(skipped.trace), skipped.invalid) == (2, 1)


def test_mooncake_keeps_hash_ids() -> None:
    trace = import_mooncake(FIXTURES / "mooncake_small.jsonl").trace
    assert len(trace) == 5
    assert trace.timestamps_ms.tolist() == [0, 0, 3052, 3052, 3299]
    assert trace.hash_ids is not None and trace.hash_ids[3] == [46, 47, 48, 49, 50]


def test_mooncake_bad_line() -> None:
    with pytest.raises(TraceError) as caught:
        import_mooncake(FIXTURES / "mooncake_malformed.jsonl")
    assert (caught.value.line, caught.value.field) == (2, "hash_ids")
    assert len(import_mooncake(FIXTURES / "mooncake_malformed.jsonl", skip_invalid=True).trace) == 2


def test_unknown_format() -> None:
    with pytest.raises(WorkloadError, match="unknown trace format"):
        importer("sharegpt")


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    fmt=st.sampled_from(["azure", "burstgpt", "mooncake"]),
    data=st.binary(max_size=300)
    | st.lists(
        st.text(max_size=50)
        | st.sampled_from(
            [
                "TIMESTAMP,ContextTokens,GeneratedTokens",
                "2023-11-16 18:15:46.6805900,374,44",
                "2023-11-16 25:15:46.6805900,374,44",
                "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
                "5,ChatGPT,472,18,490,Conversation log",
                "nan,ChatGPT,472,18,490,Conversation log",
                '"unterminated,1,2',
                '{"timestamp": 0, "input_length": 1, "output_length": 1}',
                "\x00",
            ]
        ),
        max_size=8,
    ).map(lambda lines: "\n".join(lines).encode("utf-8", "surrogatepass")),
    skip=st.booleans(),
)
def test_arbitrary_input_raises_only_workload_errors(
    tmp_path: Path, reliability, fmt: str, data: bytes, skip: bool
) -> None:
    reliability.start(
        "Trace importers (Azure, BurstGPT, Mooncake): arbitrary bytes",
        group="Bad input",
        injected=(
            "hypothesis: arbitrary bytes, and mixes of headers, good and bad rows, bad dates, "
            "NaN, unterminated quotes and NUL bytes, imported with and without --skip-invalid"
        ),
    )
    path = tmp_path / "fuzz.in"
    path.write_bytes(data)
    reliability.count(f"{fmt} files imported")
    try:
        result = importer(fmt)(path, skip_invalid=skip)
    except TraceError as error:
        assert error.path == str(path)
        assert 1 <= error.line <= data.count(b"\n") + 1 and error.field
        assert str(error).startswith(f"{path}:{error.line}: field '{error.field}' = ")
        assert "\n" not in str(error)
        reliability.held(ARBITRARY_HELD)
        return
    except WorkloadError as error:
        assert str(path) in str(error) and "\n" not in str(error)
        reliability.held(ARBITRARY_HELD)
        return
    trace = result.trace
    assert len(trace) >= 1 and trace.timestamps_ms[0] == 0.0
    assert np.all(trace.input_lengths >= 1) and np.all(trace.output_lengths >= 1)
    reliability.held(ARBITRARY_HELD)


ARBITRARY_HELD = (
    "every importer raised nothing but WorkloadError: a bad row names the file, an existing line "
    "and the column in one line; a whole-file problem names the file; what imports is valid"
)

# One row per format, with the values a test may replace: {column: text}.
FORMATS = {
    "azure": (
        ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
        lambda i: {
            "TIMESTAMP": f"2024-05-10 00:{i // 60:02d}:{i % 60:02d}.0000000+00:00",
            "ContextTokens": str(100 + i),
            "GeneratedTokens": str(10 + i),
        },
    ),
    "burstgpt": (
        ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"),
        lambda i: {
            "Timestamp": str(5 * i),
            "Model": "ChatGPT",
            "Request tokens": str(100 + i),
            "Response tokens": str(10 + i),
            "Total tokens": str(110 + 2 * i),
            "Log Type": "Conversation log",
        },
    ),
}
BAD_CELLS = {
    "TIMESTAMP": ["", "yesterday", "2024-13-10 00:00:00.0000000", "2024-05-10 25:00:00", "1715299200"],
    "ContextTokens": ["", "0", "-1", "1.5", "many", "nan", "1e999", str(2**40)],
    "GeneratedTokens": ["", "0", "-2", "2.5", "few", "inf", str(2**40)],
    "Timestamp": ["", "abc", "-1", "inf", "nan", "1e999"],
    "Request tokens": ["", "0", "-1", "1.5", "many", "nan", str(2**40)],
    "Response tokens": ["", "-1", "1.5", "few", "inf", str(2**40)],  # 0 = a failed request
}
MOONCAKE_BAD = {
    "timestamp": ['"soon"', "-1", "null", "1e999", "true"],
    "input_length": ['"12"', "0", "-4", "1.5", "null", "1e999"],
    "output_length": ['"7"', "0", "-1", "2.5", "false", str(2**40)],
    "hash_ids": ['"abc"', '[1, "x"]', "[true]", "[1e3]", str([2**64])],
}


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    fmt=st.sampled_from(["azure", "burstgpt", "mooncake"]),
    rows=st.integers(1, 10),
    data=st.data(),
)
def test_one_bad_value_names_its_file_line_and_column(
    tmp_path: Path, reliability, fmt: str, rows: int, data: st.DataObject
) -> None:
    reliability.start(
        "Trace importers (Azure, BurstGPT, Mooncake): one bad value in a valid file",
        group="Bad input",
        injected=(
            "hypothesis: valid Azure CSV, BurstGPT CSV and Mooncake JSONL files of 1-10 rows with "
            "one cell made wrong (empty, text, negative, fraction, NaN/inf, out of range, bad date)"
        ),
    )
    bad_row = data.draw(st.integers(0, rows - 1), label="bad row")
    if fmt == "mooncake":
        column = data.draw(st.sampled_from(sorted(MOONCAKE_BAD)), label="field")
        lines = []
        for row in range(rows):
            values = {"timestamp": str(100 * row), "input_length": "600", "output_length": "9",
                      "hash_ids": f"[{row}, {row + 1}]"}
            if row == bad_row:
                values[column] = data.draw(st.sampled_from(MOONCAKE_BAD[column]), label="value")
            lines.append("{" + ", ".join(f'"{k}": {v}' for k, v in values.items()) + "}")
        line = bad_row + 1
    else:
        header, make = FORMATS[fmt]
        column = data.draw(st.sampled_from([c for c in header if c in BAD_CELLS]), label="column")
        lines = [",".join(header)]
        for row in range(rows):
            values = make(row)
            if row == bad_row:
                values[column] = data.draw(st.sampled_from(BAD_CELLS[column]), label="value")
            lines.append(",".join(values[c] for c in header))
        line = bad_row + 2  # the header is line 1
    path = tmp_path / f"one-bad.{fmt}"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError) as caught:
        importer(fmt)(path)
    error = caught.value
    assert (error.path, error.line, error.field) == (str(path), line, column)
    assert str(error).startswith(f"{path}:{line}: field '{column}' = ")
    reliability.count(f"{fmt} files with one bad value")
    reliability.held(
        "one bad cell anywhere in a valid file: TraceError naming exactly that file, line and column"
    )
