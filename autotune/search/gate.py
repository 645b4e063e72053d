"""The validation gate: is the best config really better than the baseline, beyond the noise?

The top K configs of the search and the baseline are re-run on the held-out window, R times,
interleaved (round-robin, the starting config rotating per repeat) so that slow drift of the
machine hits every config alike. Then `decide`:

1. Eligible: a candidate whose every repeat ran and met every SLO.
2. Winner: the eligible candidate with the best median objective.
3. Emit it only if it beats the baseline beyond the noise:
   - the 95% bootstrap confidence interval of (median candidate - median baseline) lies
     above 0 (resampling each config's repeats independently; with 2-3 repeats this says
     "every candidate repeat beat every baseline repeat" or close to it), and
   - the relative improvement of the medians is larger than the noise: the baseline's own
     relative spread ((max - min) / median over its repeats), and never less than the
     capacity's resolution (the relative gap between the last passing and the first failing
     ladder step, the widest among the baseline's and the winner's repeats). A gain smaller
     than the run-to-run wobble of one config, or than the ladder can resolve, is not a gain
     anyone can rely on; repeats that land on the same ladder step read identical capacities,
     so their spread alone would read 0%.
   Otherwise the baseline is kept. A baseline that itself misses an SLO does not change the
   rule: the candidate must still beat it on the objective, and meet every SLO.

Under `min-memory` the value of a run is its config's gpu_memory_utilization (the same in
every repeat), so there is no noise to beat: `decide_min_memory` emits the eligible candidate
with the least memory if it uses less than the baseline. A baseline that misses an SLO at the
headroom is said so, and then any eligible candidate wins (it meets what the baseline cannot).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel

BASELINE = "baseline"


class Measurement(BaseModel):
    """One run of one config on the held-out window."""

    candidate: str  # "baseline" or "trial-0007"
    repeat: int
    value: float  # the objective (capacity, per GPU, goodput / throughput, 0 for a failed run; min-memory: the memory)
    slo_met: bool
    ok: bool = True
    failure: str | None = None
    margins_ms: dict[str, float | None] = {}  # SLO spec -> measured - threshold (report)
    host: str | None = None  # which machine measured it (gate_runner.machine_identity)
    # The run's wall time and server time, so a resumed gate's totals include reused runs.
    wall_s: float | None = None
    server_s: float | None = None
    # Capacity: the carried rate over the recorded one (below 1: it cannot carry the traffic).
    headroom: float | None = None
    broke_first: str | None = None  # capacity: the SLO that broke first above it (measure.limits)
    # Capacity: the first failing step's offered rate above it and the bracket's relative width.
    first_fail_rps: float | None = None
    resolution: float | None = None
    kv_cache_gib: float | None = None  # min-memory: the KV cache vLLM logged at start
    kv_cache_tokens: int | None = None
    # Capacity: the whole capacity (req/s) and the GPUs one engine held; under
    # capacity-per-gpu `value` is the one over the other (what the rule compares).
    capacity_rps: float | None = None
    devices: int | None = None
    # Prefix-cache hits over queries (tokens) over the run's measured steps; None: not exposed.
    prefix_cache_hit_rate: float | None = None


class CandidateStats(BaseModel):
    candidate: str
    values: list[float]
    median: float
    relative_spread: float | None  # (max - min) / median
    resolution: float | None = None  # capacity: the widest ladder bracket of its repeats (relative)
    eligible: bool
    why_not: str | None = None


class GateDecision(BaseModel):
    """What the gate concluded and the figures behind it."""

    winner: str  # the config to emit: a candidate or "baseline"
    keep_baseline: bool
    reason: str  # one line a user can read
    best_candidate: str | None  # best eligible candidate, even when it did not win
    baseline_median: float | None
    candidate_median: float | None
    effect: float | None  # relative change of medians (candidate vs baseline)
    ci_low: float | None  # 95% CI of median difference (absolute, objective units)
    ci_high: float | None
    noise: float | None  # what the effect had to exceed: spread or resolution, the larger
    noise_source: str | None = None  # where `noise` came from, for the messages
    confidence: float
    stats: list[CandidateStats]


def round_robin(candidates: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """Run order: every repeat runs every config once, the first config rotating, so each
    config is first (right after a cold machine) equally often."""
    order: list[tuple[int, str]] = []
    count = len(candidates)
    for repeat in range(repeats):
        shift = repeat % count if count else 0
        for candidate in list(candidates[shift:]) + list(candidates[:shift]):
            order.append((repeat, candidate))
    return order


def bootstrap_median_diff(
    candidate: Sequence[float],
    baseline: Sequence[float],
    *,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile-bootstrap CI of median(candidate) - median(baseline)."""
    rng = np.random.default_rng(seed)
    a = np.asarray(candidate, dtype=np.float64)
    b = np.asarray(baseline, dtype=np.float64)
    diffs = np.median(rng.choice(a, size=(resamples, a.size)), axis=1) - np.median(
        rng.choice(b, size=(resamples, b.size)), axis=1
    )
    tail = (1.0 - confidence) / 2.0
    return float(np.quantile(diffs, tail)), float(np.quantile(diffs, 1.0 - tail))


def candidate_stats(candidate: str, runs: list[Measurement]) -> CandidateStats:
    values = [run.value for run in sorted(runs, key=lambda run: run.repeat)]
    median = statistics.median(values)
    spread = (max(values) - min(values)) / median if median > 0 else None
    why_not = None
    failed = [run for run in runs if not run.ok]
    missed = [run for run in runs if run.ok and not run.slo_met]
    if failed:
        why_not = f"run {failed[0].repeat + 1} failed ({failed[0].failure or 'error'})"
    elif missed and missed[0].headroom is not None and missed[0].headroom < 1.0:
        why_not = (f"carried {missed[0].headroom:.2f}x the recorded traffic in repeat "
                   f"{missed[0].repeat + 1}: every SLO held only below the recorded rate")
    elif missed:
        why_not = f"missed an SLO in repeat {missed[0].repeat + 1}"
    resolutions = [run.resolution for run in runs if run.resolution is not None]
    return CandidateStats(
        candidate=candidate,
        values=values,
        median=median,
        relative_spread=spread,
        resolution=max(resolutions) if resolutions else None,
        eligible=why_not is None,
        why_not=why_not,
    )


def stats_by_candidate(measurements: Sequence[Measurement], baseline: str) -> dict[str, CandidateStats]:
    """Each config's repeats summarised, in the order the configs were first measured."""
    by_candidate: dict[str, list[Measurement]] = {}
    for run in measurements:
        by_candidate.setdefault(run.candidate, []).append(run)
    if baseline not in by_candidate:
        raise ValueError(f"no measurement of the baseline {baseline!r}")
    return {name: candidate_stats(name, runs) for name, runs in by_candidate.items()}


def decide(
    measurements: Sequence[Measurement],
    *,
    baseline: str = BASELINE,
    confidence: float = 0.95,
    seed: int = 0,
) -> GateDecision:
    """Pick the config to emit from the validation runs (see the module docstring)."""
    stats = stats_by_candidate(measurements, baseline)
    base = stats[baseline]
    eligible = [s for name, s in stats.items() if name != baseline and s.eligible]
    best = max(eligible, key=lambda s: s.median) if eligible else None
    noise, source = gate_noise(base, best)
    said = "" if noise is None else f"; noise used {noise_text(noise, source)}"

    def keep(reason: str, best: CandidateStats | None = None, **figures: float | None) -> GateDecision:
        return GateDecision(
            winner=baseline,
            keep_baseline=True,
            reason=reason + said,
            best_candidate=best.candidate if best else None,
            baseline_median=base.median,
            candidate_median=best.median if best else None,
            effect=figures.get("effect"),
            ci_low=figures.get("ci_low"),
            ci_high=figures.get("ci_high"),
            noise=noise,
            noise_source=source,
            confidence=confidence,
            stats=list(stats.values()),
        )

    if best is None:
        return keep("no candidate ran and met every SLO in every repeat")
    ci_low, ci_high = bootstrap_median_diff(
        best.values, base.values, confidence=confidence, seed=seed
    )
    effect = (best.median - base.median) / base.median if base.median > 0 else None
    figures = {"effect": effect, "ci_low": ci_low, "ci_high": ci_high}
    pct = f"{confidence:.0%}"
    if ci_high < 0:
        return keep(
            f"{best.candidate}, the best searched config, is worse than the baseline "
            f"({pct} CI of the difference [{ci_low:.3g}, {ci_high:.3g}] is below 0)",
            best,
            **figures,
        )
    if ci_low <= 0:
        return keep(
            f"{best.candidate} is not better than the baseline beyond the noise "
            f"({pct} CI of the difference [{ci_low:.3g}, {ci_high:.3g}] includes 0)",
            best,
            **figures,
        )
    if effect is not None and noise is not None and effect <= noise:
        return keep(
            f"{best.candidate} improves on the baseline by {effect:+.1%}, within the noise",
            best,
            **figures,
        )
    gain = f"{effect:+.1%}" if effect is not None else "a gain over a baseline that served nothing"
    # One run each: the interval is one difference and the spread 0, so no noise was measured.
    single = (" (one run each: no run-to-run noise measured; --repeats 3 would measure it)"
              if min(len(best.values), len(base.values)) < 2 else "")
    # Every repeat of each config at one value (a capacity ladder that passed and failed the
    # same steps each time, as on the H200 of results/h200-2026-12-02-fp8): the interval is a
    # point, and the noise the effect beat is the ladder's resolution, not that width.
    same = (" (every repeat of each config measured the same value)"
            if not single and ci_high - ci_low <= 1e-3 * max(abs(ci_low), abs(ci_high)) else "")
    return GateDecision(
        winner=best.candidate,
        keep_baseline=False,
        reason=(
            f"{best.candidate} beats the baseline by {gain} ({pct} CI of the difference "
            f"[{ci_low:.3g}, {ci_high:.3g}]{same}) and met every SLO in every repeat{single}{said}"
        ),
        best_candidate=best.candidate,
        baseline_median=base.median,
        candidate_median=best.median,
        effect=effect,
        ci_low=ci_low,
        ci_high=ci_high,
        noise=noise,
        noise_source=source,
        confidence=confidence,
        stats=list(stats.values()),
    )


def gate_noise(base: CandidateStats, best: CandidateStats | None) -> tuple[float | None, str | None]:
    """The relative noise an effect must exceed, and where it came from: the baseline's spread
    over its repeats, raised to the widest ladder resolution of the baseline's or `best`'s
    repeats (capacity only). None when neither was measured (one run of a non-ladder objective)."""
    spread = base.relative_spread if len(base.values) > 1 else None  # one run: no spread measured
    resolutions = [s.resolution for s in (base, best) if s is not None and s.resolution is not None]
    resolution = max(resolutions) if resolutions else None
    if resolution is not None and (spread is None or resolution > spread):
        where = "" if spread is None else f", above the baseline's spread of {spread:.1%} over its repeats"
        return resolution, f"the ladder's resolution{where}"
    if spread is None:
        return None, None
    above = "" if resolution is None else f", above the ladder's resolution of {resolution:.1%}"
    return spread, f"the baseline's spread over its repeats{above}"


def noise_text(noise: float | None, source: str | None) -> str:
    """"9.5%, the ladder's resolution (...)" or "none measured"."""
    return "none measured" if noise is None else f"{noise:.1%}, {source}"


def decide_min_memory(
    measurements: Sequence[Measurement], *, headroom: float, baseline: str = BASELINE
) -> GateDecision:
    """The min-memory rule (module docstring): least memory among the candidates that met
    every SLO at `headroom` x the recorded rate in every repeat, if below the baseline's."""
    stats = stats_by_candidate(measurements, baseline)
    base = stats[baseline]
    eligible = [s for name, s in stats.items() if name != baseline and s.eligible]
    at = f"{headroom:g}x the recorded rate"
    base_note = "" if base.eligible else f"; the baseline ({base.median:g}) {base.why_not} at {at}"
    best = min(eligible, key=lambda s: (s.median, s.candidate)) if eligible else None
    effect = (best.median - base.median) / base.median if best and base.median > 0 else None

    def decision(winner: CandidateStats | None, reason: str) -> GateDecision:
        return GateDecision(
            winner=winner.candidate if winner else baseline,
            keep_baseline=winner is None,
            reason=reason,
            best_candidate=best.candidate if best else None,
            baseline_median=base.median,
            candidate_median=best.median if best else None,
            effect=effect,
            ci_low=None,
            ci_high=None,
            noise=None,
            confidence=1.0,
            stats=list(stats.values()),
        )

    if best is None:
        return decision(None, f"no candidate met every SLO at {at} in every repeat{base_note}")
    if base.eligible and best.median >= base.median:
        return decision(None, f"{best.candidate} needs gpu_memory_utilization {best.median:g}, "
                              f"no less than the baseline's {base.median:g}, to meet every SLO at {at}")
    saving = f" ({effect:+.0%})" if effect is not None else ""
    return decision(best, f"{best.candidate} met every SLO at {at} in every repeat with "
                          f"gpu_memory_utilization {best.median:g} vs the baseline's {base.median:g}"
                          f"{saving}{base_note}")
