"""A parsed command run to its exit code: each kind of error it may end in, one stderr line
and its code (autotune.errors' EXIT_CODES_HELP)."""

from __future__ import annotations

import argparse
import sys

from autotune.errors import (
    EXIT_BAD_INPUT,
    EXIT_ENVIRONMENT,
    EXIT_NOTHING_MEASURED,
    AutotuneError,
    EnvironmentFailure,
    NothingMeasured,
)
from autotune.measure.server_start import private_ipc_folder
from autotune.measure.signals import exit_code, stop_reason, stop_signals_as_interrupt
from server.config import ConfigError
from workloads.errors import WorkloadError

USER_ERRORS = (AutotuneError, WorkloadError, ConfigError)


def exit_status(args: argparse.Namespace) -> int:
    """Runs the command `args.func` under the signal handling every command has (SIGTERM and
    SIGHUP stop it as Ctrl-C does); its exit code, or that of the error it ended in."""
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
