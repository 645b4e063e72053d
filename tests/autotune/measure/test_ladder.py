"""The load ladder: step traces, the search's next step, and whole ladders against real
server processes whose capacity the test sets (tests/autotune/fake_server.py `slots`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from autotune.measure.ladder import (
    CapacityResult,
    LadderSettings,
    LadderStep,
    LoadLadder,
    allowed_misses,
    recorded_rate,
    step_trace,
)
from autotune.measure.trial import TrialRunner
from autotune.search.objective import Objective, evaluate
from server.config import ServerConfig
from tests.factories import ladder_step, replay_summary
from workloads.replay import ReplayOptions
from workloads.slo import SLO, parse_slo
from workloads.trace import Trace, TraceRequest

HELPERS = Path(__file__).resolve().parents[1]  # tests/autotune: the fake servers, the tuners, fixtures/
FAKE_SERVER = HELPERS / "fake_server.py"


def window(n: int = 20, spacing_ms: float = 100.0, output_length: int = 5) -> Trace:
    return Trace.from_requests(
        [TraceRequest(timestamp=i * spacing_ms, input_length=10, output_length=output_length)
         for i in range(n)],
        source="test window",
    )


# -- pure logic --------------------------------------------------------------------------


def test_allowed_misses_matches_numpys_percentile() -> None:
    """The abandon rule is exact: with `allowed` values over T the percentile holds, with
    one more it does not (numpy's linear interpolation, as every summary uses)."""
    rng = np.random.default_rng(0)
    for n in (10, 20, 60, 101, 200):
        for pct in (50.0, 90.0, 95.0, 99.0):
            allowed = allowed_misses(n, pct)
            low = rng.uniform(0, 1, size=n)
            within = np.concatenate([low[: n - allowed], np.full(allowed, 5.0)])
            over = np.concatenate([low[: n - allowed - 1], np.full(allowed + 1, 5.0)])
            assert np.percentile(within, pct) <= 1.0
            assert np.percentile(over, pct) > 1.0


def test_step_trace_compresses_the_recorded_arrivals_and_repeats_the_window() -> None:
    settings = LadderSettings(step_requests=50, min_step_s=1.0)
    base = window(n=20, spacing_ms=100.0)
    assert recorded_rate(base) == pytest.approx(10.0)
    step = step_trace(base, 4.0, settings)
    assert len(step) == 50  # 2.5 copies of the window
    gaps = np.diff(step.timestamps_ms)
    assert np.allclose(gaps, 25.0)  # 100 ms / 4, the seam included
    assert list(step.input_lengths[:20]) == list(base.input_lengths)
    # A slow step is lengthened to its minimum span instead.
    slow = step_trace(base, 0.5, LadderSettings(step_requests=10, min_step_s=6.0))
    assert slow.duration_s() >= 5.9 and len(slow) == 31


def _step(index: int, speedup: float, passed: bool) -> LadderStep:
    # The window() of these tests records 10 req/s; a step sent at x s offers 10 s req/s.
    return ladder_step(index=index, speedup=speedup, offered_rps=10.0 * speedup, passed=passed)


def _ladder(settings: LadderSettings, outcomes: list[tuple[float, bool]]) -> LoadLadder:
    ladder = LoadLadder(settings, url="http://unused",
                        replay=ReplayOptions(slos=[parse_slo("ttft_p95_ms=100")]),
                        scraper=None)  # type: ignore[arg-type]
    ladder.steps = [_step(i, s, ok) for i, (s, ok) in enumerate(outcomes)]
    return ladder


def test_search_climbs_until_a_failure_then_bisects_to_the_resolution() -> None:
    settings = LadderSettings(growth=2.0, resolution=0.1)
    assert _ladder(settings, [(1.0, True)]).next_speedup() == 2.0
    # Consecutive passes would square the factor (x4, x16), but a step at most doubles the last
    # one's rate: past the cliff a bigger jump only overloads the server more.
    assert _ladder(settings, [(1.0, True), (2.0, True)]).next_speedup() == 4.0
    assert _ladder(settings, [(1.0, True), (2.0, True), (4.0, True)]).next_speedup() == 8.0
    assert _ladder(settings, [(1.0, False), (0.5, False)]).next_speedup() == 0.25
    assert _ladder(settings, [(1.0, True), (2.0, False)]).next_speedup() == pytest.approx(2**0.5)
    assert _ladder(settings, [(1.0, False)]).next_speedup() == 0.5
    done = _ladder(settings, [(1.0, True), (2.0, False), (1.41, True), (1.5, False)])
    assert done.next_speedup() is None
    capacity = done.result(window())
    assert capacity.capacity_speedup == 1.41 and capacity.bracketed
    assert capacity.capacity_rps == pytest.approx(1.41 * 10.0)
    # Nothing passes down to the floor: capacity 0, the search ends.
    floor = _ladder(settings.model_copy(update={"min_speedup": 0.25}),
                    [(1.0, False), (0.5, False), (0.25, False)])
    assert floor.next_speedup() is None and floor.result(window()).capacity_rps == 0.0


def test_a_config_passing_at_the_highest_rate_is_a_lower_bound() -> None:
    capped = LadderSettings(growth=2.0, max_speedup=3.0)
    assert _ladder(capped, [(1.0, True), (2.0, True)]).next_speedup() == 3.0  # not 4: the cap
    done = _ladder(capped, [(1.0, True), (2.0, True), (3.0, True)])
    assert done.next_speedup() is None
    capacity = done.result(window())
    assert capacity.capacity_speedup == 3.0 and not capacity.bracketed


def test_a_step_passed_early_says_what_it_did_not_wait_for() -> None:
    """The reason of an early pass names the requests still running and those never sent (not
    yet due when the verdict was certain), so the step's counts add up to its requests."""
    ladder = _ladder(LadderSettings(), [])
    summary = replay_summary(completed=27, cancelled=2)
    measured = {"ttft_p95_ms=100": 40.0}
    assert ladder._verdict(summary, measured, 30, "pass") == (
        True, "ttft p95 40/100 ms (decided with 2 still running, 1 not yet sent)")
    everything_sent = summary.model_copy(update={"cancelled": 3})
    assert ladder._verdict(everything_sent, measured, 30, "pass") == (
        True, "ttft p95 40/100 ms (decided with 3 still running)")


def test_hinted_ladder_starts_at_the_hint_with_finer_steps() -> None:
    hinted = LadderSettings(growth=2.0, resolution=0.1).hinted(3.0)
    assert hinted.start_speedup == 3.0 and hinted.growth == pytest.approx(1.25)
    # Far below its cliff, a hinted ladder's factor squares (x1.25, x1.56) up to x2.
    ladder = _ladder(hinted, [(3.0, True), (3.75, True)])
    assert ladder.next_speedup() == pytest.approx(3.75 * 1.25**2)
    ladder.steps.append(_step(2, 3.75 * 1.25**2, True))
    assert ladder.next_speedup() == pytest.approx(3.75 * 1.25**2 * 2)
    assert LadderSettings().hinted(None) == LadderSettings()


def test_capacity_objective_scores_the_ladder_and_needs_the_recorded_rate_for_slo_met() -> None:
    slos = [parse_slo("ttft_p95_ms=100")]

    class Outcome:
        ok, failure, failure_detail, summary, trial_dir = True, None, None, None, None

    outcome = Outcome()
    outcome.capacity = CapacityResult(  # type: ignore[attr-defined]
        capacity_rps=15.0, capacity_speedup=1.5, recorded_rps=10.0, first_fail_rps=16.5,
        bracketed=True, steps=[],
    )
    scored = evaluate(outcome, Objective(kind="capacity"), slos)
    assert scored.values == [15.0] and scored.headroom == pytest.approx(1.5) and scored.slo_met
    outcome.capacity = outcome.capacity.model_copy(update={"capacity_rps": 8.0})  # type: ignore[attr-defined]
    below = evaluate(outcome, Objective(kind="capacity"), slos)
    assert not below.slo_met and below.feasible  # carries something, not the recorded rate
    outcome.capacity = None  # type: ignore[attr-defined]
    assert not evaluate(outcome, Objective(kind="capacity"), slos).feasible


# -- whole ladders, real processes ---------------------------------------------------------


def ladder_runner(tmp_path: Path, slots: int, settings: LadderSettings, slos: list[SLO],
                  replay_workers: int | str = "auto", max_send_lag_ms: float | None = None,
                  token_delay_s: float = 0.01) -> TrialRunner:
    behaviour = tmp_path / f"behaviour-{slots}.json"
    behaviour.write_text(json.dumps({"slots": slots, "token_delay_s": token_delay_s}))
    return TrialRunner(
        replay_workers=replay_workers,  # type: ignore[arg-type]
        server_command=[sys.executable, str(FAKE_SERVER), "--behaviour", str(behaviour)],
        startup_timeout_s=20,
        warmup_requests=1,
        scrape_interval_s=0.2,
        stale_registry=tmp_path / "servers.json",
        replay=ReplayOptions(slos=slos, max_send_lag_ms=max_send_lag_ms),
        ladder=settings,
    )


@pytest.mark.slow
def test_a_server_with_more_slots_has_the_higher_capacity_each_in_one_launch(tmp_path: Path) -> None:
    """Side by side, same window and SLO: 1 slot vs 6 slots of the same per-request speed.
    The 6-slot server must carry more; each ladder is one server process.

    A request takes ~200 ms and the TTFT limit is 600 ms: a stall of a busy 2-core machine (a
    step's TTFT p95 went over a 150 ms limit at 10 req/s on 6 slots beside another job) does
    not decide a step, a queue of requests does. The client-lag rule has its own tests."""
    slos = [parse_slo("ttft_p95_ms=600")]
    settings = LadderSettings(step_requests=30, min_step_s=1.0, resolution=0.25, max_steps=8)
    config = ServerConfig(engine={"model": "fake"})
    results: dict[int, CapacityResult] = {}
    for slots in (1, 6):
        trial_dir = tmp_path / f"slots-{slots}"
        runner = ladder_runner(tmp_path, slots, settings, slos, max_send_lag_ms=60_000,
                               token_delay_s=0.04)
        outcome = runner.run(config, window(), trial_dir)
        assert outcome.ok, outcome.failure_detail
        assert outcome.capacity is not None and len(outcome.capacity.steps) >= 2
        starts = (trial_dir / "server.log").read_text().count("fake server pid starting")
        assert starts == 1  # the whole ladder in one launch
        saved = CapacityResult.model_validate_json((trial_dir / "ladder.json").read_text())
        assert saved == outcome.capacity
        results[slots] = outcome.capacity
    assert results[1].capacity_rps > 0
    assert results[6].capacity_rps > results[1].capacity_rps * 1.5
    # Every failing step above the capacity really missed the SLO or was abandoned.
    for capacity in results.values():
        for step in capacity.steps:
            if not step.passed:
                assert step.abandoned or "ttft" in step.reason


@pytest.mark.slow
def test_ladder_steps_are_sent_by_the_trials_replayer_processes(tmp_path: Path) -> None:
    """A ladder's upper steps on a GPU run at hundreds of req/s, more than one event loop
    sends on time: each step goes through the same multi-process replayer as a fixed-rate
    window, and still finds the cliff (1 slot: a pass below it, a fail above)."""
    slos = [parse_slo("ttft_p95_ms=150")]
    settings = LadderSettings(step_requests=30, min_step_s=1.0, resolution=0.25, max_steps=6)
    # Not about the client-lag rule (test_client_lag.py): a lagging step is scored here.
    outcome = ladder_runner(tmp_path, 1, settings, slos, replay_workers=2, max_send_lag_ms=60_000).run(
        ServerConfig(engine={"model": "fake"}), window(), tmp_path / "two-processes"
    )
    assert outcome.ok, outcome.failure_detail
    assert outcome.capacity is not None and outcome.capacity.capacity_rps > 0
    assert any(not step.passed for step in outcome.capacity.steps)
    assert [step.summary.client_processes for step in outcome.capacity.steps] == (
        [2] * len(outcome.capacity.steps))
    # Each step also says what the server's process used of the CPU while it ran.
    for step in outcome.capacity.steps:
        assert step.server is not None
        assert [p.role for p in step.server.processes] == ["main"]
        assert step.server.processes[0].cpu_s > 0
    # Every request is accounted for: the records of both processes were merged. A step passed
    # early leaves out the requests not yet due (its reason says how many; once, beside another
    # job, a step was decided with 29 of 30 done and the 30th not sent).
    for step in outcome.capacity.steps:
        accounted = step.summary.completed + step.summary.failed + step.summary.cancelled
        if not step.summary.stopped_early:
            assert accounted == step.requests
        elif step.passed:
            unsent = step.requests - accounted
            assert step.reason.endswith(f"{step.summary.cancelled} still running)" if not unsent
                                        else f", {unsent} not yet sent)")


@pytest.mark.slow
def test_a_step_far_over_capacity_is_abandoned_before_it_ends(tmp_path: Path) -> None:
    slos = [parse_slo("ttft_p95_ms=100")]
    # Starts at 40x the recorded 10 req/s on a 1-slot server that carries ~15: certain to fail.
    settings = LadderSettings(step_requests=200, min_step_s=1.0, start_speedup=40.0,
                              max_steps=1)
    # 400 req/s from this busy 2-core machine: the replayer may lag or send less than asked, and
    # such a step is not scored (test_client_lag covers that rule; beside a CPU-heavy job the
    # one step went unscored); what is tested here is the abandoning, scored or not.
    outcome = ladder_runner(tmp_path, 1, settings, slos, max_send_lag_ms=60_000).run(
        ServerConfig(engine={"model": "fake"}), window(), tmp_path / "over"
    )
    assert outcome.capacity is not None
    (step,) = [*outcome.capacity.steps, *outcome.capacity.unscored]
    assert not step.passed and step.abandoned
    assert step.summary.completed < step.requests
    assert outcome.capacity.capacity_rps == 0.0


@pytest.mark.slow
def test_a_step_that_kills_the_server_ends_the_ladder_keeping_what_was_measured(tmp_path: Path) -> None:
    """Overload that crashes the engine (e.g. OOM at high load): the trial is a classified
    crash, the steps measured before it stay in the outcome and ladder.json, and no server
    process is left."""
    import psutil

    behaviour = tmp_path / "dies.json"
    # Dies at its 80th completion: the first step (40 requests) passes, the second kills it.
    behaviour.write_text(json.dumps({"slots": 8, "token_delay_s": 0.005, "die_after": 80,
                                     "message": "CUDA out of memory (fake)"}))
    runner = TrialRunner(
        server_command=[sys.executable, str(FAKE_SERVER), "--behaviour", str(behaviour)],
        startup_timeout_s=20, warmup_requests=1, scrape_interval_s=0.2,
        stale_registry=tmp_path / "servers.json",
        # A step whose client lags is run again (it is not evidence), and a re-run of the first
        # step would reach the 80th completion: beside a CPU-heavy job that ended the test in
        # step 1. What is tested here is the crash, so the client's lag is not judged.
        replay=ReplayOptions(slos=[parse_slo("ttft_p95_ms=500")], max_send_lag_ms=60_000),
        ladder=LadderSettings(step_requests=40, min_step_s=1.0, max_steps=4),
    )
    trial_dir = tmp_path / "crash"
    outcome = runner.run(ServerConfig(engine={"model": "fake"}), window(), trial_dir)
    assert not outcome.ok and outcome.failure in ("crash", "oom")
    assert outcome.capacity is not None and outcome.capacity.stopped_by == outcome.failure
    assert outcome.capacity.steps and outcome.capacity.steps[0].passed
    assert outcome.capacity.capacity_rps > 0
    saved = CapacityResult.model_validate_json((trial_dir / "ladder.json").read_text())
    assert saved.steps == outcome.capacity.steps
    config_path = str(trial_dir / "config.yaml")
    left = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and config_path in p.info["cmdline"]]
    assert left == []
