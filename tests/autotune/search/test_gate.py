"""The gate's decision on constructed validation series."""

from __future__ import annotations

from autotune.search.gate import (
    BASELINE,
    Measurement,
    bootstrap_median_diff,
    candidate_stats,
    decide,
    round_robin,
)


def series(name: str, values: list[float], *, slo_met: list[bool] | None = None) -> list[Measurement]:
    met = slo_met or [True] * len(values)
    return [
        Measurement(candidate=name, repeat=i, value=v, slo_met=m)
        for i, (v, m) in enumerate(zip(values, met, strict=True))
    ]


def test_clear_win_is_emitted_with_effect_and_interval() -> None:
    runs = series(BASELINE, [2.0, 2.05, 1.98]) + series("trial-0003", [2.6, 2.55, 2.62])
    decision = decide(runs)
    assert decision.winner == "trial-0003" and not decision.keep_baseline
    assert abs(decision.effect - (2.6 - 2.0) / 2.0) < 1e-9
    assert decision.ci_low > 0 and decision.ci_high >= decision.ci_low
    assert "beats the baseline" in decision.reason


def test_win_within_the_noise_keeps_the_baseline() -> None:
    # The candidate's median is higher, but the baseline itself wanders more than that.
    runs = series(BASELINE, [2.0, 2.4, 1.7]) + series("trial-0002", [2.1, 2.2, 2.15])
    decision = decide(runs)
    assert decision.keep_baseline and decision.winner == BASELINE
    assert decision.best_candidate == "trial-0002"
    assert "noise" in decision.reason or "spread" in decision.reason


def test_a_candidate_clearly_worse_is_called_worse_not_within_the_noise() -> None:
    # The demo's gate once said "[-25.2, -19.6] includes 0" of a config that lost every repeat.
    runs = series(BASELINE, [98.0, 104.0, 99.0]) + series("trial-0001", [77.0, 79.0, 80.0])
    decision = decide(runs)
    assert decision.keep_baseline and decision.best_candidate == "trial-0001"
    assert decision.ci_high < 0
    assert decision.reason.startswith("trial-0001, the best searched config, is worse than the baseline")
    assert "is below 0" in decision.reason and "includes 0" not in decision.reason


def test_a_win_on_one_run_each_says_no_noise_was_measured() -> None:
    # --repeats 1 (an H200 run of 2026-11-28): the interval is one difference, the spread 0.
    decision = decide(series(BASELINE, [137.0]) + series("trial-0002", [537.0]))
    assert not decision.keep_baseline and decision.winner == "trial-0002"
    assert decision.reason.endswith("(one run each: no run-to-run noise measured; --repeats 3 would measure it)")
    three = decide(series(BASELINE, [137.0, 140.0, 135.0]) + series("trial-0002", [537.0, 530.0, 541.0]))
    assert not three.keep_baseline and "one run each" not in three.reason


def test_consistent_but_smaller_than_spread_gain_keeps_the_baseline() -> None:
    # Every candidate run beats every baseline run (CI above 0) but by less than the
    # baseline's own run-to-run spread: not a gain anyone can rely on.
    runs = series(BASELINE, [2.0, 2.1, 2.2]) + series("trial-0001", [2.21, 2.22, 2.23])
    decision = decide(runs)
    assert decision.ci_low > 0
    assert decision.keep_baseline
    assert "spread" in decision.reason


def test_slo_broken_in_one_repeat_is_not_eligible() -> None:
    runs = (
        series(BASELINE, [2.0, 2.0, 2.0])
        + series("trial-0004", [3.0, 3.1, 3.0], slo_met=[True, False, True])
        + series("trial-0005", [2.5, 2.55, 2.6])
    )
    decision = decide(runs)
    assert decision.winner == "trial-0005"  # the faster one missed an SLO once
    stats = {s.candidate: s for s in decision.stats}
    assert not stats["trial-0004"].eligible and "repeat 2" in stats["trial-0004"].why_not


def test_no_eligible_candidate_keeps_the_baseline() -> None:
    runs = series(BASELINE, [2.0, 2.0]) + series("trial-0001", [5.0, 5.0], slo_met=[False, False])
    decision = decide(runs)
    assert decision.keep_baseline and decision.best_candidate is None


def test_bootstrap_interval_brackets_the_difference() -> None:
    low, high = bootstrap_median_diff([3.0, 3.2, 3.1], [2.0, 2.1, 1.9])
    # Bounded by the most extreme resamples: 3.0 - 2.1 and 3.2 - 1.9.
    assert 0.9 - 1e-9 <= low <= 1.1 <= high <= 1.3 + 1e-9


def test_round_robin_runs_everyone_each_repeat_and_rotates_the_first() -> None:
    order = round_robin(["baseline", "a", "b"], 3)
    repeats = [[name for r, name in order if r == k] for k in range(3)]
    assert all(sorted(rep) == ["a", "b", "baseline"] for rep in repeats)
    assert [rep[0] for rep in repeats] == ["baseline", "a", "b"]


def test_a_config_that_carries_less_than_the_recorded_traffic_says_so_not_missed_an_slo() -> None:
    # The H100 small-model run: the hand-tuned 16 sequences met every SLO only at 0.10x.
    runs = [Measurement(candidate="compare-handtuned", repeat=r, value=22.7, slo_met=False,
                        headroom=0.10) for r in range(3)]
    stats = candidate_stats("compare-handtuned", runs)
    assert not stats.eligible
    assert stats.why_not == ("carried 0.10x the recorded traffic in repeat 1: every SLO held "
                             "only below the recorded rate")


def ladder_series(name: str, values: list[float], fails: list[float]) -> list[Measurement]:
    """Capacity repeats with their brackets: passed at `values`, failed at `fails` above."""
    return [
        Measurement(candidate=name, repeat=i, value=v, slo_met=True, first_fail_rps=f,
                    resolution=f / v - 1.0)
        for i, (v, f) in enumerate(zip(values, fails, strict=True))
    ]


def test_repeats_on_the_same_ladder_step_still_carry_the_ladder_s_resolution_as_noise() -> None:
    """Three baseline repeats passing the same step read one capacity: a spread of 0%. The
    capacity is only known to within the 10% bracket, so a 5% gain is within the noise."""
    runs = (ladder_series(BASELINE, [10.0, 10.0, 10.0], [11.0, 11.0, 11.0])
            + ladder_series("trial-0002", [10.5, 10.5, 10.5], [11.55, 11.55, 11.55]))
    decision = decide(runs)
    assert decision.keep_baseline
    assert decision.noise is not None and abs(decision.noise - 0.1) < 1e-9
    assert decision.reason.endswith(
        "within the noise; noise used 10.0%, the ladder's resolution, above the baseline's spread "
        "of 0.0% over its repeats")
    # A gain beyond the bracket is emitted, and the message still states the noise it beat.
    clear = (ladder_series(BASELINE, [10.0, 10.0, 10.0], [11.0, 11.0, 11.0])
             + ladder_series("trial-0003", [12.5, 12.6, 12.5], [13.7, 13.8, 13.7]))
    won = decide(clear)
    assert not won.keep_baseline and won.winner == "trial-0003"
    assert "noise used 10.0%, the ladder's resolution" in won.reason
    assert "measured the same value" not in won.reason  # 12.5, 12.6, 12.5: an interval


def test_a_point_interval_says_every_repeat_measured_the_same_value() -> None:
    """The H200 fp8 gate (results/h200-2026-12-02-fp8): 17.3 and 28.9 req/s in each of three
    repeats read "95% CI of the difference [11.6, 11.6]", which looks like a certainty the
    ladder's 5.7% steps do not give: the reason says why the interval is a point."""
    runs = (ladder_series(BASELINE, [17.3, 17.3, 17.3], [18.7, 18.7, 18.7])
            + ladder_series("trial-0001", [28.9, 28.9, 28.9], [31.0, 31.0, 31.0]))
    won = decide(runs)
    assert not won.keep_baseline and won.winner == "trial-0001"
    assert "[11.6, 11.6] (every repeat of each config measured the same value)" in won.reason


def test_a_baseline_spread_wider_than_the_resolution_is_the_noise() -> None:
    runs = (ladder_series(BASELINE, [10.0, 12.0, 11.0], [10.5, 12.6, 11.5])
            + ladder_series("trial-0002", [13.0, 13.1, 12.9], [13.6, 13.7, 13.5]))
    decision = decide(runs)
    assert decision.noise is not None and abs(decision.noise - 2.0 / 11.0) < 1e-9
    assert "the baseline's spread over its repeats, above the ladder's resolution of" in decision.reason
