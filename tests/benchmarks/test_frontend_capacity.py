"""The front-end capacity benchmark's columns (benchmarks/frontend_capacity.py): a column may
change engine arguments, and such columns are compared with the first one, round by round.
No engine runs here."""

from __future__ import annotations

from types import ModuleType

import pytest

BENCHMARK = "frontend_capacity"  # benchmarks/frontend_capacity.py, imported by the `bench` fixture (conftest)


def test_a_column_names_its_server_and_its_engine_changes(bench: ModuleType) -> None:
    column = bench.parse_column("ours:4+max_num_batched_tokens=512+enable_prefix_caching=false")
    assert (column.kind, column.count) == ("ours", 4)
    assert column.engine == {"max_num_batched_tokens": 512, "enable_prefix_caching": False}
    assert bench.parse_column("vllm:1").engine == {}
    assert bench.parse_column("in_process+max_num_seqs=8").kind == "in_process"
    assert "/" not in bench.safe_name(column.label) and ":" not in bench.safe_name(column.label)


@pytest.mark.parametrize("text, why", [
    ("ours:1+max_num_seqs", "'max_num_seqs' is not KEY=VALUE"),
    ("ours:0", "expected in_process, ours:N or vllm:N (N >= 1)"),
    ("sglang:1", "expected in_process, ours:N or vllm:N (N >= 1)"),
])
def test_a_bad_column_is_refused_in_one_line(bench: ModuleType, text: str, why: str) -> None:
    with pytest.raises(SystemExit) as refused:
        bench.parse_column(text)
    message = str(refused.value)
    assert message.startswith(f"frontend_capacity: column {text!r}: ") and why in message
    assert "\n" not in message


def test_engine_changes_are_compared_with_the_first_column_round_by_round(bench: ModuleType) -> None:
    columns = [bench.parse_column(text) for text in ("ours:1", "ours:1+max_num_seqs=512", "vllm:1")]
    rows = [
        {"round": 1, "column": "ours:1", "capacity_rps": 100.0},
        {"round": 1, "column": "ours:1+max_num_seqs=512", "capacity_rps": 150.0},
        {"round": 1, "column": "vllm:1", "capacity_rps": 90.0},
        {"round": 2, "column": "ours:1+max_num_seqs=512", "capacity_rps": 120.0},
        {"round": 2, "column": "ours:1", "capacity_rps": 120.0},
        {"round": 2, "column": "vllm:1", "capacity_rps": None},  # a failed launch
    ]
    compared, lines = bench.versus_first(rows, columns)
    assert list(compared) == ["ours:1+max_num_seqs=512"]  # vllm:1 changes no engine argument
    assert compared["ours:1+max_num_seqs=512"]["paired"] == [1.5, 1.0]
    assert compared["ours:1+max_num_seqs=512"]["ratio_of_medians"] == pytest.approx(135 / 110)
    assert any("ours:1+max_num_seqs=512" in line and "1.5, 1" in line for line in lines)


def test_each_launch_is_compared_with_the_in_process_launch_of_its_own_round(bench: ModuleType) -> None:
    # The in-process reference moves between launches (here 400 then 300 req/s): a launch's
    # share is taken against its own round's reference, never against another round's.
    rows = [
        {"round": 1, "column": "in_process", "capacity_rps": 400.0},
        {"round": 1, "column": "ours:4", "capacity_rps": 300.0},
        {"round": 2, "column": "ours:4", "capacity_rps": 285.0},
        {"round": 2, "column": "in_process", "capacity_rps": 300.0},
        {"round": 3, "column": "ours:4", "capacity_rps": 250.0},
        {"round": 3, "column": "in_process", "capacity_rps": None},  # a failed launch
    ]
    assert bench.per_round(rows, "ours:4", "in_process") == {1: 0.75, 2: 0.95}
