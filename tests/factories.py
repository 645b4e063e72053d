"""The measured objects the tests build, with realistic defaults for every required field.

Each factory takes the fields a test is about as keyword overrides and fills the rest, so a
test says only what matters to it: `replay_summary(request_goodput=1.5, p95_ttft_ms=700)`.
A test about the exact fields of one of these builds it by hand.

The defaults are one consistent run: 20 requests in a 10 s window, 50 prompt and 20 output
tokens each (2 req/s, 40 output tok/s, 140 tok/s in all), none failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.measure.ladder import LadderStep
from autotune.measure.trial import TrialOutcome, TrialTiming
from workloads.replay_summary import ReplaySummary


def replay_summary(**overrides: Any) -> ReplaySummary:
    """A replay's figures; the latency percentiles and goodput are unset unless given."""
    fields: dict[str, Any] = {
        "duration": 10.0,
        "completed": 20,
        "failed": 0,
        "total_input_tokens": 1000,
        "total_output_tokens": 400,
        "request_throughput": 2.0,
        "output_throughput": 40.0,
        "total_token_throughput": 140.0,
    }
    return ReplaySummary(**(fields | overrides))


def trial_timing(**overrides: Any) -> TrialTiming:
    """Where a short fake trial's time went: a 1 s start, a 10 s window."""
    fields: dict[str, Any] = {"launch_s": 0.1, "ready_s": 1.0, "warmup_s": 0.5, "measure_s": 10.0, "teardown_s": 0.5}
    return TrialTiming(**(fields | overrides))


def trial_outcome(trial_dir: str | Path, **overrides: Any) -> TrialOutcome:
    """A trial's outcome in `trial_dir`: ok unless a `failure` is given (then not ok). Nothing
    else is set unless given (no summary, timing or capacity: which one a trial carries is what
    its test is about)."""
    fields: dict[str, Any] = {"ok": overrides.get("failure") is None, "trial_dir": str(trial_dir)}
    return TrialOutcome(**(fields | overrides))


def ladder_step(**overrides: Any) -> LadderStep:
    """One rung of a ladder: the window at 1x (10 req/s offered, 10 requests) that passed, its
    summary the default one; no SLO figures unless `measured_ms` is given."""
    fields: dict[str, Any] = {
        "index": 0,
        "speedup": 1.0,
        "offered_rps": 10.0,
        "requests": 10,
        "passed": True,
        "reason": "",
        "measured_ms": {},
        "summary": replay_summary(),
        "seconds": 1.0,
    }
    return LadderStep(**(fields | overrides))
