"""Reconcile one replay run: were the requests and tokens planned the ones measured?

A run's figures rest on two counts that can go wrong without any error: requests (a record
lost on the way back, a request never sent) and tokens. TPOT divides a request's decode time
by the tokens it received, and the inter-token gaps assume one token per gap: a server that
streams several tokens per chunk and sends no usage (and no `token_ids`) is counted one token
per chunk, so TPOT reads several times too high and the gaps are per chunk. A run whose counts
do not add up is not to be scored; `reconcile` says which and why in one line.

    reconciliation = reconcile(trace, result, benchmark_mode=True)
    if reconciliation.problem:          # one line: why the run must not be scored
        ...
    for warning in reconciliation.warnings:   # one line each: figures to read with care
        ...
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel

from workloads.replay_summary import ReplayResult, RequestRecord
from workloads.trace import Trace

# Received output tokens may differ from those requested by this fraction (over completed
# requests), and chunk counts from the server's usage, before the run is flagged. Exact
# counts agree to the token; a few percent leaves room for a stray empty or merged chunk.
TOKEN_TOLERANCE = 0.05

TokensSource = Literal["usage", "chunks", "mixed"]


class Reconciliation(BaseModel):
    """One replay run's requests and output tokens, planned against measured.

    Counts are requests; tokens are output tokens over *completed* requests (a failed or
    cancelled request's partial answer is no measure of the server's token accounting).
    """

    planned: int  # requests the run was to send
    sent: int  # requests sent: one record each
    completed: int  # the run's tally (ReplaySummary), which must add up to `sent`
    failed: int
    cancelled: int  # in flight when the run was stopped early
    stopped_early: bool = False
    tokens_requested: int = 0  # trace output_length summed over completed requests
    tokens_received: int = 0  # usage.completion_tokens where sent, else tokens counted from chunks
    # Where `tokens_received` came from: every completed request's usage, none's (counted from
    # chunks), or some of each; None when no request completed.
    tokens_source: TokensSource | None = None
    # Over completed requests with both counts: usage's tokens, the chunks' count, and how far
    # the chunks are from usage ((chunks - usage) / usage; None when no request had both).
    usage_tokens: int = 0
    chunk_tokens: int = 0
    chunk_vs_usage: float | None = None
    send_lag_p99_ms: float | None = None
    problem: str | None = None  # one line: why the run must not be scored (None: it may be)
    warnings: list[str] = []  # one line each

    @property
    def ok(self) -> bool:
        """True when the run may be scored (no `problem`)."""
        return self.problem is None

    def describe(self) -> str:
        """One line: `60 planned, 60 sent, 54 completed, 6 failed; 432 of 432 requested output
        tokens received (usage)`."""
        counts = f"{self.planned} planned, {self.sent} sent, {self.completed} completed, {self.failed} failed"
        if self.cancelled:
            counts += f", {self.cancelled} cancelled"
        source = self.tokens_source or "none completed"
        return (f"{counts}; {self.tokens_received:,} of {self.tokens_requested:,} requested "
                f"output tokens received ({source})")


def reconcile(trace: Trace, result: ReplayResult, *, benchmark_mode: bool) -> Reconciliation:
    """Check `result`, the replay of `trace`, against what `trace` asked for.

    `trace` is the trace that was replayed (a record's `index` is its request's index there);
    `benchmark_mode`: the run asked for exact output lengths (ignore_eos / min_tokens), so the
    server must return exactly each request's `output_length`. Planned requests are
    `result.summary.planned` (a duration cut sends fewer), else `len(trace)`.

    Rules. A *problem* (the run must not be scored; `problem` joins all of them on one line):
    - records lost: the run's tally (completed + failed + cancelled) differs from the records
      that came back (`sent`), or a record's index is repeated or not in the trace;
    - a planned request neither sent nor accounted for in a run that was not stopped early;
    - benchmark mode: output tokens received more than TOKEN_TOLERANCE short of (or over) those
      requested, over completed requests: TPOT and ITL would be wrong.
    A *warning* (figures to read with care):
    - the same token mismatch outside benchmark mode (answers may end at EOS);
    - tokens counted from chunks disagreeing with the server's usage by more than
      TOKEN_TOLERANCE: the inter-token gaps are then per chunk, not per token.
    Send lag is reported, not judged here (the caller's lag rule decides what it means).
    Never raises for a bad run: a run is always reconciled, however broken.
    """
    summary = result.summary
    records = result.records
    planned = summary.planned or len(trace)
    problems: list[str] = []
    warnings: list[str] = []

    lost = _lost_records(trace, records, planned, summary.stopped_early,
                         summary.completed + summary.failed + summary.cancelled)
    if lost is not None:
        problems.append(lost)

    completed = [r for r in records if r.error is None and not r.cancelled and 0 <= r.index < len(trace)]
    requested = int(sum(int(trace.output_lengths[r.index]) for r in completed))
    received = sum(r.output_tokens for r in completed)
    with_usage = sum(1 for r in completed if r.usage_tokens is not None)
    source: TokensSource | None = None
    if completed:
        source = "usage" if with_usage == len(completed) else ("chunks" if with_usage == 0 else "mixed")
    both = [r for r in completed if r.usage_tokens is not None and r.chunk_tokens is not None]
    usage_tokens = sum(r.usage_tokens or 0 for r in both)
    chunk_tokens = sum(r.chunk_tokens or 0 for r in both)
    chunk_vs_usage = (chunk_tokens - usage_tokens) / usage_tokens if usage_tokens else None

    if requested and abs(received - requested) > TOKEN_TOLERANCE * requested:
        line = _token_mismatch(requested, received, len(completed), source, benchmark_mode)
        (problems if benchmark_mode else warnings).append(line)
    if chunk_vs_usage is not None and abs(chunk_vs_usage) > TOKEN_TOLERANCE:
        warnings.append(
            f"the stream's chunks carried {chunk_tokens:,} tokens by count, the server's usage "
            f"says {usage_tokens:,} ({chunk_vs_usage:+.0%}): the server bundles tokens in chunks "
            "without token_ids, so inter-token gaps (ITL) are per chunk, not per token "
            "(TPOT uses usage and holds)"
        )
    return Reconciliation(
        planned=planned,
        sent=len(records),
        completed=summary.completed,
        failed=summary.failed,
        cancelled=summary.cancelled,
        stopped_early=summary.stopped_early,
        tokens_requested=requested,
        tokens_received=received,
        tokens_source=source,
        usage_tokens=usage_tokens,
        chunk_tokens=chunk_tokens,
        chunk_vs_usage=chunk_vs_usage,
        send_lag_p99_ms=summary.send_lag_p99_ms,
        problem="; ".join(problems) or None,
        warnings=warnings,
    )


def combined(parts: Sequence[Reconciliation]) -> Reconciliation:
    """Several runs' reconciliations as one (a window's steps): counts and tokens summed, the
    worst send-lag p99, every problem and warning kept (each prefixed with its run's place,
    `run 2: ...`). No parts: an empty reconciliation."""
    sources = {p.tokens_source for p in parts if p.tokens_source is not None}
    usage = sum(p.usage_tokens for p in parts)
    chunks = sum(p.chunk_tokens for p in parts)
    lags = [p.send_lag_p99_ms for p in parts if p.send_lag_p99_ms is not None]
    problems = [f"run {k + 1}: {p.problem}" for k, p in enumerate(parts) if p.problem]
    return Reconciliation(
        planned=sum(p.planned for p in parts),
        sent=sum(p.sent for p in parts),
        completed=sum(p.completed for p in parts),
        failed=sum(p.failed for p in parts),
        cancelled=sum(p.cancelled for p in parts),
        stopped_early=any(p.stopped_early for p in parts),
        tokens_requested=sum(p.tokens_requested for p in parts),
        tokens_received=sum(p.tokens_received for p in parts),
        tokens_source=(sources.pop() if len(sources) == 1 else "mixed") if sources else None,
        usage_tokens=usage,
        chunk_tokens=chunks,
        chunk_vs_usage=(chunks - usage) / usage if usage else None,
        send_lag_p99_ms=max(lags) if lags else None,
        problem="; ".join(problems) or None,
        warnings=[f"run {k + 1}: {w}" for k, p in enumerate(parts) for w in p.warnings],
    )


def _lost_records(
    trace: Trace, records: Sequence[RequestRecord], planned: int, stopped_early: bool, tallied: int
) -> str | None:
    """Why the records do not account for the run's requests (None: they do)."""
    sent = len(records)
    if tallied != sent:
        return (f"records lost: the run counted {tallied} requests finished (completed, failed "
                f"or cancelled) but {sent} records came back")
    counts = Counter(r.index for r in records)
    repeated = sorted(i for i, n in counts.items() if n > 1)
    if repeated:
        return f"records do not match the trace: {len(repeated)} request indices recorded twice (first: {repeated[0]})"
    outside = sorted(i for i in counts if not 0 <= i < min(planned, len(trace)))
    if outside:
        return (f"records do not match the trace: {len(outside)} record indices outside the "
                f"{min(planned, len(trace))} planned requests (first: {outside[0]})")
    if sent < planned and not stopped_early:
        return (f"records lost: {planned - sent} of {planned} planned requests were neither sent "
                "nor accounted for, and the run was not stopped early")
    return None


def _token_mismatch(
    requested: int, received: int, completed: int, source: TokensSource | None, benchmark_mode: bool
) -> str:
    share = received / requested
    counted = {
        "usage": "by the server's usage",
        "chunks": "counted from chunks (the server sent no usage)",
        "mixed": "by usage where sent, else counted from chunks",
    }[source or "usage"]
    if not benchmark_mode:
        cause = "outside benchmark mode answers may end at EOS, but TPOT/ITL rest on these counts"
    elif received < requested and source != "usage":
        cause = ("the server likely streams several tokens per chunk without token_ids or "
                 "usage; TPOT/ITL would be wrong")
    elif received < requested:
        cause = ("the server ended answers early although asked for exact lengths "
                 "(ignore_eos, min_tokens); TPOT/ITL would be wrong")
    else:
        cause = "the server sent more than max_tokens; TPOT/ITL would be wrong"
    return (f"received {received:,} of {requested:,} requested output tokens ({share:.0%}) over "
            f"{completed} completed requests, {counted}: {cause}")
