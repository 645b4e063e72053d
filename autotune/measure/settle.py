"""Between ladder steps: wait until the server is as idle as before the first step.

A step that inherits the last one's queue fails at a rate the config carries. The engine's
running / waiting gauges, which the ladder waited on alone before, do not see every queue:

- requests still inside an API process, received but not yet handed to the engine. On an
  H200 (results/benchmarks/frontend_capacity.md, 2026-11-28 settle section), after steps
  at 421 req/s a lone request took 96-301 ms with the gauges at zero, against 11-15 ms idle,
  on `vllm serve` and on our server with one front end; the queue cleared within a second.
  A front end that falls further behind leaves more (tests/autotune/measure/test_settle.py);
- gauges that read busy for the whole 120 s timeout after an abandoned step, on servers with
  four front ends (results/benchmarks/frontends-h100, frontends-workers-split-cpus): vLLM
  sends its scheduler's counts with engine steps, to one front end at a time, so an engine
  left idle by aborts can leave a last count standing.

So the server counts as idle when its gauges read zero and a lone short request (the probe)
is answered about as fast as on the idle server before the ladder: within
max(IDLE_FACTOR x, + slack) of that time. A gauge that stays busy while every probe of
STALE_PROBES in a row is answered that fast, for STALE_GAUGE_S, is taken as stale: the wait
ends and the log says so. A probe costs one short request (~10-20 ms on a GPU, a few more
on the laptop CPU engine) per step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from autotune.measure.scraper import NUM_RUNNING, NUM_WAITING, MetricsScraper
from workloads.prompts import PromptFactory
from workloads.replay import ReplayMode, ReplayOptions
from workloads.trace import Trace, TraceRequest

if TYPE_CHECKING:
    from autotune.measure.step_load import ReplayFunction

logger = logging.getLogger(__name__)

__all__ = ["ServerSettler", "Settled"]

PROBE_INPUT_TOKENS = 8
PROBE_OUTPUT_TOKENS = 1
CALIBRATION_PROBES = 3
IDLE_FACTOR = 2.0
# A gauge this long above zero while probes are answered at idle speed is stale.
STALE_GAUGE_S = 10.0
STALE_PROBES = 3
POLL_S = 0.2
# The probes' prompt tokens: apart from every step's seed (steps use seed + attempt + 1).
PROBE_SEED_OFFSET = 1_000_003


@dataclasses.dataclass
class Settled:
    """How one wait ended: its seconds, each probe's TTFT (None: the probe failed), those
    that found the server not idle yet, and whether it ended on a stale gauge or the timeout."""

    seconds: float
    probes_ms: list[float | None]
    not_idle_ms: list[float | None] = dataclasses.field(default_factory=list)
    stale_gauge: bool = False
    timed_out: bool = False


class ServerSettler:
    """Waits until the server is idle: gauges at zero and a probe at idle speed.

    `calibrate()` measures the idle probe time once, before the first step; without it (or
    when every calibration probe failed) only the gauges are waited on, as before."""

    def __init__(
        self,
        *,
        url: str,
        replay: ReplayOptions,
        replay_fn: ReplayFunction,
        scraper: MetricsScraper,
        timeout_s: float,
        slack_ms: float,
        check_alive: Callable[[str], None],
        probe: bool = True,
        stale_after_s: float = STALE_GAUGE_S,
    ) -> None:
        self.url = url
        self.replay = replay
        self.replay_fn = replay_fn
        self.scraper = scraper
        self.timeout_s = timeout_s
        self.slack_ms = slack_ms
        self.check_alive = check_alive
        self.probe = probe
        self.stale_after_s = stale_after_s
        self.idle_ms: float | None = None
        self._probes_sent = 0

    def limit_ms(self) -> float | None:
        """The probe time that counts as idle (None: not calibrated)."""
        if self.idle_ms is None:
            return None
        return max(IDLE_FACTOR * self.idle_ms, self.idle_ms + self.slack_ms)

    async def calibrate(self) -> float | None:
        """The idle server's probe time: the median of a few probes in a row."""
        if not self.probe:
            return None
        times = [t for t in [await self.probe_ms(self.timeout_s) for _ in range(CALIBRATION_PROBES)]
                 if t is not None]
        if not times:
            logger.warning("every idle probe request failed: between ladder steps only the "
                           "server's running/waiting gauges are waited on")
            return None
        self.idle_ms = statistics.median(times)
        return self.idle_ms

    async def probe_ms(self, timeout_s: float) -> float | None:
        """One lone short request's TTFT in ms (None when it failed or took over `timeout_s`)."""
        self._probes_sent += 1
        trace = Trace.from_requests(
            [TraceRequest(timestamp=0.0, input_length=PROBE_INPUT_TOKENS,
                          output_length=PROBE_OUTPUT_TOKENS)], source="idle probe")
        # Timed at t=0 (one request: no schedule to lag), fresh prompt tokens each time so
        # that no probe is a prefix-cache hit.
        options = dataclasses.replace(
            self.replay, mode=ReplayMode(kind="timed"), speedup=1.0, duration_s=None,
            timeout_s=max(timeout_s, 1.0),
            prompts=PromptFactory(seed=self.replay.prompts.seed + PROBE_SEED_OFFSET + self._probes_sent))
        result = await self.replay_fn(trace, self.url, options)
        (record,) = result.records
        return record.ttft_ms if record.error is None and not record.cancelled else None

    async def wait(self, when: str) -> Settled:
        """Wait until the server is idle, or the timeout (then warn and go on)."""
        started = time.monotonic()
        deadline = started + self.timeout_s
        limit = self.limit_ms()  # None without a calibration: the gauges alone
        probes: list[float | None] = []
        not_idle: list[float | None] = []
        busy_since: float | None = None
        fast_in_a_row = 0
        while True:
            snapshot = await self.scraper.scrape(only=(*NUM_RUNNING, *NUM_WAITING))
            busy = (snapshot.value(NUM_RUNNING) or 0.0) + (snapshot.value(NUM_WAITING) or 0.0)
            now = time.monotonic()
            if busy <= 0 and limit is None:
                return Settled(now - started, probes)
            if busy > 0:
                busy_since = busy_since if busy_since is not None else now
            if limit is not None and (busy <= 0 or now - busy_since >= self.stale_after_s):
                probe = await self.probe_ms(deadline - now)
                probes.append(probe)
                fast = probe is not None and probe <= limit
                fast_in_a_row = fast_in_a_row + 1 if fast else 0
                if not fast:
                    not_idle.append(probe)
                if fast and busy <= 0:
                    return Settled(time.monotonic() - started, probes, not_idle)
                if busy > 0 and fast_in_a_row >= STALE_PROBES:
                    logger.warning(
                        "%s: the running/waiting gauges read %d for %.0f s while %d requests in a "
                        "row were answered at idle speed: taken as a stale gauge; going on",
                        when, busy, now - (busy_since or now), fast_in_a_row)
                    return Settled(time.monotonic() - started, probes, not_idle, stale_gauge=True)
            if time.monotonic() > deadline:
                slowest = max((p for p in probes if p is not None), default=None)
                logger.warning(
                    "%s: the server was not idle after %.0f s (%d requests running/waiting%s); "
                    "going on", when, self.timeout_s, busy,
                    "" if limit is None else f", last probe {_ms(probes[-1] if probes else None)} "
                    f"against {limit:.0f} ms idle (slowest {_ms(slowest)})")
                return Settled(time.monotonic() - started, probes, not_idle, timed_out=True)
            self.check_alive(when)
            await asyncio.sleep(POLL_S)


def _ms(value: float | None) -> str:
    return "failed" if value is None else f"{value:.0f} ms"

