"""`autotune` command line: one subcommand per job, each registered by its own module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from autotune.errors import (
    EXIT_BAD_INPUT,
    EXIT_CODES_HELP,
    EXIT_ENVIRONMENT,
    EXIT_NOTHING_MEASURED,
    AutotuneError,
    EnvironmentFailure,
    HelpFormatter,
    NothingMeasured,
)
from autotune.measure.server_start import private_ipc_folder
from autotune.measure.signals import exit_code, stop_reason, stop_signals_as_interrupt
from server.config import ConfigError
from workloads.errors import WorkloadError
from workloads.pipes import run_closing_quietly

USER_ERRORS = (AutotuneError, WorkloadError, ConfigError)


def build_parser() -> argparse.ArgumentParser:
    # Imported here so `autotune --help` names every command while each module owns its flags.
    from autotune import fork_server_cli, retune, run_cli, worker_cli
    from workloads import cli as workloads_cli
    from workloads import replay_cli

    parser = argparse.ArgumentParser(
        prog="autotune",
        description="Find the best vLLM serving config for your real traffic.",
        epilog=EXIT_CODES_HELP,
        formatter_class=HelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    registrars: list[Callable[[argparse._SubParsersAction], None]] = [
        run_cli.register,
        retune.register,
        worker_cli.register,
        fork_server_cli.register,
        workloads_cli.register,
        replay_cli.register,
    ]
    for register in registrars:
        register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; its exit code (see EXIT_CODES_HELP). A closed stdout pipe (`| head -1`)
    ends it quietly with EXIT_CLOSED_PIPE, as standard tools end."""
    return run_closing_quietly(lambda: _run(argv))


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with stop_signals_as_interrupt(), private_ipc_folder():
            return int(args.func(args) or 0)
    except USER_ERRORS as error:
        print(f"autotune: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except EnvironmentFailure as error:
        print(f"autotune: environment failure: {error}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    except NothingMeasured as error:
        print(f"autotune: nothing could be measured: {error}", file=sys.stderr)
        return EXIT_NOTHING_MEASURED
    except KeyboardInterrupt as error:
        print(f"autotune: interrupted ({stop_reason(error)})", file=sys.stderr)
        return exit_code(error)


if __name__ == "__main__":
    sys.exit(main())
