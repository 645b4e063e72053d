"""A capacity is only ever a rate a step really offered: the steps replay representative
stretches of the window, are credited what their client sent, hold the requests their
percentile needs, and a load no rate can serve is said plainly.

The ladders here are `LoadLadder.result` over steps scored by a deterministic server model
(it meets the SLOs up to a set offered rate): what is tested is our crediting, not a server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState

from autotune.decide.outcome import baseline_failure
from autotune.errors import AutotuneError
from autotune.measure.ladder import (
    LadderSettings,
    LadderStep,
    LoadLadder,
    busy_share,
    offered_as_sent,
    offered_rate,
    recorded_rate,
    requests_for_slos,
    step_is_idle,
    step_trace,
)
from autotune.prepare import ladder_settings
from autotune.request import TuningRequest
from tests.factories import replay_summary
from workloads.importers import import_azure
from workloads.replay import ReplayOptions
from workloads.replay_summary import ReplayResult, RequestRecord
from workloads.slo import parse_slo
from workloads.trace import Trace, TraceRequest
from workloads.trace_io import write_trace
from workloads.windows import select_windows

SHARED_TRACES = Path(__file__).parents[3].parent / "shared" / "traces"
AZURE_CODE = SHARED_TRACES / "azure_code_2023.csv"


def bursty_window(bursts: int = 12, per_burst: int = 20, gap_s: float = 10.0) -> Trace:
    """Bursts of `per_burst` requests within one second, then idle to the next burst."""
    rng = np.random.default_rng(7)
    requests = []
    for burst in range(bursts):
        for offset in np.sort(rng.uniform(0.0, 1000.0, per_burst)):
            requests.append(TraceRequest(timestamp=burst * gap_s * 1000.0 + float(offset),
                                         input_length=int(rng.integers(10, 200)),
                                         output_length=int(rng.integers(5, 50))))
    return Trace.from_requests(requests, source="bursty")


def sent_on_schedule(trace: Trace, *, lag_ms: float = 0.0, e2e_ms: float = 50.0) -> ReplayResult:
    """What a client that keeps its schedule records: every request sent at its time."""
    records = [
        RequestRecord(index=i, scheduled_s=t / 1000.0, sent_s=t / 1000.0 + lag_ms / 1000.0,
                      lag_ms=lag_ms, ttft_ms=10.0, e2e_ms=e2e_ms, input_tokens=int(trace.input_lengths[i]),
                      output_tokens=int(trace.output_lengths[i]))
        for i, t in enumerate(trace.timestamps_ms.tolist())
    ]
    summary = replay_summary(duration=trace.duration_s() + e2e_ms / 1000.0, completed=len(records),
                             planned=len(records))
    return ReplayResult(records=records, summary=summary)


def modelled_ladder(window: Trace, settings: LadderSettings, serves_up_to_rps: float) -> LoadLadder:
    """A ladder whose steps pass while the offered rate (as sent) is within the model's
    capacity: the steps a real ladder would take, scored without a server."""
    ladder = LoadLadder(settings, url="http://unused",
                        replay=ReplayOptions(slos=[parse_slo("ttft_p95_ms=100")]),
                        scraper=None)  # type: ignore[arg-type]
    speedup = settings.start_speedup
    for index in range(settings.max_steps):
        trace = step_trace(window, speedup, settings)
        result = sent_on_schedule(trace)
        offered = offered_as_sent(trace, result)
        ladder.steps.append(LadderStep(
            index=index, speedup=speedup, offered_rps=offered, requests=len(trace),
            passed=offered <= serves_up_to_rps, reason="", measured_ms={}, summary=result.summary,
            seconds=1.0, busy_share=busy_share(result)))
        following = ladder.next_speedup()
        if following is None:
            break
        speedup = following
    return ladder


@pytest.mark.parametrize("step_requests", [20, 60, 200, 500])
@pytest.mark.parametrize("speedup", [0.25, 0.5, 1.0, 2.0, 4.0, 16.0])
def test_a_bursty_window_s_step_offers_about_speed_up_times_its_rate(speedup: float, step_requests: int) -> None:
    """The first 20 requests of this window are one burst: 20 req/s where the window records
    2.2. A step replays a stretch as busy as the whole window instead."""
    window = bursty_window()
    settings = LadderSettings(step_requests=step_requests, min_step_s=1.0)
    trace = step_trace(window, speedup, settings)
    assert len(trace) >= step_requests
    assert trace.duration_s() >= settings.min_step_s * 0.99
    nominal = speedup * recorded_rate(window)
    offered = offered_as_sent(trace, sent_on_schedule(trace))
    assert offered == pytest.approx(nominal, rel=0.25)
    first_n = window.rebased().subset(np.arange(min(step_requests, len(window))))
    if step_requests <= 20:  # the old first-N step: one burst, ~10x the window's rate
        assert (len(first_n) - 1) / first_n.duration_s() > 5 * recorded_rate(window)


@pytest.mark.parametrize("step_requests", [20, 60, 200])
@pytest.mark.parametrize("start", [0.25, 1.0, 3.0])
@pytest.mark.parametrize("serves", [0.7, 3.0, 11.0, 40.0])
def test_capacity_is_never_more_than_a_passing_step_offered(step_requests: int, start: float,
                                                           serves: float) -> None:
    window = bursty_window()
    settings = LadderSettings(step_requests=step_requests, min_step_s=1.0, start_speedup=start,
                              resolution=0.1, min_speedup=1 / 64)
    capacity = modelled_ladder(window, settings, serves).result(window)
    passing = [step.offered_rps for step in capacity.steps if step.passed]
    assert passing, "the model serves every rate down to its capacity"
    assert capacity.capacity_rps <= max(passing)
    assert capacity.capacity_rps <= serves  # never credited a rate the model did not serve
    assert capacity.headroom == pytest.approx(capacity.capacity_rps / recorded_rate(window))
    if capacity.first_fail_rps is not None:
        assert capacity.first_fail_rps > serves * 0.999
        assert capacity.resolution is not None and 0 < capacity.resolution <= 0.1 + 1e-9
        assert capacity.interval() == f"{capacity.capacity_rps:.3g}-{capacity.first_fail_rps:.3g} req/s"


@pytest.mark.parametrize("which", ["tuning", "holdout"])
def test_capacity_on_the_azure_code_trace_s_windows_is_a_rate_a_step_offered(which: str) -> None:
    if not AZURE_CODE.is_file():
        pytest.skip(f"real Azure trace not found at {AZURE_CODE} (kept outside the repository)")
    trace = import_azure(AZURE_CODE).trace
    tuning, holdout, _ = select_windows(trace, 60.0, 60.0)
    window = tuning if which == "tuning" else holdout
    for step_requests in (60, 200):
        for serves in (0.5 * recorded_rate(window), 2.0 * recorded_rate(window)):
            settings = LadderSettings(step_requests=step_requests, min_step_s=6.0, resolution=0.1)
            capacity = modelled_ladder(window, settings, serves).result(window)
            passing = [step.offered_rps for step in capacity.steps if step.passed]
            assert capacity.capacity_rps <= max(passing) and capacity.capacity_rps <= serves
            if step_requests < 0.9 * len(window):
                # This trace idles for seconds at a time: every stretch of 60 of the window's
                # 160-200 requests either spans an idle gap or not, at ~0.5x or ~1.5x its rate.
                continue
            for step in capacity.steps:  # steps that hold the window are as busy as it is
                assert step.offered_rps == pytest.approx(step.speedup * recorded_rate(window), rel=0.1)


def test_a_step_is_credited_what_its_client_sent_not_what_it_planned() -> None:
    """A client that sent the second half of a step late offered less than planned."""
    window = bursty_window()
    trace = step_trace(window, 1.0, LadderSettings(step_requests=60, min_step_s=1.0))
    result = sent_on_schedule(trace)
    half = len(result.records) // 2
    stretched = [r.model_copy(update={"sent_s": r.sent_s * 2.0 if i >= half else r.sent_s})
                 for i, r in enumerate(result.records)]
    late = ReplayResult(records=stretched, summary=result.summary)
    assert offered_as_sent(trace, late) < 0.8 * offered_as_sent(trace, result)


def test_a_step_the_server_idled_through_is_idle_and_a_busy_one_is_not() -> None:
    window = bursty_window()
    trace = step_trace(window, 0.25, LadderSettings(step_requests=60, min_step_s=1.0))
    quiet = sent_on_schedule(trace, e2e_ms=20.0)
    busy = sent_on_schedule(trace, e2e_ms=60_000.0)
    assert busy_share(quiet) < 0.5 < busy_share(busy)  # type: ignore[operator]
    summary = quiet.summary
    idle_step = LadderStep(index=0, speedup=0.25, offered_rps=0.5, requests=60, passed=False,
                           reason="", measured_ms={}, summary=summary, seconds=1.0,
                           busy_share=busy_share(quiet))
    assert step_is_idle(idle_step)
    assert not step_is_idle(idle_step.model_copy(update={"busy_share": busy_share(busy)}))


def test_requests_that_failed_fast_leave_the_server_idle_and_those_of_unknown_end_busy() -> None:
    """A server that refuses every request at once (a 400 in a millisecond) idled through the
    step; a request whose end is unknown (cancelled) is held in flight to the run's end."""
    window = bursty_window()
    trace = step_trace(window, 0.25, LadderSettings(step_requests=60, min_step_s=1.0))
    quiet = sent_on_schedule(trace, e2e_ms=20.0)
    refused = [r.model_copy(update={"e2e_ms": None, "ttft_ms": None, "error": "HTTP 400",
                                    "failed_after_ms": 1.0}) for r in quiet.records]
    unknown = [r.model_copy(update={"e2e_ms": None, "ttft_ms": None, "cancelled": True}) for r in quiet.records]
    fast = busy_share(ReplayResult(records=refused, summary=quiet.summary))
    held = busy_share(ReplayResult(records=unknown, summary=quiet.summary))
    assert fast is not None and held is not None
    assert fast < busy_share(quiet) < 0.5 < held  # type: ignore[operator]


def test_a_ladder_that_fails_with_the_server_idle_stops_and_says_which_slo_cannot_be_met() -> None:
    ladder = LoadLadder(LadderSettings(), url="http://unused",
                        replay=ReplayOptions(slos=[parse_slo("ttft_p95_ms=1000"), parse_slo("tpot_p95_ms=100")]),
                        scraper=None)  # type: ignore[arg-type]
    summary = sent_on_schedule(step_trace(bursty_window(), 0.5, LadderSettings())).summary
    step = LadderStep(index=0, speedup=0.0625, offered_rps=0.18, requests=200, passed=False,
                      reason="ttft p95 1640/1000 ms", measured_ms={"ttft_p95_ms=1000": 1640.0,
                                                                   "tpot_p95_ms=100": 40.0},
                      summary=summary, seconds=50.0, busy_share=0.3)
    message = ladder._infeasible(step)
    assert message.startswith("no load meets the SLOs: ttft p95 1,640 ms (SLO 1000 ms) at 0.18 req/s")
    assert "idle 70%" in message and "relax the SLO or use a faster host" in message
    assert "tpot" not in message  # it met the TPOT SLO
    ladder.steps = [step]
    ladder.infeasible = message
    result = ladder.result(bursty_window(), stopped_by="infeasible")
    assert result.capacity_rps == 0 and result.describe() == message


def test_every_step_holds_the_requests_its_percentile_needs() -> None:
    slos = [parse_slo("ttft_p95_ms=1000"), parse_slo("tpot_p99_ms=100")]
    assert requests_for_slos(slos) == 1000
    assert requests_for_slos([parse_slo("ttft_p50_ms=100")]) == 20
    assert requests_for_slos([parse_slo("itl_p99_ms=100")]) == 0  # ITL counts gaps, not requests
    request = TuningRequest(workload="w.jsonl", study_name="s", output_dir=Path("out"), command_line=[])
    # The CPU default of 60 requests a step is raised to what a p95 needs.
    assert ladder_settings(request, "cpu", [parse_slo("ttft_p95_ms=1000")]).step_requests == 200
    assert ladder_settings(request, "gpu", [parse_slo("ttft_p99_ms=1000")]).step_requests == 1000
    small = request.model_copy(update={"step_requests": 60})
    with pytest.raises(AutotuneError) as refused:
        ladder_settings(small, "cpu", [parse_slo("ttft_p95_ms=1000")])
    assert str(refused.value) == (
        "--step-requests 60: a p95 verdict (ttft_p95_ms=1000) needs at least 200 requests a step "
        "(10 / (1 - 95/100): about ten requests above the percentile); raise it or use a lower "
        "percentile")


# -- an SLO no load can meet, end to end (the real CLI, fake trial servers) ---------------

HELPERS = Path(__file__).resolve().parents[1]  # tests/autotune: the fake servers, the tuners, fixtures/
ROOT = HELPERS.parents[1]
TUNER = HELPERS / "fake_server_tuner.py"


def slow_answers_trace(path: Path) -> Path:
    """10 req/s of one-token answers for 40 s: a server whose every first token takes 200 ms
    misses a 100 ms TTFT at any rate, and is mostly idle below ~2.5 req/s."""
    requests = [TraceRequest(timestamp=i * 100.0, input_length=16, output_length=1) for i in range(400)]
    write_trace(path, Trace.from_requests(requests, source="slow answers"))
    return path


def run_tuner(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    behaviour = tmp_path / "behaviour.json"
    behaviour.write_text(json.dumps({"token_delay_s": 0.2, "slots": 64}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(TUNER), str(behaviour), "run", *args], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=600)


@pytest.mark.slow
def test_a_baseline_that_meets_the_slos_at_no_load_ends_the_study_with_exit_12(tmp_path: Path) -> None:
    trace = slow_answers_trace(tmp_path / "slow.jsonl")
    common = ["--workload", str(trace), "--trials", "2", "--tuning-window", "15", "--holdout-window", "15",
              "--top-k", "1", "--repeats", "1", "--step-requests", "20",
              "--slo", "ttft_p50_ms=100"]
    done = run_tuner(tmp_path, *common, "--output-dir", str(tmp_path / "out"), "--study-name", "never")
    output = done.stdout + done.stderr
    assert done.returncode == 12, output[-3000:]
    assert "no load meets the SLOs: ttft p50" in output and "(SLO 100 ms)" in output
    assert "relax the SLO or use a faster host" in output and "--search-anyway" in output
    assert not (tmp_path / "out" / "best.yaml").exists()
    ladder = json.loads((tmp_path / "out" / "trials" / "trial-0000" / "ladder.json").read_text())
    assert ladder["stopped_by"] == "infeasible" and ladder["capacity_rps"] == 0
    # It stopped where the server idled, long before the ladder's floor of 1/16.
    assert min(step["speedup"] for step in ladder["steps"]) > 1 / 16
    assert ladder["steps"][-1]["busy_share"] < 0.5
    assert len(list((tmp_path / "out" / "trials").glob("trial-*"))) == 1  # no trial after it


def test_search_anyway_goes_on_past_a_baseline_that_met_the_slos_at_no_load() -> None:
    infeasible = "no load meets the SLOs: ttft p50 203 ms (SLO 100 ms) at 1.25 req/s"
    baseline = optuna.trial.create_trial(
        state=TrialState.COMPLETE, value=0.0,
        user_attrs={"baseline": True, "failure": None, "infeasible": infeasible})
    refused = baseline_failure([baseline])
    assert refused is not None and refused.startswith("the baseline's trial ")
    assert refused.endswith(f": {infeasible} (--search-anyway searches all the same)")
    assert baseline_failure([baseline], infeasible_ok=True) is None


def test_a_step_whose_counts_did_not_reconcile_is_named_in_the_trial_s_record() -> None:
    """The ladder keeps an unscored step apart; the trial's score carries how many and why, for
    the live line's trial and the report's trial table."""
    from autotune.measure.ladder import CapacityResult
    from autotune.search.objective import unscored_note

    summary = sent_on_schedule(step_trace(bursty_window(), 1.0, LadderSettings())).summary
    unscored = LadderStep(index=1, speedup=2.0, offered_rps=4.4, requests=200, passed=False, scored=False,
                          reason="not scored: its counts do not reconcile: received 1,494 of 5,908 "
                                 "requested output tokens (25%)",
                          measured_ms={}, summary=summary, seconds=1.0)
    capacity = CapacityResult(capacity_rps=2.2, capacity_speedup=1.0, recorded_rps=2.2, first_fail_rps=None,
                              bracketed=False, steps=[], unscored=[unscored], stopped_by="reconciliation")
    assert unscored_note(capacity) == (
        "1 step not scored (last: its counts do not reconcile: received 1,494 of 5,908 requested "
        "output tokens (25%))")
    assert unscored_note(capacity.model_copy(update={"unscored": []})) is None


def test_a_failing_step_abandoned_early_still_brackets_the_capacity_from_above() -> None:
    """Abandoned after its first requests, a step sent at a lower rate than its schedule: the
    bracket's upper end is the rate it was certain to fail at, never under the capacity."""
    window = bursty_window()
    ladder = modelled_ladder(window, LadderSettings(step_requests=60, min_step_s=1.0, max_steps=1), 100.0)
    passed = ladder.steps[0]
    abandoned = passed.model_copy(update={"index": 1, "speedup": 1.1, "passed": False, "abandoned": True,
                                          "offered_rps": passed.offered_rps * 0.9,
                                          "planned_rps": passed.offered_rps * 1.1})
    ladder.steps.append(abandoned)
    capacity = ladder.result(window)
    assert capacity.capacity_rps == passed.offered_rps
    assert capacity.first_fail_rps == pytest.approx(passed.offered_rps * 1.1)
    assert capacity.first_fail_rps > capacity.capacity_rps


def test_a_step_abandoned_inside_its_opening_burst_brackets_at_its_schedule_s_rate() -> None:
    """Bursts then silence (the Azure code trace's tuning window): a step certain to fail in
    its first burst sent only that burst, at ~10x the schedule's rate. The bracket's upper end
    is the schedule it failed, next to the passing step's: not the burst's rate."""
    window = bursty_window()
    settings = LadderSettings(step_requests=60, min_step_s=1.0, max_steps=1)
    ladder = modelled_ladder(window, settings, 100.0)
    [passed] = ladder.steps
    trace = step_trace(window, 1.1, settings)
    whole = sent_on_schedule(trace)
    opening = int(np.flatnonzero(np.diff(trace.timestamps_ms) > 1000.0)[0]) + 1  # its first burst
    burst = ReplayResult(records=whole.records[:opening], summary=replay_summary(
        duration=1.0, completed=opening, planned=len(trace)))
    as_sent = offered_as_sent(trace, burst)
    assert as_sent > 5 * passed.offered_rps  # what the burst alone sent
    ladder.steps.append(passed.model_copy(update={
        "index": 1, "speedup": 1.1, "passed": False, "abandoned": True, "offered_rps": as_sent,
        "planned_rps": offered_rate(trace), "requests": len(trace)}))
    capacity = ladder.result(window)
    assert capacity.capacity_rps == passed.offered_rps
    assert capacity.first_fail_rps == pytest.approx(offered_rate(trace))
    assert capacity.capacity_rps < capacity.first_fail_rps < 1.3 * capacity.capacity_rps
    assert capacity.interval() == f"{capacity.capacity_rps:.3g}-{capacity.first_fail_rps:.3g} req/s"


def test_a_pass_decided_inside_its_opening_burst_is_credited_no_more_than_its_schedule() -> None:
    """191 requests at 10 req/s, 70 s of silence, 9 more: p95 over 200 allows 9 misses, so the
    pass is certain before the last 9 are sent. What was sent ran at 10 req/s; the schedule,
    which the pass holds for, offers 2.2: the capacity is the schedule's, under the failing
    step's above it, never the burst's 4.5x more."""
    window = Trace.from_requests(
        [TraceRequest(timestamp=100.0 * i, input_length=10, output_length=5) for i in range(191)]
        + [TraceRequest(timestamp=19_000.0 + 70_000.0 + 100.0 * i, input_length=10, output_length=5)
           for i in range(9)], source="burst-then-silence")
    settings = LadderSettings(step_requests=200, min_step_s=1.0, max_steps=1)
    ladder = modelled_ladder(window, settings, 100.0)
    [step] = ladder.steps
    whole_rate = offered_rate(window)
    sent = sent_on_schedule(window)
    burst = ReplayResult(records=sent.records[:191], summary=replay_summary(duration=20.0, completed=191,
                                                                          planned=200))
    assert offered_as_sent(window, burst) == pytest.approx(10.0)
    early_pass = step.model_copy(update={"offered_rps": offered_as_sent(window, burst), "planned_rps": whole_rate,
                                         "speedup": 1.0, "passed": True})
    ladder.steps = [early_pass, early_pass.model_copy(update={
        "index": 1, "speedup": 1.1, "passed": False, "abandoned": True,
        "offered_rps": 11.0, "planned_rps": 1.1 * whole_rate})]
    capacity = ladder.result(window)
    assert capacity.capacity_rps == pytest.approx(whole_rate) and whole_rate < 2.3
    assert capacity.capacity_rps < capacity.first_fail_rps
    assert capacity.headroom == pytest.approx(1.0, rel=0.01)


@pytest.mark.slow
def test_a_hinted_ladder_stops_at_a_sixteenth_of_its_start_without_calling_the_slo_infeasible(tmp_path: Path) -> None:
    """A searched config started at the best capacity so far (x16 here) that fails all the way
    down stops at 1/16 of it: lower loads are not tried, so nothing is said of them."""
    from autotune.measure.trial import TrialRunner
    from server.config import ServerConfig

    behaviour = tmp_path / "behaviour.json"
    behaviour.write_text(json.dumps({"slots": 1, "token_delay_s": 0.05}))  # ~4 req/s of 5 tokens
    window = Trace.from_requests([TraceRequest(timestamp=i * 100.0, input_length=10, output_length=5)
                                  for i in range(20)], source="10 req/s")
    runner = TrialRunner(
        server_command=[sys.executable, str(HELPERS / "fake_server.py"), "--behaviour", str(behaviour)],
        startup_timeout_s=20, warmup_requests=1, scrape_interval_s=0.2,
        stale_registry=tmp_path / "servers.json",
        replay=ReplayOptions(slos=[parse_slo("ttft_p50_ms=150")], max_send_lag_ms=60_000),
        ladder=LadderSettings(step_requests=20, min_step_s=1.0, resolution=0.25, max_steps=12),
    )
    outcome = runner.run(ServerConfig(engine={"model": "fake"}), window, tmp_path / "trial", start_speedup=16.0)
    capacity = outcome.capacity
    assert capacity is not None and capacity.capacity_rps == 0
    assert capacity.stopped_by == "below_floor" and capacity.infeasible is None
    assert min(step.speedup for step in capacity.steps) == pytest.approx(1.0)
    assert all(not step.passed for step in capacity.steps)
    # Named at the lowest step's whole schedule (20 requests 100 ms apart at x1: 10 req/s), the
    # load it was certain to miss, not what its client happened to send before it stopped (9.99
    # or 10.0, as the clock falls: CI once read one where this test expected the other).
    lowest = min(step.planned_rps for step in capacity.steps)
    assert lowest == pytest.approx(10.0)
    assert capacity.describe() == ("fails even at 10 req/s, 1/16 of the capacity its "
                                   "ladder started from: not measured lower")
