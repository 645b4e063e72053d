"""The prefix-cache hit rate a trial records: vLLM's token counters diffed over each measured
window (a ladder step), summed over the steps; no counters, no figure (never a made-up 0)."""

from __future__ import annotations

import pytest

from autotune.measure.scraper import (
    ServerMetrics,
    parse_metrics,
    prefix_cache_hit_rate,
    server_metrics,
)

# As vLLM 0.32 exposes them: counters per engine (a data-parallel server has one per replica).
BEFORE = """# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 100.0
"""
AFTER = BEFORE.replace("} 1000.0", "} 3000.0").replace("} 100.0", "} 1100.0")


def test_a_window_counts_the_prompt_tokens_queried_and_hit_during_it_over_every_engine() -> None:
    metrics = server_metrics(parse_metrics(BEFORE), parse_metrics(AFTER), [])
    assert (metrics.prefix_cache_queries, metrics.prefix_cache_hits) == (4000.0, 2000.0)
    assert prefix_cache_hit_rate([metrics]) == 0.5


def test_the_older_spelling_is_read_too() -> None:
    old = AFTER.replace("vllm:prefix_cache_", "vllm:gpu_prefix_cache_")
    metrics = server_metrics(parse_metrics(""), parse_metrics(old), [])
    assert (metrics.prefix_cache_queries, metrics.prefix_cache_hits) == (6000.0, 2200.0)


def test_a_server_without_the_counters_has_no_hit_rate() -> None:
    metrics = server_metrics(parse_metrics("vllm:num_requests_running 0\n"),
                             parse_metrics("vllm:num_requests_running 1\n"), [])
    assert metrics.prefix_cache_queries is None and metrics.prefix_cache_hits is None
    assert prefix_cache_hit_rate([metrics, None]) is None


@pytest.mark.parametrize(("windows", "rate"), [
    # Token-weighted over the steps: 900 of 1000 and 0 of 3000 tokens hit -> 22.5%.
    ([ServerMetrics(prefix_cache_queries=1000, prefix_cache_hits=900),
      ServerMetrics(prefix_cache_queries=3000, prefix_cache_hits=0)], 0.225),
    # A step whose server lacked the counters is left out, not counted as misses.
    ([ServerMetrics(prefix_cache_queries=1000, prefix_cache_hits=900), ServerMetrics()], 0.9),
    ([ServerMetrics(prefix_cache_queries=0, prefix_cache_hits=0)], None),  # nothing queried
    ([], None),
])
def test_the_hit_rate_over_measured_steps(windows: list[ServerMetrics], rate: float | None) -> None:
    assert prefix_cache_hit_rate(windows) == rate
