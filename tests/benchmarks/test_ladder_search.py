"""The ladder-search benchmark (benchmarks/ladder_search.py) runs the real search rule: a
capacity of 5x the recorded rate, found by both rules, with the overshoot each offered."""

from __future__ import annotations

from autotune.measure.ladder import LadderSettings
from benchmarks import ladder_search as bench


def test_both_rules_find_the_cliff_and_only_the_capped_one_stays_within_twice_it() -> None:
    capped = bench.search(LadderSettings(), 5.0)
    squared = bench.search(LadderSettings(max_step_factor=1e12), 5.0)
    assert capped["bracketed"] and squared["bracketed"]
    # x1, x2, x4 pass, x8 fails: 1.6x the capacity; squaring jumps from x2 to x8 as well, but a
    # capacity of 9 is passed by x8 and then overshot by x128.
    assert capped["overshoot"] <= 2.0
    assert bench.search(LadderSettings(max_step_factor=1e12), 9.0)["overshoot"] > 2.0
    assert bench.search(LadderSettings(), 9.0)["overshoot"] <= 2.0


def test_a_hinted_ladder_far_below_its_cliff_still_climbs_to_it() -> None:
    run = bench.search(LadderSettings().hinted(0.5), 40.0)
    assert run["bracketed"] and run["overshoot"] <= 2.0
