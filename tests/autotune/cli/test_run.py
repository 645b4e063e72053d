"""`autotune run` refuses bad input before any server starts, in one line, exit code 2."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from autotune.cli import main
from autotune.progress import format_duration, parse_duration

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = str(ROOT / "workloads" / "samples" / "translation_trace.jsonl")


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["run", "--workload", SAMPLE, *args])
    return code, capsys.readouterr().err.strip()


def test_unwritable_results_folder_fails_before_any_trial(tmp_path: Path, capsys, reliability) -> None:
    reliability.start(
        "Results folder unwritable",
        group="Faults during a study",
        injected="`autotune run --output-dir` under a path whose parent is a file (mkdir fails, even as root)",
    )
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    started = time.monotonic()
    code, err = run(capsys, "--output-dir", str(blocker / "results"))
    assert code == 2
    assert err.startswith("autotune: error: ") and "a-file/results" in err and "--output-dir" in err
    assert not (tmp_path / "a-file" / "results").exists()
    assert "\n" not in err
    reliability.held(f"exit 2 with one line, before any trial or server: \"{err}\"")
    reliability.figure("time to the error", time.monotonic() - started, "s")


@pytest.mark.slow  # a real `autotune run` subprocess
def test_a_damaged_study_database_is_refused_before_any_trial(tmp_path: Path, reliability) -> None:
    reliability.start(
        "Study database damaged",
        group="Bad input",
        injected="`autotune run --resume` on a study.db holding a real study, cut in half",
    )
    out = tmp_path / "out"
    out.mkdir()
    database = out / "study.db"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{database}")
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=5)
    database.write_bytes(database.read_bytes()[: database.stat().st_size // 2])
    # A subprocess: what a user's terminal shows, free of this test process's log handlers.
    done = subprocess.run(
        [sys.executable, "-m", "autotune", "run", "--workload", SAMPLE, "--output-dir", str(out),
         "--study-name", "s", "--resume"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("autotune: error: ")]
    assert len(errors) == 1 and str(database) in errors[0] and "malformed" in errors[0]
    assert "Traceback" not in done.stderr and "[SQL" not in done.stderr  # one line, no SQL dump
    assert not (out / "trials").exists()
    reliability.held(f"exit 2 before any trial or server, one line naming the file and SQLite's reason: \"{errors[0]}\"")


def test_bad_time_budget_and_objective_are_named(tmp_path: Path, capsys) -> None:
    code, err = run(capsys, "--time-budget", "30 minutes", "--output-dir", str(tmp_path))
    assert code == 2 and "--time-budget '30 minutes'" in err
    code, err = run(capsys, "--objective", "latency", "--output-dir", str(tmp_path))
    assert code == 2 and "--objective 'latency'" in err


def test_a_ladder_flag_out_of_range_is_named_with_its_value(tmp_path: Path, capsys) -> None:
    code, err = run(capsys, "--max-speedup", "0", "--output-dir", str(tmp_path))
    assert code == 2 and "--max-speedup 0.0: " in err and "\n" not in err
    code, err = run(capsys, "--step-requests", "5", "--output-dir", str(tmp_path))
    assert code == 2 and "--step-requests 5: " in err and "\n" not in err
    for bad in ("-1", "five", "inf"):
        code, err = run(capsys, "--max-silence", bad, "--output-dir", str(tmp_path))
        assert code == 2 and err == f"autotune: error: --max-silence '{bad}': expected seconds >= 0 (0: replay silences whole)"
    for bad in ("0", "-2", "ten", "nan", "1e9"):
        code, err = run(capsys, "--step-seconds", bad, "--output-dir", str(tmp_path))
        assert code == 2 and err == (f"autotune: error: --step-seconds '{bad}': expected seconds > 0 and "
                                     "at most 3600 (an hour a step)")
    code, err = run(capsys, "--step-requests", "1000000000", "--output-dir", str(tmp_path))
    assert code == 2 and err.startswith("autotune: error: --step-requests 1000000000: ") and "100000" in err
    assert not (tmp_path / "trials").exists()


def test_max_silence_reaches_the_ladder_and_0_keeps_silences_whole() -> None:
    from autotune.cli import build_parser
    from autotune.cli.run import run_request
    from autotune.prepare import ladder_settings

    for given, expected in ((None, 5.0), ("2.5", 2.5), ("0", None)):
        flags = ["--max-silence", given] if given is not None else []
        request = run_request(build_parser().parse_args(["run", "--workload", SAMPLE, *flags]))
        assert ladder_settings(request, "cpu", []).max_silence_s == expected


def test_step_seconds_reaches_the_ladder_over_the_accelerators_default() -> None:
    from autotune.cli import build_parser
    from autotune.cli.run import run_request
    from autotune.prepare import ladder_settings

    for accelerator, given, expected in (("cpu", None, 6.0), ("gpu", None, 10.0), ("cpu", "2.5", 2.5),
                                         ("gpu", "30", 30.0)):
        flags = ["--step-seconds", given] if given is not None else []
        request = run_request(build_parser().parse_args(["run", "--workload", SAMPLE, *flags]))
        assert ladder_settings(request, accelerator, []).min_step_s == expected


def test_a_re_sorted_trace_is_said_in_one_line_not_as_a_python_warning(tmp_path: Path, capsys) -> None:
    lines = Path(SAMPLE).read_text().splitlines(keepends=True)
    unsorted = tmp_path / "unsorted.jsonl"
    unsorted.write_text("".join([lines[1], lines[0], *lines[2:]]))
    # Windows the trace cannot hold end the run right after the trace is read.
    code = main(["run", "--workload", str(unsorted), "--tuning-window", "10000", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[0] == f"autotune: {unsorted}: timestamps were not ascending; requests sorted by timestamp"
    assert err[1].startswith("autotune: error: ") and len(err) == 2, err


def test_a_window_of_no_length_is_refused_naming_its_flag(tmp_path: Path, capsys) -> None:
    for flag in ("--tuning-window", "--holdout-window"):
        for bad in ("0", "-5", "abc", "inf"):
            code, err = run(capsys, flag, bad, "--output-dir", str(tmp_path))
            assert code == 2 and err == f"autotune: error: {flag} '{bad}': expected seconds > 0"
    assert not (tmp_path / "trials").exists()


def test_windows_longer_than_the_trace_are_refused(tmp_path: Path, capsys) -> None:
    code, err = run(capsys, "--tuning-window", "500", "--holdout-window", "500", "--output-dir", str(tmp_path))
    assert code == 2 and "too short" in err
    assert not (tmp_path / "trials").exists()


def test_durations_read_and_print_like_people_write_them() -> None:
    assert parse_duration("30m") == 1800 and parse_duration("1.5h") == 5400 and parse_duration("90") == 90
    assert format_duration(75.2) == "1m15s" and format_duration(3725) == "1h02m"


@pytest.mark.parametrize("study", ["h200-prod", "cpu-2026-12-01", "my-study"])
def test_a_user_s_run_writes_to_an_ignored_folder_by_default(study: str) -> None:
    """Whatever the study is called, its default folder is one git ignores: a user's run (or
    ours) never ends up tracked by accident."""
    import shutil

    from autotune.cli import build_parser
    from autotune.cli.run import run_request

    git = shutil.which("git")
    assert git is not None, "git is needed to ask what the repository ignores"

    args = build_parser().parse_args(["run", "--workload", SAMPLE, "--study-name", study])
    output_dir = run_request(args).output_dir
    assert output_dir == Path("runs") / study
    for name in ("best.yaml", "report.md", "study.db", "trials/trial-0000/server.log"):
        ignored = subprocess.run([git, "check-ignore", "-q", str(output_dir / name)], cwd=ROOT)
        assert ignored.returncode == 0, output_dir / name
