"""Prometheus parsing, before/after diffs and histogram estimates (autotune.measure.scraper)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import httpx
import pytest

from autotune.measure.scraper import (
    KV_CACHE_USAGE,
    NUM_RUNNING,
    NUM_WAITING,
    TIMELINE_GAUGES,
    Histogram,
    MetricSample,
    MetricsSampler,
    MetricsScraper,
    parse_metrics,
    parse_scalars,
    server_metrics,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def ttft_text(counts: dict[str, tuple[float, float]], *, total: float) -> str:
    """A TTFT histogram for two engines; counts = le -> (engine 0, engine 1) cumulative."""
    lines = [
        "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ]
    for le, (e0, e1) in counts.items():
        for engine, value in (("0", e0), ("1", e1)):
            lines.append(
                f'vllm:time_to_first_token_seconds_bucket{{engine="{engine}",le="{le}",'
                f'model_name="m"}} {value}'
            )
    inf = counts["+Inf"]
    for engine, value in (("0", inf[0]), ("1", inf[1])):
        lines.append(f'vllm:time_to_first_token_seconds_count{{engine="{engine}",model_name="m"}} {value}')
        lines.append(
            f'vllm:time_to_first_token_seconds_sum{{engine="{engine}",model_name="m"}} {total / 2}'
        )
    return "\n".join(lines) + "\n"


def test_histogram_diff_and_estimates_match_a_hand_computed_case() -> None:
    before = parse_metrics(
        ttft_text({"0.1": (1, 1), "0.5": (2, 1), "1.0": (2, 1), "+Inf": (2, 1)}, total=0.6)
    )
    after = parse_metrics(
        ttft_text({"0.1": (2, 1), "0.5": (5, 4), "1.0": (7, 5), "+Inf": (8, 5)}, total=7.6)
    )
    window = after.histograms["vllm:time_to_first_token_seconds"].minus(
        before.histograms["vllm:time_to_first_token_seconds"]
    )
    # Summed over both engines and diffed: <=0.1: 3-2=1, <=0.5: 9-3=6, <=1.0: 12-3=9, all: 13-3=10
    assert window.bounds == (0.1, 0.5, 1.0, math.inf)
    assert window.cumulative == (1, 6, 9, 10)
    assert window.count == 10
    assert window.mean() == pytest.approx((7.6 - 0.6) / 10)
    # Median: rank 5 lies in (0.1, 0.5], 4 of that bucket's 5 observations: 0.1 + 0.4 * 4/5.
    assert window.quantile(0.5) == pytest.approx(0.42)
    # p90: rank 9 is exactly the top of the (0.5, 1.0] bucket.
    assert window.quantile(0.9) == pytest.approx(1.0)
    # p95: rank 9.5 is in the +Inf bucket: the largest finite bound is all that is known.
    assert window.quantile(0.95) == pytest.approx(1.0)
    # p5: rank 0.5 in the first bucket, interpolated from 0.
    assert window.quantile(0.05) == pytest.approx(0.05)


def test_empty_window_has_no_estimates() -> None:
    empty = Histogram(bounds=(0.1, math.inf), cumulative=(0, 0), sum=0.0, count=0)
    assert empty.mean() is None
    assert empty.quantile(0.95) is None


def test_counter_reset_counts_everything_after() -> None:
    before = Histogram(bounds=(1.0, math.inf), cumulative=(5, 9), sum=9.0, count=9)
    after = Histogram(bounds=(1.0, math.inf), cumulative=(1, 2), sum=1.5, count=2)
    assert after.minus(before) == after


@pytest.mark.parametrize("name", ["metrics_vllm_0_32.txt", "metrics_vllm_0_24_names.txt"])
def test_real_exposition_gives_every_server_metric(name: str) -> None:
    # The same window seen by two vLLM generations: current names and the older ones.
    text = (FIXTURES / name).read_text()
    after = parse_metrics(text)
    before = parse_metrics("")
    timeline = [
        MetricSample(t_s=0.0, kv_cache_usage=0.25, num_running=3, num_waiting=1),
        MetricSample(t_s=1.0, kv_cache_usage=0.75, num_running=6, num_waiting=0),
    ]
    metrics = server_metrics(before, after, timeline)
    for field in (
        "ttft_mean_ms",
        "ttft_p95_ms",
        "itl_mean_ms",
        "itl_p95_ms",
        "queue_mean_ms",
        "queue_p95_ms",
        "e2e_mean_ms",
        "prefill_mean_ms",
        "decode_mean_ms",
        "preemptions",
    ):
        assert getattr(metrics, field) is not None, field
    raw = {
        line.split("{")[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("vllm:time_to_first_token_seconds_")
        and ("_sum{" in line or "_count{" in line)
    }
    expected_mean_ms = 1000 * raw["vllm:time_to_first_token_seconds_sum"] / raw[
        "vllm:time_to_first_token_seconds_count"
    ]
    assert metrics.ttft_mean_ms == pytest.approx(expected_mean_ms)
    assert metrics.itl_mean_ms > 0
    assert metrics.kv_cache_usage_max == 0.75
    assert metrics.kv_cache_usage_mean == pytest.approx(0.5)
    assert metrics.num_running_max == 6 and metrics.num_waiting_max == 1
    assert after.value(("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")) is not None


def test_both_name_generations_give_the_same_numbers() -> None:
    current = parse_metrics((FIXTURES / "metrics_vllm_0_32.txt").read_text())
    older = parse_metrics((FIXTURES / "metrics_vllm_0_24_names.txt").read_text())
    empty = parse_metrics("")
    assert server_metrics(empty, current, []) == server_metrics(empty, older, [])


@pytest.mark.parametrize(
    ("header", "sample"),
    [
        ("# TYPE vllm:num_preemptions counter\n", "vllm:num_preemptions_total"),
        ("# TYPE vllm:num_preemptions_total counter\n", "vllm:num_preemptions_total"),
        ("", "vllm:num_preemptions"),  # untyped, no _total suffix
    ],
)
def test_preemptions_are_diffed_in_every_spelling(header: str, sample: str) -> None:
    line = sample + '{{engine="0",model_name="m"}} {}\n'
    before = parse_metrics(header + line.format(4.0))
    after = parse_metrics(header + line.format(7.0))
    assert server_metrics(before, after, []).preemptions == 3.0
    assert server_metrics(before, after, []).ttft_mean_ms is None


@pytest.mark.parametrize("name", ["metrics_vllm_0_32.txt", "metrics_vllm_0_24_names.txt"])
def test_the_timeline_line_scan_reads_what_the_full_parse_reads(name: str) -> None:
    text = (FIXTURES / name).read_text()
    full = parse_metrics(text)
    # A longer name sharing a wanted prefix, and a label value holding a space and a brace.
    text += (
        'vllm:num_requests_running_extra{engine="0"} 99.0\n'
        'vllm:num_requests_running{engine="1",model_name="my model}"} 2.0\n'
    )
    scanned = parse_scalars(text, TIMELINE_GAUGES)
    for names in (KV_CACHE_USAGE, NUM_RUNNING, NUM_WAITING):
        expected = full.value(names)
        if names is NUM_RUNNING:
            expected = (expected or 0.0) + 2.0
        assert scanned.value(names) == pytest.approx(expected)
    assert set(scanned.scalars) <= set(TIMELINE_GAUGES) and not scanned.histograms


def test_sampler_builds_a_timeline_and_skips_failed_scrapes() -> None:
    text = (FIXTURES / "metrics_vllm_0_32.txt").read_text()
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        # Every third scrape fails, as a busy server's may.
        return httpx.Response(500 if calls["n"] % 3 == 0 else 200, text=text)

    samples_seen = []

    async def run() -> tuple[list[MetricSample], int]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            sampler = MetricsSampler(
                MetricsScraper(client, "http://server"),
                interval_s=0.05,
                on_sample=lambda: samples_seen.append(1),
            )
            sampler.start()
            await asyncio.sleep(0.5)
            timeline = await sampler.stop()
            return timeline, sampler.failed_scrapes

    timeline, failed = asyncio.run(run())
    assert len(timeline) >= 4
    assert failed >= 1
    assert len(samples_seen) == len(timeline) + failed
    assert [s.t_s for s in timeline] == sorted(s.t_s for s in timeline)
    expected = parse_metrics(text)
    assert timeline[0].num_running == expected.value(("vllm:num_requests_running",))
    assert timeline[0].kv_cache_usage == expected.value(("vllm:kv_cache_usage_perc",))
