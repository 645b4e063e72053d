"""`autotune finalize`: validate a shared study's best configs and export them, once, as
`autotune run` does after its search (see autotune.distributed)."""

from __future__ import annotations

import argparse
from pathlib import Path

from autotune.cli.flags import add_study_flags, connect_study
from autotune.errors import EXIT_OK, describe_command


def configure(parser: argparse.ArgumentParser) -> None:
    """`autotune finalize`'s description and flags."""
    describe_command(
        parser,
        (
            "Wait for the study's running trials, then re-run the top configs and the baseline "
            "on the held-out window on this machine and write OUTPUT_DIR/best.yaml and "
            "report.md, exactly as `autotune run` does after its search. One finalize per study."
        ),
    )
    add_study_flags(parser)
    parser.add_argument("--partial", action="store_true",
                        help="validate what was measured even if the study has fewer trials than asked")
    parser.add_argument("--again", action="store_true",
                        help="finalise a study that was finalised before (or whose finalize was killed)")
    parser.add_argument("--wait", type=float, default=None, metavar="S",
                        help="give up after waiting this long for running trials (default: no limit)")
    parser.set_defaults(func=finalize_command)


def finalize_command(args: argparse.Namespace) -> int:
    # Imported here, not at the top: Optuna and the measuring stack are not needed for
    # `autotune finalize --help`.
    from autotune.distributed import WorkerIdentity, finalize

    storage, fork_server = connect_study(args)
    finalize(
        storage,
        args.study,
        url=args.storage,
        output_dir=args.output_dir or Path("runs") / args.study,
        identity=WorkerIdentity.detect(args.worker_id),
        partial=args.partial,
        again=args.again,
        wait_timeout_s=args.wait,
        fork_server_socket=fork_server,
    )
    return EXIT_OK
