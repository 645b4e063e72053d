"""A replay's records and their statistics: one `RequestRecord` per request, the run's
`ReplaySummary` (`vllm bench serve` key names), `ReplayResult` and its files, and `Tally`,
which keeps a run's figures as requests finish so a summary can be taken at any moment.
The replaying itself (schedules, HTTP, streams) is `workloads.replay`.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from workloads.files import write_text_atomic
from workloads.slo import SLO, request_is_good, request_tpot_ms, request_value_ms, slo_met

# Above this send-lag p99 the client is not keeping the schedule: the run measures the
# replayer as much as the server, so the summary says so.
CLIENT_LAG_WARN_MS = 10.0
# A run is scored up to this send-lag p99 at least (more where the SLOs allow: ReplayOptions).
CLIENT_LAG_LIMIT_MS = 50.0
# SLO metrics with one value per request, so a request can be counted as missing one.
PER_REQUEST_METRICS = ("ttft", "tpot", "e2el")


class RequestRecord(BaseModel):
    """What happened to one request. Times are seconds from the replay start; latencies ms."""

    index: int
    scheduled_s: float
    sent_s: float
    lag_ms: float
    ttft_ms: float | None = None
    itl_ms: list[float] = []
    e2e_ms: float | None = None
    input_tokens: int
    # The answer's tokens: `usage_tokens` when the server sent usage, else `chunk_tokens`.
    output_tokens: int = 0
    # Both counts, kept for the run's reconciliation (workloads.reconcile): the server's
    # `usage.completion_tokens` (None: it sent none) and the tokens counted from the stream's
    # chunks (`token_ids` lengths, else one per chunk with text; None: records written before
    # these fields existed).
    usage_tokens: int | None = None
    chunk_tokens: int | None = None
    status: int | None = None
    error: str | None = None
    # A failed request (error set, not cancelled): ms from its send to its failure, so what
    # reads the records knows when it stopped occupying the server; None otherwise, and in
    # records written before this field.
    failed_after_ms: float | None = None
    # In flight when the replay was stopped early (on_progress returned True): neither
    # completed nor failed.
    cancelled: bool = False


class ReplaySummary(BaseModel):
    """A run's figures, under the key names `vllm bench serve` writes."""

    duration: float
    completed: int
    failed: int
    cancelled: int = 0
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None = None
    mean_ttft_ms: float | None = None
    median_ttft_ms: float | None = None
    p90_ttft_ms: float | None = None
    p95_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    mean_tpot_ms: float | None = None
    median_tpot_ms: float | None = None
    p90_tpot_ms: float | None = None
    p95_tpot_ms: float | None = None
    p99_tpot_ms: float | None = None
    mean_itl_ms: float | None = None
    median_itl_ms: float | None = None
    p90_itl_ms: float | None = None
    p95_itl_ms: float | None = None
    p99_itl_ms: float | None = None
    mean_e2el_ms: float | None = None
    median_e2el_ms: float | None = None
    p90_e2el_ms: float | None = None
    p95_e2el_ms: float | None = None
    p99_e2el_ms: float | None = None
    send_lag_p50_ms: float | None = None
    send_lag_p99_ms: float | None = None
    send_lag_max_ms: float | None = None
    client_lagging: bool = False
    client_processes: int = 1  # replayer processes that sent the run (workloads.replay_workers)
    # SLO spec -> the run meets it: its percentile over completed *and failed* requests, a
    # failed request counting as a miss (workloads.slo.slo_met); the latency figures above are
    # over completed requests only, as `vllm bench serve` has them.
    slo_met: dict[str, bool] = {}
    # SLO spec -> the requests that check was over (its denominator): completed requests with a
    # value of the metric (TPOT: answers of 2+ tokens) plus the failed ones.
    slo_requests: dict[str, int] = {}
    # SLO spec -> requests known to miss it (failed, finished over the threshold, or, in a
    # progress summary, still waiting past it); per-request metrics only (not itl). More
    # than (100 - percentile)% of `planned` means the SLO's percentile is missed already.
    slo_violations: dict[str, int] = {}
    planned: int = 0  # requests this run was to send
    stopped_early: bool = False


class ReplayResult(BaseModel):
    records: list[RequestRecord]
    summary: ReplaySummary

    def write(self, records_path: str | os.PathLike[str], summary_path: str | os.PathLike[str]) -> None:
        """Per-request JSONL and the summary JSON, each written atomically."""
        write_records(records_path, self.records)
        write_text_atomic(Path(summary_path), self.summary.model_dump_json(indent=2) + "\n")


def write_records(path: str | os.PathLike[str], records: Iterable[RequestRecord]) -> None:
    """One RequestRecord per JSONL line, written atomically."""
    write_text_atomic(Path(path), "".join(record.model_dump_json() + "\n" for record in records))


def _stats(values: np.ndarray, name: str) -> dict[str, float | None]:
    if values.size == 0:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "p90", "p95", "p99")}
    p50, p90, p95, p99 = np.percentile(values, [50, 90, 95, 99])
    return {
        f"mean_{name}_ms": float(values.mean()),
        f"median_{name}_ms": float(p50),
        f"p90_{name}_ms": float(p90),
        f"p95_{name}_ms": float(p95),
        f"p99_{name}_ms": float(p99),
    }


@dataclass(slots=True)
class Tally:
    """A run's values, appended as requests finish, ready to summarise at any moment.

    Columns are flat `array('d')`s: adding a record is cheap, and a copy for a progress
    summary is one memcpy, so the event loop that times sends never walks all records.
    """

    slos: tuple[SLO, ...]
    ttft: array = field(default_factory=lambda: array("d"))
    tpot: array = field(default_factory=lambda: array("d"))
    itl: array = field(default_factory=lambda: array("d"))
    e2el: array = field(default_factory=lambda: array("d"))
    lag: array = field(default_factory=lambda: array("d"))
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    good: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    violations: list[int] = field(default_factory=list)  # per SLO, aligned with `slos`

    def __post_init__(self) -> None:
        if len(self.violations) != len(self.slos):
            self.violations = [0] * len(self.slos)

    def _violated(self, record: RequestRecord) -> None:
        for k, slo in enumerate(self.slos):
            if slo.metric not in PER_REQUEST_METRICS:
                continue
            if record.error is not None:
                self.violations[k] += 1
                continue
            value = request_value_ms(record, slo)
            if value is not None and value > slo.threshold_ms:
                self.violations[k] += 1

    def add(self, record: RequestRecord) -> None:
        self.lag.append(record.lag_ms)
        if record.cancelled:
            self.cancelled += 1
            return
        self._violated(record)
        if record.error is not None:
            self.failed += 1
            return
        self.completed += 1
        self.input_tokens += record.input_tokens
        self.output_tokens += record.output_tokens
        if record.ttft_ms is not None:
            self.ttft.append(record.ttft_ms)
        if record.e2e_ms is not None:
            self.e2el.append(record.e2e_ms)
        tpot = request_tpot_ms(record)
        if tpot is not None:
            self.tpot.append(tpot)
        self.itl.extend(record.itl_ms)
        if self.slos and request_is_good(record, self.slos):
            self.good += 1

    def copy(self) -> Tally:
        # One memcpy per column, on the loop: 0.04 ms for 100k token gaps, ~20 ms for 2M
        # (measured here); the percentiles themselves run in the progress thread.
        return Tally(
            self.slos,
            self.ttft[:],
            self.tpot[:],
            self.itl[:],
            self.e2el[:],
            self.lag[:],
            self.completed,
            self.failed,
            self.cancelled,
            self.good,
            self.input_tokens,
            self.output_tokens,
            list(self.violations),
        )

    def _judged(self, slo: SLO, metrics: dict[str, np.ndarray]) -> int:
        if slo.metric == "itl":
            return self.completed + self.failed
        return int(metrics[slo.metric].size) + self.failed

    def summary(
        self,
        duration_s: float,
        *,
        stopped_early: bool = False,
        planned: int = 0,
        late: Sequence[int] = (),
    ) -> ReplaySummary:
        """`late`: per SLO, requests still in flight already past its threshold."""
        duration = max(duration_s, 1e-9)
        metrics = {
            name: np.frombuffer(getattr(self, name), dtype=np.float64)
            for name in ("ttft", "tpot", "itl", "e2el")
        }
        values: dict[str, object] = {}
        for name, column in metrics.items():
            values.update(_stats(column, name))
        lags = np.frombuffer(self.lag, dtype=np.float64)
        lag_p50 = lag_p99 = lag_max = None
        if lags.size:
            lag_p50, lag_p99 = (float(v) for v in np.percentile(lags, [50, 99]))
            lag_max = float(lags.max())
        total = self.input_tokens + self.output_tokens
        return ReplaySummary(
            duration=duration_s,
            completed=self.completed,
            failed=self.failed,
            cancelled=self.cancelled,
            total_input_tokens=self.input_tokens,
            total_output_tokens=self.output_tokens,
            request_throughput=self.completed / duration,
            output_throughput=self.output_tokens / duration,
            total_token_throughput=total / duration,
            request_goodput=self.good / duration if self.slos else None,
            send_lag_p50_ms=lag_p50,
            send_lag_p99_ms=lag_p99,
            send_lag_max_ms=lag_max,
            client_lagging=lag_p99 is not None and lag_p99 > CLIENT_LAG_WARN_MS,
            slo_met={
                slo.spec(): slo_met(metrics[slo.metric], slo, failed=self.failed,
                                    requests=self.completed + self.failed)
                for slo in self.slos
            },
            slo_requests={slo.spec(): self._judged(slo, metrics) for slo in self.slos},
            slo_violations={
                slo.spec(): self.violations[k] + (late[k] if late else 0)
                for k, slo in enumerate(self.slos)
                if slo.metric in PER_REQUEST_METRICS
            },
            planned=planned,
            stopped_early=stopped_early,
            **values,
        )


def summarize(
    records: Iterable[RequestRecord],
    duration_s: float,
    slos: Sequence[SLO] = (),
    *,
    stopped_early: bool = False,
) -> ReplaySummary:
    """Aggregate records over a run that lasted `duration_s` seconds.

    Completed requests give the latency figures and goodput; failed ones count, and count
    against every SLO (`slo_met`, `slo_violations`);
    cancelled ones (in flight when the run was stopped) are neither; send lag covers all.
    """
    tally = Tally(tuple(slos))
    count = 0
    for record in records:
        tally.add(record)
        count += 1
    return tally.summary(duration_s, stopped_early=stopped_early, planned=count)
