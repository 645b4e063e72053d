"""Cutting and reshaping traces: representative windows, time and rate scaling, clipping.

The tuner cannot replay hours of traffic per trial, so it replays a window. A window is
only useful if it looks like the whole trace: `select_windows` slides candidate windows
and picks the one whose rate, burstiness and length percentiles are closest to the whole
trace's, then a disjoint held-out window chosen the same way for validation.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict

from workloads.errors import WorkloadError
from workloads.profile import burstiness_cv
from workloads.trace import Trace

FEATURES = ("rate_rps", "burstiness_cv", "input_p50", "input_p90", "output_p50", "output_p90")
# Candidate windows per search: fine enough to find a good window, cheap for long traces.
_MAX_CANDIDATES = 400


class WindowFeatures(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rate_rps: float
    burstiness_cv: float | None
    input_p50: float
    input_p90: float
    output_p50: float
    output_p90: float


class WindowChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    start_s: float  # seconds from the first arrival of the whole trace
    end_s: float
    requests: int
    distance: float  # 0 = identical features to the whole trace
    features: WindowFeatures


class WindowInfo(BaseModel):
    """Why these windows: features of the trace and of both picks, and the search size."""

    model_config = ConfigDict(extra="forbid")

    whole: WindowFeatures
    tuning: WindowChoice
    holdout: WindowChoice
    candidates: int
    step_s: float


def _features(
    timestamps_ms: np.ndarray, inputs: np.ndarray, outputs: np.ndarray, span_s: float
) -> WindowFeatures:
    if len(timestamps_ms) == 0:
        return WindowFeatures(
            rate_rps=0.0, burstiness_cv=None, input_p50=0, input_p90=0, output_p50=0, output_p90=0
        )
    in_p50, in_p90 = np.percentile(inputs, [50, 90])
    out_p50, out_p90 = np.percentile(outputs, [50, 90])
    return WindowFeatures(
        rate_rps=len(timestamps_ms) / span_s if span_s > 0 else 0.0,
        burstiness_cv=burstiness_cv(timestamps_ms),
        input_p50=float(in_p50),
        input_p90=float(in_p90),
        output_p50=float(out_p50),
        output_p90=float(out_p90),
    )


def stretch_features(
    timestamps_ms: np.ndarray, inputs: np.ndarray, outputs: np.ndarray
) -> WindowFeatures:
    """The features of a run of consecutive requests, its rate over its own arrivals:
    (n - 1) / (last - first), the rate a replay of just these requests offers."""
    span_s = float(timestamps_ms[-1] - timestamps_ms[0]) / 1000.0 if len(timestamps_ms) > 1 else 0.0
    features = _features(timestamps_ms, inputs, outputs, span_s)
    rate = (len(timestamps_ms) - 1) / span_s if span_s > 0 else 0.0
    return features.model_copy(update={"rate_rps": rate})


def feature_distance(window: WindowFeatures, whole: WindowFeatures) -> float:
    """Root-mean-square of relative differences, feature by feature (scale-free)."""
    squares = []
    for name in FEATURES:
        a, b = getattr(window, name), getattr(whole, name)
        if b is None:
            continue
        if a is None:
            squares.append(1.0)  # too few requests to measure: as bad as 100% off
            continue
        squares.append(((a - b) / max(abs(b), 1e-9)) ** 2)
    return math.sqrt(sum(squares) / len(squares))


def _best_window(
    trace: Trace,
    whole: WindowFeatures,
    length_s: float,
    starts_s: np.ndarray,
    excluded: tuple[float, float] | None,
) -> WindowChoice | None:
    t0 = trace.timestamps_ms[0]
    best: WindowChoice | None = None
    for start_s in starts_s.tolist():
        end_s = start_s + length_s
        if excluded is not None and start_s < excluded[1] and excluded[0] < end_s:
            continue
        lo, hi = np.searchsorted(trace.timestamps_ms, [t0 + start_s * 1000, t0 + end_s * 1000])
        features = _features(
            trace.timestamps_ms[lo:hi],
            trace.input_lengths[lo:hi],
            trace.output_lengths[lo:hi],
            length_s,
        )
        distance = feature_distance(features, whole)
        if best is None or distance < best.distance:
            best = WindowChoice(
                start_s=start_s,
                end_s=end_s,
                requests=int(hi - lo),
                distance=distance,
                features=features,
            )
    return best


def select_windows(
    trace: Trace, tuning_s: float, holdout_s: float, *, step_s: float | None = None
) -> tuple[Trace, Trace, WindowInfo]:
    """The most representative tuning window and a disjoint, representative held-out window.

    Both are re-based to t=0. `step_s` is the slide between candidate starts (default: a
    quarter of the shorter window, coarser for very long traces).
    """
    if tuning_s <= 0 or holdout_s <= 0:
        raise WorkloadError(
            f"window lengths must be > 0 s (got tuning {tuning_s:g} s, held-out {holdout_s:g} s)"
        )
    span_s = trace.duration_s()
    if span_s < tuning_s + holdout_s:
        raise WorkloadError(
            f"{trace.source or 'trace'}: {span_s:.1f} s long, too short for a {tuning_s:g} s "
            f"tuning window plus a disjoint {holdout_s:g} s held-out window; shorten the "
            "windows or use a longer trace"
        )
    if step_s is None:
        step_s = max(
            min(tuning_s, holdout_s) / 4, (span_s - min(tuning_s, holdout_s)) / _MAX_CANDIDATES
        )
    if step_s <= 0:
        raise WorkloadError(f"window step must be > 0 s (got {step_s:g})")
    whole = _features(trace.timestamps_ms, trace.input_lengths, trace.output_lengths, span_s)

    def starts(length_s: float) -> np.ndarray:
        grid = np.arange(0.0, span_s - length_s + 1e-9, step_s)
        # The last possible start too, so the end of the trace is a candidate.
        return np.unique(np.append(grid, span_s - length_s))

    tuning_starts = starts(tuning_s)
    # Only tuning windows that leave room for the held-out one beside them (before or after).
    roomy = tuning_starts[
        (tuning_starts >= holdout_s - 1e-9) | (tuning_starts + tuning_s + holdout_s <= span_s + 1e-9)
    ]
    tuning = _best_window(trace, whole, tuning_s, roomy if len(roomy) else tuning_starts, None)
    assert tuning is not None  # span >= tuning_s, so there is at least one start
    holdout_starts = starts(holdout_s)
    holdout = _best_window(trace, whole, holdout_s, holdout_starts, (tuning.start_s, tuning.end_s))
    if holdout is None:
        # The step skipped every disjoint slot: place the held-out window flush against
        # the tuning window on whichever side has room.
        flush = [tuning.end_s] if tuning.end_s + holdout_s <= span_s else []
        if tuning.start_s - holdout_s >= 0:
            flush.append(tuning.start_s - holdout_s)
        holdout = _best_window(
            trace, whole, holdout_s, np.array(flush), (tuning.start_s, tuning.end_s)
        )
    if holdout is None:
        raise WorkloadError(
            f"{trace.source or 'trace'}: no room for a {holdout_s:g} s held-out window beside the "
            f"tuning window at {tuning.start_s:.1f}-{tuning.end_s:.1f} s; use shorter windows"
        )
    t0 = float(trace.timestamps_ms[0])
    info = WindowInfo(
        whole=whole,
        tuning=tuning,
        holdout=holdout,
        candidates=len(tuning_starts) + len(holdout_starts),
        step_s=step_s,
    )
    return (
        trace.slice_time(t0 + tuning.start_s * 1000, t0 + tuning.end_s * 1000),
        trace.slice_time(t0 + holdout.start_s * 1000, t0 + holdout.end_s * 1000),
        info,
    )


def speedup(trace: Trace, factor: float) -> Trace:
    """Arrivals `factor` times faster (2 = same requests in half the time)."""
    if not factor > 0 or not math.isfinite(factor):
        raise WorkloadError(f"speedup must be a finite number > 0 (got {factor!r})")
    return trace.replace(timestamps_ms=trace.timestamps_ms / factor)


def scale_rate(trace: Trace, target_rps: float, *, seed: int = 0) -> Trace:
    """The same time span at a different mean rate, keeping the shape of the traffic.

    Lower rate: a seeded random subset of requests (thinning). Higher rate: the trace is
    overlaid with copies of itself, each circularly shifted in time by a random offset, so
    every copy keeps the original burst pattern without stacking requests on identical
    instants; the last copy is thinned to hit the target.
    """
    if not target_rps > 0 or not math.isfinite(target_rps):
        raise WorkloadError(f"target rate must be a finite number > 0 req/s (got {target_rps!r})")
    span_s = trace.duration_s()
    if span_s <= 0:
        raise WorkloadError(
            f"{trace.source or 'trace'}: needs two or more distinct arrival times to rescale its rate"
        )
    rng = np.random.default_rng(seed)
    n = len(trace)
    wanted = max(1, round(target_rps * span_s))
    if wanted <= n:
        return trace.subset(np.sort(rng.choice(n, wanted, replace=False)))
    t0 = trace.timestamps_ms[0]
    span_ms = span_s * 1000
    indices = [np.arange(n)]
    times = [trace.timestamps_ms]
    remaining = wanted - n
    while remaining > 0:
        take = min(n, remaining)
        picked = np.arange(n) if take == n else np.sort(rng.choice(n, take, replace=False))
        offset = rng.uniform(0, span_ms)
        shifted = (trace.timestamps_ms[picked] - t0 + offset) % span_ms + t0
        indices.append(picked)
        times.append(shifted)
        remaining -= take
    scaled = trace.subset(np.concatenate(indices))
    return scaled.replace(timestamps_ms=np.concatenate(times))


def clip_lengths(trace: Trace, max_model_len: int) -> tuple[Trace, int]:
    """Make every request fit `input + output <= max_model_len`; returns the count changed.

    The output is shortened first (down to 1 token), then the input.
    """
    if max_model_len < 2:
        raise WorkloadError(f"max_model_len must be >= 2 tokens (got {max_model_len})")
    inputs, outputs = trace.input_lengths, trace.output_lengths
    too_long = inputs + outputs > max_model_len
    count = int(too_long.sum())
    if count == 0:
        return trace, 0
    new_outputs = np.where(
        too_long, np.minimum(outputs, np.maximum(1, max_model_len - inputs)), outputs
    )
    new_inputs = np.where(too_long, np.minimum(inputs, max_model_len - new_outputs), inputs)
    clipped = trace.replace()
    clipped.input_lengths = new_inputs.astype(np.int64)
    clipped.output_lengths = new_outputs.astype(np.int64)
    return clipped, count
