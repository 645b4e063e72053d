"""`autotune` command line: one subcommand per job, each registered by its own module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from autotune.errors import AutotuneError
from server.config import ConfigError
from workloads.errors import WorkloadError

USER_ERRORS = (AutotuneError, WorkloadError, ConfigError)


def build_parser() -> argparse.ArgumentParser:
    # Imported here so `autotune --help` names every command while each module owns its flags.
    from autotune import retune, run_cli, worker_cli
    from workloads import cli as workloads_cli
    from workloads import replay_cli

    parser = argparse.ArgumentParser(
        prog="autotune",
        description="Find the best vLLM serving config for your real traffic.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    registrars: list[Callable[[argparse._SubParsersAction], None]] = [
        run_cli.register,
        retune.register,
        worker_cli.register,
        workloads_cli.register,
        replay_cli.register,
    ]
    for register in registrars:
        register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as error:
        print(f"autotune: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autotune: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
