"""SLO specs (`ttft_p95_ms=500`), per-request goodness and run-level SLO checks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from workloads.errors import WorkloadError
from workloads.replay_summary import RequestRecord
from workloads.slo import (
    SLO,
    allowed_misses,
    parse_slo,
    parse_slos,
    request_is_good,
    run_percentile_ms,
    slo_met,
)


def record(**fields) -> RequestRecord:
    base = dict(index=0, scheduled_s=0, sent_s=0, lag_ms=0, input_tokens=1)
    return RequestRecord(**(base | fields))


def test_parse_reads_metric_percentile_and_threshold() -> None:
    assert parse_slo("ttft_p95_ms=500") == SLO(metric="ttft", percentile=95, threshold_ms=500)
    assert parse_slo(" itl_p99.9_ms=12.5 ") == SLO(metric="itl", percentile=99.9, threshold_ms=12.5)
    assert parse_slo("e2el_p50_ms=2000").metric == "e2el"
    assert parse_slo("tpot_p100_ms=40").percentile == 100


@given(
    metric=st.sampled_from(["ttft", "tpot", "itl", "e2el"]),
    percentile=st.sampled_from([50, 90, 95, 99, 99.9, 100]),
    threshold=st.floats(min_value=0.001, max_value=1e7, allow_nan=False),
)
def test_spec_reads_back_to_the_same_slo(metric: str, percentile: float, threshold: float) -> None:
    slo = SLO(metric=metric, percentile=percentile, threshold_ms=threshold)
    again = parse_slo(slo.spec())
    assert again.metric == slo.metric and again.percentile == slo.percentile
    assert again.threshold_ms == pytest.approx(slo.threshold_ms, rel=1e-5)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("ttft<500", "ttft<500"),
        ("latency_p95_ms=500", "unknown metric 'latency'"),
        ("ttft_p95=500", "ttft_p95=500"),
        ("ttft_p10_ms=500", "p50..p100"),
        ("ttft_p101_ms=500", "p50..p100"),
        ("ttft_p95_ms=fast", "'fast'"),
        ("ttft_p95_ms=0", "positive"),
        ("ttft_p95_ms=-3", "positive"),
        ("ttft_p9.9.9_ms=1", "'9.9.9'"),
    ],
)
def test_bad_spec_names_the_text_and_the_accepted_form(text: str, names: str) -> None:
    with pytest.raises(WorkloadError) as raised:
        parse_slo(text)
    message = str(raised.value)
    assert names in message and "ttft_p95_ms=500" in message and "\n" not in message


def test_the_same_objective_twice_is_rejected() -> None:
    assert len(parse_slos(["ttft_p95_ms=500", "ttft_p99_ms=900"])) == 2
    with pytest.raises(WorkloadError, match="repeats"):
        parse_slos(["ttft_p95_ms=500", "ttft_p95_ms=400"])


def test_a_request_is_good_only_when_every_own_value_is_within() -> None:
    slos = [parse_slo("ttft_p95_ms=100"), parse_slo("tpot_p95_ms=20")]
    fast = record(ttft_ms=80, e2e_ms=80 + 9 * 15, output_tokens=10, itl_ms=[15] * 9)
    slow_start = record(ttft_ms=120, e2e_ms=120 + 9 * 15, output_tokens=10, itl_ms=[15] * 9)
    slow_decode = record(ttft_ms=80, e2e_ms=80 + 9 * 25, output_tokens=10, itl_ms=[25] * 9)
    failed = record(ttft_ms=10, e2e_ms=None, error="HTTP 500: boom", output_tokens=0)
    assert request_is_good(fast, slos)
    assert not request_is_good(slow_start, slos)
    assert not request_is_good(slow_decode, slos)
    assert not request_is_good(failed, slos)


def test_itl_slo_uses_the_requests_own_gaps_at_the_slo_percentile() -> None:
    one_stall = record(ttft_ms=10, e2e_ms=300, output_tokens=11, itl_ms=[10] * 9 + [200])
    assert request_is_good(one_stall, [parse_slo("itl_p50_ms=20")])
    assert not request_is_good(one_stall, [parse_slo("itl_p99_ms=20")])


def test_one_token_answers_have_no_tpot_to_fail() -> None:
    single = record(ttft_ms=50, e2e_ms=50, output_tokens=1)
    assert request_is_good(single, [parse_slo("tpot_p99_ms=1"), parse_slo("itl_p99_ms=1")])
    assert not request_is_good(single, [parse_slo("e2el_p99_ms=10")])


def test_run_meets_an_slo_when_its_percentile_is_within() -> None:
    values = list(range(1, 101))  # 1..100 ms
    assert slo_met(values, parse_slo("ttft_p50_ms=51"))
    assert not slo_met(values, parse_slo("ttft_p99_ms=90"))
    assert slo_met(values, parse_slo("ttft_p100_ms=100"))
    assert not slo_met([], parse_slo("ttft_p50_ms=1000"))


def test_failed_requests_count_as_misses_of_a_run_percentile() -> None:
    # The case: 53 fast answers and 7 HTTP 400s of 60. Over the completed ones the
    # p95 holds; a failed request meets no SLO, so over all 60 it cannot (7 > 2 allowed).
    fast = [100.0] * 53
    slo = parse_slo("ttft_p95_ms=500")
    assert slo_met(fast, slo)
    assert not slo_met(fast, slo, failed=7)
    assert allowed_misses(60, 95) == 2
    assert slo_met(fast + [100.0] * 5, slo, failed=2)  # 2 of 60 may miss
    assert not slo_met([], slo, failed=3)


def test_failed_requests_count_against_an_itl_slo_by_request() -> None:
    gaps = [5.0] * 1000  # every token gap fast
    slo = parse_slo("itl_p95_ms=50")
    assert slo_met(gaps, slo, failed=2, requests=60)
    assert not slo_met(gaps, slo, failed=3, requests=60)


@given(
    values=st.lists(st.floats(min_value=0, max_value=1000), min_size=1, max_size=40),
    failed=st.integers(min_value=0, max_value=6),
    percentile=st.sampled_from([50, 90, 95, 99, 100]),
)
def test_run_percentile_is_numpys_with_failures_as_infinitely_slow(
    values: list[float], failed: int, percentile: float
) -> None:
    got = run_percentile_ms(values, percentile, failed=failed)
    # Failures as a value far above any threshold: the same percentile, or far above too.
    stand_in = float(np.percentile(values + [1e15] * failed, percentile))
    if got == float("inf"):
        assert stand_in > 1000
    else:
        assert got == pytest.approx(stand_in, rel=1e-9, abs=1e-9)
    # Within the count the percentile allows, the run holds for certain.
    slo = SLO(metric="ttft", percentile=percentile, threshold_ms=1000)
    if failed <= allowed_misses(len(values) + failed, percentile):
        assert slo_met(values, slo, failed=failed)
