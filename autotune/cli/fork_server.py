"""`autotune fork-server --socket PATH`: one fork server for every tuner of this host.

Each `autotune run` forks its trial servers from a process that imported vLLM once
(autotune.measure.forkserver), paying that import (8-9 s of CPU on a 2-core VM) per run. Tuners
started with `--fork-server-socket PATH` (or AUTOTUNE_FORK_SERVER_SOCKET) fork theirs from this
one instead, where they run in the environment it imported under; elsewhere they start their own.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from autotune.errors import AutotuneError, describe_command
from autotune.measure.forkserver import ForkServer


def configure(parser: argparse.ArgumentParser) -> None:
    """`autotune fork-server`'s description and flags."""
    describe_command(
        parser,
        (
            "Start a fork server listening on a Unix socket and keep it until Ctrl-C or SIGTERM. "
            "`autotune run|retune --fork-server-socket PATH` (or AUTOTUNE_FORK_SERVER_SOCKET=PATH) "
            "then forks each trial server from it instead of importing vLLM in a fork server of "
            "its own, where the tuner's environment is the one this command was started in."
        ),
    )
    parser.add_argument("--socket", type=Path, required=True, metavar="PATH",
                        help="the Unix socket to listen on (a stale one is replaced)")
    parser.set_defaults(func=fork_server_command)


def fork_server_command(args: argparse.Namespace) -> int:
    server = ForkServer(listen=args.socket)
    try:
        if not server.wait_ready():
            raise AutotuneError(f"{server.describe_exit()} before it had imported vLLM and the server")
        print(f"fork server {server.pid} listening at {args.socket}; stop it with Ctrl-C", flush=True)
        server.process.wait()  # until Ctrl-C or SIGTERM (a KeyboardInterrupt here), or its death
        raise AutotuneError(f"{server.describe_exit()} while listening at {args.socket}")
    finally:
        server.close()
