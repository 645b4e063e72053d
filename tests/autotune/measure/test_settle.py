"""Between ladder steps the server must be as idle as before the first: its gauges at zero
and a lone short request answered about as fast as then (autotune.measure.settle).

The ladder test runs a real fake-server process whose front end serves one request at a time
outside the running/waiting gauges (as one API process's event loop does): an overloaded
step leaves a queue there that the gauges never show. The rules of the wait itself run
against stand-ins whose gauges and probe times the test sets.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from autotune.measure.ladder import LadderSettings
from autotune.measure.scraper import MetricsSnapshot
from autotune.measure.settle import ServerSettler
from autotune.measure.trial import TrialRunner
from server.config import ServerConfig
from workloads.replay import ReplayOptions
from workloads.replay_summary import ReplayResult, RequestRecord, summarize
from workloads.slo import parse_slo
from workloads.trace import Trace, TraceRequest

FAKE_SERVER = Path(__file__).resolve().parents[1] / "fake_server.py"


def window() -> Trace:  # 5 req/s recorded
    return Trace.from_requests(
        [TraceRequest(timestamp=i * 200.0, input_length=10, output_length=5) for i in range(20)],
        source="test window",
    )


def front_end_runner(tmp_path: Path, settle_probe: bool) -> TrialRunner:
    # One front end at 40 ms a request: 25 req/s, outside the gauges; 8 slots of 5 tokens at
    # 5 ms behind it (320 req/s): the front end is the limit. The ladder starts at 16x (80
    # req/s), certain to fail, then goes to 4x (20 req/s, evenly spaced), which the server
    # carries with a fifth of its time to spare when it starts idle.
    # Why these sizes: the overload is decided about when its 11th request has waited out the
    # TTFT SLO (S), its line then holds ~3.2 S of front-end work (the line grows 2.2 s a
    # second), and the cancelled requests' line is what the next step inherits. Between the
    # steps the line drains at full speed for however long the tuner takes (more on a loaded
    # 2-core CI machine); during the step below it drains at the fifth to spare. With S = 1.5
    # s the step below starts ~3.3 s over the SLO, less the gap, and stays over it for 5x that:
    # it fails unless the gap exceeds ~3 s. At S = 0.5 s and twice the rates the margin was ~1
    # s, and a fresh-clone CI run's unsettled step passed with TTFT p95 41/500 ms.
    behaviour = tmp_path / "behaviour.json"
    behaviour.write_text(json.dumps({"slots": 8, "token_delay_s": 0.005, "front_s": 0.04}))
    ladder = LadderSettings(step_requests=200, min_step_s=1.0, start_speedup=16.0, growth=4.0,
                            max_steps=2, settle_probe=settle_probe)
    return TrialRunner(
        server_command=[sys.executable, str(FAKE_SERVER), "--behaviour", str(behaviour)],
        startup_timeout_s=20, warmup_requests=1, scrape_interval_s=0.2,
        stale_registry=tmp_path / "servers.json",
        # Not about the client-lag rule (test_client_lag.py): every step is scored.
        replay=ReplayOptions(slos=(parse_slo("ttft_p95_ms=1500"),), max_send_lag_ms=60_000),
        ladder=ladder,
    )


@pytest.mark.slow
def test_the_next_step_waits_for_a_queue_the_gauges_do_not_show(tmp_path: Path) -> None:
    """Side by side, same server and steps: waiting on the gauges alone, the step below the
    overload inherits its queue and fails at a rate the server carries; with the probe it
    starts once a lone request is answered at idle speed again, and passes."""
    config = ServerConfig(engine={"model": "fake"})
    found = {}
    for settle_probe in (False, True):
        outcome = front_end_runner(tmp_path, settle_probe).run(config, window(), tmp_path / f"settle-{settle_probe}")
        assert outcome.ok, outcome.failure_detail
        assert outcome.capacity is not None
        found[settle_probe] = outcome.capacity
    overload, below = found[True].steps
    assert not overload.passed and overload.abandoned
    idle, limit = found[True].idle_probe_ms, found[True].idle_limit_ms
    assert idle is not None and limit == max(2 * idle, idle + 50)  # the default slack
    # The queue was there: the first lone request after the overload waited behind it.
    first, *_, last = overload.settle_probes_ms
    assert first is not None and first > limit
    assert last is not None and last <= limit
    assert below.passed, below.reason
    # The step planned at 4x the recorded 5 req/s, credited what the client sent, at most its
    # schedule's rate (no rate asserted: a busy machine's client sends late, and the credit
    # must follow it).
    assert below.planned_rps == pytest.approx(20.0)
    assert found[True].capacity_rps == min(below.offered_rps, below.planned_rps)
    # Waiting on the gauges alone, the same step failed: the overload's queue was still there.
    unsettled_overload, unsettled_below = found[False].steps
    assert not unsettled_overload.passed and unsettled_overload.settle_probes_ms == []
    assert not unsettled_below.passed, unsettled_below.reason
    assert found[False].capacity_rps == 0.0 < found[True].capacity_rps


# -- the wait's rules, against stand-ins -------------------------------------------------------


class StandInServer:
    """Gauges and probe times set by the test: `busy` is what /metrics says; `probe_ms`
    lists the TTFTs the next probes get (the last repeats; None: the probe fails)."""

    def __init__(self, busy: float, probe_ms: list[float | None]) -> None:
        self.busy = busy
        self.probe_ms = probe_ms
        self.probes = 0
        self.prompts: list[int] = []

    async def scrape(self, only: object = None) -> MetricsSnapshot:
        return MetricsSnapshot(taken_at=0.0, scalars={"vllm:num_requests_running": self.busy,
                                                      "vllm:num_requests_waiting": 0.0})

    async def replay_fn(self, trace: Trace, url: str, options: ReplayOptions, *, on_progress=None) -> ReplayResult:
        assert len(trace) == 1 and options.mode.kind == "timed"
        self.prompts.append(options.prompts.seed)
        ttft = self.probe_ms[min(self.probes, len(self.probe_ms) - 1)]
        self.probes += 1
        record = RequestRecord(index=0, scheduled_s=0.0, sent_s=0.0, input_tokens=8, lag_ms=0.0,
                               ttft_ms=ttft, e2e_ms=ttft, output_tokens=1, status=200,
                               error=None if ttft is not None else "HTTP 500")
        return ReplayResult(records=[record], summary=summarize([record], 0.1, ()))


def settler(server: StandInServer, **options: object) -> ServerSettler:
    return ServerSettler(url="http://stand-in", replay=ReplayOptions(), replay_fn=server.replay_fn,
                         scraper=server, timeout_s=options.pop("timeout_s", 30.0), slack_ms=50.0,  # type: ignore[arg-type]
                         check_alive=lambda when: None, **options)  # type: ignore[arg-type]


def test_idle_is_the_median_probe_and_a_slow_probe_is_waited_out() -> None:
    server = StandInServer(busy=0.0, probe_ms=[30.0, 10.0, 20.0, 900.0, 400.0, 35.0])
    waiting = settler(server)
    assert asyncio.run(waiting.calibrate()) == 20.0
    assert waiting.limit_ms() == 70.0  # max(2 x 20, 20 + 50)
    settled = asyncio.run(waiting.wait("after step 1"))
    assert settled.probes_ms == [900.0, 400.0, 35.0]
    assert not settled.stale_gauge and not settled.timed_out
    # Each probe draws fresh prompt tokens: none is a prefix-cache hit of another.
    assert len(set(server.prompts)) == len(server.prompts)


def test_a_gauge_that_stays_busy_while_probes_are_fast_is_taken_as_stale() -> None:
    server = StandInServer(busy=3.0, probe_ms=[20.0])
    waiting = settler(server, stale_after_s=0.3)
    asyncio.run(waiting.calibrate())
    settled = asyncio.run(waiting.wait("after step 1"))
    assert settled.stale_gauge and not settled.timed_out
    assert settled.probes_ms == [20.0, 20.0, 20.0]


def test_a_server_that_stays_slow_is_waited_on_until_the_timeout_then_the_ladder_goes_on() -> None:
    server = StandInServer(busy=0.0, probe_ms=[20.0, 20.0, 20.0, None, 5_000.0])
    waiting = settler(server, timeout_s=0.5)
    asyncio.run(waiting.calibrate())
    settled = asyncio.run(waiting.wait("after step 1"))
    assert settled.timed_out and settled.probes_ms[0] is None and settled.probes_ms[-1] == 5_000.0


def test_without_a_calibration_only_the_gauges_are_waited_on() -> None:
    server = StandInServer(busy=0.0, probe_ms=[None])  # the server refuses every probe
    waiting = settler(server)
    assert asyncio.run(waiting.calibrate()) is None and waiting.limit_ms() is None
    settled = asyncio.run(waiting.wait("after step 1"))
    assert settled.probes_ms == [] and not settled.timed_out
    assert server.probes == 3  # the calibration's, none after
