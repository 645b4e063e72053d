"""Read the server's Prometheus `/metrics`: snapshots, before/after diffs, a sampled timeline.

vLLM renamed several metrics between versions; every lookup here names the current
spelling first and the older one after it, so the tuner works against both generations
(current names checked against vllm/v1/metrics/loggers.py of vLLM 0.32).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from autotune.measure.process_cpu import CpuReading, ProcessCpu, cpu_use

# Metric names, current spelling first. Counters are looked up by their exposed sample name
# (`<name>_total`), which is the same whether vLLM declared the counter with or without it.
KV_CACHE_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
NUM_RUNNING = ("vllm:num_requests_running",)
NUM_WAITING = ("vllm:num_requests_waiting",)
PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
TTFT = ("vllm:time_to_first_token_seconds",)
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
QUEUE_TIME = ("vllm:request_queue_time_seconds",)
E2E_LATENCY = ("vllm:e2e_request_latency_seconds",)
PREFILL_TIME = ("vllm:request_prefill_time_seconds",)
DECODE_TIME = ("vllm:request_decode_time_seconds",)
# Prefix caching, in prompt tokens: queried, and found in the cache (vLLM 0.32's
# vllm:prefix_cache_queries / _hits; before them vllm:gpu_prefix_cache_queries / _hits).
PREFIX_CACHE_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_CACHE_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
TIMELINE_GAUGES = (*KV_CACHE_USAGE, *NUM_RUNNING, *NUM_WAITING)  # sampled during the window


@dataclass(frozen=True)
class Histogram:
    """One Prometheus histogram, summed over its label sets (engines, models)."""

    bounds: tuple[float, ...]  # bucket upper bounds ("le"), ascending, last is +Inf
    cumulative: tuple[float, ...]  # observations <= each bound
    sum: float
    count: float

    def minus(self, earlier: Histogram) -> Histogram:
        """Observations made between `earlier` and this snapshot."""
        if self.bounds != earlier.bounds or self.count < earlier.count:
            # Different buckets or a counter reset (server restarted): everything is new.
            return self
        return Histogram(
            bounds=self.bounds,
            cumulative=tuple(a - b for a, b in zip(self.cumulative, earlier.cumulative, strict=True)),
            sum=self.sum - earlier.sum,
            count=self.count - earlier.count,
        )

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """Estimate the q-quantile (0..1) the way Prometheus' histogram_quantile does.

        Linear interpolation inside the bucket holding the rank; the first bucket starts at 0;
        a rank in the +Inf bucket returns the largest finite bound (nothing better is known).
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile q = {q!r}: must be between 0 and 1")
        if self.count <= 0 or not self.bounds:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative, strict=True):
            if cumulative >= rank and cumulative > lower_count:
                if math.isinf(bound):
                    return lower_bound
                fraction = (rank - lower_count) / (cumulative - lower_count)
                return lower_bound + (bound - lower_bound) * fraction
            lower_bound, lower_count = bound, cumulative
        return lower_bound


@dataclass(frozen=True)
class MetricsSnapshot:
    """Every sample of one `/metrics` scrape, summed over label sets."""

    taken_at: float  # time.monotonic() of the scrape
    scalars: dict[str, float] = field(default_factory=dict)  # counter/gauge sample name -> value
    histograms: dict[str, Histogram] = field(default_factory=dict)  # family name -> histogram

    def value(self, names: Iterable[str]) -> float | None:
        """The first of `names` (aliases across vLLM versions) present in this scrape."""
        for name in names:
            if name in self.scalars:
                return self.scalars[name]
        return None

    def histogram(self, names: Iterable[str]) -> Histogram | None:
        for name in names:
            if name in self.histograms:
                return self.histograms[name]
        return None


def parse_metrics(text: str, *, taken_at: float | None = None) -> MetricsSnapshot:
    """Parse Prometheus text exposition into a snapshot (label sets summed, `le` kept)."""
    scalars: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "histogram":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    bound = float(sample.labels["le"])
                    family_buckets = buckets.setdefault(family.name, {})
                    family_buckets[bound] = family_buckets.get(bound, 0.0) + sample.value
                elif sample.name.endswith("_sum"):
                    sums[family.name] = sums.get(family.name, 0.0) + sample.value
                elif sample.name.endswith("_count"):
                    counts[family.name] = counts.get(family.name, 0.0) + sample.value
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue  # creation timestamps, not values
            scalars[sample.name] = scalars.get(sample.name, 0.0) + sample.value
    histograms = {}
    for name, by_bound in buckets.items():
        bounds = tuple(sorted(by_bound))
        histograms[name] = Histogram(
            bounds=bounds,
            cumulative=tuple(by_bound[b] for b in bounds),
            sum=sums.get(name, 0.0),
            count=counts.get(name, by_bound.get(math.inf, 0.0)),
        )
    return MetricsSnapshot(
        taken_at=time.monotonic() if taken_at is None else taken_at,
        scalars=scalars,
        histograms=histograms,
    )


def parse_scalars(text: str, names: Iterable[str], *, taken_at: float | None = None) -> MetricsSnapshot:
    """Only the counter/gauge samples called `names` (label sets summed): a line scan.

    The in-window timeline needs three gauges a second; the full parse of vLLM's ~66 KB
    exposition costs ~15 ms of CPU on the loop that times the replayer's sends, and a busy
    machine that preempts it mid-parse stalls every send behind it (measured: send-lag p99
    ~1 s on 2 cores). Scanning for the wanted lines is ~1 ms.
    """
    wanted = frozenset(names)
    prefixes = tuple(wanted)
    scalars: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefixes):
            continue
        brace = line.find("{")
        if brace >= 0:
            name, rest = line[:brace], line[line.rfind("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        if name not in wanted:
            continue  # a longer name with a wanted prefix
        fields = rest.split()
        if fields:
            scalars[name] = scalars.get(name, 0.0) + float(fields[0])
    return MetricsSnapshot(
        taken_at=time.monotonic() if taken_at is None else taken_at, scalars=scalars
    )


class MetricSample(BaseModel):
    """One point of the in-window timeline."""

    t_s: float  # seconds since the sampler started
    kv_cache_usage: float | None  # 0..1
    num_running: float | None
    num_waiting: float | None


class ServerMetrics(BaseModel):
    """Server-side view of one measured window (histograms diffed before/after it)."""

    ttft_mean_ms: float | None = None
    ttft_p95_ms: float | None = None
    itl_mean_ms: float | None = None
    itl_p95_ms: float | None = None
    queue_mean_ms: float | None = None
    queue_p95_ms: float | None = None
    e2e_mean_ms: float | None = None
    prefill_mean_ms: float | None = None
    decode_mean_ms: float | None = None
    kv_cache_usage_max: float | None = None
    kv_cache_usage_mean: float | None = None
    num_running_max: float | None = None
    num_waiting_max: float | None = None
    preemptions: float | None = None
    # Prompt tokens looked up in the prefix cache during the window, and those found there;
    # None where the server exposes no such counters.
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    timeline: list[MetricSample] = []
    # CPU use of each server process over the same span (busiest first), where measured.
    processes: list[ProcessCpu] = []


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _max(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _counted(before: MetricsSnapshot, after: MetricsSnapshot, names: tuple[str, ...]) -> float | None:
    """How much a counter grew between two scrapes; None when the later one lacks it. A counter
    that went down was reset (the server restarted): all of its value is new."""
    late = after.value(names)
    if late is None:
        return None
    early = before.value(names) or 0.0
    return late - early if late >= early else late


def prefix_cache_hit_rate(windows: Iterable[ServerMetrics | None]) -> float | None:
    """Hits over queries (prompt tokens) summed over `windows` (a ladder's measured steps, or
    one replayed window): 0..1, or None where no window has both counters or none queried the
    cache. Token-weighted, as vLLM's own logged "Prefix cache hit rate" is."""
    counted = [w for w in windows if w is not None and w.prefix_cache_queries is not None
               and w.prefix_cache_hits is not None]
    queries = sum(w.prefix_cache_queries or 0.0 for w in counted)
    if not counted or queries <= 0:
        return None
    return sum(w.prefix_cache_hits or 0.0 for w in counted) / queries


def server_metrics(
    before: MetricsSnapshot, after: MetricsSnapshot, timeline: list[MetricSample]
) -> ServerMetrics:
    """What the server saw between two scrapes, plus gauge extremes from the timeline."""

    def window(names: tuple[str, ...]) -> Histogram | None:
        late = after.histogram(names)
        if late is None:
            return None
        early = before.histogram(names)
        return late if early is None else late.minus(early)

    ttft, itl, queue = window(TTFT), window(ITL), window(QUEUE_TIME)
    e2e, prefill, decode = window(E2E_LATENCY), window(PREFILL_TIME), window(DECODE_TIME)
    preempted_after = after.value(PREEMPTIONS)
    preempted_before = before.value(PREEMPTIONS) or 0.0
    return ServerMetrics(
        ttft_mean_ms=_ms(ttft.mean()) if ttft else None,
        ttft_p95_ms=_ms(ttft.quantile(0.95)) if ttft else None,
        itl_mean_ms=_ms(itl.mean()) if itl else None,
        itl_p95_ms=_ms(itl.quantile(0.95)) if itl else None,
        queue_mean_ms=_ms(queue.mean()) if queue else None,
        queue_p95_ms=_ms(queue.quantile(0.95)) if queue else None,
        e2e_mean_ms=_ms(e2e.mean()) if e2e else None,
        prefill_mean_ms=_ms(prefill.mean()) if prefill else None,
        decode_mean_ms=_ms(decode.mean()) if decode else None,
        kv_cache_usage_max=_max([s.kv_cache_usage for s in timeline]),
        kv_cache_usage_mean=_mean([s.kv_cache_usage for s in timeline]),
        num_running_max=_max([s.num_running for s in timeline]),
        num_waiting_max=_max([s.num_waiting for s in timeline]),
        preemptions=None if preempted_after is None else preempted_after - preempted_before,
        prefix_cache_queries=_counted(before, after, PREFIX_CACHE_QUERIES),
        prefix_cache_hits=_counted(before, after, PREFIX_CACHE_HITS),
        timeline=list(timeline),
    )


class MetricsScraper:
    """Fetches `/metrics` of one server."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, *, timeout_s: float = 10.0):
        self._client = client
        self._url = base_url.rstrip("/") + "/metrics"
        self._timeout_s = timeout_s

    async def scrape(self, only: Iterable[str] | None = None) -> MetricsSnapshot:
        """One snapshot (with `only`: just those counters/gauges, cheaply); httpx.HTTPError
        when the server does not answer with 200."""
        response = await self._client.get(self._url, timeout=self._timeout_s)
        response.raise_for_status()
        if only is not None:
            return parse_scalars(response.text, only)
        return parse_metrics(response.text)


class MetricsSampler:
    """Scrapes every `interval_s` in a background task while the window is replayed.

    `on_sample` runs after every scrape attempt (the trial runner uses it to keep its list of
    the server's child processes fresh). A failed scrape is counted and skipped: a gap in the
    timeline must not fail the trial, the before/after scrapes carry the numbers that matter.
    `cpu_reading` (the server's process CPU counters) is read at start and stop; `processes`
    then holds what each server process used in between.
    """

    def __init__(
        self,
        scraper: MetricsScraper,
        interval_s: float = 1.0,
        on_sample: Callable[[], None] | None = None,
        cpu_reading: Callable[[], CpuReading] | None = None,
    ):
        if interval_s <= 0:
            raise ValueError(f"scrape interval = {interval_s!r}: must be > 0 seconds")
        self._scraper = scraper
        self._interval_s = interval_s
        self._on_sample = on_sample
        self._samples: list[MetricSample] = []
        self._task: asyncio.Task[None] | None = None
        self._started_at = 0.0
        self.failed_scrapes = 0
        self._cpu_reading = cpu_reading
        self._cpu_start: CpuReading | None = None
        self.processes: list[ProcessCpu] = []

    def start(self) -> None:
        self._started_at = time.monotonic()
        self._cpu_start = self._cpu_reading() if self._cpu_reading else None
        self._task = asyncio.create_task(self._loop(), name="metrics-sampler")

    async def stop(self) -> list[MetricSample]:
        """Cancel the loop and return the timeline collected so far."""
        if self._cpu_reading is not None and self._cpu_start is not None:
            self.processes = cpu_use(self._cpu_start, self._cpu_reading())
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                # The sampler's own cancellation ends here; the caller's (Ctrl-C landing
                # while this waits) must go on, or asyncio.run would return as if all was well.
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
            finally:
                self._task = None
        return list(self._samples)

    async def _loop(self) -> None:
        while True:
            try:
                snapshot = await self._scraper.scrape(only=TIMELINE_GAUGES)
            except httpx.HTTPError:
                self.failed_scrapes += 1
            else:
                self._samples.append(
                    MetricSample(
                        t_s=snapshot.taken_at - self._started_at,
                        kv_cache_usage=snapshot.value(KV_CACHE_USAGE),
                        num_running=snapshot.value(NUM_RUNNING),
                        num_waiting=snapshot.value(NUM_WAITING),
                    )
                )
            if self._on_sample is not None:
                self._on_sample()
            await asyncio.sleep(self._interval_s)
