"""The load ladder: one engine launch, the window replayed at rising speed-ups, the capacity.

A config's capacity is the highest request rate at which every SLO holds. At one fixed rate
the SLO is a cliff (below capacity every config passes, above it every config fails), so the
ladder looks for the cliff itself:

1. Step: replay a stretch of the window at a speed-up: of the stretches of consecutive
   requests (the window repeating itself when a step needs more than it holds), the one
   whose rate, then burstiness and lengths, are closest to the window's, its recorded
   arrival pattern compressed by the speed-up (`autotune.measure.step_load.step_trace`). A
   step holds at least `step_requests` requests and lasts at least `min_step_s`; the plan
   raises `step_requests` to what the SLOs' percentiles need (`requests_for_slos`). A
   silence in the step's schedule longer than `max_silence_s` is cut to it: the server
   idles through it either way, so only the step's length changes; the step is credited at
   its uncut schedule's rate, and a failing step whose cut silence ended with requests in
   flight is run again with its silences whole (`step_load.cut_silences`).
2. Search: geometric steps (x `growth`, the factor squared after each further step in the
   same direction but never past x2) from the start speed-up until a step fails (or down
   until one passes), then bisection (geometric mean) until the failing and passing
   speed-ups are within `resolution` of each other. Capacity = the offered rate of the
   highest passing step as its client sent it (requests over the span of their send times),
   never more than its schedule's rate (`step_rate`: a pass decided early may have sent only
   a burst), never speed-up x a rate the step did not replay; the first failing step's offered rate
   above it is the other end of the bracket. Like `vllm bench sweep serve_sla`'s
   doubling-then-bisection and Etalon's capacity search, but inside one launch and on the
   recorded arrivals rather than Poisson.
3. A step ends as soon as its verdict is certain. Fail: more requests than the percentile
   allows are known to miss an SLO (failed, finished over the threshold, or still without
   a first token past the TTFT threshold): no later request can save it. Pass: even if
   every unfinished request missed, the percentile would hold, so a long answer at the end
   of a step is not waited for. Both are exact, not heuristics.
4. Between steps the server drains until it is as idle as before the first step: running
   and waiting back to 0 on /metrics, and a lone short request answered about as fast as
   then (autotune.measure.settle: the gauges miss requests still inside an API process).
   Each step draws fresh prompt tokens (its own seed) so that nothing an earlier step left in
   the prefix cache can hit: steps are independent. This also works against stock `vllm
   serve`, which has no cache-reset route unless started in dev mode.

A step that kills the server ends the ladder with the capacity found so far; the trial
records the failure and keeps every step measured before it. A ladder that fails all the
way down to a step the server idled through (`step_is_idle`) stops there: no load meets the
SLOs (`CapacityResult.infeasible` says which and with what figure).

5. A step whose client fell behind its schedule (send-lag p99 over
   `ReplayOptions.send_lag_limit_ms`, or less than 90% of its rate sent) is not scored: it
   proves nothing about the server at that rate. It is run once more; a second lagging run
   ends the ladder with the capacity found so far, marked as a lower bound ("client_lag").
   Likewise a step whose counts do not reconcile (`workloads.reconcile`: records lost,
   answers of the wrong length): "reconciliation".
   A failed step still counts when the server's own queue held requests during it: the
   server was past its capacity whatever the client did.

Over 400 lines in one module because the steps, their early verdicts and the search over
speed-ups read the same settings, window and steps so far; most of it is `LoadLadder`, which
runs one ladder. What a step sends and offered is `autotune.measure.step_load`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
from pydantic import BaseModel, Field

from autotune.errors import AutotuneError
from autotune.measure.process_cpu import CpuReading
from autotune.measure.scraper import (
    MetricsSampler,
    MetricsScraper,
    ServerMetrics,
    server_metrics,
)
from autotune.measure.settle import ServerSettler
from autotune.measure.step_load import (
    IDLE_BUSY_SHARE,
    UNSCORED_RETRIES,
    ReplayFunction,
    SilenceCuts,
    busy_share,
    client_fell_behind,
    cut_silences,
    cuts_found_idle,
    due_by_last_send,
    offered_as_sent,
    offered_rate,
    recorded_rate,
    requests_for_percentile,
    requests_for_slos,
    step_trace,
)
from workloads.prompts import PromptFactory
from workloads.reconcile import Reconciliation, reconcile
from workloads.replay import ReplayMode, ReplayOptions, replay
from workloads.replay_summary import PER_REQUEST_METRICS, ReplayResult, ReplaySummary
from workloads.slo import SLO, allowed_misses, request_value_ms, slo_met
from workloads.trace import Trace

logger = logging.getLogger(__name__)

__all__ = [
    "CapacityResult",
    "LadderSettings",
    "LadderStep",
    "LoadLadder",
    "ReplayFunction",
    "SilenceCuts",
    "allowed_misses",
    "client_fell_behind",
    "cut_silences",
    "recorded_rate",
    "requests_for_percentile",
    "requests_for_slos",
    "step_rate",
    "step_trace",
]


# Seconds of a silence kept: several times a loaded step's answers (the code trace's e2e p99
# was 1.7 s on an H200 at its capacity), so the server is idle when the next burst comes;
# `cuts_found_idle` checks that it was.
DEFAULT_MAX_SILENCE_S = 5.0


MAX_STEP_REQUESTS = 100_000
MAX_STEP_S = 3600.0


class LadderSettings(BaseModel):
    """How a ladder searches. Defaults suit a GPU; `for_accelerator("cpu")` a laptop."""

    # Bounded so that planning a step (the window repeated to cover it) stays small: 100,000
    # requests hold a p99.99; an hour a step at x256 is ~20,000 copies of a one-minute window.
    step_requests: int = Field(200, ge=10, le=MAX_STEP_REQUESTS)  # requests per step, at least
    min_step_s: float = Field(10.0, gt=0, le=MAX_STEP_S)  # seconds per step, at least (at the step's rate)
    start_speedup: float = Field(1.0, gt=0)
    growth: float = Field(2.0, gt=1)  # factor between steps until the cliff is bracketed
    # The factor squares after each further step in one direction, up to this (or `growth`):
    # past the cliff a bigger jump only offers more overload and client work for the same bracket.
    max_step_factor: float = Field(2.0, gt=1)
    resolution: float = Field(0.1, gt=0)  # stop when fail / pass <= 1 + resolution
    min_speedup: float = Field(1 / 16, gt=0)  # below this the config carries nothing
    # Set by `hinted`: the ladder descends no further than this share of the known capacity it
    # started at. A config that fails there carries far less than the best one measured; how
    # much less matters to no one, and its 200-request steps at a trickle of load took minutes.
    hint_floor: float | None = None
    max_speedup: float = Field(256.0, gt=0)
    # 14: doubling from x1 brackets a capacity up to the x256 cap and bisects it to 10%.
    max_steps: int = Field(14, ge=1)
    drain_timeout_s: float = Field(120.0, gt=0)
    # Between steps, also wait for a lone short request to be answered within
    # max(2x, + settle_slack_ms) of its time on the idle server (autotune.measure.settle).
    settle_probe: bool = True
    settle_slack_ms: float = Field(50.0, ge=0)
    max_error_fraction: float = Field(0.05, ge=0, lt=1)
    # A silence in a step's schedule longer than this (seconds, at the step's speed) is cut to
    # it: the server idles through it, so the rest changes no latency, only the step's length
    # (`step_load.cut_silences`; credited at the uncut rate). None: silences replayed whole.
    max_silence_s: float | None = Field(DEFAULT_MAX_SILENCE_S, gt=0)
    # One step at `start_speedup`, no search (min-memory: do the SLOs hold at H x the rate?).
    single_step: bool = False

    def single(self, speedup: float) -> LadderSettings:
        """These settings as one step at `speedup`."""
        return self.model_copy(update={
            "single_step": True, "start_speedup": speedup, "max_steps": 1,
            "min_speedup": min(self.min_speedup, speedup), "max_speedup": max(self.max_speedup, speedup),
        })

    @classmethod
    def for_accelerator(cls, accelerator: str, **overrides: object) -> LadderSettings:
        # The 2-core CPU engine carries a few req/s: 200-request steps would take a minute
        # each. 60 requests put the p95 on the 4th-worst request: coarse, but a CPU ladder
        # of ~7 steps stays near two minutes.
        base = {"step_requests": 60, "min_step_s": 6.0} if accelerator == "cpu" else {}
        return cls(**{**base, **overrides})

    def hinted(self, speedup: float | None) -> LadderSettings:
        """Start at a known capacity (another config's, or this one's from the search) with
        finer steps: the cliff is probably near, so fewer steps bracket it."""
        if speedup is None or not speedup > 0 or self.single_step:
            return self
        growth = min(self.growth, 1.0 + 2.5 * self.resolution)
        floor = speedup * HINT_FLOOR_SHARE
        return self.model_copy(update={"start_speedup": speedup, "growth": growth,
                                       "min_speedup": max(self.min_speedup, floor),
                                       "hint_floor": floor if floor > self.min_speedup else None})


# A hinted ladder (`LadderSettings.hinted`) descends to this share of the capacity it started at.
HINT_FLOOR_SHARE = 1 / 16


class LadderStep(BaseModel):
    """One rung: the window at one speed-up."""

    index: int
    speedup: float
    # What the step offered, measured from what the client sent: requests over the span of
    # their send times (a step stopped early: what it sent by then). Capacity is credited this,
    # never more than `planned_rps` (`step_rate`).
    offered_rps: float
    planned_rps: float | None = None  # the step trace's own arrival rate, as scheduled (uncut)
    # Seconds of silence cut from the step's schedule (`LadderSettings.max_silence_s`), and
    # whether each cut silence found the server idle (False: the step ran harder than its
    # schedule; a pass stands, a failure is run again with its silences whole).
    silence_cut_s: float = 0.0
    cuts_idle: bool = True
    requests: int  # planned
    # Share of the step's span with at least one request in flight: below ~0.5 the server
    # was mostly idle, so a miss is not load (`LoadLadder.run` stops descending there).
    busy_share: float | None = None
    passed: bool
    scored: bool = True  # False: the client fell behind; kept in `CapacityResult.unscored`
    abandoned: bool = False  # stopped early: certain to fail
    ended_early: bool = False  # stopped early: certain to pass whatever the rest did
    reason: str  # why it passed or failed, one line
    measured_ms: dict[str, float | None]  # SLO spec -> measured percentile
    summary: ReplaySummary
    server: ServerMetrics | None = None
    seconds: float  # replay
    drain_s: float = 0.0  # waiting for the server to be idle again after the step
    settle_probes_ms: list[float | None] = []  # the lone requests' TTFTs then (None: failed)
    # Planned / sent / completed / failed, tokens requested vs received, send-lag: a step
    # whose counts do not add up is not scored (workloads.reconcile).
    reconciliation: Reconciliation | None = None


class CapacityResult(BaseModel):
    """What a ladder found; also written to `ladder.json` in the trial folder."""

    # The rate the highest passing step offered (`step_rate`: as sent, at most its schedule's);
    # 0 when no step passed.
    capacity_rps: float
    capacity_speedup: float | None
    recorded_rps: float  # the window's own rate
    # The lowest failing step above it: the rate it was certain to fail at (`step_rate`).
    first_fail_rps: float | None
    first_fail_speedup: float | None = None
    bracketed: bool  # a pass and a fail within the resolution: the cliff was found
    steps: list[LadderStep]  # the scored steps: the capacity rests on these alone
    stopped_by: str | None = None  # what ended the ladder early (crash, client_lag, ...)
    unscored: list[LadderStep] = []  # steps whose client fell behind its schedule
    idle_probe_ms: float | None = None  # a lone short request's TTFT before the first step
    idle_limit_ms: float | None = None  # a probe at most this slow found the server idle
    # No rate the ladder tried met the SLOs, down to a step the server was mostly idle in:
    # which SLO cannot be met at any load, with its figure (None otherwise).
    infeasible: str | None = None
    ladder_resolution: float | None = None  # LadderSettings.resolution of the ladder that ran

    @property
    def headroom(self) -> float:
        """Capacity over the recorded rate: 1.9 means "carries 1.9x your traffic"."""
        return self.capacity_rps / self.recorded_rps if self.recorded_rps > 0 else 0.0

    @property
    def resolution(self) -> float | None:
        """How far apart the last pass and the first fail above it are, relative (0.1: the
        capacity is known to within 10%): the ratio of their speed-ups, which their offered
        rates follow (a stretch of the window sped up), so it stays positive when a step
        stopped early sent a quieter or busier part of it. Without a failing step above the
        capacity (a lower bound), the ladder's own resolution: it is known no better than
        that. None when no step passed."""
        if not self.capacity_speedup:
            return None
        if not self.first_fail_speedup:
            return self.ladder_resolution
        return max(self.first_fail_speedup / self.capacity_speedup - 1.0, 0.0)

    def interval(self) -> str:
        """The capacity's bracket as measured: "12.1-13.4 req/s" (offered rates of the last
        passing and first failing step), ">= 12.1 req/s" when no step failed above it."""
        if self.capacity_rps <= 0:
            return "0 req/s"
        if self.first_fail_rps is None:
            return f">= {self.capacity_rps:.3g} req/s"
        return f"{self.capacity_rps:.3g}-{self.first_fail_rps:.3g} req/s"

    def passing_step(self) -> LadderStep | None:
        passing = [step for step in self.steps if step.passed]
        return max(passing, key=lambda step: step.speedup) if passing else None

    def describe(self) -> str:
        if self.capacity_rps <= 0:
            if self.infeasible:
                return self.infeasible
            failed = [step_rate(s) for s in self.steps if not s.passed]
            if self.stopped_by == "below_floor" and failed:
                return (f"fails even at {min(failed):.3g} req/s, 1/{1 / HINT_FLOOR_SHARE:.0f} of the "
                        f"capacity its ladder started from: not measured lower")
            lowest = min((step_rate(s) for s in self.steps), default=0.0)
            return f"no step met the SLOs (lowest tried {lowest:.3g} req/s)"
        edge = "" if self.bracketed else " (lower bound: the ladder ended before the cliff)"
        if self.stopped_by == "client_lag" and self.unscored:
            edge = (f" (lower bound: the replayer fell behind its schedule at "
                    f"{self.unscored[-1].offered_rps:.3g} req/s)")
        bracket = (f", the first failing step {self.first_fail_rps:.3g}"
                   if self.first_fail_rps is not None else "")
        return (
            f"capacity {self.capacity_rps:.3g} req/s (offered by the highest passing step"
            f"{bracket}) = {self.headroom:.2f}x the recorded {self.recorded_rps:.3g} req/s{edge}"
        )


def step_rate(step: LadderStep) -> float:
    """The rate a scored step stands for, the same way for every step: a failed one, its whole
    schedule's (it was certain to miss at that schedule, `LoadLadder._certain`); a passed one,
    what its client sent, never more than its whole schedule's rate. What was sent alone where
    the schedule is unknown (steps recorded before `planned_rps`).

    Why not what was sent: a step stopped early sent only its schedule's opening, whose rate
    is the opening's, below the whole's on a quiet one, far above it on a burst (the Azure code
    trace's tuning window on an H200: 5.87 req/s sent inside its opening burst, of a schedule
    of 0.78 req/s, beside a pass at 0.715). A pass decided early holds for the whole schedule,
    so crediting its burst would claim more than the schedule offers.
    """
    if step.planned_rps is None:
        return step.offered_rps
    return min(step.offered_rps, step.planned_rps) if step.passed else step.planned_rps


def step_is_idle(step: LadderStep) -> bool:
    """The server was mostly idle during the step (`IDLE_BUSY_SHARE`)."""
    return step.busy_share is not None and step.busy_share < IDLE_BUSY_SHARE


class LoadLadder:
    """Runs one ladder against a started server.

    `check_alive()` raises when the server died (the trial runner classifies it);
    `on_sample` keeps the runner's view of the server's child processes fresh; `replay_fn`
    runs one step (`ReplayFunction`: the contract an in-process replayer must keep);
    `cpu_reading` reads the server processes' CPU counters, so each step records what every
    process used (`ServerMetrics.processes`).
    """

    def __init__(
        self,
        settings: LadderSettings,
        *,
        url: str,
        replay: ReplayOptions,
        scraper: MetricsScraper,
        scrape_interval_s: float = 1.0,
        on_sample: Callable[[], None] | None = None,
        check_alive: Callable[[str], None] | None = None,
        say: Callable[[str], None] | None = None,
        replay_fn: ReplayFunction = replay,
        cpu_reading: Callable[[], CpuReading] | None = None,
    ) -> None:
        if not replay.slos:
            raise AutotuneError("the capacity objective needs at least one SLO (--slo ...)")
        self.settings = settings
        self.url = url
        # Each step replays with these options' SLOs, timeout, model and token, on the
        # recorded schedule of its own step trace (`_step_options`).
        self.replay = replay
        self.slos = replay.slos
        self.scraper = scraper
        self.scrape_interval_s = scrape_interval_s
        self.on_sample = on_sample
        self.check_alive = check_alive or (lambda when: None)
        self.say = say or logger.info
        self.replay_fn = replay_fn
        self.cpu_reading = cpu_reading
        self.steps: list[LadderStep] = []  # scored
        self.results: list[ReplayResult] = []  # per scored step, for the trial's records
        self.unscored: list[LadderStep] = []  # the client fell behind: not evidence either way
        self.reruns = 0  # failed steps run again with their silences whole (`step`)
        self.infeasible: str | None = None  # set when no load is low enough (`_infeasible`)
        self.settler = ServerSettler(
            url=url, replay=replay, replay_fn=replay_fn, scraper=scraper,
            timeout_s=settings.drain_timeout_s, slack_ms=settings.settle_slack_ms,
            check_alive=self.check_alive, probe=settings.settle_probe,
        )

    async def run(self, window: Trace) -> CapacityResult:
        """Climb (or descend), then bisect. Exceptions from `check_alive` propagate after
        `self.steps` holds every finished step (the runner then builds the partial result)."""
        settings = self.settings
        speedup = min(max(settings.start_speedup, settings.min_speedup), settings.max_speedup)
        await self.settler.calibrate()
        self.check_alive("probing the idle server before the ladder")
        retries = 0
        for _ in range(settings.max_steps):
            step = await self.step(window, speedup)
            if not step.scored:
                if retries < UNSCORED_RETRIES:
                    retries += 1
                    continue  # the same rate again: a one-off stall should not end the ladder
                if step.reconciliation is not None and step.reconciliation.problem is not None:
                    self.say("  the step's counts did not reconcile twice: the capacity so far is a lower bound")
                    return self.result(window, stopped_by="reconciliation")
                self.say("  the replayer cannot keep this schedule: the capacity so far is a lower bound")
                return self.result(window, stopped_by="client_lag")
            retries = 0
            following = self.next_speedup()
            floor = settings.hint_floor
            if following is None and floor is not None and not any(s.passed for s in self.steps):
                # Lower loads were not tried: this is a config far below the one measured best.
                self.say(f"  fails even at {step_rate(step):.3g} req/s, 1/{1 / HINT_FLOOR_SHARE:.0f} "
                         f"of the capacity it started from: not measured lower")
                return self.result(window, stopped_by="below_floor")
            if not any(s.passed for s in self.steps) and (following is None or step_is_idle(step)):
                # Halving again would only add idle time: the SLO is out of reach at any load.
                self.infeasible = self._infeasible(step)
                self.say(f"  {self.infeasible}")
                break
            if following is None:
                break
            speedup = following
        return self.result(window, stopped_by="infeasible" if self.infeasible else None)

    def next_speedup(self) -> float | None:
        """Where the next step goes, from the steps so far; None when the search is done.

        Unbracketed, each further step in the same direction squares the factor (x1.25,
        x1.56, then x2): a hinted start that is far off still brackets in a few steps. The
        factor stops at x2 (`max_step_factor`): squaring on (factors 2, 4, 16) overshot a GPU's
        capacity up to 16x, a step of overload and client work that bought no more than a
        doubling would; with the cap, capacities of 1-16x the recorded rate bracket in half a
        step fewer on average (a deterministic cliff, start x1, growth x2, resolution 10%).
        Bracketed: the geometric mean of the highest pass and the lowest fail above it.
        """
        settings = self.settings
        passes = [s.speedup for s in self.steps if s.passed]
        passed = max(passes) if passes else None
        fails = [s.speedup for s in self.steps if not s.passed and (passed is None or s.speedup > passed)]
        failed = min(fails) if fails else None
        if passed is not None and failed is not None:
            if failed / passed <= 1.0 + settings.resolution + 1e-9:
                return None
            return math.sqrt(passed * failed)
        run = 0  # consecutive steps in the current direction
        for step in reversed(self.steps):
            if step.passed != self.steps[-1].passed:
                break
            run += 1
        factor = min(settings.growth ** (2 ** (run - 1)), max(settings.growth, settings.max_step_factor))
        if failed is None:
            assert passed is not None
            if passed >= settings.max_speedup:
                return None
            return min(passed * factor, settings.max_speedup)
        if failed <= settings.min_speedup:
            return None
        return max(failed / factor, settings.min_speedup)

    def result(self, window: Trace, stopped_by: str | None = None) -> CapacityResult:
        recorded = recorded_rate(window)
        passing = [s for s in self.steps if s.passed]
        best = max(passing, key=lambda s: s.speedup) if passing else None
        above = [s for s in self.steps if not s.passed and (best is None or s.speedup > best.speedup)]
        first_fail = min(above, key=lambda s: s.speedup) if above else None
        bracketed = (
            best is not None
            and first_fail is not None
            and first_fail.speedup / best.speedup <= 1.0 + self.settings.resolution + 1e-9
        )
        return CapacityResult(
            capacity_rps=step_rate(best) if best else 0.0,
            capacity_speedup=best.speedup if best else None,
            recorded_rps=recorded,
            first_fail_rps=step_rate(first_fail) if first_fail else None,
            first_fail_speedup=first_fail.speedup if first_fail else None,
            bracketed=bracketed,
            steps=list(self.steps),
            stopped_by=stopped_by,
            unscored=list(self.unscored),
            idle_probe_ms=self.settler.idle_ms,
            idle_limit_ms=self.settler.limit_ms(),
            infeasible=self.infeasible,
            ladder_resolution=self.settings.resolution,
        )

    # -- one step ------------------------------------------------------------------------

    async def step(self, window: Trace, speedup: float, *, cut: bool = True) -> LadderStep:
        index = len(self.steps)
        attempt = index + len(self.unscored) + self.reruns  # a re-run gets its own prompt tokens too
        uncut = step_trace(window, speedup, self.settings)
        trace, cuts = cut_silences(uncut, self.settings.max_silence_s if cut else None)
        planned = len(trace)
        limits = {slo.spec(): allowed_misses(planned, slo.percentile) for slo in self.slos}

        decision: dict[str, str] = {}

        # What the early verdict rested on: once in-flight requests are cancelled, those that
        # already missed a TTFT no longer count in the final summary.
        missed_when_decided: dict[str, int] = {}

        def decided(_elapsed: float, summary: ReplaySummary) -> bool:
            verdict = self._certain(summary, limits, planned)
            if verdict is not None:
                decision["verdict"] = verdict
                missed_when_decided.update(summary.slo_violations)
            return verdict is not None

        before = await self.scraper.scrape()
        sampler = MetricsSampler(self.scraper, self.scrape_interval_s, self.on_sample, self.cpu_reading)
        sampler.start()
        started = time.monotonic()
        try:
            result = await self.replay_fn(trace, self.url, self._step_options(attempt),
                                          on_progress=decided)
        finally:
            seconds = time.monotonic() - started
            timeline = await sampler.stop()
        self.check_alive(f"during ladder step {index + 1} (x{speedup:.3g})")
        after = await self.scraper.scrape()
        server = server_metrics(before, after, timeline)
        server.processes = sampler.processes
        summary = result.summary
        values = {slo.spec(): _slo_values(result, slo) for slo in self.slos}  # once per SLO
        measured = {slo.spec(): _percentile(values[slo.spec()], slo) for slo in self.slos}
        held = {slo.spec(): _holds(result, slo, values[slo.spec()]) for slo in self.slos}
        early = decision.get("verdict") if summary.stopped_early else None
        passed, reason = self._verdict(summary, measured, planned, early, missed_when_decided, held)
        behind = client_fell_behind(result, offered_rate(due_by_last_send(trace, result)),
                                    self.replay.send_lag_limit_ms())
        counted = reconcile(trace, result, benchmark_mode=self.replay.benchmark_mode)
        for warning in counted.warnings:
            self.say(f"  step {index + 1}: warning: {warning}")
        if counted.problem is not None:
            # Counts that do not add up (records lost, answers of the wrong length): the
            # latencies describe other requests than the step planned. Not evidence either way.
            behind = f"its counts do not reconcile: {counted.problem}"
        # A miss stands when the server queued requests: it was past its capacity anyway.
        queued = (server.num_waiting_max or 0) > 0
        scored = behind is None or (not passed and queued and counted.problem is None)
        if behind is not None:
            # Offered less (or later) than the step claims, latencies read by a late client:
            # nothing about the server at this rate, unless its own queue says it was full.
            reason = (f"{reason}; the server queued requests, so the miss stands although {behind}"
                      if scored else f"not scored: {behind}")
            passed = passed and scored
        settled = await self.settler.wait(f"draining after ladder step {index + 1}")
        idle = cuts_found_idle(result, cuts)
        if scored and not passed and not idle:
            # Requests were still in flight when a cut silence ended: the step offered more
            # than its schedule, so its failure says nothing about that schedule.
            self.say(f"  step {index + 1}: x{speedup:.3g} failed ({reason}), but a cut silence "
                     "ended with requests in flight: run again with its silences whole")
            self.reruns += 1
            return await self.step(window, speedup, cut=False)
        sent_last = max((r.index for r in result.records), default=0)
        cut_s = cuts.between(-1, sent_last)  # the cut seconds up to the last request sent
        step = LadderStep(
            index=index,
            speedup=speedup,
            offered_rps=offered_as_sent(trace, result, cuts, uncut),
            planned_rps=offered_rate(uncut),
            silence_cut_s=cut_s,
            cuts_idle=idle,
            busy_share=busy_share(result, idle_s=cut_s),
            requests=planned,
            passed=passed,
            scored=scored,
            abandoned=early == "fail",
            ended_early=early == "pass",
            reason=reason,
            measured_ms=measured,
            summary=summary,
            server=server.model_copy(update={"timeline": []}),
            seconds=seconds,
            drain_s=settled.seconds,
            settle_probes_ms=settled.probes_ms,
            reconciliation=counted,
        )
        if scored:
            self.steps.append(step)
            self.results.append(result)
        else:
            self.unscored.append(step)
        verdict = ("pass" if passed else ("abandoned" if step.abandoned else "fail")) if scored else "not scored"
        # A step stopped early sent only its schedule's opening: that rate is not the load it
        # stands for (`step_rate`: its schedule's), so both are shown.
        offered = f"{step.offered_rps:.3g} req/s offered as sent"
        if scored and not math.isclose(step_rate(step), step.offered_rps, rel_tol=0.05):
            offered = (f"{step_rate(step):.3g} req/s planned, {step.offered_rps:.3g} as sent "
                       "before its verdict was certain")
        if step.silence_cut_s > 0:
            offered += (f", {step.silence_cut_s:.0f} s of idle silence cut" if step.cuts_idle else
                        f", {step.silence_cut_s:.0f} s of silence cut (one ended with requests in "
                        "flight: the step ran harder than its schedule)")
        self.say(
            # The step's own rate differs from x speed-up times the window's mean rate: its
            # requests are a stretch of the window, quieter or burstier than the whole.
            f"  step {index + 1}: x{speedup:.3g} the recorded arrivals ({planned} requests, "
            f"{offered}), {seconds:.0f} s: {verdict} ({reason})"
        )
        if settled.not_idle_ms:
            self.say(
                f"    then the server was not idle yet: a lone request took {_slowest(settled.not_idle_ms)} "
                f"(idle {self.settler.idle_ms:.0f} ms); waited {settled.seconds:.1f} s"
            )
        return step

    def _infeasible(self, step: LadderStep) -> str:
        """One line: which SLO no load the ladder tried could meet, at the lowest rate tried
        and how idle the server was then, and what to do."""
        missed = [
            f"{slo.metric} p{slo.percentile:g} {value:,.0f} ms (SLO {slo.threshold_ms:g} ms)"
            for slo in self.slos
            for value in [step.measured_ms.get(slo.spec())]
            if value is not None and value > slo.threshold_ms
        ]
        what = " and ".join(missed) if missed else step.reason
        idle = (f" with the server idle {1.0 - step.busy_share:.0%} of the step"
                if step.busy_share is not None else "")
        return (f"no load meets the SLOs: {what} at {step_rate(step):.3g} req/s{idle}; single "
                f"requests alone miss it on this host: relax the SLO or use a faster host")

    def _step_options(self, attempt: int) -> ReplayOptions:
        """The replay of the ladder's `attempt`-th run: timed, at the step trace's own times
        (speed-up 1, no cut), with fresh prompt tokens (its own seed), so no step hits what
        another left cached."""
        return dataclasses.replace(self.replay, mode=ReplayMode(kind="timed"), speedup=1.0,
                                   duration_s=None,
                                   prompts=PromptFactory(seed=self.replay.prompts.seed + attempt + 1))

    def _certain(
        self, summary: ReplaySummary, limits: dict[str, int], planned: int
    ) -> str | None:
        """"fail" once enough requests miss an SLO that no later request can save the
        step; "pass" once even the unfinished requests all missing could not break any SLO
        (per-request SLOs only: a token-level ITL percentile needs every gap)."""
        errors_allowed = self.settings.max_error_fraction * planned
        missed = summary.slo_violations
        if summary.failed > errors_allowed or any(missed.get(s, 0) > n for s, n in limits.items()):
            return "fail"
        unfinished = planned - summary.completed - summary.failed
        if unfinished <= 0 or any(slo.metric not in PER_REQUEST_METRICS for slo in self.slos):
            return None
        if summary.failed + unfinished <= errors_allowed and all(
            missed.get(spec, 0) + unfinished <= limit for spec, limit in limits.items()
        ):
            return "pass"
        return None

    def _verdict(
        self,
        summary: ReplaySummary,
        measured: dict[str, float | None],
        planned: int,
        early: str | None,
        missed_when_decided: dict[str, int] | None = None,
        held: dict[str, bool] | None = None,
    ) -> tuple[bool, str]:
        """Pass or fail, and why in one line. `held`: each SLO judged with the step's failed
        requests as misses (`workloads.slo.slo_met`); `measured` is over completed requests."""
        if summary.failed > self.settings.max_error_fraction * planned:
            return False, f"{summary.failed} of {planned} requests failed"
        if early == "fail":
            counts = missed_when_decided or summary.slo_violations
            missed = [
                f"{spec}: {counts[spec]} of {planned} over"
                for spec in counts
                if counts[spec] > allowed_misses(planned, _pct(spec, self.slos))
            ]
            return False, "certain to miss " + ("; ".join(missed) or "an SLO")
        parts = []
        ok = True
        for slo in self.slos:
            value = measured[slo.spec()]
            if value is None or value > slo.threshold_ms or (held is not None and not held[slo.spec()]):
                ok = False
            shown = "none" if value is None else f"{value:.0f}"
            parts.append(f"{slo.metric} p{slo.percentile:g} {shown}/{slo.threshold_ms:g} ms")
        if summary.failed and early != "pass":
            parts.append(f"{summary.failed} failed request{'s' if summary.failed > 1 else ''} "
                         f"counted as misses")
        if early == "pass":
            # The last few requests could not change the verdict: not waited for (those not yet
            # due when it was decided were never sent).
            unsent = planned - summary.completed - summary.failed - summary.cancelled
            left = f"{summary.cancelled} still running" + (f", {unsent} not yet sent" if unsent else "")
            return True, ", ".join(parts) + f" (decided with {left})"
        return ok, ", ".join(parts)


def _slowest(probes: Sequence[float | None]) -> str:
    times = [p for p in probes if p is not None]
    return f"{max(times):.0f} ms" if times else "failed"


def _pct(spec: str, slos: Sequence[SLO]) -> float:
    return next(slo.percentile for slo in slos if slo.spec() == spec)


def _slo_values(result: ReplayResult, slo: SLO) -> list[float]:
    """The step's values of the SLO's metric (ms) over its completed requests: token gaps for
    ITL, one per request otherwise (cancelled ones, stopped by an early verdict, left out)."""
    if slo.metric == "itl":
        return [gap for r in result.records if r.error is None for gap in r.itl_ms]
    return [v for r in result.records if r.error is None and not r.cancelled
            for v in [request_value_ms(r, slo)] if v is not None]


def _holds(result: ReplayResult, slo: SLO, values: list[float]) -> bool:
    """Whether the step met `slo` with its failed requests counted as misses (a failed
    request meets no SLO); `values`: `_slo_values` of the step."""
    failed = sum(1 for r in result.records if r.error is not None and not r.cancelled)
    completed = sum(1 for r in result.records if r.error is None and not r.cancelled)
    return slo_met(values, slo, failed=failed, requests=completed + failed)


def _percentile(values: list[float], slo: SLO) -> float | None:
    """The SLO's percentile of `values` (`_slo_values`: completed requests only), ms."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), slo.percentile))
