"""`autotune run` refuses bad input before any server starts, in one line, exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.cli import main
from autotune.progress import format_duration, parse_duration

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = str(ROOT / "workloads" / "samples" / "translation_trace.jsonl")


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["run", "--workload", SAMPLE, *args])
    return code, capsys.readouterr().err.strip()


def test_unwritable_results_folder_fails_before_any_trial(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, err = run(capsys, "--output-dir", str(blocker / "results"))
    assert code == 2
    assert err.startswith("autotune: error: ") and "a-file/results" in err and "--output-dir" in err
    assert not (tmp_path / "a-file" / "results").exists()


def test_bad_time_budget_and_objective_are_named(tmp_path: Path, capsys) -> None:
    code, err = run(capsys, "--time-budget", "30 minutes", "--output-dir", str(tmp_path))
    assert code == 2 and "--time-budget '30 minutes'" in err
    code, err = run(capsys, "--objective", "latency", "--output-dir", str(tmp_path))
    assert code == 2 and "--objective 'latency'" in err


def test_windows_longer_than_the_trace_are_refused(tmp_path: Path, capsys) -> None:
    code, err = run(capsys, "--tuning-window", "500", "--holdout-window", "500", "--output-dir", str(tmp_path))
    assert code == 2 and "too short" in err
    assert not (tmp_path / "trials").exists()


def test_durations_read_and_print_like_people_write_them() -> None:
    assert parse_duration("30m") == 1800 and parse_duration("1.5h") == 5400 and parse_duration("90") == 90
    assert format_duration(75.2) == "1m15s" and format_duration(3725) == "1h02m"
