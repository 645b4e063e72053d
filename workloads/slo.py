"""Service-level objectives: `ttft_p95_ms=500` and what it means for a request and for a run.

Two questions, two answers (the same as `vllm bench serve --goodput`):

- Is one *request* good? For every SLO, the request's own value of the metric is <= the
  threshold. TTFT and E2E latency are single numbers per request; TPOT per request is
  `(e2e - ttft) / (output_tokens - 1)`; a request has many inter-token gaps, so for an ITL
  SLO its own gaps are summarised with the SLO's percentile. A failed request is never good.
- Does a *run* meet an SLO? The run's `percentile` of the metric is <= the threshold, over
  every request that completed or failed: a failed request meets no SLO, so it counts as
  infinitely slow (`run_percentile_ms`). `vllm bench serve` takes its percentiles over
  completed requests only, so a server failing 10% of requests would meet every p95 there;
  the latency figures of a summary (`p95_ttft_ms`, ...) stay over completed requests, under
  their `vllm bench serve` names. ITL is a percentile of token gaps, not of requests: its
  run check is the gaps' percentile and, on top, no more failed requests than the
  percentile lets miss (`allowed_misses`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from workloads.errors import WorkloadError

Metric = Literal["ttft", "tpot", "itl", "e2el"]
METRICS: tuple[Metric, ...] = ("ttft", "tpot", "itl", "e2el")
MIN_PERCENTILE = 50.0
MAX_PERCENTILE = 100.0

_SPEC = re.compile(r"^(?P<metric>[a-z0-9]+)_p(?P<pct>[0-9.]+)_ms=(?P<value>\S+)$")
_FORM = "expected METRIC_pPCT_ms=MS with METRIC in ttft|tpot|itl|e2el, e.g. ttft_p95_ms=500"


class SLO(BaseModel):
    """One objective: the `percentile` of `metric` must be at most `threshold_ms`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    metric: Metric
    percentile: float = Field(ge=MIN_PERCENTILE, le=MAX_PERCENTILE)
    threshold_ms: float = Field(gt=0, allow_inf_nan=False)

    def spec(self) -> str:
        """The text form, which `parse_slo` reads back: `ttft_p95_ms=500`."""
        return f"{self.metric}_p{self.percentile:g}_ms={self.threshold_ms:g}"

    def __str__(self) -> str:
        return self.spec()


def parse_slo(text: str) -> SLO:
    """`"ttft_p95_ms=500"` -> SLO(metric="ttft", percentile=95, threshold_ms=500)."""
    spec = text.strip()
    match = _SPEC.match(spec)
    if match is None:
        raise WorkloadError(f"SLO {text!r}: {_FORM}")
    metric = match["metric"]
    if metric not in METRICS:
        raise WorkloadError(f"SLO {text!r}: unknown metric {metric!r}; {_FORM}")
    try:
        percentile = float(match["pct"])
    except ValueError:
        raise WorkloadError(f"SLO {text!r}: percentile {match['pct']!r} is not a number; {_FORM}") from None
    if not MIN_PERCENTILE <= percentile <= MAX_PERCENTILE:
        raise WorkloadError(
            f"SLO {text!r}: percentile p{match['pct']} is outside p50..p100; {_FORM}"
        )
    try:
        threshold = float(match["value"])
    except ValueError:
        raise WorkloadError(
            f"SLO {text!r}: threshold {match['value']!r} is not a number of ms; {_FORM}"
        ) from None
    if not threshold > 0 or threshold == float("inf"):
        raise WorkloadError(f"SLO {text!r}: threshold must be a positive number of ms; {_FORM}")
    return SLO(metric=metric, percentile=percentile, threshold_ms=threshold)


def parse_slos(texts: Iterable[str]) -> list[SLO]:
    """Several specs; the same metric and percentile twice is a mistake worth naming."""
    slos: list[SLO] = []
    seen: dict[tuple[str, float], str] = {}
    for text in texts:
        slo = parse_slo(text)
        key = (slo.metric, slo.percentile)
        if key in seen:
            raise WorkloadError(f"SLO {text!r} repeats {seen[key]!r}; give each metric and percentile once")
        seen[key] = text
        slos.append(slo)
    return slos


class MeasuredRequest(Protocol):
    """What `request_is_good` reads from a request record (`workloads.replay_summary.RequestRecord`)."""

    error: str | None
    ttft_ms: float | None
    e2e_ms: float | None
    itl_ms: list[float]
    output_tokens: int


def request_tpot_ms(record: MeasuredRequest) -> float | None:
    """Time per output token after the first; None for one-token or unfinished requests."""
    if record.ttft_ms is None or record.e2e_ms is None or record.output_tokens < 2:
        return None
    return (record.e2e_ms - record.ttft_ms) / (record.output_tokens - 1)


def request_value_ms(record: MeasuredRequest, slo: SLO) -> float | None:
    """The request's own value of `slo.metric` (None when the request has none)."""
    if slo.metric == "ttft":
        return record.ttft_ms
    if slo.metric == "e2el":
        return record.e2e_ms
    if slo.metric == "tpot":
        return request_tpot_ms(record)
    if not record.itl_ms:
        return None
    return percentile(record.itl_ms, slo.percentile)


def percentile(values: Sequence[float], q: float) -> float:
    """numpy's default (linear) percentile in plain Python: for one request's few hundred
    gaps, checked once per request while the replay runs, about twice as fast as numpy."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def request_is_good(record: MeasuredRequest, slos: Sequence[SLO]) -> bool:
    """True when the request succeeded and meets every SLO on its own values.

    A metric a request cannot have (TPOT or ITL of a one-token answer) does not count
    against it, as in `vllm bench serve`; TTFT and E2E always exist for a success.
    """
    if record.error is not None or record.ttft_ms is None:
        return False
    for slo in slos:
        value = request_value_ms(record, slo)
        if value is None:
            if slo.metric in ("ttft", "e2el"):
                return False
            continue
        if value > slo.threshold_ms:
            return False
    return True


def allowed_misses(requests: int, percentile: float) -> int:
    """How many of `requests` may miss a threshold (fail, or be over it) while the run's
    `percentile` still holds for certain: numpy's linear percentile of n values is at or under
    T when at most floor((n - 1) * (1 - percentile / 100)) of them exceed T. (One miss more
    can still pass by interpolation when the values either side of the rank are close.)"""
    if requests <= 0:
        return 0
    return int(math.floor((requests - 1) * (1.0 - percentile / 100.0) + 1e-9))


def run_percentile_ms(
    values: Sequence[float] | np.ndarray, percentile: float, *, failed: int = 0
) -> float | None:
    """The `percentile` (numpy's linear interpolation) of `values` (ms, one per completed
    request) and `failed` more requests counted as infinitely slow: `math.inf` when the
    percentile reaches into the failures, None when there is nothing to judge. With no
    failures it is exactly `np.percentile(values, percentile)`."""
    array = np.asarray(values, dtype=np.float64)
    if failed <= 0:
        return float(np.percentile(array, percentile)) if array.size else None
    ordered = np.sort(array)
    n = ordered.size + failed
    rank = (n - 1) * percentile / 100.0
    low = int(math.floor(rank + 1e-9))
    fraction = max(rank - low, 0.0)
    if low >= ordered.size:
        return math.inf
    if fraction < 1e-9:
        return float(ordered[low])
    if low + 1 >= ordered.size:
        return math.inf  # interpolating towards a failure
    return float(ordered[low] + (ordered[low + 1] - ordered[low]) * fraction)


def slo_met(
    values: Sequence[float] | np.ndarray, slo: SLO, *, failed: int = 0, requests: int = 0
) -> bool:
    """True when the run meets `slo`. `values`: the run's values of its metric over completed
    requests (ms; token gaps for ITL); `failed`: requests that failed, which meet no SLO;
    `requests`: completed + failed (read by the ITL rule only).

    TTFT, TPOT, E2E: `run_percentile_ms(values, percentile, failed=failed)` <= threshold.
    ITL: the gaps' percentile <= threshold, and `failed` <= `allowed_misses(requests, ...)`.
    No values means nothing was measured, which cannot meet an objective.
    """
    array = np.asarray(values, dtype=np.float64)
    if array.size == 0:
        return False
    if slo.metric == "itl":
        within = float(np.percentile(array, slo.percentile)) <= slo.threshold_ms
        return within and failed <= allowed_misses(max(requests, failed), slo.percentile)
    value = run_percentile_ms(array, slo.percentile, failed=failed)
    return value is not None and value <= slo.threshold_ms


# A percentile rests on enough samples when about this many lie beyond it.
MIN_TAIL_SAMPLES = 10


def min_samples(percentile: float) -> int:
    """Samples (requests) a `percentile` needs: MIN_TAIL_SAMPLES beyond it, n >= 10 / (1 - p/100)
    (p50 20, p90 100, p95 200, p99 1,000). Pre-flight asks it of a window, the ladder of a step."""
    tail = 1.0 - percentile / 100.0
    return max(MIN_TAIL_SAMPLES, math.ceil(round(MIN_TAIL_SAMPLES / tail, 6)))
