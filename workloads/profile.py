"""What a trace looks like, in numbers: rates, burstiness, lengths, sharing, concurrency.

`profile_trace(trace)` -> `TraceProfile`, a pydantic model that is small enough to store in
an exported config's provenance and carries a compact sample of (input, output) lengths so
that a profile alone can serve as the reference of a drift test. Its `fingerprint` is a
sha256 over a canonical summary: the same requests give the same fingerprint whatever the
file is called or how its JSON keys are ordered.

One module over ~400 lines: the profile's models, the statistics that fill them, and their
text form and plots (`format_profile`, `write_plots`, which read the same fields) are one
description of a trace.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from workloads.errors import WorkloadError
from workloads.files import atomic_file
from workloads.trace import Trace

PROFILE_VERSION = 1
RATE_WINDOWS_S = (1, 10, 60)
LENGTH_PERCENTILES = (5, 10, 25, 50, 75, 90, 95, 99)
HISTOGRAM_BINS = 24
LENGTH_SAMPLE_SIZE = 2000
# Fingerprint rounding: enough digits to tell traces apart, few enough to survive
# platform-level float noise in percentiles and means.
_FINGERPRINT_DIGITS = 6
# Ranks by counting need an array of max(values) + 1 counters: only when that is at most
# this many times the number of values (else sort, as scipy does).
_COUNTING_RANK_FACTOR = 4


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WindowRate(_Model):
    """Requests per second counted in consecutive windows of `window_s` seconds."""

    window_s: int
    windows: int
    p50: float
    p90: float
    p99: float
    max: float


class ArrivalRate(_Model):
    mean_rps: float
    windows: list[WindowRate] = Field(description="one entry per window size that fits")


class Histogram(_Model):
    edges: list[float]  # len(counts) + 1, log-spaced
    counts: list[int]


class LengthStats(_Model):
    mean: float
    min: int
    max: int
    percentiles: dict[str, float]  # "p5" .. "p99"
    histogram: Histogram


class PrefixSharing(_Model):
    blocks: int  # hash_ids in the whole trace
    unique_blocks: int
    reused_fraction: float  # share of blocks already seen in an earlier request
    requests_with_reuse: float  # share of requests whose first block was seen before


class Concurrency(_Model):
    """Requests in flight (arrival to arrival + latency), weighted by time."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: int
    requests_with_latency: int


class LanguagePair(_Model):
    source_lang: str | None
    target_lang: str | None
    requests: int
    share: float
    output_input_ratio: float  # mean of output_length / input_length


class LengthSample(_Model):
    """A seeded random sample of (input, output) pairs, for drift tests against a profile."""

    input_lengths: list[int]
    output_lengths: list[int]


class TraceProfile(_Model):
    version: int = PROFILE_VERSION
    source: str = ""
    requests: int
    duration_s: float
    arrival_rate: ArrivalRate
    burstiness_cv: float | None = Field(description="CV of inter-arrival times (1 = Poisson)")
    input_length: LengthStats
    output_length: LengthStats
    in_out_spearman: float | None
    prefix_sharing: PrefixSharing | None = None
    concurrency: Concurrency | None = None
    languages: list[LanguagePair] | None = None
    sessions: int | None = None
    length_sample: LengthSample
    fingerprint: str = ""

    def canonical_summary(self) -> str:
        """The JSON the fingerprint hashes: no source, no fingerprint, rounded floats."""
        data = self.model_dump(mode="json", exclude={"source", "fingerprint"})
        return json.dumps(_rounded(data), sort_keys=True, separators=(",", ":"))

    def compute_fingerprint(self) -> str:
        return hashlib.sha256(self.canonical_summary().encode()).hexdigest()[:16]


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.{_FINGERPRINT_DIGITS}g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def window_counts(timestamps_ms: np.ndarray, window_s: float) -> np.ndarray:
    """Arrivals per consecutive window from the first arrival; a final partial window is
    dropped when at least one full window exists (it would read as a lull)."""
    if len(timestamps_ms) == 0:
        return np.zeros(0, dtype=np.int64)
    offsets_s = (timestamps_ms - timestamps_ms[0]) / 1000.0
    bins = np.floor(offsets_s / window_s).astype(np.int64)
    counts = np.bincount(bins)
    duration_s = float(offsets_s[-1])
    full = int(duration_s // window_s)
    if full >= 1:
        counts = counts[:full]
    return counts


def _window_rates(timestamps_ms: np.ndarray, duration_s: float) -> list[WindowRate]:
    rates = []
    for window_s in RATE_WINDOWS_S:
        if duration_s < window_s:
            continue
        per_s = window_counts(timestamps_ms, window_s) / window_s
        p50, p90, p99 = np.percentile(per_s, [50, 90, 99])
        rates.append(
            WindowRate(
                window_s=window_s,
                windows=len(per_s),
                p50=float(p50),
                p90=float(p90),
                p99=float(p99),
                max=float(per_s.max()),
            )
        )
    return rates


def burstiness_cv(timestamps_ms: np.ndarray) -> float | None:
    """Coefficient of variation of inter-arrival gaps: 1 for Poisson, > 1 bursty."""
    if len(timestamps_ms) < 3:
        return None
    gaps = np.diff(timestamps_ms)
    mean = float(gaps.mean())
    if mean <= 0:
        return None
    return float(gaps.std() / mean)


def _length_stats(lengths: np.ndarray) -> LengthStats:
    values = np.percentile(lengths, LENGTH_PERCENTILES)
    top = int(lengths.max())
    edges = np.unique(np.round(np.logspace(0, math.log10(top + 1), HISTOGRAM_BINS + 1)))
    if len(edges) < 2:
        edges = np.array([1.0, top + 1.0])
    edges[-1] = max(edges[-1], top + 1)  # the last bin is closed; keep max inside it
    counts, _ = np.histogram(lengths, bins=edges)
    return LengthStats(
        mean=float(lengths.mean()),
        min=int(lengths.min()),
        max=top,
        percentiles={f"p{p}": float(v) for p, v in zip(LENGTH_PERCENTILES, values, strict=True)},
        histogram=Histogram(edges=edges.tolist(), counts=counts.tolist()),
    )


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """`scipy.stats.rankdata(values)` (ties share their mean rank), by counting when the
    values are integers in a small range (token counts): several times faster than sorting,
    and the ranks are whole or half numbers, so both ways give exactly the same floats."""
    small = values.dtype.kind == "i" and len(values) > 0 and values.min() >= 0
    if not small or values.max() > _COUNTING_RANK_FACTOR * len(values):
        # Imported here: scipy.stats takes ~0.6 s to import, and every `autotune` command
        # (`--help` too) imports this module through the trace windows.
        from scipy import stats

        return stats.rankdata(values)
    counts = np.bincount(values)
    last = np.cumsum(counts)  # the rank of the last of each value's ties
    return (last - (counts - 1) / 2.0)[values]


def _spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    """Spearman's rho exactly as `scipy.stats.spearmanr` computes it (Pearson correlation
    of the average ranks, by `np.corrcoef` on the same n x 2 array)."""
    if len(a) < 3 or np.all(a == a[0]) or np.all(b == b[0]):
        return None
    ranks = np.column_stack([_average_ranks(a), _average_ranks(b)])
    rho = float(np.corrcoef(ranks, rowvar=False)[1, 0])
    return None if not math.isfinite(rho) else rho


def _prefix_sharing(trace: Trace) -> PrefixSharing | None:
    column = trace.hash_ids
    if column is None or len(column.values) == 0:
        return None
    values = column.values
    # Rows are in arrival order, so the first index of each id is its first appearance.
    _, first_index = np.unique(values, return_index=True)
    seen_before = np.ones(len(values), dtype=bool)
    seen_before[first_index] = False
    starts = column.offsets[:-1]
    has_blocks = column.offsets[1:] > starts
    reuse = seen_before[starts[has_blocks]]
    return PrefixSharing(
        blocks=len(values),
        unique_blocks=len(first_index),
        reused_fraction=float(seen_before.mean()),
        requests_with_reuse=float(reuse.mean()) if len(reuse) else 0.0,
    )


def concurrency_levels(trace: Trace) -> tuple[np.ndarray, np.ndarray] | None:
    """Sweep of start/end events: (levels, seconds spent at each level), or None without
    recorded latencies."""
    if trace.latencies_ms is None:
        return None
    known = ~np.isnan(trace.latencies_ms)
    if not known.any():
        return None
    starts = trace.timestamps_ms[known]  # already sorted
    ends = np.sort(starts + trace.latencies_ms[known])
    # Ends first, then a stable sort (two sorted runs: a cheap merge): at equal times an
    # end comes before a start, so back-to-back requests do not count as overlapping.
    times = np.concatenate([ends, starts])
    deltas = np.concatenate(
        [-np.ones(len(ends), dtype=np.int64), np.ones(len(starts), dtype=np.int64)]
    )
    order = np.argsort(times, kind="stable")
    times, deltas = times[order], deltas[order]
    levels = np.cumsum(deltas)[:-1]
    spans_s = np.diff(times) / 1000.0
    return levels, spans_s


def _level_percentile(seconds_at_level: np.ndarray, q: float) -> int:
    """The level below which `q` percent of the time is spent."""
    cumulative = np.cumsum(seconds_at_level)
    return int(min(np.searchsorted(cumulative, q / 100.0 * cumulative[-1]), len(cumulative) - 1))


def _concurrency(trace: Trace) -> Concurrency | None:
    swept = concurrency_levels(trace)
    if swept is None:
        return None
    levels, spans = swept
    n_known = int((~np.isnan(trace.latencies_ms)).sum())  # type: ignore[arg-type]
    if spans.sum() <= 0:
        return Concurrency(mean=0.0, p50=0, p90=0, p99=0, max=1, requests_with_latency=n_known)
    # Levels are small non-negative integers: time spent at each level, by bincount.
    seconds_at_level = np.bincount(levels, weights=spans)
    return Concurrency(
        mean=float(np.average(levels, weights=spans)),
        p50=_level_percentile(seconds_at_level, 50),
        p90=_level_percentile(seconds_at_level, 90),
        p99=_level_percentile(seconds_at_level, 99),
        max=int(levels.max()),
        requests_with_latency=n_known,
    )


def _languages(trace: Trace) -> list[LanguagePair] | None:
    if trace.source_langs is None and trace.target_langs is None:
        return None
    n = len(trace)
    sources = trace.source_langs or [None] * n
    targets = trace.target_langs or [None] * n
    # Integer codes per language (via C-level map), then one bincount per statistic.
    source_names = list(dict.fromkeys(sources))
    target_names = list(dict.fromkeys(targets))
    source_code = {name: i for i, name in enumerate(source_names)}
    target_code = {name: i for i, name in enumerate(target_names)}
    codes = np.fromiter(map(source_code.__getitem__, sources), dtype=np.int64, count=n) * len(
        target_names
    ) + np.fromiter(map(target_code.__getitem__, targets), dtype=np.int64, count=n)
    size = len(source_names) * len(target_names)
    counts = np.bincount(codes, minlength=size)
    ratio = trace.output_lengths / trace.input_lengths
    ratio_sums = np.bincount(codes, weights=ratio, minlength=size)
    result = [
        LanguagePair(
            source_lang=source_names[code // len(target_names)],
            target_lang=target_names[code % len(target_names)],
            requests=int(counts[code]),
            share=float(counts[code] / n),
            output_input_ratio=float(ratio_sums[code] / counts[code]),
        )
        for code in np.flatnonzero(counts).tolist()
    ]
    # Most common first; ties by name so the order (and the fingerprint) is stable.
    result.sort(key=lambda p: (-p.requests, p.source_lang or "", p.target_lang or ""))
    return result


def _length_sample(trace: Trace) -> LengthSample:
    n = len(trace)
    if n <= LENGTH_SAMPLE_SIZE:
        picked = np.arange(n)
    else:
        picked = np.sort(np.random.default_rng(0).choice(n, LENGTH_SAMPLE_SIZE, replace=False))
    return LengthSample(
        input_lengths=trace.input_lengths[picked].tolist(),
        output_lengths=trace.output_lengths[picked].tolist(),
    )


def profile_trace(trace: Trace) -> TraceProfile:
    """Measure a trace. Needs at least one request."""
    if len(trace) == 0:
        raise WorkloadError(f"{trace.source or 'trace'}: no requests to profile")
    duration_s = trace.duration_s()
    profile = TraceProfile(
        source=trace.source,
        requests=len(trace),
        duration_s=duration_s,
        arrival_rate=ArrivalRate(
            mean_rps=(len(trace) - 1) / duration_s if duration_s > 0 else 0.0,
            windows=_window_rates(trace.timestamps_ms, duration_s),
        ),
        burstiness_cv=burstiness_cv(trace.timestamps_ms),
        input_length=_length_stats(trace.input_lengths),
        output_length=_length_stats(trace.output_lengths),
        in_out_spearman=_spearman(trace.input_lengths, trace.output_lengths),
        prefix_sharing=_prefix_sharing(trace),
        concurrency=_concurrency(trace),
        languages=_languages(trace),
        sessions=None if trace.session_ids is None else len(set(trace.session_ids) - {None}),
        length_sample=_length_sample(trace),
    )
    profile.fingerprint = profile.compute_fingerprint()
    return profile


def format_profile(profile: TraceProfile) -> str:
    """A compact human-readable table."""

    def pct(stats_: LengthStats, key: str) -> str:
        return f"{stats_.percentiles[key]:g}"

    rows: list[tuple[str, str]] = [
        ("source", profile.source or "-"),
        ("fingerprint", profile.fingerprint),
        ("requests", f"{profile.requests}"),
        ("duration", f"{profile.duration_s:.1f} s"),
        ("mean rate", f"{profile.arrival_rate.mean_rps:.3f} req/s"),
    ]
    for window in profile.arrival_rate.windows:
        rows.append(
            (
                f"rate over {window.window_s} s",
                f"p50 {window.p50:.4g}  p90 {window.p90:.4g}  p99 {window.p99:.4g}  "
                f"max {window.max:.4g}"
                f"  ({window.windows} windows)",
            )
        )
    cv = profile.burstiness_cv
    rows.append(("burstiness (CV)", "-" if cv is None else f"{cv:.3f}  (1 = Poisson)"))
    for label, stats_ in (
        ("input tokens", profile.input_length),
        ("output tokens", profile.output_length),
    ):
        rows.append(
            (
                label,
                f"mean {stats_.mean:.1f}  p5 {pct(stats_, 'p5')}  p50 {pct(stats_, 'p50')}  "
                f"p90 {pct(stats_, 'p90')}  p99 {pct(stats_, 'p99')}  max {stats_.max}",
            )
        )
    rho = profile.in_out_spearman
    rows.append(("in/out Spearman", "-" if rho is None else f"{rho:.3f}"))
    if profile.prefix_sharing is not None:
        sharing = profile.prefix_sharing
        rows.append(
            (
                "prefix sharing",
                f"{sharing.reused_fraction:.1%} of {sharing.blocks} blocks seen before "
                f"({sharing.unique_blocks} unique)",
            )
        )
    if profile.concurrency is not None:
        c = profile.concurrency
        rows.append(
            (
                "concurrency",
                f"mean {c.mean:.2f}  p50 {c.p50:g}  p90 {c.p90:g}  p99 {c.p99:g}  max {c.max}",
            )
        )
    if profile.sessions is not None:
        rows.append(("sessions", f"{profile.sessions}"))
    if profile.languages:
        shown = ", ".join(
            f"{p.source_lang or '?'}->{p.target_lang or '?'} {p.share:.0%} (x{p.output_input_ratio:.2f})"
            for p in profile.languages[:6]
        )
        more = len(profile.languages) - 6
        rows.append(("language pairs", shown + (f", +{more} more" if more > 0 else "")))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def write_plots(trace: Trace, profile: TraceProfile, out_dir: str | Path) -> list[Path]:
    """PNG plots (Agg backend, no display needed). Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = folder / name
        fig.tight_layout()
        with atomic_file(path, "wb", shared=True) as out:
            fig.savefig(out, format="png", dpi=100)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(9, 3))
    per_s = window_counts(trace.timestamps_ms, 1.0)
    ax.plot(np.arange(len(per_s)), per_s, linewidth=0.7)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests / s")
    ax.set_title(
        f"arrivals (mean {profile.arrival_rate.mean_rps:.2f} req/s, CV {profile.burstiness_cv or 0:.2f})"
    )
    save(fig, "arrivals.png")

    fig, axes = plt.subplots(1, 2, figsize=(9, 3))
    for ax, stats_, label in (
        (axes[0], profile.input_length, "input tokens"),
        (axes[1], profile.output_length, "output tokens"),
    ):
        edges = stats_.histogram.edges
        ax.stairs(stats_.histogram.counts, edges, fill=True)
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("requests")
    save(fig, "lengths.png")

    fig, ax = plt.subplots(figsize=(4.5, 4))
    sample = profile.length_sample
    ax.scatter(sample.input_lengths, sample.output_lengths, s=3, alpha=0.4)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("input tokens")
    ax.set_ylabel("output tokens")
    ax.set_title(f"Spearman {profile.in_out_spearman or 0:.2f}")
    save(fig, "in_out.png")

    swept = concurrency_levels(trace)
    if swept is not None:
        levels, spans = swept
        fig, ax = plt.subplots(figsize=(9, 3))
        starts = np.concatenate([[0.0], np.cumsum(spans)[:-1]])
        ax.step(starts, levels, where="post", linewidth=0.7)
        ax.set_xlabel("time since first event (s)")
        ax.set_ylabel("in flight")
        save(fig, "concurrency.png")
    return written
