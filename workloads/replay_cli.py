"""`autotune replay`: send a trace to a running server and print what it measured.

    autotune replay --workload trace.jsonl --url http://127.0.0.1:8000 \\
        [--mode timed|concurrency=N] [--speedup X] [--duration S] \\
        [--slo ttft_p95_ms=500 ...] [--model NAME] [--no-benchmark-mode] \\
        [--api-key KEY] [--out requests.jsonl]

With `--out FILE` the per-request records go to FILE (JSONL) and the summary to
FILE with `.summary.json` in place of its suffix: `vllm bench serve`'s keys and ours, plus
`reconciliation` (workloads.reconcile.Reconciliation).

SLO lines judge the run over completed *and failed* requests (a failed request meets no SLO)
and say over how many: `ttft_p95_ms=500: MISSED (9 of 60 over or failed; at most 2 may miss)`.
A run whose requests or tokens do not add up (workloads.reconcile) prints a WARNING line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from pathlib import Path

from workloads.errors import WorkloadError
from workloads.files import write_text_atomic
from workloads.reconcile import Reconciliation, reconcile
from workloads.replay import ReplayMode, ReplayOptions, replay
from workloads.replay_summary import PER_REQUEST_METRICS, ReplayResult, ReplaySummary, write_records
from workloads.slo import allowed_misses, parse_slo, parse_slos
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
    reconciliation = reconcile(trace, result, benchmark_mode=options.benchmark_mode)
    print(format_summary(result.summary, title=f"Replay of {trace.source} ({mode})",
                         reconciliation=reconciliation))
    if args.out is not None:
        write_result(result, reconciliation, args.out)
        print(f"records: {args.out}\nsummary: {summary_path(args.out)}")
    _print_errors(result)
    return 0


def write_result(result: ReplayResult, reconciliation: Reconciliation, out: Path) -> None:
    """The records to `out` (JSONL) and the summary with its `reconciliation` beside them
    (`summary_path(out)`), each written atomically."""
    write_records(out, result.records)
    payload = result.summary.model_dump(mode="json")
    payload["reconciliation"] = reconciliation.model_dump(mode="json")
    write_text_atomic(summary_path(out), json.dumps(payload, indent=2) + "\n")


def _print_errors(result: ReplayResult) -> None:
    errors: dict[str, int] = {}
    for record in result.records:
        if record.error is not None and not record.cancelled:
            errors[record.error] = errors.get(record.error, 0) + 1
    for error, count in sorted(errors.items(), key=lambda item: -item[1])[:5]:
        print(f"  {count} x {error}")


def format_summary(
    summary: ReplaySummary, *, title: str = "Replay", reconciliation: Reconciliation | None = None
) -> str:
    """The `vllm bench serve` result table, then each SLO's verdict with its denominator and,
    given one, the run's reconciliation with a WARNING line per problem or warning."""
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
        lines.append(f"{'SLOs (failed requests count as misses)':-^{width}}")
        for spec, met in summary.slo_met.items():
            lines.append(slo_line(summary, spec, met))
    if reconciliation is not None:
        lines.extend(reconciliation_lines(reconciliation, width))
    lines.append("=" * width)
    return "\n".join(lines)


def slo_line(summary: ReplaySummary, spec: str, met: bool) -> str:
    """`ttft_p95_ms=500: MISSED (9 of 60 over or failed; at most 2 may miss)`: the verdict
    and the requests it was judged over (`ReplaySummary.slo_requests`)."""
    slo = parse_slo(spec)
    verdict = "met" if met else "MISSED"
    judged = summary.slo_requests.get(spec)
    if judged is None:  # a summary written before the denominators were kept
        return f"{spec}: {verdict}"
    if judged == 0:
        return f"{spec}: {verdict} (nothing measured)"
    allowed = allowed_misses(judged, slo.percentile)
    if slo.metric not in PER_REQUEST_METRICS:
        # A percentile of token gaps: failures are judged by count beside it.
        return (f"{spec}: {verdict} (p{slo.percentile:g} of the token gaps of {summary.completed} "
                f"completed requests; {summary.failed} of {judged} failed, at most {allowed} may fail)")
    missed = summary.slo_violations.get(spec, 0)
    detail = f"{missed} of {judged} over or failed"
    if met and missed > allowed:  # the percentile interpolates between a value within and one over
        return f"{spec}: {verdict} ({detail}; the p{slo.percentile:g} still falls within)"
    return f"{spec}: {verdict} ({detail}; at most {allowed} may miss)"


def reconciliation_lines(reconciliation: Reconciliation, width: int = 50) -> list[str]:
    """The reconciliation block of `format_summary`."""
    r = reconciliation
    source = r.tokens_source or "none completed"
    lines = [
        f"{'Reconciliation':-^{width}}",
        f"{'Requests planned / sent:':<30}{f'{r.planned} / {r.sent}':>20}",
        f"{'Completed / failed / cancelled:':<30}{f'{r.completed} / {r.failed} / {r.cancelled}':>20}",
        f"{'Output tokens requested:':<30}{f'{r.tokens_requested:,}':>20}",
        f"{'Output tokens received:':<30}{f'{r.tokens_received:,} ({source})':>20}",
    ]
    if r.chunk_vs_usage is not None:
        lines.append(f"{'Chunk count vs usage:':<30}{f'{r.chunk_vs_usage:+.1%}':>20}")
    if r.problem is not None:
        lines.append(f"WARNING: this run must not be scored: {r.problem}")
    lines.extend(f"WARNING: {warning}" for warning in r.warnings)
    return lines
