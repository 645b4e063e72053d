"""The flags more than one command takes, defined once so that their spelling, defaults and
help are the same in each: how each config is measured (replay, load ladder, server start)
and re-checked in the gate (`run`, `retune`) and the request fields they fill; the shared fork
server's socket (`run`, `retune`, `worker`, `finalize`); the shared study (`worker`,
`finalize`).

The client-lag limit may also come from the environment (`AUTOTUNE_MAX_CLIENT_LAG_MS`), for
hosts where the load client shares its CPUs with other work on purpose (a CI runner, a test
suite) and a lagging client is expected rather than a measurement to throw away; the flag wins
over it. So may the shared fork server's socket (`AUTOTUNE_FORK_SERVER_SOCKET`), for every
tuner of a host."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune.errors import AutotuneError
from autotune.measure.forkserver import SharedForkServer
from autotune.plan import (
    DEFAULT_HOLDOUT_S,
    DEFAULT_LADDER_RESOLUTION,
    DEFAULT_REPEATS,
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_TOP_K,
    DEFAULT_TUNING_S,
)
from autotune.preflight import OVER_CONTEXT_CHOICES

FORK_SERVERS_CHOICES = ("on", "off")

CLIENT_LAG_ENV = "AUTOTUNE_MAX_CLIENT_LAG_MS"
FORK_SERVER_SOCKET_ENV = "AUTOTUNE_FORK_SERVER_SOCKET"

# A dead worker's trial is failed and re-queued within about a minute; a heartbeat every 10 s
# costs one tiny UPDATE per running trial.
HEARTBEAT_INTERVAL_S = 10
GRACE_PERIOD_S = 60
MAX_RETRY = 2


def add_measurement_flags(add: Any) -> None:
    """Register the shared flags with `add` (a parser's `add_argument`)."""
    add("--over-context", choices=OVER_CONTEXT_CHOICES, default="refuse",
        help="requests whose input + output exceed the model's context: refuse the run (default), "
             "drop them from the trace, or cap them (prompts cut to fit); dropped or capped "
             "requests are counted in the log, report.md and best.yaml")
    add("--step-requests", type=int, default=None, metavar="N",
        help="capacity ladder: requests per load step, at least (default: 200 on GPU, 60 on CPU)")
    add("--ladder-resolution", type=float, default=DEFAULT_LADDER_RESOLUTION, metavar="R",
        help="capacity ladder: stop bisecting when the failing rate is within this fraction "
             "of the passing one (default: %(default)s)")
    add("--max-speedup", type=float, default=None, metavar="X",
        help="capacity ladder: the highest rate tried, as a multiple of the recorded rate; a "
             "config that meets every SLO there is reported as carrying at least X (default: 256)")
    add("--max-client-lag-ms", type=float, default=None, metavar="MS",
        help="a measured run (ladder step or window) whose replayer send-lag p99 exceeds this "
             "is not scored: the client, not only the server, shaped it (default: $"
             + CLIENT_LAG_ENV + " if set, else a tenth of the tightest TTFT or E2E SLO "
             "threshold, at least 50)")
    add("--client-cpus", default="auto", metavar="auto|off|LIST",
        help="CPUs of the load client (the replayer); the server gets the others: auto = the "
             "last half of the host's CPUs on hosts of 8 or more with a GPU engine, off = "
             "shared, or a list such as 12-15 (default: %(default)s)")
    add("--fork-servers", choices=FORK_SERVERS_CHOICES, default="on",
        help="start each trial's server (ours, not --server vllm) by forking a process that "
             "imported vLLM once, instead of a fresh `python -m server`: ready in 0.3x the time "
             "on a 2-core CPU, 0.5x on an H200 with a 1.5B model (default: %(default)s)")
    add_fork_server_socket_flag(add)
    add("--seed", type=int, default=0, help="sampler seed (default: %(default)s)")
    add("--tuning-window", type=float, default=DEFAULT_TUNING_S, metavar="S",
        help="seconds of trace replayed per search trial; lengthened when too few requests for "
             "the SLO percentiles (p95: 200, p99: 1,000) (default: %(default)s)")
    add("--holdout-window", type=float, default=DEFAULT_HOLDOUT_S, metavar="S",
        help="seconds of (disjoint) trace replayed per validation run; lengthened likewise "
             "(default: %(default)s)")
    add("--speedup", type=float, default=1.0,
        help="replay arrivals this many times faster than recorded (timed mode) (default: %(default)s)")
    add("--top-k", type=int, default=DEFAULT_TOP_K, metavar="K",
        help="configs from the search re-run in validation beside the baseline (default: %(default)s)")
    add("--repeats", type=int, default=DEFAULT_REPEATS, metavar="R",
        help="validation repeats per config (interleaved) (default: %(default)s)")
    add("--mode", default="timed", metavar="timed|concurrency=N",
        help="replay at recorded arrival times, or closed loop with N requests in flight (default: %(default)s)")
    add("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S, metavar="S",
        help="seconds a server may take to become ready before the trial fails (default: %(default)s)")


def add_fork_server_socket_flag(add: Any) -> None:
    """--fork-server-socket (run, retune, worker, finalize)."""
    add("--fork-server-socket", type=Path, default=None, metavar="PATH",
        help="fork trial servers from the shared fork server listening here (`autotune "
             "fork-server --socket PATH`) where it imported vLLM in this environment, else from "
             "one of our own, where fork servers are on (default: $" + FORK_SERVER_SOCKET_ENV + ")")


def add_study_flags(add: Any) -> None:
    """The shared study's flags (worker, finalize) with `add` (a parser's `add_argument`)."""
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


def measurement_fields(args: argparse.Namespace,
                       environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The `TuningRequest` fields the shared flags fill, by field name."""
    return {
        "max_client_lag_ms": client_lag_limit(args.max_client_lag_ms, environ),
        "client_cpus": args.client_cpus,
        "fork_servers": args.fork_servers,
        "fork_server_socket": fork_server_socket(args.fork_server_socket, environ, fork_servers=args.fork_servers),
        "over_context": args.over_context,
        "step_requests": args.step_requests,
        "ladder_resolution": args.ladder_resolution,
        "max_speedup": args.max_speedup,
        "seed": args.seed,
        "tuning_window_s": args.tuning_window,
        "holdout_window_s": args.holdout_window,
        "speedup": args.speedup,
        "top_k": args.top_k,
        "repeats": args.repeats,
        "mode": args.mode,
        "startup_timeout_s": args.startup_timeout,
    }
