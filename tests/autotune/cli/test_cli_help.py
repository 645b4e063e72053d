"""`autotune --help` lists every command from autotune.cli's table and imports none of their
modules: a command's module, and what it needs (NumPy, SciPy, pydantic, Optuna, the measuring
stack), is imported only when that command is parsed. Checked in a fresh interpreter, by what
it imported, never by how long it took."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from autotune.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[3]

# What the commands import and `autotune --help` must not.
HEAVY = ("numpy", "scipy", "pydantic", "optuna", "yaml", "aiohttp", "httpx", "server.config",
         "autotune.plan", "autotune.pipeline", "autotune.measure.ladder", "workloads.trace")

PARSE_IN_A_FRESH_INTERPRETER = """
import contextlib, io, json, sys
from autotune.cli import build_parser
printed = io.StringIO()
with contextlib.redirect_stdout(printed), contextlib.suppress(SystemExit):
    build_parser().parse_args(sys.argv[1:])
print(json.dumps({"help": printed.getvalue(), "modules": sorted(sys.modules)}))
"""


def parse(argv: list[str]) -> tuple[str, set[str]]:
    """What `autotune ARGV` printed, and every module imported to print it."""
    child = subprocess.run([sys.executable, "-c", PARSE_IN_A_FRESH_INTERPRETER, *argv],
                           capture_output=True, text=True, check=True, cwd=ROOT, timeout=120)
    shown = json.loads(child.stdout)
    return shown["help"], set(shown["modules"])


def test_the_root_help_lists_every_command_and_imports_none_of_them() -> None:
    printed, imported = parse(["--help"])
    for command in COMMANDS:
        assert f"\n    {command.name} " in printed or f"\n    {command.name}\n" in printed, command.name
    needless = sorted(imported & ({command.module for command in COMMANDS} | set(HEAVY)))
    assert needless == [], f"`autotune --help` imported {', '.join(needless)}"


def test_a_commands_help_imports_its_own_module_only() -> None:
    printed, imported = parse(["drift", "--help"])
    assert "--burstiness-threshold" in printed
    assert imported & {command.module for command in COMMANDS} == {"autotune.cli.drift"}


def usage_error(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_a_usage_error_is_one_line_naming_the_flag_and_value() -> None:
    """Not argparse's usage block first: the one line that says what is wrong is all there is,
    exit status 2, for the tuner, the server and a benchmark script alike."""
    for argv, flag, shown in (
        (["-m", "autotune", "run", "--workload", "t.jsonl", "--trials", "abc"], "--trials", "'abc'"),
        (["-m", "autotune", "nosuch"], "COMMAND", "'nosuch'"),
        (["-m", "server", "--port", "x"], "--port", "'x'"),
        (["benchmarks/search_efficiency.py", "replay", "--seeds", "many"], "--seeds", "'many'"),
    ):
        child = usage_error(argv)
        assert child.returncode == 2, (argv, child.stderr)
        assert child.stdout == "" and child.stderr.count("\n") == 1, child.stderr
        assert flag in child.stderr and shown in child.stderr and "--help" in child.stderr
