"""Importers of public trace formats: the real Azure file, small fixtures, malformed input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workloads.errors import TraceError, WorkloadError
from workloads.importers import import_azure, import_burstgpt, import_mooncake, importer
from workloads.trace import load_trace, write_trace

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
    tmp_path: Path, fmt: str, data: bytes, skip: bool
) -> None:
    path = tmp_path / "fuzz.in"
    path.write_bytes(data)
    try:
        result = importer(fmt)(path, skip_invalid=skip)
    except WorkloadError:
        return
    trace = result.trace
    assert len(trace) >= 1 and trace.timestamps_ms[0] == 0.0
    assert np.all(trace.input_lengths >= 1) and np.all(trace.output_lengths >= 1)
