"""`autotune replay`: send a trace to a running server and print what it measured.

    autotune replay --workload trace.jsonl --url http://127.0.0.1:8000 \\
        [--mode timed|concurrency=N] [--speedup X] [--duration S] \\
        [--slo ttft_p95_ms=500 ...] [--model NAME] [--no-benchmark-mode] \\
        [--api-key KEY] [--out requests.jsonl]

With `--out FILE` the per-request records go to FILE (JSONL) and the summary to
FILE with `.summary.json` in place of its suffix.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

from workloads.errors import WorkloadError
from workloads.replay import ReplayMode, ReplayOptions, replay
from workloads.replay_summary import ReplayResult, ReplaySummary
from workloads.slo import parse_slos
from workloads.trace_io import load_trace


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="replay a trace against a running server and measure it",
        description="Send a trace's requests to an OpenAI-compatible server (streaming "
        "/v1/completions with token-id prompts) at their recorded times or at a fixed "
        "concurrency, and measure TTFT, inter-token latency, E2E latency and goodput.",
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
    parser.set_defaults(func=run)


def summary_path(out: Path) -> Path:
    """Where the summary goes next to the records: `run.jsonl` -> `run.summary.json`."""
    return out.with_name(out.stem + ".summary.json") if out.suffix else Path(f"{out}.summary.json")


def run(args: argparse.Namespace) -> int:
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
    print(format_summary(result.summary, title=f"Replay of {trace.source} ({mode})"))
    if args.out is not None:
        result.write(args.out, summary_path(args.out))
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


def format_summary(summary: ReplaySummary, *, title: str = "Replay") -> str:
    """The `vllm bench serve` result table."""
    width = 50
    lines = [f"{' ' + title + ' ':=^{width}}"]

    def row(label: str, value: object, fmt: str = "") -> None:
        shown = "n/a" if value is None else format(value, fmt)
        lines.append(f"{label:<40}{shown:>10}")

    row("Successful requests:", summary.completed)
    row("Failed requests:", summary.failed)
    if summary.cancelled:
        row("Cancelled (stopped early):", summary.cancelled)
    row("Benchmark duration (s):", summary.duration, ".2f")
    row("Total input tokens:", summary.total_input_tokens)
    row("Total generated tokens:", summary.total_output_tokens)
    row("Request throughput (req/s):", summary.request_throughput, ".2f")
    if summary.request_goodput is not None:
        row("Request goodput (req/s):", summary.request_goodput, ".2f")
    row("Output token throughput (tok/s):", summary.output_throughput, ".2f")
    row("Total token throughput (tok/s):", summary.total_token_throughput, ".2f")
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for metric, heading in titles.items():
        lines.append(f"{heading:-^{width}}")
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"),
                            ("p95", "P95"), ("p99", "P99")):
            row(f"{label} {metric.upper()} (ms):", getattr(summary, f"{stat}_{metric}_ms"), ".2f")
    lines.append(f"{'Client send lag':-^{width}}")
    row("P50 lag (ms):", summary.send_lag_p50_ms, ".2f")
    row("P99 lag (ms):", summary.send_lag_p99_ms, ".2f")
    row("Max lag (ms):", summary.send_lag_max_ms, ".2f")
    if summary.client_lagging:
        lines.append("WARNING: the replayer lagged its schedule; figures reflect the client too")
    if summary.slo_met:
        lines.append(f"{'SLOs (run percentiles)':-^{width}}")
        for spec, met in summary.slo_met.items():
            row(f"{spec}:", "met" if met else "MISSED")
    lines.append("=" * width)
    return "\n".join(lines)
