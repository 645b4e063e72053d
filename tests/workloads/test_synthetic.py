"""Synthetic traffic: seeded, shaped like its reference, the shipped sample reproducible."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from autotune.cli import main as autotune_main
from workloads.profile import burstiness_cv, profile_trace
from workloads.synthetic import TranslationSpec, arrival_times_ms, like, translation
from workloads.trace import Trace

SAMPLE = Path(__file__).parents[2] / "workloads" / "samples" / "translation_trace.jsonl"


def correlated_trace(seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    inputs = rng.integers(10, 2000, size=3000)
    outputs = np.maximum(1, (inputs * rng.uniform(0.3, 0.6, size=3000)).astype(int))
    times = np.cumsum(rng.gamma(0.25, 4 * 250.0, size=3000))  # CV 2, 4 req/s
    return Trace(times, inputs, outputs, source="correlated")


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    a, b, c = translation(seed=7), translation(seed=7), translation(seed=8)
    assert a.timestamps_ms.tolist() == b.timestamps_ms.tolist()
    assert a.session_ids == b.session_ids and a.target_langs == b.target_langs
    assert a.timestamps_ms.tolist() != c.timestamps_ms.tolist()
    ref = correlated_trace()
    assert (
        like(ref, duration_s=100, seed=1).input_lengths.tolist()
        == like(ref, duration_s=100, seed=1).input_lengths.tolist()
    )


def test_like_keeps_correlation_rate_and_burstiness() -> None:
    ref = correlated_trace()
    ref_rho = stats.spearmanr(ref.input_lengths, ref.output_lengths).statistic
    assert ref_rho > 0.9
    synthetic = like(ref, duration_s=1500, seed=2)
    rho = stats.spearmanr(synthetic.input_lengths, synthetic.output_lengths).statistic
    assert rho == pytest.approx(ref_rho, abs=0.03)
    ref_rate = (len(ref) - 1) / ref.duration_s()
    assert len(synthetic) / 1500 == pytest.approx(ref_rate, rel=0.15)
    assert burstiness_cv(synthetic.timestamps_ms) == pytest.approx(
        burstiness_cv(ref.timestamps_ms), rel=0.15
    )
    # From a profile alone (its length sample) too; Poisson arrivals on request.
    from_profile = like(profile_trace(ref), duration_s=1500, seed=2, arrivals="poisson")
    assert burstiness_cv(from_profile.timestamps_ms) == pytest.approx(1.0, abs=0.08)
    assert stats.spearmanr(from_profile.input_lengths, from_profile.output_lengths).statistic > 0.85


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0, 3.0])
def test_gamma_arrivals_match_target_cv(cv: float) -> None:
    times = arrival_times_ms(np.random.default_rng(0), rate_rps=20, duration_s=1000, cv=cv)
    assert burstiness_cv(times) == pytest.approx(cv, rel=0.1)
    assert len(times) / 1000 == pytest.approx(20, rel=0.1)
    assert times[0] == 0 and times[-1] < 1_000_000


def test_translation_traffic_shape() -> None:
    spec = TranslationSpec(duration_s=1200)
    trace = translation(spec, seed=1)
    assert trace.input_lengths.min() >= 10 and trace.input_lengths.max() <= 200
    profile = profile_trace(trace)
    pairs = {(p.source_lang, p.target_lang): p for p in profile.languages or []}
    ratios = {(p.source_lang, p.target_lang): p.ratio for p in spec.language_pairs}
    for key in [("en", "de"), ("de", "en"), ("en", "ja")]:
        # Mean of ratio x log-normal noise (sigma 0.15) is ratio x ~1.011, plus rounding.
        assert pairs[key].output_input_ratio == pytest.approx(ratios[key], rel=0.05)
    assert 4 <= profile.arrival_rate.mean_rps <= 6
    # Bursts: the busiest 10 s are well above the mean, the quietest well below.
    ten_s = next(w for w in profile.arrival_rate.windows if w.window_s == 10)
    assert ten_s.max > 1.5 * profile.arrival_rate.mean_rps
    # A session keeps one language pair.
    by_session: dict[str, set] = {}
    for session, src, tgt in zip(
        trace.session_ids, trace.source_langs, trace.target_langs, strict=True
    ):
        by_session.setdefault(session, set()).add((src, tgt))
    assert all(len(v) == 1 for v in by_session.values())
    assert len(by_session) < len(trace) / 2


def test_shipped_sample_is_reproducible(tmp_path: Path) -> None:
    # The command recorded in workloads/samples/README.md.
    out = tmp_path / "sample.jsonl"
    assert autotune_main(["generate", str(out), "--duration-s", "600", "--seed", "0"]) == 0
    assert out.read_bytes() == SAMPLE.read_bytes()
