"""`autotune` command line: the root parser, one module per subcommand.

The root parser is built from COMMANDS, a static table of each command's name, one-line help
and module. A command's module is imported, and its flags added, only when argparse selects
that command (to run it or print its --help): `autotune --help` lists every command and
imports none of them, nor their dependencies (NumPy, SciPy, pydantic, Optuna, the measuring
stack). Each command module has `configure(parser)`, which gives the command's parser its
description, its flags and the function that runs it (`func`).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from typing import Any, NamedTuple

from autotune.errors import EXIT_CODES_HELP, HelpFormatter
from workloads.errors import OneLineErrorParser
from workloads.pipes import run_closing_quietly


class Command(NamedTuple):
    """One subcommand: its name, the line `autotune --help` shows for it, and its module."""

    name: str
    help: str
    module: str


# In the order `autotune --help` lists them.
COMMANDS = (
    Command(
        "run",
        "tune a vLLM config on a traffic trace and export best.yaml + report.md",
        "autotune.cli.run",
    ),
    Command(
        "retune",
        "re-tune the deployed config if the traffic drifted (exit 10: new best.yaml)",
        "autotune.cli.retune",
    ),
    Command(
        "worker",
        "measure trials of a shared study (one worker per GPU, on any number of hosts)",
        "autotune.cli.worker",
    ),
    Command(
        "finalize",
        "validate a shared study's best configs and export best.yaml + report.md (once)",
        "autotune.cli.finalize",
    ),
    Command(
        "fork-server",
        "import vLLM once for every tuner of this host (they connect with --fork-server-socket)",
        "autotune.cli.fork_server",
    ),
    Command(
        "convert",
        "convert a public trace (Azure, BurstGPT, Mooncake) to our JSONL",
        "autotune.cli.convert",
    ),
    Command(
        "profile",
        "measure a trace: rates, burstiness, lengths, concurrency, fingerprint",
        "autotune.cli.profile",
    ),
    Command(
        "generate",
        "write a synthetic trace (translation traffic, or like a given trace/profile)",
        "autotune.cli.generate",
    ),
    Command(
        "window",
        "cut a representative tuning window and a disjoint held-out window",
        "autotune.cli.window",
    ),
    Command(
        "drift",
        "test whether current traffic drifted from a reference (exit 3 if it did)",
        "autotune.cli.drift",
    ),
    Command(
        "replay",
        "replay a trace against a running server and measure it",
        "autotune.cli.replay",
    ),
)


class CommandParser(OneLineErrorParser):
    """A subcommand's parser that imports its module and takes its flags from it the first
    time it parses (or when `add_flags` is called)."""

    def __init__(self, *args: Any, module: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.module = module
        self.has_flags = False

    def add_flags(self) -> None:
        """Import the command's module and let it configure this parser (once)."""
        if not self.has_flags:
            importlib.import_module(self.module).configure(self)
            self.has_flags = True

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        # argparse hands a selected subcommand its arguments through this method.
        self.add_flags()
        return super().parse_known_args(args, namespace)


def build_parser(*, complete: bool = False) -> argparse.ArgumentParser:
    """`autotune`'s parser. Each command's flags are added when it is parsed; with `complete`,
    every command's are added now (the CLI reference prints every command's --help)."""
    parser = OneLineErrorParser(
        prog="autotune",
        description="Find the best vLLM serving config for your real traffic.",
        epilog=EXIT_CODES_HELP,
        formatter_class=HelpFormatter,
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=CommandParser
    )
    for command in COMMANDS:
        subparser = commands.add_parser(command.name, help=command.help, module=command.module)
        if complete:
            subparser.add_flags()
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; its exit code (see EXIT_CODES_HELP). A closed stdout pipe (`| head -1`)
    ends it quietly with EXIT_CLOSED_PIPE, as standard tools end."""
    return run_closing_quietly(lambda: _run(argv))


def _run(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    # Imported once a command is chosen: --help and usage errors end above, without the
    # error classes' modules (server.config loads pydantic) or the signal handling.
    from autotune.cli.exit_status import exit_status

    return exit_status(args)

