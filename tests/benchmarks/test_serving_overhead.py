"""The serving-overhead benchmark's columns (benchmarks/serving_overhead.py): a column may change
engine arguments for its launches, keeps its full label as its name in the results, and is
compared with in_process and with its kind without changes. No engine runs here."""

from __future__ import annotations

import pytest

from benchmarks import serving_overhead as bench


def test_a_column_names_its_kind_and_its_engine_changes() -> None:
    columns = bench.parse_columns("in_process, our_server+stream_interval=4,vllm_serve+max_num_seqs=8"
                                  "+enable_prefix_caching=false,our_server_equal")
    assert [(c.label, c.kind, c.engine) for c in columns] == [
        ("in_process", "in_process", {}),
        ("our_server+stream_interval=4", "our_server", {"stream_interval": 4}),
        ("vllm_serve+max_num_seqs=8+enable_prefix_caching=false", "vllm_serve",
         {"max_num_seqs": 8, "enable_prefix_caching": False}),
        ("our_server_equal", "our_server_equal", {}),
    ]


@pytest.mark.parametrize("text, label, why", [
    ("our_server+stream_interval", "our_server+stream_interval", "'stream_interval' is not KEY=VALUE"),
    ("in_process,ours+stream_interval=4", "ours+stream_interval=4", "'ours' is not one of in_process, "),
    ("our_server+=4", "our_server+=4", "'=4' is not KEY=VALUE"),
    ("our_server,our_server", "our_server", "given twice"),
])
def test_a_bad_column_is_refused_in_one_line(text: str, label: str, why: str) -> None:
    with pytest.raises(SystemExit) as refused:
        bench.parse_columns(text)
    message = str(refused.value)
    assert message.startswith(f"serving_overhead: column {label!r}: ") and why in message
    assert "\n" not in message


def test_changed_columns_are_compared_with_in_process_and_their_plain_kind() -> None:
    columns = bench.parse_columns("in_process,our_server,our_server+stream_interval=4,"
                                  "our_server+stream_interval=16,in_process+max_num_seqs=8")
    assert bench.ratio_pairs(columns) == [
        ("our_server", "in_process"),
        ("our_server+stream_interval=4", "in_process"),
        ("our_server+stream_interval=4", "our_server"),
        ("our_server+stream_interval=16", "in_process"),
        ("our_server+stream_interval=16", "our_server"),
        ("in_process+max_num_seqs=8", "in_process"),
    ]
    # Without its plain kind running, a changed column is still compared with in_process.
    assert bench.ratio_pairs(bench.parse_columns("our_server+stream_interval=4,in_process")) == [
        ("our_server+stream_interval=4", "in_process")]


def test_a_changed_column_has_its_row_and_its_ratios_in_the_tables() -> None:
    columns = bench.parse_columns("in_process,our_server+stream_interval=4")

    def session(column: str, round_index: int, rps: float) -> dict:
        repeat = {metric: rps for metric in bench.METRICS}
        return {"column": column, "round": round_index, "order": 0, "ready_s": 1.0, "load_1min_before": 0.5,
                "repeats": [repeat, repeat], "other_engines": {"share_with_foreign_engine": 0.0},
                "engine_changes": next(c.engine for c in columns if c.label == column)}

    sessions = {"in_process": [session("in_process", 0, 40.0), session("in_process", 1, 50.0)],
                "our_server+stream_interval=4": [session("our_server+stream_interval=4", 0, 30.0),
                                                 session("our_server+stream_interval=4", 1, 40.0)]}
    summary = bench.summarise(sessions)
    ratios = bench.ratios_for(sessions, summary, columns)
    by_rps = ratios["our_server+stream_interval=4/in_process"]["requests_per_s"]
    assert by_rps["ratio_of_medians"] == pytest.approx(35 / 45)
    assert by_rps["paired"]["per_round"] == pytest.approx([0.75, 0.8])
    text = bench.tables(summary, ratios, sessions)
    assert "| our_server+stream_interval=4 | 35 (30-40) |" in text
    assert "| our_server+stream_interval=4/in_process | requests_per_s | 0.778 | 0.775 (0.750-0.800) |" in text
    assert any('our_server+stream_interval=4: {"stream_interval": 4}' in note for note in bench.notes_for(sessions))


def test_cpu_per_request_is_reported_by_process_role() -> None:
    # 100 requests in 2 s per repeat: the engine core's 1.5 CPU-seconds are 15 ms a request.
    def repeat(client_s: float) -> dict:
        return {"requests_per_s": 50.0, "seconds": 2.0,
                "cpu": {"client": {"cpu_s": client_s, "share": client_s / 2},
                        "server": {"cpu_s": 0.8, "share": 0.4},
                        "engine core": {"cpu_s": 1.5, "share": 0.75}}}

    sessions = {"our_server": [{"repeats": [repeat(0.4), repeat(0.6)]}],
                "vllm_serve": [{"repeats": [{"requests_per_s": 40.0, "seconds": 2.0}]}]}  # recorded no CPU
    lines = bench.cpu_table(sessions)
    row = next(line for line in lines if line.startswith("| our_server |"))
    assert row == "| our_server | - | 5 (0.25) | 8 (0.4) | 15 (0.75) | - | - | 28 |"
    assert not any(line.startswith("| vllm_serve |") for line in lines)
