"""What a replay leaves: the summary table `autotune replay` prints, and the records and
summary files it writes with `--out FILE`.

The records go to FILE (JSONL) and the summary to FILE with `.summary.json` in place of its
suffix: `vllm bench serve`'s keys and ours, plus `reconciliation`
(workloads.reconcile.Reconciliation).

SLO lines judge the run over completed *and failed* requests (a failed request meets no SLO)
and say over how many: `ttft_p95_ms=500: MISSED (9 of 60 over or failed; at most 2 may miss)`.
A run whose requests or tokens do not add up (workloads.reconcile) prints a WARNING line.
"""

from __future__ import annotations

import json
from pathlib import Path

from workloads.files import write_text_atomic
from workloads.reconcile import Reconciliation
from workloads.replay_summary import PER_REQUEST_METRICS, ReplayResult, ReplaySummary, write_records
from workloads.slo import allowed_misses, parse_slo


def summary_path(out: Path) -> Path:
    """Where the summary goes next to the records: `run.jsonl` -> `run.summary.json`."""
    return out.with_name(out.stem + ".summary.json") if out.suffix else Path(f"{out}.summary.json")


def write_result(result: ReplayResult, reconciliation: Reconciliation, out: Path) -> None:
    """The records to `out` (JSONL) and the summary with its `reconciliation` beside them
    (`summary_path(out)`), each written atomically."""
    write_records(out, result.records)
    payload = result.summary.model_dump(mode="json")
    payload["reconciliation"] = reconciliation.model_dump(mode="json")
    write_text_atomic(summary_path(out), json.dumps(payload, indent=2) + "\n")


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
