"""What more than one command reads beside its typed options: the environment fallbacks of
two TuningRequest fields, and the shared study's flags (`worker`, `finalize`).

`autotune run`'s and `retune`'s measurement flags are generated from TuningRequest's fields
(autotune.request, autotune.options): declared there once. Two of them may also come from
the environment: the client-lag limit (`AUTOTUNE_MAX_CLIENT_LAG_MS`), for hosts where the load
client shares its CPUs with other work on purpose (a CI runner, a test suite) and a lagging
client is expected rather than a measurement to throw away, and the shared fork server's
socket (`AUTOTUNE_FORK_SERVER_SOCKET`), for every tuner of a host. The flag wins."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from autotune.errors import AutotuneError
from autotune.measure.forkserver import SharedForkServer
from autotune.options import add_flags, flag_values
from autotune.request import CLIENT_LAG_ENV, FORK_SERVER_SOCKET_ENV, TuningRequest

# A dead worker's trial is failed and re-queued within about a minute; a heartbeat every 10 s
# costs one tiny UPDATE per running trial.
HEARTBEAT_INTERVAL_S = 10
GRACE_PERIOD_S = 60
MAX_RETRY = 2


def add_fork_server_socket_flag(parser: argparse.ArgumentParser) -> None:
    """--fork-server-socket (worker, finalize): TuningRequest's field of that name."""
    add_flags(parser, TuningRequest, groups=("server",), only=("fork_server_socket",))


def add_study_flags(parser: argparse.ArgumentParser) -> None:
    """The shared study's flags (worker, finalize) and --fork-server-socket."""
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
    add_fork_server_socket_flag(parser)


def client_lag_limit(flag_ms: float | None, environ: Mapping[str, str]) -> float | None:
    """The client-lag limit in ms: the flag, else $AUTOTUNE_MAX_CLIENT_LAG_MS, else None (derived
    from the SLOs downstream)."""
    if flag_ms is not None:
        if not flag_ms > 0:
            raise AutotuneError(f"--max-client-lag-ms {flag_ms:g}: must be above 0 (e.g. 50)")
        return flag_ms
    text = environ.get(CLIENT_LAG_ENV, "").strip()
    if not text:
        return None
    try:
        limit = float(text)
    except ValueError:
        limit = math.nan
    if not (math.isfinite(limit) and limit > 0):
        raise AutotuneError(f"{CLIENT_LAG_ENV}={text}: must be a number of milliseconds above 0 "
                            "(e.g. 50)")
    return limit


def fork_server_socket(flag: Path | None, environ: Mapping[str, str], *, fork_servers: str = "on") -> Path | None:
    """The shared fork server's socket: the flag, else $AUTOTUNE_FORK_SERVER_SOCKET, else None
    (and None without fork servers); one nobody listens on is refused now, in one line."""
    text = environ.get(FORK_SERVER_SOCKET_ENV, "").strip()
    path = flag if flag is not None else Path(text) if text else None
    if path is None or fork_servers != "on":
        return None
    SharedForkServer(path).close()
    return path


def request_fields(args: argparse.Namespace, *, model: type[BaseModel] = TuningRequest,
                   only: Sequence[str] | None = None,
                   environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The `model` fields (a MeasurementOptions: TuningRequest, RetuneRequest) the user gave as
    flags (`only`: just these), with the client-lag limit and the fork server's socket from the
    environment where their flags are not given."""
    values = flag_values(args, model, only=only)
    if only is None or "max_client_lag_ms" in only:
        lag = client_lag_limit(values.get("max_client_lag_ms"), environ)
        if lag is not None:
            values["max_client_lag_ms"] = lag
    if only is None or "fork_server_socket" in only:
        values["fork_server_socket"] = fork_server_socket(
            values.get("fork_server_socket"), environ, fork_servers=values.get("fork_servers", "on"))
    return values


def connect_study(args: argparse.Namespace) -> tuple[Any, Path | None]:
    """(the study's storage, the shared fork server's socket) from `add_study_flags`' flags
    (worker, finalize): the socket refused in one line before connecting."""
    from autotune.distributed import connect

    fork_server = fork_server_socket(args.fork_server_socket, os.environ)
    storage = connect(args.storage, heartbeat_interval_s=args.heartbeat_interval,
                      grace_period_s=args.grace_period, max_retry=args.max_retry)
    return storage, fork_server
