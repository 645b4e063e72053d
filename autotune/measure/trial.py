"""One measured trial: write the config, start the server, warm it up, replay the window
while scraping `/metrics`, stop the server, and write everything to the trial folder.

A failed trial is an outcome, not an exception: the study records it and goes on. Only
Ctrl-C (after stopping the server and writing `outcome.json`) and bugs propagate.

One module because every step shares one server's lifetime and one trial folder: `_Trial`
holds what the steps gathered, `TrialRunner` runs them in order and classifies the failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Literal

import httpx
import numpy as np
from pydantic import BaseModel

from autotune.errors import AutotuneError
from autotune.measure.cpu_split import CpuSplit
from autotune.measure.forkserver import ForkServer, ForkServers
from autotune.measure.kv_cache import KVCacheSize, read_kv_cache
from autotune.measure.ladder import (
    UNSCORED_RETRIES,
    CapacityResult,
    LadderSettings,
    LoadLadder,
    client_fell_behind,
    offered_rate,
    step_rate,
)
from autotune.measure.launcher import (
    ServerLauncher,
    ServerProcess,
    ServerStartFailed,
    TeardownReport,
)
from autotune.measure.scraper import (
    MetricSample,
    MetricsSampler,
    MetricsScraper,
    MetricsSnapshot,
    ServerMetrics,
    prefix_cache_hit_rate,
    server_metrics,
)
from autotune.measure.server_registry import StaleServerRegistry
from autotune.measure.servers import TrialServer
from autotune.measure.signals import stop_reason
from server.config import ServerConfig
from workloads.files import write_text_atomic
from workloads.prompts import PromptFactory
from workloads.reconcile import reconcile
from workloads.replay import ReplayOptions, replay
from workloads.replay_summary import ReplayResult, ReplaySummary, write_records
from workloads.replay_workers import replay_with_workers
from workloads.trace import Trace, TraceRequest

logger = logging.getLogger("autotune")

__all__ = [
    "FailureKind",
    "MetricSample",
    "ServerMetrics",
    "TrialOutcome",
    "TrialRunner",
    "TrialTiming",
]

FailureKind = Literal[
    "oom",
    "start_timeout",
    "crash",
    "http_errors",
    "port_in_use",
    "invalid_config",
    "interrupted",
    "pruned",
    "client_lag",  # the replayer fell behind its schedule: the run is not scored
    "unreconciled",  # the run's counts did not add up (workloads.reconcile): not scored
    "environment",  # the install or the machine (a missing module, no CUDA driver): stops the study
]

# Warm-up requests: short, so they touch every code path (prefill, decode, streaming) fast.
WARMUP_INPUT_TOKENS = 16
WARMUP_OUTPUT_TOKENS = 8
# A killed server's sockets close before its exit shows (waitpid), the more so on a loaded
# machine: a failed GET /metrics waits this long for the exit before it is called a hang.
EXIT_GRACE_S = 5.0
EXIT_POLL_S = 0.05


class TrialTiming(BaseModel):
    """Where the wall-clock time of a trial went, in seconds."""

    launch_s: float  # spawn -> process running
    ready_s: float  # spawn -> /health 200 (engine start)
    warmup_s: float
    measure_s: float  # the replayed window
    teardown_s: float  # stop signal -> every child gone and memory back


class TrialOutcome(BaseModel):
    """What one trial produced; also written to `outcome.json` in the trial folder."""

    ok: bool
    failure: FailureKind | None = None
    failure_detail: str | None = None  # one line
    summary: ReplaySummary | None = None
    server_metrics: ServerMetrics | None = None
    timing: TrialTiming | None = None
    trial_dir: str
    teardown: TeardownReport | None = None  # how the server was stopped, what was left
    # The load ladder's result (capacity objective); kept when a step crashed the server.
    capacity: CapacityResult | None = None
    server: str | None = None  # what ran the trial (TrialServer.describe())
    # The KV cache vLLM logged at start (server.log); None when the log has no such line.
    kv_cache: KVCacheSize | None = None
    # Prefix-cache hits over queries (prompt tokens) over the ladder's scored steps, or over the
    # window; None where vLLM's counters are not exposed (never a made-up 0).
    prefix_cache_hit_rate: float | None = None


class _Failed(Exception):
    """Ends the measuring part of a trial with a classified failure."""

    def __init__(self, kind: FailureKind, detail: str):
        super().__init__(detail)
        self.kind: FailureKind = kind
        self.detail = detail


class _Trial:
    """What one run has gathered so far (filled step by step, read when writing results)."""

    def __init__(self, trial_dir: Path, server: str):
        self.dir = trial_dir
        self.server_kind = server
        self.server: ServerProcess | None = None
        self.failure: FailureKind | None = None
        self.failure_detail: str | None = None
        self.result: ReplayResult | None = None
        self.metrics: ServerMetrics | None = None
        self.capacity: CapacityResult | None = None
        self.teardown: TeardownReport | None = None
        self.launch_s: float | None = None
        self.ready_s: float | None = None
        self.warmup_s: float | None = None
        self.measure_s: float | None = None

    def fail(self, kind: FailureKind, detail: str) -> None:
        if self.failure is None:  # the first cause is the one that explains the rest
            self.failure, self.failure_detail = kind, " ".join(detail.split())

    def timing(self) -> TrialTiming | None:
        parts = (self.launch_s, self.ready_s, self.warmup_s, self.measure_s, self.teardown)
        if any(part is None for part in parts):
            return None
        return TrialTiming(
            launch_s=self.launch_s,
            ready_s=self.ready_s,
            warmup_s=self.warmup_s,
            measure_s=self.measure_s,
            teardown_s=self.teardown.seconds,
        )

    def outcome(self) -> TrialOutcome:
        return TrialOutcome(
            ok=self.failure is None,
            failure=self.failure,
            failure_detail=self.failure_detail,
            summary=self.result.summary if self.result is not None else None,
            server_metrics=self.metrics,
            timing=self.timing(),
            trial_dir=str(self.dir),
            teardown=self.teardown,
            capacity=self.capacity,
            server=self.server_kind,
            kv_cache=read_kv_cache(self.dir / "server.log"),
            prefix_cache_hit_rate=prefix_cache_hit_rate(
                [step.server for step in self.capacity.steps] if self.capacity is not None else [self.metrics]
            ),
        )


class TrialRunner:
    """Runs trials: one server start, warm-up, measured window and stop per `run()`.

    `max_error_fraction`: above this share of failed requests the trial fails with
    "http_errors" (the summary is kept). `server` says which server runs the trials (ours
    by default, or stock `vllm serve`); `server_command` replaces its command (tests' fakes).

    Longer than ~250 lines: the steps of a run (start, warm-up, ladder or window, scrape,
    stop) all read the runner's settings and one trial's state, and the failure
    classification has to see every one of them.
    """

    def __init__(
        self,
        *,
        python: str = sys.executable,
        startup_timeout_s: float = 300,
        warmup_requests: int = 4,
        host: str = "127.0.0.1",
        replay: ReplayOptions | None = None,
        scrape_interval_s: float = 1.0,
        stale_registry: Path | None = None,
        max_error_fraction: float = 0.05,
        server_command: Sequence[str] | None = None,
        ladder: LadderSettings | None = None,
        say: Callable[[str], None] | None = None,
        replay_workers: int | Literal["auto"] = "auto",
        server: TrialServer | None = None,
        cpu_split: CpuSplit | None = None,
        preload_server: bool | ForkServers = False,
        shared_fork_server: Path | None = None,
    ):
        if warmup_requests < 0:
            raise AutotuneError(f"warm-up requests = {warmup_requests!r}: must be >= 0")
        if not 0 <= max_error_fraction < 1:
            raise AutotuneError(
                f"max error fraction = {max_error_fraction!r}: must be in [0, 1), e.g. 0.05"
            )
        self.python = python
        self.startup_timeout_s = startup_timeout_s
        self.warmup_requests = warmup_requests
        self.host = host
        # How the window is replayed (mode, speed-up, SLOs, per-request timeout); a ladder
        # replays it at its own speed-ups with these SLOs and timeout.
        self.replay = replay or ReplayOptions()
        self.scrape_interval_s = scrape_interval_s
        self.stale_registry = stale_registry
        self.max_error_fraction = max_error_fraction
        self.server_command = server_command
        self.server = server or TrialServer()
        # Replayer processes for the measured window (auto: more than one only at rates one
        # event loop cannot send on time; workloads.replay_workers).
        self.replay_workers = replay_workers
        # With a ladder, a trial measures the config's capacity (several rates, one launch)
        # instead of replaying the window once at `speedup`.
        self.ladder = ladder
        self.say = say
        # The client (this thread, replay workers) and the server on separate CPUs, or shared.
        self.cpu_split = cpu_split
        # Our server forked from a process that imported vLLM once (autotune.measure.forkserver)
        # instead of a fresh `python -m server` per trial; a fake command never is. Given
        # ForkServers (shared, e.g. by a test session) are used and left open by close(); a
        # shared fork server's socket (`autotune fork-server`) is tried before a fork server of our own.
        self.preload_server = bool(preload_server) and server_command is None and not self.server.is_vllm
        self._given_forkservers = preload_server if isinstance(preload_server, ForkServers) else None
        self._forkservers = self._given_forkservers or ForkServers(python, shared=shared_fork_server)

    def forkserver(self, log_dir: Path) -> ForkServer | None:
        """The fork server the next trial's server comes from (started now if there is none
        for this environment; its import then runs while the caller prepares), or None."""
        return self._forkservers.for_environment(log_dir) if self.preload_server else None

    def close(self) -> None:
        """End the fork server this runner started, if any (it also ends with this process)."""
        if self._given_forkservers is None:
            self._forkservers.close()

    def run(
        self,
        config: ServerConfig,
        window: Trace,
        trial_dir: Path,
        *,
        should_prune: Callable[[float, ReplaySummary], bool] | None = None,
        start_speedup: float | None = None,
    ) -> TrialOutcome:
        """Measure `config` on `window`; results go to `trial_dir` (created if needed).

        `should_prune(elapsed_s, summary_so_far)` is asked about once a second during the
        window; True stops the replay and the trial ends with failure "pruned".
        With a ladder, `start_speedup` is where the ladder starts (a capacity known from
        elsewhere: the cliff is probably near); `should_prune` is not used.
        """
        if len(window) == 0:
            raise AutotuneError(f"{trial_dir}: the trial window has no requests")
        trial_dir = Path(trial_dir)
        trial_dir.mkdir(parents=True, exist_ok=True)
        trial = _Trial(trial_dir, self.server.describe(config))
        interrupted = False
        pinned = self.cpu_split.client_pinned() if self.cpu_split else contextlib.nullcontext()
        try:
            with pinned:
                try:
                    config = self.server.served(config)  # e.g. our --api-processes N
                    config.write(trial_dir / "config.yaml")
                    self._start(trial, self.server.write_config(config, trial_dir), config)
                    if self.ladder is not None:
                        asyncio.run(self._measure_ladder(trial, window, start_speedup))
                    else:
                        asyncio.run(self._measure(trial, window, should_prune))
                except _Failed as failed:
                    trial.fail(failed.kind, failed.detail)
                except KeyboardInterrupt:
                    interrupted = True
                    raise
                finally:
                    if trial.server is not None:
                        # On the user's stop the group still goes, but nobody waits for memory
                        # readings: only a next trial's start needs the memory back.
                        trial.teardown = (trial.server.stop(memory_wait_s=0.0) if interrupted
                                          else trial.server.stop())
        except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM / SIGHUP (autotune.measure.signals)
            trial.fail("interrupted", f"interrupted ({stop_reason(stop)}); the server was stopped")
            self._write(trial)
            raise
        return self._write(trial)

    # -- steps --------------------------------------------------------------------------

    def _replay(self, trace: Trace, url: str, options: ReplayOptions, *,
                on_progress: Callable[[float, ReplaySummary], bool] | None = None,
                ) -> Awaitable[ReplayResult]:
        """The window, or one ladder step: in several processes where one event loop would
        fall behind the schedule (a ladder's upper steps on a GPU run at hundreds of req/s)."""
        return replay_with_workers(trace, url, options, workers=self.replay_workers,
                                   on_progress=on_progress)

    def _start(self, trial: _Trial, config_path: Path, config: ServerConfig) -> None:
        launcher = ServerLauncher(
            host=self.host,
            startup_timeout_s=self.startup_timeout_s,
            registry=StaleServerRegistry(self.stale_registry) if self.stale_registry else None,
            study=trial.dir.parent.name,
            command=self.server_command or self.server.command(self.python),
            extra_args=self.server.extra_args(self.host, config),
            cpu_split=self.cpu_split,
            forkserver=self.forkserver(trial.dir.parent),
        )
        try:
            server = launcher.start(config_path, trial.dir / "server.log", trial=trial.dir.name)
        except ServerStartFailed as failure:
            trial.teardown = failure.teardown
            raise _Failed(failure.kind, failure.detail) from None
        trial.server = server
        trial.launch_s = server.launched_at - server.spawned_at
        trial.ready_s = server.ready_at - server.spawned_at

    async def _measure(
        self,
        trial: _Trial,
        window: Trace,
        should_prune: Callable[[float, ReplaySummary], bool] | None,
    ) -> None:
        server = trial.server
        assert server is not None
        async with httpx.AsyncClient(trust_env=False) as client:
            scraper = MetricsScraper(client, server.url)

            started = time.monotonic()
            await self._warm_up(trial, server)
            trial.warmup_s = time.monotonic() - started

            # A run whose client fell behind says nothing about the server: replayed once more
            # (fresh prompt tokens, so nothing is served from the first run's cache), as a
            # ladder re-runs such a step; a second lagging run fails the trial as client_lag.
            for attempt in range(1 + UNSCORED_RETRIES):
                options = self.replay if attempt == 0 else dataclasses.replace(
                    self.replay, prompts=PromptFactory(seed=self.replay.prompts.seed + attempt))
                behind = await self._measure_once(trial, server, scraper, window, options,
                                                  should_prune)
                if behind is None:
                    return
                if attempt < UNSCORED_RETRIES:
                    logger.warning("%s: not scored (%s); replaying the window once more",
                                   trial.dir.name, behind)
            raise _Failed("client_lag", f"not scored: {behind}")

    async def _measure_once(
        self,
        trial: _Trial,
        server: ServerProcess,
        scraper: MetricsScraper,
        window: Trace,
        options: ReplayOptions,
        should_prune: Callable[[float, ReplaySummary], bool] | None,
    ) -> str | None:
        """One replay of the window; raises for a pruned run or too many errors, returns why
        the client fell behind its schedule (None: it kept it)."""
        before = await self._scrape(scraper, server, "before the window")
        sampler = MetricsSampler(scraper, self.scrape_interval_s, server.track_children,
                                 server.cpu_reading)
        sampler.start()
        started = time.monotonic()

        def stop_if(elapsed: float, summary: ReplaySummary) -> bool:
            # A dead server fails every request still due: the rest of the window tells nothing.
            if not server.alive():
                return True
            return should_prune is not None and bool(should_prune(elapsed, summary))

        try:
            trial.result = await self._replay(window, server.url, options, on_progress=stop_if)
        finally:
            trial.measure_s = (trial.measure_s or 0.0) + time.monotonic() - started
            timeline = await sampler.stop()
        self._check_alive(server, "during the window")
        after = await self._scrape(scraper, server, "after the window")
        trial.metrics = server_metrics(before, after, timeline)
        trial.metrics.processes = sampler.processes

        summary = trial.result.summary
        attempted = summary.completed + summary.failed
        if summary.stopped_early:
            raise _Failed("pruned", f"stopped by the pruner after {summary.duration:.1f} s")
        if attempted and summary.failed > self.max_error_fraction * attempted:
            first_error = next(r.error for r in trial.result.records if r.error and not r.cancelled)
            raise _Failed(
                "http_errors",
                f"{summary.failed} of {attempted} requests failed "
                f"(limit {self.max_error_fraction:.0%}); first: {first_error}",
            )
        counted = reconcile(window.subset(np.arange(options.planned(window))), trial.result,
                            benchmark_mode=options.benchmark_mode)
        for warning in counted.warnings:
            self.say(f"  warning: {warning}")
        if counted.problem is not None:
            raise _Failed("unreconciled", f"not scored: its counts do not reconcile: {counted.problem}")
        if options.mode.kind != "timed":
            return None
        sent = window.subset(np.arange(options.planned(window)))
        return client_fell_behind(trial.result, offered_rate(sent) * options.speedup,
                                  options.send_lag_limit_ms())

    async def _measure_ladder(
        self, trial: _Trial, window: Trace, start_speedup: float | None
    ) -> None:
        server = trial.server
        assert server is not None and self.ladder is not None
        settings = self.ladder.hinted(start_speedup)
        async with httpx.AsyncClient(trust_env=False) as client:
            scraper = MetricsScraper(client, server.url)
            started = time.monotonic()
            await self._warm_up(trial, server)
            trial.warmup_s = time.monotonic() - started
            await self._scrape(scraper, server, "before the ladder")
            ladder = LoadLadder(
                settings,
                url=server.url,
                replay=self.replay,
                scraper=scraper,
                scrape_interval_s=self.scrape_interval_s,
                on_sample=server.track_children,
                check_alive=lambda when: self._check_alive(server, when),
                say=self.say,
                replay_fn=self._replay,
                cpu_reading=server.cpu_reading,
            )
            started = time.monotonic()
            try:
                trial.capacity = await ladder.run(window)
                if not ladder.steps and trial.capacity.stopped_by == "reconciliation":
                    raise _Failed("unreconciled", trial.capacity.unscored[-1].reason)
                if not ladder.steps:  # every run unscored: nothing known about this config
                    raise _Failed("client_lag", "not scored: the replayer fell behind its schedule "
                                  f"at every rate tried ({trial.capacity.unscored[-1].reason.removeprefix('not scored: ')})")
                lowest = min(ladder.steps, key=lambda step: step.speedup)
                if trial.capacity.capacity_rps <= 0 and lowest.summary.failed > (
                    self.max_error_fraction * lowest.requests
                ):
                    first_error = next(
                        (r.error for r in ladder.results[lowest.index].records if r.error and not r.cancelled),
                        "unknown",
                    )
                    raise _Failed(
                        "http_errors",
                        f"{lowest.summary.failed} of {lowest.requests} requests failed even at "
                        f"{step_rate(lowest):.3g} req/s; first: {first_error}",
                    )
            except _Failed as failed:
                # Everything measured before the crash counts: capacity found so far.
                trial.capacity = ladder.result(window, stopped_by=failed.kind)
                raise
            except httpx.HTTPError as error:
                # /metrics stopped answering: a dead server (classified by its exit), else a hang.
                failure = _Failed("crash", f"GET /metrics during the ladder failed: {error!r}")
                try:
                    await self._check_exited_within_grace(server, "during the ladder")
                except _Failed as died:
                    failure = died
                trial.capacity = ladder.result(window, stopped_by=failure.kind)
                raise failure from None
            finally:
                trial.measure_s = time.monotonic() - started
                self._keep_ladder_records(trial, ladder)

    @staticmethod
    def _keep_ladder_records(trial: _Trial, ladder: LoadLadder) -> None:
        """The trial's summary, metrics and requests.jsonl are those of the capacity step
        (the highest passing one), else of the first step; every step is in ladder.json."""
        if not ladder.steps:
            return
        passing = [i for i, step in enumerate(ladder.steps) if step.passed]
        chosen = max(passing, key=lambda i: ladder.steps[i].speedup) if passing else 0
        trial.result = ladder.results[chosen]
        trial.metrics = ladder.steps[chosen].server

    async def _warm_up(self, trial: _Trial, server: ServerProcess) -> None:
        """A few short unmeasured requests, so the window does not pay for first-use costs."""
        if self.warmup_requests == 0:
            return
        requests = [
            TraceRequest(
                timestamp=0.0,
                input_length=WARMUP_INPUT_TOKENS,
                output_length=WARMUP_OUTPUT_TOKENS,
            )
        ] * self.warmup_requests
        # All at once, closed loop: a burst in timed mode would trip the replayer's lag warning.
        result = await replay(
            Trace.from_requests(requests, source="warm-up"),
            server.url,
            ReplayOptions(mode=f"concurrency={self.warmup_requests}", timeout_s=self.replay.timeout_s),
        )
        self._check_alive(server, "during warm-up")
        if result.summary.completed == 0:
            first_error = next((r.error for r in result.records if r.error), "no answer")
            raise _Failed("http_errors", f"every warm-up request failed; first: {first_error}")

    async def _scrape(
        self, scraper: MetricsScraper, server: ServerProcess, when: str
    ) -> MetricsSnapshot:
        try:
            return await scraper.scrape()
        except httpx.HTTPError as error:
            await self._check_exited_within_grace(server, when)
            raise _Failed("crash", f"GET /metrics {when} failed: {error!r}") from None

    @staticmethod
    def _check_alive(server: ServerProcess, when: str) -> None:
        if not server.alive():
            failure = server.failure()
            raise _Failed(failure.kind, f"server died {when}: {failure.detail}")

    @classmethod
    async def _check_exited_within_grace(cls, server: ServerProcess, when: str) -> None:
        """After a failed request: raise the server's classified death if its exit shows
        within EXIT_GRACE_S; return if it is still running then (a hang, not a death)."""
        deadline = time.monotonic() + EXIT_GRACE_S
        while server.alive() and time.monotonic() < deadline:
            await asyncio.sleep(EXIT_POLL_S)
        cls._check_alive(server, when)

    def _write(self, trial: _Trial) -> TrialOutcome:
        """Write the result files (what exists) and `outcome.json`; return the outcome."""
        if trial.result is not None:
            write_records(trial.dir / "requests.jsonl", trial.result.records)
            write_text_atomic(
                trial.dir / "summary.json", trial.result.summary.model_dump_json(indent=2) + "\n"
            )
        if trial.metrics is not None:
            write_text_atomic(
                trial.dir / "server_metrics.json", trial.metrics.model_dump_json(indent=2) + "\n"
            )
        if trial.capacity is not None:
            write_text_atomic(
                trial.dir / "ladder.json", trial.capacity.model_dump_json(indent=2) + "\n"
            )
        outcome = trial.outcome()
        write_text_atomic(trial.dir / "outcome.json", outcome.model_dump_json(indent=2) + "\n")
        return outcome

