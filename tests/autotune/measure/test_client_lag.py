"""A measured run whose client fell behind its schedule is not scored (issue 17).

Pure ladders run against a stand-in replayer with a set server capacity and a set client
limit (records built from the step's own schedule), so each verdict is known in advance;
the trial-level rules run against the real fake-server process.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from autotune.cli import build_parser, main
from autotune.cli.flags import CLIENT_LAG_ENV, request_fields
from autotune.measure.ladder import LadderSettings, LoadLadder, client_fell_behind, offered_rate
from autotune.measure.scraper import MetricsSnapshot
from autotune.measure.trial import TrialRunner
from server.config import ServerConfig
from workloads.errors import WorkloadError
from workloads.replay import ReplayOptions
from workloads.replay_summary import ReplayResult, RequestRecord, summarize
from workloads.slo import parse_slo
from workloads.trace import Trace, TraceRequest

HELPERS = Path(__file__).resolve().parents[1]  # tests/autotune: the fake servers, the tuners, fixtures/
SAMPLE = str(HELPERS.parents[1] / "workloads" / "samples" / "translation_trace.jsonl")
SLOS = (parse_slo("ttft_p95_ms=500"),)


def window(n: int = 20, spacing_ms: float = 100.0) -> Trace:  # 10 req/s recorded
    return Trace.from_requests(
        [TraceRequest(timestamp=i * spacing_ms, input_length=10, output_length=5) for i in range(n)],
        source="test window",
    )


class StandIn:
    """A server that meets the SLO up to `capacity` req/s and a client that lags `lag_ms`
    above `client_limit` req/s (or on the runs listed in `stalls`, counted from 0)."""

    def __init__(self, capacity: float, client_limit: float, lag_ms: float = 80.0,
                 stalls: tuple[int, ...] = ()) -> None:
        self.capacity, self.client_limit, self.lag_ms, self.stalls = capacity, client_limit, lag_ms, stalls
        self.runs: list[float] = []  # offered req/s per run
        self.waiting = 0.0  # what /metrics says is queued while a run is under way
        self.seen_by_scrape: asyncio.Event | None = None
        self.watched = False  # a ladder's scraper reads this stand-in's /metrics

    async def replay_fn(self, trace: Trace, url: str, options: ReplayOptions, *, on_progress=None) -> ReplayResult:
        rate = offered_rate(trace)
        run = len(self.runs)
        self.runs.append(rate)
        lagging = rate > self.client_limit or run in self.stalls
        ttft = 50.0 if rate <= self.capacity else 2_000.0
        self.waiting = 3.0 if rate > self.capacity else 0.0
        self.seen_by_scrape = asyncio.Event()
        # The run lasts until the ladder's /metrics sampler has seen it (a condition, not a
        # fixed span: a busy machine may delay the sampler).
        if self.watched:
            await asyncio.wait_for(self.seen_by_scrape.wait(), timeout=60)
        self.waiting = 0.0  # drained once the run is over
        records = [
            RequestRecord(index=i, scheduled_s=t / 1000.0, sent_s=t / 1000.0, input_tokens=10,
                          lag_ms=self.lag_ms if lagging else 0.5, ttft_ms=ttft, e2e_ms=ttft + 20,
                          output_tokens=5, itl_ms=[5.0] * 4, status=200)
            for i, t in enumerate(trace.timestamps_ms)
        ]
        return ReplayResult(records=records, summary=summarize(records, trace.duration_s(), options.slos))


class Scraper:
    def __init__(self, stand_in: StandIn, report_queue: bool) -> None:
        self.stand_in, self.report_queue = stand_in, report_queue
        stand_in.watched = True

    async def scrape(self, only: object = None) -> MetricsSnapshot:
        waiting = self.stand_in.waiting if self.report_queue else 0.0
        if self.stand_in.seen_by_scrape is not None and self.stand_in.runs:
            self.stand_in.seen_by_scrape.set()
        return MetricsSnapshot(taken_at=0.0, scalars={"vllm:num_requests_running": 0.0,
                                                      "vllm:num_requests_waiting": waiting})


def run_ladder(stand_in: StandIn, *, report_queue: bool = False, **options: object):
    # The stand-ins model steps only: no idle probe between them (test_settle.py has those).
    settings = LadderSettings(step_requests=20, min_step_s=1.0, resolution=0.1, max_steps=12,
                              settle_probe=False)
    ladder = LoadLadder(settings, url="http://stand-in", replay=ReplayOptions(slos=SLOS, **options),
                        scraper=Scraper(stand_in, report_queue), scrape_interval_s=0.05,
                        replay_fn=stand_in.replay_fn, say=lambda line: None)
    return asyncio.run(ladder.run(window()))


def test_the_lag_limit_is_a_tenth_of_the_tightest_latency_slo_at_least_50_ms_unless_given() -> None:
    assert ReplayOptions(slos=SLOS).send_lag_limit_ms() == 50.0
    assert ReplayOptions(slos=(parse_slo("ttft_p95_ms=2000"), parse_slo("e2el_p99_ms=1500"))).send_lag_limit_ms() == 150.0
    assert ReplayOptions(slos=(parse_slo("tpot_p95_ms=50"),)).send_lag_limit_ms() == 50.0  # no TTFT/E2E
    # An SLO no config can meet (1 ms, as tests use to force misses) does not make every run unscored.
    assert ReplayOptions(slos=(parse_slo("ttft_p50_ms=1"),)).send_lag_limit_ms() == 50.0
    assert ReplayOptions(slos=SLOS, max_send_lag_ms=5).send_lag_limit_ms() == 5
    with pytest.raises(WorkloadError, match="client lag limit -1 ms: must be > 0"):
        ReplayOptions(max_send_lag_ms=-1)


def test_a_client_that_falls_behind_ends_the_ladder_with_a_lower_bound() -> None:
    """Server carries 40 req/s, client keeps up to 25: the steps above 25 prove nothing, so
    the capacity is the last scored pass (20), marked as a lower bound, not a false cliff."""
    stand_in = StandIn(capacity=40.0, client_limit=25.0)
    result = run_ladder(stand_in)
    assert result.stopped_by == "client_lag" and not result.bracketed
    assert result.capacity_rps == pytest.approx(20.0, rel=0.02)
    assert all(step.offered_rps <= 25.0 for step in result.steps)  # only what the client kept
    assert len(result.unscored) == 2  # the lagging rate, and its one re-run
    assert [s.scored for s in result.unscored] == [False, False] and not any(s.passed for s in result.unscored)
    assert result.unscored[0].speedup == result.unscored[1].speedup
    assert "send-lag p99 was 80 ms (limit 50 ms" in result.unscored[0].reason
    assert "lower bound: the replayer fell behind its schedule" in result.describe()


def test_a_one_off_stall_is_run_again_and_the_cliff_still_found() -> None:
    stand_in = StandIn(capacity=40.0, client_limit=1e9, stalls=(1,))
    result = run_ladder(stand_in)
    assert result.stopped_by is None and result.bracketed
    assert 36.0 <= result.capacity_rps <= 40.0
    assert len(result.unscored) == 1
    assert stand_in.runs[1] == stand_in.runs[2]  # the stalled rate measured again


def test_a_miss_stands_when_the_server_queued_requests_although_the_client_lagged() -> None:
    # The client lags exactly where the server is past its capacity; /metrics shows a queue.
    stand_in = StandIn(capacity=40.0, client_limit=40.0)
    result = run_ladder(stand_in, report_queue=True)
    assert result.stopped_by is None and result.bracketed and not result.unscored
    assert 36.0 <= result.capacity_rps <= 40.0
    failed = [step for step in result.steps if not step.passed]
    assert failed and all("the server queued requests, so the miss stands" in s.reason for s in failed)


class QuietStartServer:
    """Misses the SLO at any rate; the client keeps its schedule, and each step is abandoned
    (certain to fail) once the quiet first half of its requests has been sent."""

    def __init__(self) -> None:
        self.runs = 0

    async def replay_fn(self, trace: Trace, url: str, options: ReplayOptions, *, on_progress=None) -> ReplayResult:
        self.runs += 1
        sent = trace.timestamps_ms[: len(trace) // 2]
        records = [
            RequestRecord(index=i, scheduled_s=t / 1000.0, sent_s=t / 1000.0, input_tokens=10, lag_ms=0.5,
                          ttft_ms=2_000.0, e2e_ms=2_020.0, output_tokens=5, itl_ms=[5.0] * 4, status=200)
            for i, t in enumerate(sent)
        ]
        summary = summarize(records, sent[-1] / 1000.0, options.slos, stopped_early=True)
        assert on_progress is not None and on_progress(sent[-1] / 1000.0, summary)  # the ladder's verdict
        return ReplayResult(records=records, summary=summary)


def test_a_step_abandoned_after_a_quiet_stretch_is_a_miss_not_a_lagging_client() -> None:
    # The window's first half arrives at 5 req/s, its second at 20 (mean 8): a step stopped
    # after the first half sent 5 req/s, all on time, of the 8 the whole step offers.
    quiet_then_busy = Trace.from_requests(
        [TraceRequest(timestamp=t, input_length=10, output_length=5)
         for t in [i * 200.0 for i in range(10)] + [2000.0 + i * 50.0 for i in range(10)]],
        source="test window",
    )
    server = QuietStartServer()
    settings = LadderSettings(step_requests=20, min_step_s=1.0, resolution=0.1, max_steps=4,
                              settle_probe=False)
    ladder = LoadLadder(settings, url="http://stand-in", replay=ReplayOptions(slos=SLOS),
                        scraper=Scraper(StandIn(0.0, 1e9), report_queue=False), scrape_interval_s=0.05,
                        replay_fn=server.replay_fn, say=lambda line: None)
    result = asyncio.run(ladder.run(quiet_then_busy))
    # Scored misses (below the recorded rate, so capacity 0), not "the client sent 5 of 8 req/s".
    assert result.unscored == [] and result.steps
    assert all(step.scored and step.abandoned and not step.passed for step in result.steps)
    assert result.capacity_rps == 0.0 and result.stopped_by is None


def test_client_fell_behind_reads_lag_and_the_rate_sent() -> None:
    trace = window()
    options = ReplayOptions(slos=SLOS)
    kept = asyncio.run(StandIn(100.0, 1e9).replay_fn(trace, "", options))
    assert client_fell_behind(kept, offered_rate(trace), 50.0) is None
    lagged = asyncio.run(StandIn(100.0, 0.0).replay_fn(trace, "", options))
    assert "send-lag p99 was 80 ms" in client_fell_behind(lagged, offered_rate(trace), 50.0)
    assert "the client sent" in client_fell_behind(kept, 2 * offered_rate(trace), 50.0)


# -- whole trials, the real fake-server process ------------------------------------------------


def fake_runner(tmp_path: Path, replay: ReplayOptions, ladder: LadderSettings | None,
                runner: type[TrialRunner] = TrialRunner) -> TrialRunner:
    behaviour = tmp_path / "behaviour.json"
    behaviour.write_text(json.dumps({"slots": 8, "token_delay_s": 0.005}))
    return runner(
        server_command=[sys.executable, str(HELPERS / "fake_server.py"), "--behaviour", str(behaviour)],
        startup_timeout_s=20, warmup_requests=1, scrape_interval_s=0.2,
        stale_registry=tmp_path / "servers.json", replay=replay, ladder=ladder,
    )


@pytest.mark.slow
def test_a_window_or_ladder_whose_client_lagged_is_not_scored(tmp_path: Path) -> None:
    # A limit no real client meets (a millionth of a ms): every run lags beyond it.
    strict = ReplayOptions(slos=SLOS, max_send_lag_ms=1e-6)
    config = ServerConfig(engine={"model": "fake"})
    window_outcome = fake_runner(tmp_path, strict, None).run(config, window(), tmp_path / "window")
    assert window_outcome.failure == "client_lag"
    assert window_outcome.failure_detail.startswith("not scored: the replayer's send-lag p99 was")
    assert window_outcome.summary is not None and window_outcome.summary.completed == 20  # kept
    ladder = LadderSettings(step_requests=20, min_step_s=1.0, max_steps=4)
    ladder_outcome = fake_runner(tmp_path, strict, ladder).run(config, window(), tmp_path / "ladder")
    assert ladder_outcome.failure == "client_lag"
    assert ladder_outcome.capacity is not None and ladder_outcome.capacity.stopped_by == "client_lag"
    assert ladder_outcome.capacity.steps == [] and len(ladder_outcome.capacity.unscored) == 2
    # The same trial with the default limit (a tenth of the 500 ms TTFT SLO) is scored.
    relaxed = fake_runner(tmp_path, ReplayOptions(slos=SLOS), ladder).run(config, window(), tmp_path / "ok")
    assert relaxed.ok and relaxed.capacity is not None and relaxed.capacity.capacity_rps > 0


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_bad_client_lag_limit_is_refused_in_one_line(value: str, tmp_path: Path, capsys) -> None:
    code = main(["run", "--workload", SAMPLE, "--max-client-lag-ms", value, "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == f"autotune: error: --max-client-lag-ms {value}: must be above 0 (e.g. 50)"
    assert not (tmp_path / "trials").exists()


def lag_limit_from(argv: list[str], environ: dict[str, str]) -> float | None:
    args = build_parser().parse_args(["run", "--workload", "w.jsonl", *argv])
    return request_fields(args, only=("max_client_lag_ms",), environ=environ).get("max_client_lag_ms")


def test_the_environment_sets_the_lag_limit_and_the_flag_wins_over_it() -> None:
    assert lag_limit_from([], {}) is None  # derived from the SLOs downstream
    assert lag_limit_from([], {CLIENT_LAG_ENV: "5000"}) == 5000.0
    assert lag_limit_from(["--max-client-lag-ms", "70"], {CLIENT_LAG_ENV: "5000"}) == 70.0
    assert lag_limit_from([], {CLIENT_LAG_ENV: " "}) is None


@pytest.mark.parametrize("value", ["0", "-5", "fast", "inf", "nan"])
def test_a_bad_client_lag_limit_in_the_environment_is_refused_in_one_line(
        value: str, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv(CLIENT_LAG_ENV, value)
    code = main(["run", "--workload", SAMPLE, "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == (f"autotune: error: {CLIENT_LAG_ENV}={value}: must be a number of milliseconds "
                   "above 0 (e.g. 50)")
    assert not (tmp_path / "trials").exists()


class FirstRunStalls(TrialRunner):
    """The real replayer against the real fake server, except that the first run's records
    say the client lagged 10 s (a one-off stall of a busy machine)."""

    seeds: list[int]
    returned: list[ReplayResult]

    async def _replay(self, trace, url, options, *, on_progress=None):  # type: ignore[override]
        result = await super()._replay(trace, url, options, on_progress=on_progress)
        self.seeds.append(options.prompts.seed)
        if len(self.seeds) == 1:
            records = [record.model_copy(update={"lag_ms": 10_000.0}) for record in result.records]
            result = ReplayResult(records=records, summary=summarize(records, trace.duration_s(), options.slos))
        self.returned.append(result)
        return result


@pytest.mark.slow
def test_a_window_whose_client_stalled_once_is_replayed_and_scored(tmp_path: Path) -> None:
    # A 5 s limit: only the injected 10 s stall is over it, not a busy machine's own lag.
    runner = fake_runner(tmp_path, ReplayOptions(slos=SLOS, max_send_lag_ms=5_000), None,
                         runner=FirstRunStalls)
    runner.seeds, runner.returned = [], []
    outcome = runner.run(ServerConfig(engine={"model": "fake"}), window(), tmp_path / "window")
    assert outcome.ok, outcome.failure_detail
    assert len(runner.seeds) == 2 and runner.seeds[0] != runner.seeds[1]  # fresh prompt tokens
    assert outcome.summary is not None and outcome.summary.completed == 20
    # Scored on the second run's records, not the stalled first run's.
    assert outcome.summary == runner.returned[1].summary != runner.returned[0].summary


def test_an_abandoned_step_s_line_names_the_rate_it_was_judged_at_beside_what_it_sent() -> None:
    # Sparse first, then dense: a step stopped after its first 5 requests sent them at 5 req/s,
    # while the step it was certain to miss was planned at ~9.5 req/s.
    times = [i * 200.0 for i in range(10)] + [1800.0 + i * 20.0 for i in range(1, 11)]
    steep = Trace.from_requests([TraceRequest(timestamp=t, input_length=10, output_length=5) for t in times],
                                source="sparse, then dense")

    async def stopped_after_five(trace: Trace, url: str, options: ReplayOptions, *, on_progress=None) -> ReplayResult:
        records = [RequestRecord(index=i, scheduled_s=t / 1000.0, sent_s=t / 1000.0, input_tokens=10, lag_ms=0.5,
                                 ttft_ms=2_000.0, e2e_ms=2_020.0, output_tokens=5, itl_ms=[5.0] * 4, status=200)
                   for i, t in enumerate(trace.timestamps_ms[:5])]
        so_far = summarize(records, 1.0, options.slos)
        assert on_progress is not None and on_progress(1.0, so_far)  # the ladder: certain to miss
        summary = summarize(records, 1.0, options.slos, stopped_early=True)
        return ReplayResult(records=records, summary=summary.model_copy(update={"planned": len(trace)}))

    lines: list[str] = []
    settings = LadderSettings(step_requests=20, min_step_s=0.1, max_steps=1, settle_probe=False)
    stand_in = StandIn(capacity=100.0, client_limit=1000.0)
    ladder = LoadLadder(settings, url="http://stand-in", replay=ReplayOptions(slos=SLOS),
                        scraper=Scraper(stand_in, report_queue=False), scrape_interval_s=0.05,
                        replay_fn=stopped_after_five, say=lines.append)
    stand_in.watched = False  # this replay does not wait for the sampler
    result = asyncio.run(ladder.run(steep))
    step = result.steps[0]
    assert step.abandoned and step.offered_rps < step.planned_rps
    line = next(line for line in lines if line.startswith("  step 1:"))
    assert f"{step.planned_rps:.3g} req/s planned, {step.offered_rps:.3g} as sent before its verdict was certain" in line
    assert "abandoned" in line
