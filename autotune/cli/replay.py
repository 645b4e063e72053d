"""`autotune replay`: send a trace to a running server and print what it measured.

    autotune replay --workload trace.jsonl --url http://127.0.0.1:8000 \\
        [--mode timed|concurrency=N] [--speedup X] [--duration S] \\
        [--slo ttft_p95_ms=500 ...] [--model NAME] [--no-benchmark-mode] \\
        [--api-key KEY] [--out requests.jsonl]

The summary table, the SLO lines and the files `--out` writes: workloads.replay_output.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

from workloads.errors import WorkloadError
from workloads.reconcile import reconcile
from workloads.replay import ReplayMode, ReplayOptions, replay
from workloads.replay_output import format_summary, summary_path, write_result
from workloads.replay_summary import ReplayResult
from workloads.slo import parse_slos
from workloads.trace_io import load_trace


def configure(parser: argparse.ArgumentParser) -> None:
    """`autotune replay`'s description and flags."""
    parser.description = (
        "Send a trace's requests to an OpenAI-compatible server (streaming "
        "/v1/completions with token-id prompts) at their recorded times or at a fixed "
        "concurrency, and measure TTFT, inter-token latency, E2E latency and goodput."
    )
    parser.add_argument("--workload", required=True, metavar="TRACE", help="trace JSONL file")
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--mode",
        default="timed",
        help="'timed' (recorded arrival times) or 'concurrency=N' (N in flight); default timed",
    )
    parser.add_argument(
        "--speedup", type=float, default=1.0, help="divide inter-arrival times by X (timed mode)"
    )
    parser.add_argument(
        "--duration", type=float, default=None, metavar="S", help="replay only the first S seconds"
    )
    parser.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="SPEC",
        help="objective such as ttft_p95_ms=500 (repeatable); enables request_goodput",
    )
    parser.add_argument("--model", default=None, help="model name to send (servers that need one)")
    parser.add_argument(
        "--no-benchmark-mode",
        dest="benchmark_mode",
        action="store_false",
        help="do not send ignore_eos/min_tokens (answers may end before output_length)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="bearer token (default: $VLLM_API_KEY)",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="per-request time limit"
    )
    parser.add_argument(
        "--out", type=Path, default=None, metavar="FILE", help="write per-request JSONL here"
    )
    parser.set_defaults(func=replay_command)


def replay_command(args: argparse.Namespace) -> int:
    mode = ReplayMode.parse(args.mode)
    slos = parse_slos(args.slo)
    if args.speedup <= 0:
        raise WorkloadError(f"--speedup {args.speedup:g}: must be > 0")
    if args.duration is not None and args.duration <= 0:
        raise WorkloadError(f"--duration {args.duration:g}: must be > 0 seconds")
    if args.timeout <= 0:
        raise WorkloadError(f"--timeout {args.timeout:g}: must be > 0 seconds")
    if not args.url.startswith(("http://", "https://")):
        raise WorkloadError(f"--url {args.url!r}: expected http://HOST:PORT")
    trace = load_trace(args.workload)
    if not len(trace):
        raise WorkloadError(f"{args.workload}: the trace has no requests")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    options = ReplayOptions(mode=mode, speedup=args.speedup, duration_s=args.duration, slos=slos,
                            model=args.model, benchmark_mode=args.benchmark_mode,
                            api_token=args.api_key, timeout_s=args.timeout)
    result = asyncio.run(replay(trace, args.url, options))
    reconciliation = reconcile(trace, result, benchmark_mode=options.benchmark_mode)
    print(format_summary(result.summary, title=f"Replay of {trace.source} ({mode})",
                         reconciliation=reconciliation))
    if args.out is not None:
        write_result(result, reconciliation, args.out)
        print(f"records: {args.out}\nsummary: {summary_path(args.out)}")
    _print_errors(result)
    return 0


def _print_errors(result: ReplayResult) -> None:
    errors: dict[str, int] = {}
    for record in result.records:
        if record.error is not None and not record.cancelled:
            errors[record.error] = errors.get(record.error, 0) + 1
    for error, count in sorted(errors.items(), key=lambda item: -item[1])[:5]:
        print(f"  {count} x {error}")
