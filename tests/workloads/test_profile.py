"""Profile numbers on a hand-made trace, and the fingerprint's stability."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from workloads.profile import _spearman, format_profile, profile_trace, write_plots
from workloads.trace import Trace
from workloads.trace_io import load_trace


def hand_made() -> Trace:
    return Trace(
        [0, 500, 1000, 3000, 4000],
        [10, 20, 30, 40, 50],
        [5, 4, 3, 2, 1],
        hash_ids=[[1, 2], [1, 3], [4], [1, 2, 5], None],
        latencies_ms=[1000, 1000, 1000, 500, math.nan],
        source_langs=["en", "de", "en", "de", "en"],
        target_langs=["de", "en", "de", "en", "de"],
        session_ids=["a", "a", "b", None, "b"],
        source="hand-made",
    )


def test_profile_numbers_on_a_hand_made_trace() -> None:
    profile = profile_trace(hand_made())
    assert profile.requests == 5
    assert profile.duration_s == 4.0
    assert profile.arrival_rate.mean_rps == 1.0  # 4 gaps in 4 s
    one_s = profile.arrival_rate.windows[0]
    # Arrivals at 0, 0.5, 1, 3, 4 s -> full 1 s windows hold 2, 1, 0, 1.
    assert (one_s.window_s, one_s.windows, one_s.p50, one_s.max) == (1, 4, 1.0, 2.0)
    assert [w.window_s for w in profile.arrival_rate.windows] == [1]  # 10 s does not fit
    # Gaps 500, 500, 2000, 1000 ms: mean 1000, population std sqrt(375000).
    assert profile.burstiness_cv == pytest.approx(math.sqrt(375000) / 1000)
    assert profile.input_length.mean == 30 and profile.input_length.percentiles["p50"] == 30
    assert (profile.input_length.min, profile.input_length.max) == (10, 50)
    assert sum(profile.output_length.histogram.counts) == 5
    assert profile.in_out_spearman == pytest.approx(-1.0)
    sharing = profile.prefix_sharing
    assert sharing is not None
    # 8 blocks, 5 distinct: ids 1 (twice) and 2 (once) had been seen before.
    assert (sharing.blocks, sharing.unique_blocks) == (8, 5)
    assert sharing.reused_fraction == 3 / 8
    assert sharing.requests_with_reuse == 0.5
    concurrency = profile.concurrency
    assert concurrency is not None
    # In flight: 1 for 0-0.5 s, 2 for 0.5-1.5 s, 1 for 1.5-2 s, 0 until 3 s, 1 until 3.5 s.
    assert concurrency.mean == pytest.approx(1.0)
    assert (concurrency.p50, concurrency.p90, concurrency.max) == (1, 2, 2)
    assert concurrency.requests_with_latency == 4
    pairs = {(p.source_lang, p.target_lang): p for p in profile.languages or []}
    assert pairs[("en", "de")].requests == 3
    assert pairs[("de", "en")].output_input_ratio == pytest.approx((4 / 20 + 2 / 40) / 2)
    assert profile.sessions == 2
    assert profile.length_sample.input_lengths == [10, 20, 30, 40, 50]
    assert "fingerprint" in format_profile(profile)


def test_fingerprint_depends_on_requests_not_on_file(tmp_path: Path) -> None:
    a = tmp_path / "a.jsonl"
    b = tmp_path / "sub" / "b.jsonl"
    b.parent.mkdir()
    a.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 3}\n'
        '{"timestamp": 700, "input_length": 20, "output_length": 4}\n'
        '{"timestamp": 1900, "input_length": 30, "output_length": 9}\n'
    )
    b.write_text(
        '{"output_length": 3, "input_length": 10, "timestamp": 0.0}\n'
        '{"input_length": 20, "timestamp": 700.0, "output_length": 4}\n'
        '{"output_length": 9, "timestamp": 1900, "input_length": 30}\n'
    )
    fa, fb = profile_trace(load_trace(a)), profile_trace(load_trace(b))
    assert len(fa.fingerprint) == 16
    assert fa.fingerprint == fb.fingerprint
    c = tmp_path / "c.jsonl"
    c.write_text(a.read_text().replace('"output_length": 9', '"output_length": 10'))
    assert profile_trace(load_trace(c)).fingerprint != fa.fingerprint
    # A profile that went through JSON (as in an exported config) keeps its fingerprint.
    restored = type(fa).model_validate_json(fa.model_dump_json())
    assert restored.compute_fingerprint() == fa.fingerprint


def test_window_rates_on_a_steady_trace() -> None:
    # Exactly 4 requests per second for 120 s.
    trace = Trace(np.arange(480) * 250.0, np.full(480, 10), np.full(480, 10))
    windows = {w.window_s: w for w in profile_trace(trace).arrival_rate.windows}
    assert set(windows) == {1, 10, 60}
    for w in windows.values():
        assert w.p50 == w.p99 == w.max == 4.0
    assert profile_trace(trace).burstiness_cv == 0.0


def test_plots_are_written(tmp_path: Path) -> None:
    trace = hand_made()
    written = write_plots(trace, profile_trace(trace), tmp_path / "plots")
    names = sorted(p.name for p in written)
    assert names == ["arrivals.png", "concurrency.png", "in_out.png", "lengths.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "top",
    [3, 600, 2**31 - 1],  # many ties; typical token counts; too wide to count (sorts)
)
def test_spearman_is_scipys_to_the_last_bit(top: int) -> None:
    rng = np.random.default_rng(top)
    inputs = rng.integers(1, top + 1, size=5000)
    outputs = np.maximum(1, inputs // 2 + rng.integers(0, top // 3 + 1, size=5000))
    expected = stats.spearmanr(inputs, outputs).statistic
    assert _spearman(inputs, outputs) == expected
