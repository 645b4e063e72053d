"""Representative windows, rate and time scaling, length clipping."""

from __future__ import annotations

import numpy as np
import pytest

from workloads.errors import WorkloadError
from workloads.profile import burstiness_cv
from workloads.trace import Trace
from workloads.windows import clip_lengths, scale_rate, select_windows, speedup


def steady_trace_with_odd_start(seed: int = 0) -> Trace:
    """600 s of Poisson traffic at 5 req/s with short requests, except the first 40 s,
    which carry the same rate of very long prompts (a warm-up batch job, say)."""
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(200.0, size=3000))
    times = times[times < 600_000]
    inputs = rng.integers(10, 200, size=len(times))
    odd = times < 40_000
    inputs[odd] = rng.integers(3000, 4000, size=int(odd.sum()))
    outputs = rng.integers(10, 200, size=len(times))
    return Trace(times, inputs, outputs, source="odd-start")


def test_picks_representative_disjoint_windows() -> None:
    trace = steady_trace_with_odd_start()
    tuning, holdout, info = select_windows(trace, 60, 60)
    for choice in (info.tuning, info.holdout):
        assert choice.start_s >= 40  # clear of the unrepresentative start
        assert choice.end_s - choice.start_s == 60
    assert info.tuning.end_s <= info.holdout.start_s or info.holdout.end_s <= info.tuning.start_s
    for window in (tuning, holdout):
        assert window.input_lengths.max() < 200
        assert 0 <= window.timestamps_ms[0] < 2000 and window.timestamps_ms[-1] < 60_000
    # The naive choice, the first minute, is far from the whole trace; the pick is close.
    assert info.tuning.distance < 0.2
    first_minute = trace.slice_time(0, 60_000)
    assert np.median(first_minute.input_lengths) > 1000


def test_window_errors() -> None:
    trace = steady_trace_with_odd_start()
    with pytest.raises(WorkloadError, match="too short"):
        select_windows(trace, 400, 300)
    with pytest.raises(WorkloadError, match="> 0"):
        select_windows(trace, 0, 60)


def test_speedup_compresses_time() -> None:
    trace = steady_trace_with_odd_start()
    fast = speedup(trace, 2.0)
    assert fast.duration_s() == pytest.approx(trace.duration_s() / 2)
    assert fast.input_lengths.tolist() == trace.input_lengths.tolist()
    with pytest.raises(WorkloadError):
        speedup(trace, 0)


@pytest.mark.parametrize("factor", [0.4, 2.5])
def test_scale_rate_hits_target_and_keeps_shape(factor: float) -> None:
    trace = steady_trace_with_odd_start()
    rate = len(trace) / trace.duration_s()
    scaled = scale_rate(trace, rate * factor, seed=3)
    assert len(scaled) / trace.duration_s() == pytest.approx(rate * factor, rel=0.01)
    assert scaled.duration_s() <= trace.duration_s()
    # Poisson stays Poisson: thinning and overlaying shifted copies keep CV near 1.
    assert burstiness_cv(scaled.timestamps_ms) == pytest.approx(1.0, abs=0.1)
    again = scale_rate(trace, rate * factor, seed=3)
    assert again.timestamps_ms.tolist() == scaled.timestamps_ms.tolist()


def test_clip_lengths_counts_and_fits() -> None:
    trace = Trace([0, 1, 2, 3], [100, 500, 1000, 20], [50, 600, 10, 5])
    clipped, count = clip_lengths(trace, 512)
    assert count == 2  # requests 2 and 3 do not fit
    totals = clipped.input_lengths + clipped.output_lengths
    assert totals.max() <= 512
    assert clipped.input_lengths.tolist() == [100, 500, 511, 20]
    assert clipped.output_lengths.tolist() == [50, 12, 1, 5]
    assert clip_lengths(trace, 10_000) == (trace, 0)
