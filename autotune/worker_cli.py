"""`autotune worker` and `autotune finalize`: many GPUs on one study (see autotune.distributed)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from autotune.errors import add_command
from autotune.measure_flags import add_fork_server_socket_flag, fork_server_socket

# A dead worker's trial is failed and re-queued within about a minute; a heartbeat every 10 s
# costs one tiny UPDATE per running trial.
HEARTBEAT_INTERVAL_S = 10
GRACE_PERIOD_S = 60
MAX_RETRY = 2


def _shared_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--storage", required=True, metavar="URL",
        help="the study's database, e.g. postgresql://USER:PASSWORD@HOST:5432/DB (SQLite: workers "
             "on one host only)")
    add("--study", required=True, metavar="NAME",
        help="the study `autotune run --workers-only --study-name NAME` created")
    add("--output-dir", type=Path, default=None, metavar="DIR",
        help="where this process writes (default: runs/NAME/); workers of one host should "
             "share it, so a surviving worker ends the server of one that died")
    add("--worker-id", default=None, metavar="ID",
        help="this worker's name on its host (default: gpuN from CUDA_VISIBLE_DEVICES, else pidN); "
             "recorded on every trial with the host name")
    add("--heartbeat-interval", type=int, default=HEARTBEAT_INTERVAL_S, metavar="S",
        help="seconds between a running trial's heartbeats (default: %(default)s)")
    add("--grace-period", type=int, default=GRACE_PERIOD_S, metavar="S",
        help="a running trial without a heartbeat for this long is failed and retried "
             "(default: %(default)s; use the same on every worker)")
    add("--max-retry", type=int, default=MAX_RETRY, metavar="N",
        help="times a lost trial is re-queued (default: %(default)s)")
    add_fork_server_socket_flag(add)


def register(subparsers: argparse._SubParsersAction) -> None:
    worker = add_command(
        subparsers,
        "worker",
        help="measure trials of a shared study (one worker per GPU, on any number of hosts)",
        description=(
            "Join a study created with `autotune run --workers-only` and measure its trials on a "
            "local server until the study has them all; then exit. Start and stop workers at "
            "any time: a trial whose worker dies is failed after --grace-period and re-queued "
            "for another worker. Needs: the database, the model, and this Python environment."
        ),
    )
    _shared_flags(worker)
    worker.set_defaults(func=worker_command)

    final = add_command(
        subparsers,
        "finalize",
        help="validate a shared study's best configs and export best.yaml + report.md (once)",
        description=(
            "Wait for the study's running trials, then re-run the top configs and the baseline "
            "on the held-out window on this machine and write OUTPUT_DIR/best.yaml and "
            "report.md, exactly as `autotune run` does after its search. One finalize per study."
        ),
    )
    _shared_flags(final)
    final.add_argument("--partial", action="store_true",
                       help="validate what was measured even if the study has fewer trials than asked")
    final.add_argument("--again", action="store_true",
                       help="finalise a study that was finalised before (or whose finalize was killed)")
    final.add_argument("--wait", type=float, default=None, metavar="S",
                       help="give up after waiting this long for running trials (default: no limit)")
    final.set_defaults(func=finalize_command)


def worker_command(args: argparse.Namespace) -> int:
    # Imported here, not at the top: Optuna and the measuring stack are not needed for
    # `autotune --help`, which registers these flags.
    from autotune.distributed import WorkerIdentity, connect, run_worker

    fork_server = fork_server_socket(args.fork_server_socket, os.environ)  # refused before connecting
    storage = connect(args.storage, heartbeat_interval_s=args.heartbeat_interval,
                      grace_period_s=args.grace_period, max_retry=args.max_retry)
    # SIGTERM (a pod being deleted) and SIGHUP stop the trial's server and hand the trial back,
    # as Ctrl-C does: autotune.cli runs every command under autotune.measure.signals.
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


def finalize_command(args: argparse.Namespace) -> int:
    from autotune.distributed import WorkerIdentity, connect, finalize

    fork_server = fork_server_socket(args.fork_server_socket, os.environ)  # refused before connecting
    storage = connect(args.storage, heartbeat_interval_s=args.heartbeat_interval,
                      grace_period_s=args.grace_period, max_retry=args.max_retry)
    return finalize(
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
