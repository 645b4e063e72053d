"""`autotune worker`: measure the trials of a shared study (see autotune.distributed); many
workers, one per GPU on any number of hosts, share one study."""

from __future__ import annotations

import argparse
from pathlib import Path

from autotune.cli.flags import add_study_flags, connect_study
from autotune.errors import describe_command


def configure(parser: argparse.ArgumentParser) -> None:
    """`autotune worker`'s description and flags."""
    describe_command(
        parser,
        (
            "Join a study created with `autotune run --workers-only` and measure its trials on a "
            "local server until the study has them all; then exit. Start and stop workers at "
            "any time: a trial whose worker dies is failed after --grace-period and re-queued "
            "for another worker. Needs: the database, the model, and this Python environment."
        ),
    )
    add_study_flags(parser)
    parser.set_defaults(func=worker_command)


def worker_command(args: argparse.Namespace) -> int:
    # Imported here, not at the top: Optuna and the measuring stack are not needed for
    # `autotune worker --help`.
    from autotune.distributed import WorkerIdentity, run_worker

    storage, fork_server = connect_study(args)
    # SIGTERM (a pod being deleted) and SIGHUP stop the trial's server and hand the trial back,
    # as Ctrl-C does: autotune.cli.exit_status runs every command under autotune.measure.signals.
    run_worker(
        storage,
        args.study,
        url=args.storage,
        identity=WorkerIdentity.detect(args.worker_id),
        output_dir=args.output_dir or Path("runs") / args.study,
        max_retry=args.max_retry,
        fork_server_socket=fork_server,
    )
    return 0
