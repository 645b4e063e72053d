"""Every command ends quietly when the reader of its output goes away (`| head -1`, `| true`),
as standard Unix tools do: no traceback, exit 141 (128 + SIGPIPE) when a write failed.

Real processes and real pipes: the reader's end is closed before the command writes (as
`| true` leaves it), or after one line (as `head -1` does)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.cli import build_parser
from workloads.pipes import EXIT_CLOSED_PIPE
from workloads.synthetic import TranslationSpec, translation
from workloads.trace_io import write_trace

ROOT = Path(__file__).resolve().parents[1]


def run_with_reader_gone(args: list[str], cwd: Path) -> tuple[int, str]:
    """Runs `args` with stdout a pipe whose read end is already closed: (exit code, stderr)."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            args, stdout=write, stderr=subprocess.PIPE, cwd=cwd, timeout=300, check=False
        )
    finally:
        os.close(write)
    return done.returncode, done.stderr.decode("utf-8", "replace")


def run_into_head(args: list[str], cwd: Path) -> tuple[int, str, bytes]:
    """`args | head -1` with real processes: (the command's exit code, its stderr, what head printed)."""
    command = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd)
    head = subprocess.run([shutil.which("head") or "head", "-1"], stdin=command.stdout, capture_output=True, check=False)
    command.stdout.close()  # head's end only: the command sees a closed reader
    stderr = command.stderr.read().decode("utf-8", "replace")
    command.stderr.close()
    return command.wait(timeout=300), stderr, head.stdout


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pipe") / "trace.jsonl"
    write_trace(path, translation(TranslationSpec(duration_s=300), seed=3))
    return path


def commands(trace: Path, out: Path) -> dict[str, list[str]]:
    """Commands that print, each as `autotune ...` arguments."""
    return {
        "profile": ["profile", str(trace)],
        "profile --json": ["profile", str(trace), "--json"],
        "window": ["window", str(trace), "--tuning-s", "60", "--holdout-s", "30",
                   "--out-dir", str(out / "w")],
        "drift": ["drift", "--reference", str(trace), "--current", str(trace)],
        "convert": ["convert", "--from", "mooncake", str(trace), str(out / "c.jsonl")],
        "generate": ["generate", str(out / "g.jsonl"), "--duration-s", "30"],
    }


def subcommand_names() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)


AUTOTUNE = [sys.executable, "-m", "autotune"]


@pytest.mark.parametrize(
    "name", ["profile", "profile --json", "window", "drift", "convert", "generate"]
)
def test_a_command_whose_reader_is_gone_exits_141_quietly(
    name: str, trace_file: Path, tmp_path: Path
) -> None:
    args = commands(trace_file, tmp_path)[name]
    code, stderr = run_with_reader_gone(AUTOTUNE + args, ROOT)
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr and "Exception" not in stderr
    assert code == EXIT_CLOSED_PIPE, stderr


@pytest.mark.parametrize("name", ["", *subcommand_names()])
def test_every_commands_help_ends_quietly(name: str) -> None:
    code, stderr = run_with_reader_gone(AUTOTUNE + [name, "--help"][not name:], ROOT)
    # argparse itself ignores a failed write of a help longer than the buffer (exit 0);
    # what stays buffered fails at our flush (141). Before, that flush came at exit: exit 120
    # and "Exception ignored ... BrokenPipeError".
    assert stderr == ""
    assert code in (0, EXIT_CLOSED_PIPE)


def test_profile_into_head_prints_one_line_and_no_traceback(trace_file: Path) -> None:
    code, stderr, shown = run_into_head(AUTOTUNE + ["profile", str(trace_file)], ROOT)
    assert shown.count(b"\n") == 1
    # Whether the command was still writing when head left is up to the scheduler.
    assert code in (0, EXIT_CLOSED_PIPE)
    assert stderr == ""


def test_an_error_message_still_reaches_a_live_stderr(tmp_path: Path) -> None:
    code, stderr = run_with_reader_gone(
        AUTOTUNE + ["profile", str(tmp_path / "missing.jsonl")], ROOT
    )
    assert code == 2
    assert stderr.strip() == f"autotune: error: {tmp_path / 'missing.jsonl'}: no such trace file"
