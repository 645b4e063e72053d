"""Synthetic traces, seeded and deterministic.

- `like(reference, ...)`: new arrivals with the reference's rate and burstiness (Poisson, or
  Gamma inter-arrivals with the measured CV), lengths resampled as (input, output) *pairs*
  so their correlation survives. The reference is a Trace or a TraceProfile (its length
  sample).
- `translation(...)`: traffic like the reference user's translation service: 10-200 token
  inputs, output = input x a per-language-pair ratio x noise, quiet periods and bursts
  (a two-state Markov-modulated Poisson process), language pairs and sessions.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from workloads.errors import WorkloadError
from workloads.profile import TraceProfile, burstiness_cv
from workloads.trace import Trace

Arrivals = Literal["poisson", "gamma"]
# Sessions a returning request may belong to: the most recently opened ones.
_RECENT_SESSIONS = 20


def arrival_times_ms(
    rng: np.random.Generator, rate_rps: float, duration_s: float, cv: float = 1.0
) -> np.ndarray:
    """Arrivals in [0, duration_s) with mean rate `rate_rps`; gaps Gamma with the given CV
    (CV 1 is exactly Poisson, > 1 bursty, < 1 more regular than Poisson)."""
    if not rate_rps > 0 or not math.isfinite(rate_rps):
        raise WorkloadError(f"rate must be a finite number > 0 req/s (got {rate_rps!r})")
    if not duration_s > 0 or not math.isfinite(duration_s):
        raise WorkloadError(f"duration must be a finite number > 0 s (got {duration_s!r})")
    if not cv > 0 or not math.isfinite(cv):
        raise WorkloadError(f"inter-arrival CV must be a finite number > 0 (got {cv!r})")
    shape = 1.0 / cv**2
    mean_gap_ms = 1000.0 / rate_rps
    expected = rate_rps * duration_s
    chunks = []
    total_ms = 0.0
    # Draw in blocks until the duration is covered (a Gamma sum can fall short of its mean).
    while total_ms < duration_s * 1000:
        block = int(expected + 6 * math.sqrt(expected) * max(cv, 1.0) + 16)
        gaps = rng.gamma(shape, mean_gap_ms / shape, size=block)
        chunks.append(gaps)
        total_ms += float(gaps.sum())
    times = np.cumsum(np.concatenate(chunks))
    # Start the trace with a request at t=0: the first gap carries no information.
    times = times - times[0]
    return times[times < duration_s * 1000]


def like(
    reference: Trace | TraceProfile,
    *,
    duration_s: float,
    rate_rps: float | None = None,
    arrivals: Arrivals = "gamma",
    cv: float | None = None,
    seed: int = 0,
) -> Trace:
    """A synthetic trace with the reference's rate, burstiness and joint length distribution."""
    rng = np.random.default_rng(seed)
    if isinstance(reference, Trace):
        if len(reference) < 2 or reference.duration_s() <= 0:
            raise WorkloadError(
                f"{reference.source or 'trace'}: needs two or more arrival times to imitate"
            )
        measured_rate = (len(reference) - 1) / reference.duration_s()
        measured_cv = burstiness_cv(reference.timestamps_ms)
        inputs, outputs = reference.input_lengths, reference.output_lengths
        source = reference.source
    else:
        measured_rate = reference.arrival_rate.mean_rps
        measured_cv = reference.burstiness_cv
        inputs = np.asarray(reference.length_sample.input_lengths, dtype=np.int64)
        outputs = np.asarray(reference.length_sample.output_lengths, dtype=np.int64)
        source = reference.source or reference.fingerprint
        if measured_rate <= 0 or len(inputs) == 0:
            raise WorkloadError(f"profile {source}: no arrival rate or length sample to imitate")
    if arrivals == "poisson":
        chosen_cv = 1.0
    elif arrivals == "gamma":
        chosen_cv = cv if cv is not None else (measured_cv or 1.0)
    else:
        raise WorkloadError(f"arrivals must be 'poisson' or 'gamma' (got {arrivals!r})")
    times = arrival_times_ms(rng, rate_rps or measured_rate, duration_s, chosen_cv)
    # Resample whole (input, output) pairs: drawing each column alone would erase their
    # correlation.
    picked = rng.integers(0, len(inputs), size=len(times))
    return Trace(
        times,
        inputs[picked],
        outputs[picked],
        source=f"synthetic like {source} (seed {seed}, {arrivals})",
    )


class LanguagePairSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source_lang: str
    target_lang: str
    weight: float = Field(gt=0)
    ratio: float = Field(gt=0, description="output tokens per input token")


def default_language_pairs() -> list[LanguagePairSpec]:
    """Output/input token ratios: a target language that tokenises longer gets a higher ratio."""
    table = [
        ("en", "de", 0.22, 1.20),
        ("de", "en", 0.18, 0.85),
        ("en", "fr", 0.12, 1.15),
        ("fr", "en", 0.08, 0.88),
        ("en", "es", 0.10, 1.10),
        ("es", "en", 0.06, 0.90),
        ("en", "ja", 0.10, 1.60),
        ("ja", "en", 0.05, 0.65),
        ("en", "zh", 0.06, 1.30),
        ("zh", "en", 0.03, 0.80),
    ]
    return [
        LanguagePairSpec(source_lang=s, target_lang=t, weight=w, ratio=r) for s, t, w, r in table
    ]


class TranslationSpec(BaseModel):
    """Knobs of the translation generator (defaults: the reference user's traffic)."""

    model_config = ConfigDict(extra="forbid")

    duration_s: float = Field(600.0, gt=0)
    mean_rps: float = Field(5.0, gt=0)
    burst_multiplier: float = Field(2.5, ge=1, description="burst rate / quiet rate")
    burst_time_fraction: float = Field(0.2, gt=0, lt=1, description="share of time in bursts")
    mean_burst_s: float = Field(8.0, gt=0, description="mean length of one burst")
    min_input: int = Field(10, ge=1)
    max_input: int = Field(200, ge=1)
    median_input: float = Field(50.0, gt=0)
    input_sigma: float = Field(0.6, ge=0, description="log-normal spread of input lengths")
    ratio_noise: float = Field(0.15, ge=0, description="log-normal noise on the output ratio")
    new_session_probability: float = Field(0.3, gt=0, le=1)
    language_pairs: list[LanguagePairSpec] = Field(default_factory=default_language_pairs)


def _mmpp_times_ms(rng: np.random.Generator, spec: TranslationSpec) -> np.ndarray:
    """Two-state Markov-modulated Poisson arrivals whose long-run mean is `spec.mean_rps`."""
    f, m = spec.burst_time_fraction, spec.burst_multiplier
    quiet_rps = spec.mean_rps / ((1 - f) + m * f)
    burst_rps = m * quiet_rps
    mean_quiet_s = spec.mean_burst_s * (1 - f) / f
    times = []
    t = 0.0
    bursting = bool(rng.random() < f)
    while t < spec.duration_s:
        stay_s = rng.exponential(spec.mean_burst_s if bursting else mean_quiet_s)
        end = min(t + stay_s, spec.duration_s)
        rate = burst_rps if bursting else quiet_rps
        count = rng.poisson(rate * (end - t))
        times.append(rng.uniform(t, end, size=count))
        t = end
        bursting = not bursting
    arrivals = np.sort(np.concatenate(times)) * 1000.0
    if len(arrivals) == 0:
        raise WorkloadError("no requests generated: raise the rate or the duration")
    return arrivals - arrivals[0]


def translation(spec: TranslationSpec | None = None, *, seed: int = 0) -> Trace:
    """Bursty translation traffic with language pairs and sessions."""
    spec = spec or TranslationSpec()
    if spec.min_input > spec.max_input:
        raise WorkloadError(f"min_input {spec.min_input} > max_input {spec.max_input}")
    rng = np.random.default_rng(seed)
    times = _mmpp_times_ms(rng, spec)
    n = len(times)
    inputs = np.clip(
        np.round(rng.lognormal(math.log(spec.median_input), spec.input_sigma, size=n)),
        spec.min_input,
        spec.max_input,
    ).astype(np.int64)

    # Sessions: a request opens a new session (picking a language pair) or continues one of
    # the recently active sessions in its language pair.
    pairs = spec.language_pairs
    weights = np.array([p.weight for p in pairs])
    weights = weights / weights.sum()
    recent: list[tuple[str, int]] = []
    session_ids: list[str] = []
    pair_index = np.empty(n, dtype=np.int64)
    opened = 0
    new_session = rng.random(n) < spec.new_session_probability
    # Drawn up front, vectorised: one draw per request whether or not it is used.
    new_pairs = rng.choice(len(pairs), p=weights, size=n)
    picks = rng.random(n)
    for i in range(n):
        if new_session[i] or not recent:
            session = (f"s{opened:06d}", int(new_pairs[i]))
            opened += 1
            recent.append(session)
            if len(recent) > _RECENT_SESSIONS:
                recent.pop(0)
        else:
            session = recent[int(picks[i] * len(recent))]
        session_ids.append(session[0])
        pair_index[i] = session[1]
    ratios = np.array([p.ratio for p in pairs])[pair_index]
    noise = rng.lognormal(0.0, spec.ratio_noise, size=n)
    outputs = np.maximum(1, np.round(inputs * ratios * noise)).astype(np.int64)
    return Trace(
        times,
        inputs,
        outputs,
        source_langs=[pairs[k].source_lang for k in pair_index.tolist()],
        target_langs=[pairs[k].target_lang for k in pair_index.tolist()],
        session_ids=session_ids,
        source=f"synthetic translation (seed {seed})",
    )
