"""A ladder step cuts its schedule's long silences short and is still credited the uncut rate:
traffic that idles for minutes between bursts (the Azure code trace) costs a step its bursts,
not its idle minutes. A cut that did not find the server idle never makes a step fail.

The crediting is checked side by side on the same schedule, cut and uncut; the whole steps
against a real server process (tests/autotune/fake_server.py with a set number of slots).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from autotune.measure.ladder import LadderSettings, cut_silences
from autotune.measure.step_load import busy_share, cuts_found_idle, offered_as_sent
from autotune.measure.trial import TrialRunner
from server.config import ServerConfig
from tests.factories import replay_summary
from workloads.replay import ReplayOptions
from workloads.replay_summary import ReplayResult, RequestRecord
from workloads.slo import parse_slo
from workloads.trace import Trace, TraceRequest

FAKE_SERVER = Path(__file__).resolve().parents[1] / "fake_server.py"


def on_off(bursts: int = 3, per_burst: int = 10, spacing_ms: float = 100.0,
           silence_s: float = 3.0, output_length: int = 5, last_output: int | None = None) -> Trace:
    """`bursts` of `per_burst` requests `spacing_ms` apart, `silence_s` of nothing between;
    each burst's last request asks `last_output` tokens where given."""
    period_ms = (per_burst - 1) * spacing_ms + 1000.0 * silence_s
    return Trace.from_requests(
        [TraceRequest(timestamp=b * period_ms + i * spacing_ms, input_length=10,
                      output_length=last_output if last_output and i == per_burst - 1 else output_length)
         for b in range(bursts) for i in range(per_burst)],
        source="on-off")


def sent_on_schedule(trace: Trace, e2e_ms: float = 50.0, upto: int | None = None) -> ReplayResult:
    """A client that kept its schedule (the first `upto` requests: a step stopped early)."""
    count = len(trace) if upto is None else upto
    records = [RequestRecord(index=i, scheduled_s=t / 1000.0, sent_s=t / 1000.0, lag_ms=0.0,
                             ttft_ms=10.0, e2e_ms=e2e_ms, input_tokens=10, output_tokens=5)
               for i, t in enumerate(trace.timestamps_ms[:count].tolist())]
    return ReplayResult(records=records, summary=replay_summary(
        duration=trace.duration_s() + e2e_ms / 1000.0, completed=count, planned=len(trace)))


def test_a_silence_over_the_limit_is_cut_to_it_and_nothing_else_moves() -> None:
    trace = on_off()
    cut, cuts = cut_silences(trace, 0.5)
    gaps = np.diff(cut.timestamps_ms)
    assert gaps.max() == pytest.approx(500.0)
    assert list(cuts.after) == [10, 20] and cuts.total_s == pytest.approx(2 * 2.5)
    # Within a burst the spacing is what was recorded; lengths and order untouched.
    assert np.allclose(np.diff(cut.timestamps_ms[:10]), 100.0)
    assert np.array_equal(cut.input_lengths, trace.input_lengths)
    assert cut.duration_s() == pytest.approx(trace.duration_s() - 5.0)
    same, none = cut_silences(trace, 10.0)
    assert same is trace and none.total_s == 0
    assert cut_silences(trace, None)[0] is trace


@pytest.mark.parametrize("upto", [None, 15, 25])
def test_a_cut_step_is_credited_the_rate_of_its_uncut_schedule(upto: int | None) -> None:
    """Side by side: the same requests sent on the uncut schedule and on the cut one (all of
    them, or a step stopped after 15 or 25) are credited the same rate."""
    uncut = on_off()
    cut, cuts = cut_silences(uncut, 0.5)
    whole = offered_as_sent(uncut, sent_on_schedule(uncut, upto=upto))
    credited = offered_as_sent(cut, sent_on_schedule(cut, upto=upto), cuts, uncut)
    assert credited == pytest.approx(whole, rel=1e-9)
    # Without the cuts counted back it would credit far more than the traffic offers.
    assert offered_as_sent(cut, sent_on_schedule(cut, upto=upto)) > 1.5 * whole
    # And the server is as idle as on the uncut schedule.
    assert busy_share(sent_on_schedule(cut, upto=upto), idle_s=cuts.between(-1, (upto or 30) - 1)) == (
        pytest.approx(busy_share(sent_on_schedule(uncut, upto=upto)), rel=1e-9))


def test_a_cut_found_the_server_idle_only_when_every_earlier_request_was_answered() -> None:
    cut, cuts = cut_silences(on_off(), 0.5)
    assert cuts_found_idle(sent_on_schedule(cut, e2e_ms=50.0), cuts)
    assert not cuts_found_idle(sent_on_schedule(cut, e2e_ms=800.0), cuts)  # the 10th still running
    assert cuts_found_idle(sent_on_schedule(cut, e2e_ms=800.0, upto=10), cuts)  # never reached the cut


def test_a_request_that_failed_fast_does_not_keep_a_cut_from_finding_the_server_idle() -> None:
    """A failed request ended when it failed: one HTTP error early in a burst does not make a
    failing step run again with its silences whole. One whose end is unknown still counts as
    in flight (records written before `failed_after_ms`)."""
    cut, cuts = cut_silences(on_off(), 0.5)
    sent = sent_on_schedule(cut)
    failed = sent.records[3].model_copy(update={"e2e_ms": None, "ttft_ms": None, "error": "HTTP 500: boom",
                                                 "status": 500, "failed_after_ms": 20.0})
    records = [*sent.records[:3], failed, *sent.records[4:]]
    assert cuts_found_idle(ReplayResult(records=records, summary=sent.summary), cuts)
    unknown = failed.model_copy(update={"failed_after_ms": None})
    records[3] = unknown
    assert not cuts_found_idle(ReplayResult(records=records, summary=sent.summary), cuts)


# -- whole steps against a real server process -------------------------------------------


def runner(tmp_path: Path, name: str, slots: int, token_delay_s: float, max_silence_s: float | None,
           ttft_ms: float, step_requests: int = 30) -> TrialRunner:
    behaviour = tmp_path / f"{name}.json"
    behaviour.write_text(json.dumps({"slots": slots, "token_delay_s": token_delay_s}))
    settings = LadderSettings(step_requests=step_requests, min_step_s=0.5, max_silence_s=max_silence_s,
                              settle_probe=False).single(1.0)
    return TrialRunner(
        server_command=[sys.executable, str(FAKE_SERVER), "--behaviour", str(behaviour)],
        startup_timeout_s=20, warmup_requests=1, scrape_interval_s=0.2,
        stale_registry=tmp_path / "servers.json",
        replay=ReplayOptions(slos=[parse_slo(f"ttft_p95_ms={ttft_ms:g}")], max_send_lag_ms=60_000),
        ladder=settings)


@pytest.mark.slow
def test_an_on_off_step_passes_as_its_uncut_schedule_does_in_less_time(tmp_path: Path) -> None:
    """2 slots of 50 ms requests carry 40 req/s; the bursts offer 10: both pass, credited the
    same rate, and the cut step did not wait out 6 s of silence."""
    steps = {}
    for name, limit in (("cut", 0.5), ("whole", None)):
        outcome = runner(tmp_path, name, 2, 0.01, limit, ttft_ms=500).run(
            ServerConfig(engine={"model": "fake"}), on_off(), tmp_path / name)
        assert outcome.ok, outcome.failure_detail
        assert outcome.capacity is not None
        steps[name] = outcome.capacity.steps[-1]
    cut, whole = steps["cut"], steps["whole"]
    assert cut.passed and whole.passed
    assert cut.silence_cut_s > 4.0 and cut.cuts_idle and whole.silence_cut_s == 0
    assert cut.offered_rps == pytest.approx(whole.offered_rps, rel=0.1)
    assert cut.seconds < whole.seconds - 3.0


@pytest.mark.slow
def test_a_failing_step_whose_cut_ended_with_requests_in_flight_is_run_again_uncut(tmp_path: Path) -> None:
    """1 slot, 50 ms a token: each burst's last request takes 2 s and ends 0.5 s before the
    next burst on the whole schedule, so that passes. Cut to 0.3 s, the silence ends with it
    in flight and the next burst queues behind it: that step fails, is run again with its
    silences whole, and the whole run (a pass) is the one the ladder keeps."""
    trace = on_off(bursts=2, per_burst=5, spacing_ms=300.0, silence_s=2.5, output_length=1,
                   last_output=40)
    outcome = runner(tmp_path, "busy", 1, 0.05, 0.3, ttft_ms=300, step_requests=10).run(
        ServerConfig(engine={"model": "fake"}), trace, tmp_path / "busy")
    assert outcome.ok, outcome.failure_detail
    assert outcome.capacity is not None
    [step] = outcome.capacity.steps
    assert step.passed, step.reason
    assert step.silence_cut_s == 0 and step.cuts_idle  # the uncut run, not the cut one
