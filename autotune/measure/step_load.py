"""What one ladder step sends and what it offered: the step's requests (a representative
stretch of the window, sped up, holding what its percentiles need), its long silences cut
short, the rate its client really sent, whether the client kept its schedule, and how busy
the server was.

Split from `autotune.measure.ladder`, which runs the steps and searches over speed-ups; the
ladder re-exports these names.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Awaitable, Sequence
from typing import Protocol

import numpy as np

from autotune.errors import AutotuneError
from workloads.replay import ProgressCallback, ReplayOptions
from workloads.replay_summary import PER_REQUEST_METRICS, ReplayResult, RequestRecord
from workloads.slo import SLO, min_samples
from workloads.trace import Trace
from workloads.windows import feature_distance, stretch_features


class StepSize(Protocol):
    """The two settings a step's size comes from (`LadderSettings` has them)."""

    step_requests: int  # requests a step holds, at least
    min_step_s: float  # seconds a step lasts, at least, at its rate


def requests_for_percentile(percentile: float) -> int:
    """Requests a step needs before its `percentile` verdict rests on enough of them: the
    rule pre-flight applies to a window (`workloads.slo.min_samples`, about ten requests
    above the percentile: p50 20, p95 200, p99 1000). A p95 judged on 60 requests would rest
    on its 3rd-worst request."""
    return min_samples(percentile)


def requests_for_slos(slos: Sequence[SLO]) -> int:
    """The most requests any per-request SLO's percentile needs (`requests_for_percentile`).
    ITL counts tokens, not requests: a step has many more gaps than requests."""
    return max((requests_for_percentile(slo.percentile) for slo in slos
                if slo.metric in PER_REQUEST_METRICS), default=0)


# Candidate starts `step_trace` compares: enough to find a representative stretch of a window
# of thousands of requests, cheap enough to run before every step.
_MAX_STRETCH_STARTS = 200


def step_trace(window: Trace, speedup: float, settings: StepSize) -> Trace:
    """The step's requests: the stretch of the window most like the whole window, its
    arrival times divided by `speedup`.

    The window is taken as cyclic (repeated end to end, one mean gap at the seam so the seam
    keeps the rate). The step holds `settings.step_requests` requests and covers
    `settings.min_step_s` at its rate. Of the stretches of that many consecutive requests,
    it replays the one whose rate, burstiness and length percentiles are closest to the
    window's (`workloads.windows.feature_distance`, as `select_windows` chooses windows;
    ties go to the earliest start). The first N requests of a bursty window can be far
    quieter or busier than the window: a step replaying them would offer another rate than
    speed-up x the recorded rate. The ladder credits what was sent in any case
    (`LadderStep.offered_rps`); this keeps what is sent like the traffic it stands for.
    """
    if len(window) == 0:
        raise AutotuneError("the ladder's window has no requests")
    base = window.rebased()
    n = len(base)
    period_ms = max(base.duration_s() * 1000.0, 1.0)
    if n > 1:
        period_ms += period_ms / (n - 1)
    span_ms = settings.min_step_s * 1000.0 * speedup  # recorded ms the step must cover
    # Requests that cover the minimum span at the window's mean rate.
    covering = int(math.ceil(span_ms * n / period_ms)) + 1
    need = max(settings.step_requests, covering)
    copies = max(int(math.ceil((need + n) / n)), int(math.ceil(span_ms / period_ms)) + 2)
    stretched = base.repeated(copies, period_ms)
    start = _representative_start(stretched, n, need, base)
    stamps = stretched.timestamps_ms
    # Cover the whole minimum span from the chosen start, whatever its local rate.
    end = max(start + need, int(np.searchsorted(stamps, stamps[start] + span_ms, side="left")) + 1)
    end = min(end, len(stretched))
    picked = stretched.subset(np.arange(start, end))
    times = (picked.timestamps_ms - picked.timestamps_ms[0]) / speedup
    return picked.replace(timestamps_ms=times, source=f"{window.source} x{speedup:.3g}")


def _representative_start(stretched: Trace, n: int, need: int, window: Trace) -> int:
    """The start (within the first copy of the window) of the `need`-request stretch most like
    the window: of the stretches whose rate is within STRETCH_RATE_TOLERANCE of the window's
    (or, when none is, those nearest it), the one whose features are closest overall."""
    if n < 3 or need >= len(stretched):
        return 0
    whole = stretch_features(window.timestamps_ms, window.input_lengths, window.output_lengths)
    starts = np.unique(np.linspace(0, n - 1, num=min(n, _MAX_STRETCH_STARTS)).astype(np.int64))
    scored = []
    for start in starts.tolist():
        end = start + need
        features = stretch_features(stretched.timestamps_ms[start:end],
                                    stretched.input_lengths[start:end],
                                    stretched.output_lengths[start:end])
        rate_off = abs(features.rate_rps - whole.rate_rps) / max(whole.rate_rps, 1e-9)
        scored.append((start, rate_off, feature_distance(features, whole)))
    # The rate first: the step is to offer speed-up x the recorded rate.
    allowed = max(STRETCH_RATE_TOLERANCE, min(off for _, off, _ in scored) + 0.05)
    best, best_distance = 0, math.inf
    for start, rate_off, distance in scored:
        if rate_off <= allowed and distance < best_distance - 1e-9:
            best, best_distance = start, distance
    return best


# A step's stretch offers within this share of the window's own rate where one does.
STRETCH_RATE_TOLERANCE = 0.1


@dataclasses.dataclass(frozen=True)
class SilenceCuts:
    """The silences `cut_silences` shortened in a step's schedule: `after[k]` is the index of
    the request that ended silence k, `cut_s[k]` the seconds taken out of it. Empty: none."""

    after: tuple[int, ...] = ()
    cut_s: tuple[float, ...] = ()

    @property
    def total_s(self) -> float:
        return float(sum(self.cut_s))

    def between(self, first: int, last: int) -> float:
        """Seconds cut from the schedule between request `first` and request `last`."""
        return float(sum(cut for after, cut in zip(self.after, self.cut_s, strict=True) if first < after <= last))


def cut_silences(trace: Trace, max_silence_s: float | None) -> tuple[Trace, SilenceCuts]:
    """The step's schedule with every gap between arrivals longer than `max_silence_s`
    (seconds, at the step's speed) cut to it; None or no such gap: the trace unchanged.

    Why this measures the same: once every earlier request is answered the server is idle,
    and how long it stays idle changes no later latency (each step's prompts are fresh, so no
    cache carries over), only how long the step takes. A trace that idles for minutes between
    bursts (the Azure 2023 code trace spends 2,377 of its 3,436 s in gaps over 10 s) would
    otherwise cost minutes of idle GPU per step at a low speed-up. `cuts_found_idle` checks
    after the step that each cut silence did find the server idle; the step is credited at the
    uncut schedule's rate (`offered_as_sent` with the cuts), which is the load it stood for.
    """
    if max_silence_s is None or len(trace) < 2:
        return trace, SilenceCuts()
    stamps = np.asarray(trace.timestamps_ms, dtype=np.float64)
    gaps = np.diff(stamps)
    limit_ms = 1000.0 * max_silence_s
    over = np.flatnonzero(gaps > limit_ms)
    if over.size == 0:
        return trace, SilenceCuts()
    removed = np.zeros_like(gaps)
    removed[over] = gaps[over] - limit_ms
    shifted = stamps - np.concatenate(([0.0], np.cumsum(removed)))
    cuts = SilenceCuts(after=tuple(int(i) + 1 for i in over),
                       cut_s=tuple(float(removed[i]) / 1000.0 for i in over))
    return trace.replace(timestamps_ms=shifted), cuts


def cuts_found_idle(result: ReplayResult, cuts: SilenceCuts) -> bool:
    """True when, at the end of each cut silence, every request sent before it had been
    answered: the cut took only idle time out of the schedule. A silence the step never
    reached (it ended before) counts as idle. A failed request ended when it failed
    (`failed_after_ms`); one with no known end (cancelled, or failed in a record written
    before that field) counts as still in flight."""
    if not cuts.after:
        return True
    # In index order, the latest end of any request before each cut (inf: one never ended).
    records = sorted(result.records, key=lambda record: record.index)
    indices = [record.index for record in records]
    ends = []
    for record in records:
        took_ms = record.e2e_ms if record.e2e_ms is not None else record.failed_after_ms
        ends.append(math.inf if took_ms is None or record.cancelled else record.sent_s + took_ms / 1000.0)
    latest = np.maximum.accumulate(ends) if ends else np.array([])
    for after in cuts.after:
        at = bisect.bisect_left(indices, after)
        if at == len(indices) or indices[at] != after or at == 0:
            continue  # the step never sent the request that ends this silence, or none before it
        if latest[at - 1] > records[at].sent_s:
            return False
    return True


# A run is scored only if the client really offered at least this share of its rate.
MIN_SENT_SHARE = 0.9
# A lagging step is run again this many times before the ladder ends at the client's limit.
UNSCORED_RETRIES = 1


def sent_rate(result: ReplayResult, cuts: SilenceCuts | None = None) -> float:
    """Requests per second the client actually sent (by the send times it recorded), with the
    seconds `cuts` took out of the schedule between the first and the last send counted back;
    inf with fewer than two sends or all at one instant."""
    sent = sorted((r.sent_s, r.index) for r in result.records)
    if len(sent) < 2 or sent[-1][0] <= sent[0][0]:
        return float("inf")
    cut_s = cuts.between(sent[0][1], sent[-1][1]) if cuts else 0.0
    return (len(sent) - 1) / (sent[-1][0] - sent[0][0] + cut_s)


def due_by_last_send(trace: Trace, result: ReplayResult) -> Trace:
    """The step's requests that were due by the last one the client sent. A step stopped early
    (certain to pass or fail) never sends the rest, and the stretch it did send may be quieter
    than the whole step: its client is judged against what was due, not the step's mean rate."""
    if not result.records:
        return trace
    last_ms = 1000.0 * max(r.scheduled_s for r in result.records)
    due = int(np.searchsorted(trace.timestamps_ms, last_ms + 1e-6, side="right"))
    return trace.subset(np.arange(max(due, 1)))


def client_fell_behind(result: ReplayResult, nominal_rps: float, limit_ms: float) -> str | None:
    """Why the client, not only the server, shaped this run (None: it kept its schedule):
    its send-lag p99 over `limit_ms`, or less than MIN_SENT_SHARE of `nominal_rps` sent."""
    summary = result.summary
    lag = summary.send_lag_p99_ms
    if lag is not None and lag > limit_ms:
        return (f"the replayer's send-lag p99 was {lag:.0f} ms (limit {limit_ms:.0f} ms, "
                f"{summary.client_processes} process{'es' if summary.client_processes > 1 else ''})")
    sent = sent_rate(result)
    if sent < MIN_SENT_SHARE * nominal_rps:
        return (f"the client sent {sent:.3g} of the {nominal_rps:.3g} req/s asked "
                f"(send-lag p99 {lag or 0:.0f} ms)")
    return None


def offered_as_sent(trace: Trace, result: ReplayResult, cuts: SilenceCuts | None = None,
                    uncut: Trace | None = None) -> float:
    """The rate a step offered, from what its client sent: requests over the span of their
    send times, with the seconds `cuts` took out of the schedule between the first and the
    last send counted back (the load the step stands for; `trace` is what was sent, `uncut`
    the schedule before `cut_silences`). With fewer than two sends (or all at one instant):
    the uncut scheduled rate of the requests due by then."""
    rate = sent_rate(result, cuts)
    if math.isfinite(rate):
        return rate
    due = due_by_last_send(trace, result)
    return offered_rate((uncut or trace).subset(np.arange(len(due))))


# Below this share of a step's span with a request in flight, the server was mostly idle:
# a miss there is what single requests take, not load.
IDLE_BUSY_SHARE = 0.5


def busy_share(result: ReplayResult, idle_s: float = 0.0) -> float | None:
    """Share of the run's span (first send to last answer, plus `idle_s` the schedule was cut
    by: `SilenceCuts.total_s`) with at least one request in flight; None without records. A
    request that failed is in flight until it failed (`RequestRecord.failed_after_ms`); one
    whose end is unknown (cancelled, or recorded before that field) until the run ended."""
    if not result.records:
        return None
    start = min(r.sent_s for r in result.records)
    run_end = max(start + result.summary.duration, max(r.sent_s for r in result.records))

    def ended_s(record: RequestRecord) -> float:
        if record.e2e_ms is not None:
            return record.sent_s + record.e2e_ms / 1000.0
        if record.failed_after_ms is not None:
            return record.sent_s + record.failed_after_ms / 1000.0
        return run_end

    spans = sorted((r.sent_s, ended_s(r)) for r in result.records)
    end = max(stop for _, stop in spans)
    if end <= start:
        return 1.0
    busy, open_start, open_end = 0.0, spans[0][0], spans[0][1]
    for lo, hi in spans[1:]:
        if lo > open_end:
            busy += open_end - open_start
            open_start, open_end = lo, hi
        else:
            open_end = max(open_end, hi)
    busy += open_end - open_start
    return min(busy / (end - start + idle_s), 1.0)


def recorded_rate(window: Trace) -> float:
    """The window's own request rate (req/s), the 1x of the ladder."""
    return offered_rate(window.rebased()) if len(window) > 1 else 0.0


def offered_rate(trace: Trace) -> float:
    span = trace.duration_s()
    if span <= 0:
        return float("inf")
    # n arrivals over their span: n - 1 gaps.
    return (len(trace) - 1) / span


class ReplayFunction(Protocol):
    """What `LoadLadder` calls to run one step (`workloads.replay.replay` by default):

        result = await replay_fn(trace, url, options, on_progress=callback)

    - `trace`: the step's requests (`step_trace`: a representative stretch of the window,
      repeated as needed, its arrival times already divided by the step's speed-up).
    - `url`: the server's base URL (`http://HOST:PORT`); requests go to `{url}/v1/completions`.
    - `options`: a `workloads.replay.ReplayOptions`: timed mode at speed-up 1 (send request i
      at its timestamp after the start), the ladder's SLOs and per-request timeout, benchmark
      mode on (exact output lengths), no duration cut, and a `PromptFactory` seeded per step
      (fresh prompt tokens every step). Honour all of them as `replay` does.
    - `on_progress(elapsed_s, summary_so_far)`: call it about once a second with the run's
      `ReplaySummary` so far (`Tally.summary(elapsed, planned=..., late=...)`: the ladder's
      early verdicts read `completed`, `failed` and `slo_violations`, which must count the
      requests still in flight that already miss a TTFT / E2E threshold, `ReplayRun.late_counts`).
      It may block: call it off the event loop. When it returns True, stop sending, cancel what
      is in flight (records with `cancelled=True`) and return with `summary.stopped_early=True`.
    - returns a `ReplayResult` whose `records` hold every request sent (index = the
      request's index in `trace`) and whose `summary` covers the run.
    Errors of single requests are records, not exceptions; an exception ends the trial.
    """

    def __call__(self, trace: Trace, url: str, options: ReplayOptions, *,
                 on_progress: ProgressCallback | None = None) -> Awaitable[ReplayResult]: ...
