"""Capacity fidelity (issue 57, item 6): an independent check of our capacity figure.

At the capacity our ladder reports for a config, are TTFT p95 and TPOT p95 what a client we
did not write measures? One server (`python -m server --benchmark-mode`, started by the
tuner's launcher), one config (default: the embedded model on vLLM's defaults), one window
(chosen as `autotune run` chooses its tuning window: context fit, then `fit_windows` with the
default SLOs' sample-size rule). The capacity comes from `--rate` or from one load ladder on
that server (`LoadLadder`, CPU settings, the default SLOs: `CapacityResult.capacity_rps`).
Then, at that rate, on the same server, runs alternate (ours, theirs, ours, theirs, ...):

  ours    workloads.replay.replay: `--requests` consecutive requests of the window as a ladder
          step picks them (`step_trace`), their recorded arrivals scaled so that they offer the
          rate as sent ((n - 1) / span: the rate the ladder credits a step with), benchmark
          mode (ignore_eos + min_tokens: exact output lengths);
  theirs  `vllm bench serve` of the installed vLLM (benchmarks/vllm_cli.py bench-serve),
          `--dataset-name timed_trace`: the same requests in a JSONL file (arrival ms, input
          and output lengths, fresh 16-token hash ids per prompt: token-id prompts of exactly
          the window's lengths, sampled from the embedded model's own tokenizer.json), its own
          arrival clock on those timestamps (`--self-timed`), `--ignore-eos`, temperature 0.

`--arrivals poisson`: ours on seeded Poisson arrivals at the rate, theirs on its own Poisson
process (`--request-rate R --no-self-timed`, burstiness 1); same requests and lengths.
Then `--together K` pairs of runs with both clients at once on one schedule (vLLM self-timed
on the file's timestamps whatever `--arrivals`), ours on the even positions and theirs on the
odd ones, then swapped: each client measures every request once under the same server state
as the other (a shared machine's drift between one-at-a-time runs cancels out).

Each run draws fresh prompt tokens (nothing cached by an earlier run can hit), and before each
run the server is waited on until idle (gauges at zero, a lone request at idle speed:
`ServerSettler`, as between ladder steps). Around each run `/metrics` is read, so the server's
own count of prompt and generated tokens (and its TTFT histogram) checks what each client
says it sent and received.

Reported per run and as medians: TTFT p95 and TPOT p95 (ms) of each client and their ratio
(ours / theirs: per pair of runs, and of the medians), each p95 with its 90% bootstrap interval
over the run's own requests, requests sent / completed, offered rate as sent (req/s: (n - 1) /
span of the send times each client recorded), send-lag p99 (ms, against the schedule), input
and output tokens (the client's count and the server's), CPU seconds of the client over its run
and of the server. Both clients: TPOT = (E2E - TTFT) / (output tokens - 1) per request, p95 =
numpy's linear percentile over completed requests.

    .venv/bin/python benchmarks/capacity_fidelity.py [--rate R] [--config FILE]
        [--trace FILE] [--runs 3] [--requests 120] [--max-run-s 30] [--together 2]
        [--arrivals recorded|poisson] [--keep DIR]
        [--tuning-window-s 30] [--holdout-window-s 20] [--quick] [--name capacity_fidelity]

Results: results/benchmarks/{name}.{json,md} (quick: results/benchmarks/quick/), no
per-request files: both clients' per-request results, the datasets and the server log go to a
temporary folder, or with `--keep DIR` to DIR.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
import psutil
from pydantic import BaseModel, ConfigDict

if not __package__:  # run as a file: its folder is on sys.path, the repository (benchmarks.*) is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune import preflight
from autotune.measure.ladder import (
    CapacityResult,
    LadderSettings,
    LoadLadder,
    offered_rate,
    recorded_rate,
    step_trace,
)
from autotune.measure.launcher import ServerLauncher, ServerProcess
from autotune.measure.process_cpu import cpu_use
from autotune.measure.scraper import MetricsScraper, MetricsSnapshot, server_metrics
from autotune.measure.servers import TrialServer
from autotune.measure.settle import ServerSettler
from autotune.measure.trial import WARMUP_INPUT_TOKENS, WARMUP_OUTPUT_TOKENS
from autotune.search.objective import default_slos
from benchmarks.benchlib import ROOT, EngineWatch, Goal, Recorder, fmt, md_table, say, spread
from server.config import DEFAULT_MAX_MODEL_LEN, DEFAULT_MODEL_DIR, ServerConfig
from workloads.errors import OneLineErrorParser
from workloads.files import write_text_atomic
from workloads.prompts import PromptFactory
from workloads.replay import ReplayOptions, replay
from workloads.replay_summary import ReplayResult
from workloads.slo import SLO, request_tpot_ms
from workloads.trace import Trace, TraceRequest
from workloads.trace_io import load_trace

logger = logging.getLogger("capacity_fidelity")

SAMPLE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"
VLLM_CLI = ROOT / "benchmarks" / "vllm_cli.py"
CHUNK = 16  # tokens per hash id in the timed_trace file (vLLM's default chunk size)
TOLERANCE = 0.10  # the done-when: ours / theirs within 10%
PERCENTILES = "50,95,99"
# Server counters read around each run (vLLM's own, exposed by our server's /metrics).
PROMPT_TOKENS = ("vllm:prompt_tokens_total",)
GENERATION_TOKENS = ("vllm:generation_tokens_total",)
REQUESTS_DONE = ("vllm:request_success_total",)
PROMPT_SEED_BASE = 5000  # ours: PromptFactory seed per run, far from the ladder's step seeds
HASH_ID_STRIDE = 1_000_000  # theirs: hash ids per run, so no two runs share a prompt chunk

MIN_REQUESTS = 40  # per run: the p95 on the 2nd-3rd worst request at least
Client = Literal["ours", "vllm"]
Arrivals = Literal["recorded", "poisson"]
# alternate: one client at a time, ours then theirs; together: both at once, each sending half
# the requests (even / odd positions), then the halves swapped.
Schedule = Literal["alternate", "together"]


class VllmBenchResult(BaseModel):
    """What we read from `vllm bench serve --save-result --save-detailed` (vLLM 0.32's
    `benchmarks/serve.py`: `result` merged into `result_json`). Seconds in the per-request
    lists (`ttfts`, `latencies`, `start_times` on `time.perf_counter`), ms in the aggregates."""

    model_config = ConfigDict(extra="ignore")

    duration: float  # s
    completed: int
    failed: int
    total_input_tokens: int  # prompt tokens of completed requests (from the server's usage)
    total_output_tokens: int
    p95_ttft_ms: float
    p95_tpot_ms: float
    median_ttft_ms: float | None = None
    median_tpot_ms: float | None = None
    request_rate: float | str | None = None  # as configured ("inf": self-timed)
    input_lens: list[int] = []
    output_lens: list[int] = []
    ttfts: list[float | None] = []
    latencies: list[float | None] = []
    start_times: list[float | None] = []
    errors: list[str | None] = []


class RunFigures(BaseModel):
    """One run of one client at the capacity rate: what it measured and what the server saw."""

    client: Client
    run: int  # 1-based, per client (together: per pair of runs)
    schedule: Schedule = "alternate"
    ttft_p95_ms: float | None
    tpot_p95_ms: float | None
    ttft_median_ms: float | None = None
    tpot_median_ms: float | None = None
    # 90% bootstrap intervals (ms) of the two p95s over this run's own requests (p95_interval).
    ttft_p95_interval: tuple[float, float] | None = None
    tpot_p95_interval: tuple[float, float] | None = None
    requests: int  # sent
    completed: int
    failed: int
    offered_rps: float | None  # as sent: (n - 1) / span of the send times
    send_lag_p99_ms: float | None = None  # how late the client sent, against its schedule
    # CPU seconds over the run: the client's own process (ours: this one; vLLM's from the
    # start of its main run to its result table), and every server process together.
    client_cpu_s: float | None = None
    server_cpu_s: float | None = None
    input_tokens: int  # the client's count
    output_tokens: int
    server_prompt_tokens: float | None = None  # the server's counters over the run
    server_generation_tokens: float | None = None
    server_requests: float | None = None
    server_ttft_p95_ms: float | None = None  # from the server's histograms (bucketed)
    server_itl_p95_ms: float | None = None
    wall_s: float = 0.0
    # Other users' vLLM engines running when the run started (EngineWatch.foreign_engines;
    # counted between runs, not during them: no sampling thread inside our client's process).
    foreign_engines: int = 0


# -- the window and the requests ----------------------------------------------------------


def choose_window(trace: Trace, config: ServerConfig, slos: Sequence[SLO], tuning_s: float,
                  holdout_s: float) -> Trace:
    """The tuning window `autotune run` would measure: the trace fitted to the config's
    context (refused where requests do not fit), then `fit_windows` with the SLOs' needs."""
    context = int(config.engine.get("max_model_len") or DEFAULT_MAX_MODEL_LEN)
    served, _fit = preflight.fit_context(trace, context, source=f"max_model_len={context}")
    tuning, _holdout, _info, _window_fit = preflight.fit_windows(
        served, tuning_s, holdout_s, preflight.requirements(slos))
    return tuning


def poisson_arrivals(n: int, rate_rps: float, seed: int) -> np.ndarray:
    """n arrival times (ms from 0) of a seeded Poisson process at `rate_rps`."""
    gaps = np.random.default_rng(seed).exponential(1000.0 / rate_rps, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def measured_trace(window: Trace, rate_rps: float, requests: int, arrivals: Arrivals, seed: int = 0) -> Trace:
    """The requests both clients send at `rate_rps`: `requests` consecutive requests of the
    window as a ladder step picks them (`step_trace`: the stretch most like the window,
    repeated end to end where the window is short), on their recorded arrivals scaled so that
    they offer `rate_rps` as sent ((n - 1) / span, the rate the ladder credits), or for
    `poisson` on seeded Poisson arrivals at `rate_rps`."""
    settings = LadderSettings(step_requests=max(requests, 10), min_step_s=1e-3)
    picked = step_trace(window, 1.0, settings).subset(np.arange(requests))
    if arrivals == "recorded":
        factor = rate_rps / offered_rate(picked)
        return picked.replace(timestamps_ms=picked.timestamps_ms / factor,
                              source=f"{window.source} recorded arrivals at {rate_rps:.3g} req/s")
    return picked.replace(timestamps_ms=poisson_arrivals(len(picked), rate_rps, seed),
                          source=f"{window.source} poisson {rate_rps:.3g} req/s")


def timed_trace_lines(trace: Trace, first_hash_id: int) -> list[dict[str, Any]]:
    """`trace` as vLLM `timed_trace` records: arrival ms, exact lengths, and ceil(input / 16)
    hash ids never used before (from `first_hash_id`), so vLLM builds each prompt of exactly
    `input_length` token ids and no two prompts share a chunk."""
    lines = []
    next_id = first_hash_id
    for i in range(len(trace)):
        length = int(trace.input_lengths[i])
        blocks = -(-length // CHUNK)
        lines.append({
            "timestamp": round(float(trace.timestamps_ms[i]), 3),
            "input_length": length,
            "output_length": int(trace.output_lengths[i]),
            "hash_ids": list(range(next_id, next_id + blocks)),
        })
        next_id += blocks
    return lines


def write_timed_trace(trace: Trace, path: Path, first_hash_id: int) -> None:
    write_text_atomic(path, "".join(json.dumps(line) + "\n" for line in timed_trace_lines(trace, first_hash_id)),
                      shared=True)


# -- vllm bench serve ---------------------------------------------------------------------


def vllm_command(dataset: Path, requests: int, url: str, result: Path, *, arrivals: Arrivals,
                 rate_rps: float, seed: int, model: str) -> list[str]:
    """`vllm bench serve` on the timed_trace file (through benchmarks/vllm_cli.py)."""
    command = [
        sys.executable, str(VLLM_CLI), "bench-serve",
        "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", model,  # a local folder: its tokenizer.json builds the prompts
        "--dataset-name", "timed_trace", "--dataset-path", str(dataset),
        "--timed-trace-sec-multiplier", "0.001", "--timed-trace-chunk-hash-size", str(CHUNK),
        "--num-prompts", str(requests),
        "--ignore-eos", "--temperature", "0",
        "--disable-tqdm", "--num-warmups", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", PERCENTILES,
        "--seed", str(seed),
        "--save-result", "--save-detailed",
        "--result-dir", str(result.parent), "--result-filename", result.name,
    ]
    if arrivals == "poisson":
        command += ["--no-self-timed", "--request-rate", f"{rate_rps:.6g}", "--burstiness", "1"]
    return command


def shown_command(command: Sequence[str], work: Path) -> str:
    """A vllm_cli command as typed from the repository root, the work folder as WORK/ and the
    server's port as PORT (both change from run to run)."""
    text = " ".join([".venv/bin/python", *command[1:]])
    text = text.replace(f"{work}/", "WORK/").replace(str(work), "WORK").replace(f"{ROOT}/", "")
    return re.sub(r"http://127\.0\.0\.1:\d+", "http://127.0.0.1:PORT", text)


def parse_vllm_result(path: Path) -> VllmBenchResult:
    return VllmBenchResult.model_validate_json(path.read_text(encoding="utf-8"))


def send_rate(send_times_s: Sequence[float]) -> float | None:
    """Requests per second as sent: n - 1 gaps over the span of the send times."""
    times = sorted(send_times_s)
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def vllm_send_lag_p99_ms(result: VllmBenchResult, scheduled_ms: Sequence[float]) -> float | None:
    """p99 of how late vLLM sent each request against the file's schedule, in ms, measured
    from its first send (its start instant is not in the result): (start_i - start_0) -
    (t_i - t_0). None without one send time per scheduled request."""
    starts = result.start_times
    if len(starts) != len(scheduled_ms) or len(starts) < 2 or any(t is None for t in starts):
        return None
    sent = np.asarray(starts, dtype=np.float64)
    due = np.asarray(scheduled_ms, dtype=np.float64) / 1000.0
    return float(np.percentile(((sent - sent[0]) - (due - due[0])) * 1000.0, 99))


def vllm_figures(result: VllmBenchResult, run: int, scheduled_ms: Sequence[float] | None = None) -> RunFigures:
    """One vLLM run's figures; `scheduled_ms`: the file's arrival times (self-timed runs), for
    its send lag."""
    completed = result.completed
    ttfts, tpots = vllm_per_request(result)
    return RunFigures(
        client="vllm", run=run,
        # vLLM writes 0 for a percentile of no values: no completed request, no figure.
        ttft_p95_ms=result.p95_ttft_ms if completed else None,
        tpot_p95_ms=result.p95_tpot_ms if completed else None,
        ttft_median_ms=result.median_ttft_ms if completed else None,
        tpot_median_ms=result.median_tpot_ms if completed else None,
        ttft_p95_interval=p95_interval(ttfts), tpot_p95_interval=p95_interval(tpots),
        requests=completed + result.failed,
        completed=completed, failed=result.failed,
        offered_rps=send_rate([t for t in result.start_times if t is not None]),
        send_lag_p99_ms=None if scheduled_ms is None else vllm_send_lag_p99_ms(result, scheduled_ms),
        input_tokens=result.total_input_tokens, output_tokens=result.total_output_tokens,
    )


def ours_figures(result: ReplayResult, run: int) -> RunFigures:
    summary = result.summary
    ttfts, tpots = ours_per_request(result)
    return RunFigures(
        client="ours", run=run,
        ttft_p95_ms=summary.p95_ttft_ms, tpot_p95_ms=summary.p95_tpot_ms,
        ttft_median_ms=summary.median_ttft_ms, tpot_median_ms=summary.median_tpot_ms,
        ttft_p95_interval=p95_interval(ttfts), tpot_p95_interval=p95_interval(tpots),
        requests=len(result.records), completed=summary.completed, failed=summary.failed,
        offered_rps=send_rate([r.sent_s for r in result.records]),
        send_lag_p99_ms=summary.send_lag_p99_ms,
        input_tokens=summary.total_input_tokens, output_tokens=summary.total_output_tokens,
    )


BOOTSTRAP_RESAMPLES = 2000


def p95_interval(values: Sequence[float], seed: int = 0) -> tuple[float, float] | None:
    """The 90% bootstrap interval (ms) of the p95 of `values`: how far the figure of one run
    could move with another draw of as many requests from the same conditions."""
    if len(values) < 2:
        return None
    array = np.asarray(values, dtype=np.float64)
    draws = np.random.default_rng(seed).choice(array, size=(BOOTSTRAP_RESAMPLES, array.size))
    low, high = np.percentile(np.percentile(draws, 95, axis=1), [5, 95])
    return float(low), float(high)


def p95(values: Sequence[float]) -> float | None:
    """numpy's linear 95th percentile, as both clients compute theirs; None for no values."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), 95)) if len(values) else None


def vllm_per_request(result: VllmBenchResult) -> tuple[list[float], list[float]]:
    """TTFTs and TPOTs (ms) of vLLM's completed requests, as its own metrics define them:
    TPOT = (latency - TTFT) / (output tokens - 1) for two or more tokens."""
    ttfts, tpots = [], []
    for ttft, latency, out, error in zip(result.ttfts, result.latencies, result.output_lens, result.errors,
                                         strict=False):
        if error or ttft is None or latency is None:
            continue
        ttfts.append(ttft * 1000.0)
        if out > 1:
            tpots.append((latency - ttft) * 1000.0 / (out - 1))
    return ttfts, tpots


def ours_per_request(result: ReplayResult) -> tuple[list[float], list[float]]:
    """TTFTs and TPOTs (ms) of our completed requests (`request_tpot_ms`)."""
    done = [r for r in result.records if r.error is None and r.ttft_ms is not None]
    tpots = [t for t in (request_tpot_ms(r) for r in done) if t is not None]
    return [r.ttft_ms for r in done], tpots


def together_figures(client: Client, pair: int, halves: Sequence[tuple[list[float], list[float]]],
                     sent: Sequence[RunFigures]) -> RunFigures:
    """One client's figures over a pair of together-runs: its p95s over every request of the
    trace (each half measured once), its counts summed, its rate as sent per half (mean)."""
    ttfts = [v for half in halves for v in half[0]]
    tpots = [v for half in halves for v in half[1]]
    rates = [r.offered_rps for r in sent if r.offered_rps is not None]
    lags = [r.send_lag_p99_ms for r in sent if r.send_lag_p99_ms is not None]
    cpu = [r.client_cpu_s for r in sent if r.client_cpu_s is not None]
    return RunFigures(
        client=client, run=pair, schedule="together", ttft_p95_ms=p95(ttfts), tpot_p95_ms=p95(tpots),
        client_cpu_s=sum(cpu) if len(cpu) == len(sent) else None,
        ttft_p95_interval=p95_interval(ttfts), tpot_p95_interval=p95_interval(tpots),
        send_lag_p99_ms=max(lags) if lags else None,
        ttft_median_ms=float(np.median(ttfts)) if ttfts else None,
        tpot_median_ms=float(np.median(tpots)) if tpots else None,
        requests=sum(r.requests for r in sent), completed=sum(r.completed for r in sent),
        failed=sum(r.failed for r in sent), offered_rps=float(np.mean(rates)) if rates else None,
        input_tokens=sum(r.input_tokens for r in sent), output_tokens=sum(r.output_tokens for r in sent),
        wall_s=round(sum(r.wall_s for r in sent), 1),
    )


def with_server_view(figures: RunFigures, before: MetricsSnapshot, after: MetricsSnapshot) -> RunFigures:
    """`figures` with the server's own counters and histograms over the run (after - before)."""
    def delta(names: tuple[str, ...]) -> float | None:
        late, early = after.value(names), before.value(names)
        return None if late is None else late - (early or 0.0)

    seen = server_metrics(before, after, [])
    return figures.model_copy(update={
        "server_prompt_tokens": delta(PROMPT_TOKENS),
        "server_generation_tokens": delta(GENERATION_TOKENS),
        "server_requests": delta(REQUESTS_DONE),
        "server_ttft_p95_ms": seen.ttft_p95_ms,
        "server_itl_p95_ms": seen.itl_p95_ms,
    })


# -- the comparison -----------------------------------------------------------------------

METRICS = ("ttft_p95_ms", "tpot_p95_ms")


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def relative_range(values: Sequence[float]) -> float | None:
    """(max - min) / median; None for no values."""
    median = spread(values)["median"]
    return (max(values) - min(values)) / median if values and median else None


def against_server(runs: Sequence[RunFigures]) -> dict[str, float | None]:
    """Per client, the median over its runs of its TTFT p95 over the server's own TTFT p95 in
    the same run (vLLM's histogram): ~equal for both clients means both report what the
    server did, and a gap between the clients' figures is the server's state, not a client."""
    out: dict[str, float | None] = {}
    for client in ("ours", "vllm"):
        ratios = [r.ttft_p95_ms / r.server_ttft_p95_ms for r in runs
                  if r.client == client and r.schedule == "alternate" and r.ttft_p95_ms is not None
                  and r.server_ttft_p95_ms]
        out[client] = spread(ratios)["median"]
    return out


def compare(runs: Sequence[RunFigures], schedule: Schedule = "alternate") -> dict[str, Any]:
    """Per metric, over the runs of `schedule`: each client's runs and median, the ratio of the
    medians (ours / theirs), the ratio within each pair (run k of ours against run k of
    theirs), and the verdict."""
    runs = [r for r in runs if r.schedule == schedule]
    out: dict[str, Any] = {}
    for metric in METRICS:
        ours = {r.run: getattr(r, metric) for r in runs if r.client == "ours"}
        theirs = {r.run: getattr(r, metric) for r in runs if r.client == "vllm"}
        ours_values = [v for v in ours.values() if v is not None]
        theirs_values = [v for v in theirs.values() if v is not None]
        median_ours = spread(ours_values)["median"]
        median_theirs = spread(theirs_values)["median"]
        paired = [ratio(ours[k], theirs.get(k)) for k in sorted(ours)]
        of_medians = ratio(median_ours, median_theirs)
        out[metric] = {
            "ours": ours_values, "vllm": theirs_values,
            "ours_median": median_ours, "vllm_median": median_theirs,
            # Run-to-run noise of each client alone: (max - min) / median of its runs.
            "ours_range": relative_range(ours_values), "vllm_range": relative_range(theirs_values),
            "paired_ratios": [p for p in paired if p is not None],
            "ratio_of_medians": of_medians,
            "within_tolerance": None if of_medians is None else abs(of_medians - 1.0) <= TOLERANCE,
        }
    return out


def goals(comparison: dict[str, Any], together: dict[str, Any] | None = None) -> list[Goal]:
    found = []
    cases = [(comparison, "one client at a time")] + ([(together, "both at once")] if together else [])
    for compared, how in cases:
        found += goals_of(compared, how)
    return found


def goals_of(comparison: dict[str, Any], how: str) -> list[Goal]:
    found = []
    for metric, name in (("ttft_p95_ms", "TTFT p95"), ("tpot_p95_ms", "TPOT p95")):
        c = comparison[metric]
        if c["ratio_of_medians"] is None and not c["ours"]:
            continue  # no runs of this schedule
        paired = ", ".join(fmt(p) for p in c["paired_ratios"])
        found.append(Goal(name=f"{name} at the capacity, ours / vllm bench serve, {how} (ratio of medians)",
                          target=f"within {TOLERANCE:.0%} of 1", measured=c["ratio_of_medians"],
                          met=c["within_tolerance"], note=f"per pair {paired}" if paired else ""))
    return found


def runs_table(runs: Sequence[RunFigures]) -> list[str]:
    """One row per run, in the order run, and the pair's ratios on the second run of a pair."""
    by_key = {(r.client, r.run, r.schedule): r for r in runs}
    rows = []
    for r in runs:
        other = by_key.get(("ours" if r.client == "vllm" else "vllm", r.run, r.schedule))
        pair = r.client == "vllm" and other is not None
        rows.append([
            r.run, r.schedule, "ours (workloads.replay)" if r.client == "ours" else "vllm bench serve",
            f"{fmt(r.ttft_p95_ms, 4)} ({interval_text(r.ttft_p95_interval)})",
            f"{fmt(r.tpot_p95_ms, 4)} ({interval_text(r.tpot_p95_interval)})",
            fmt(ratio(other.ttft_p95_ms, r.ttft_p95_ms), 3) if pair else "",
            fmt(ratio(other.tpot_p95_ms, r.tpot_p95_ms), 3) if pair else "",
            f"{r.completed}/{r.requests}", fmt(r.offered_rps, 4), fmt(r.send_lag_p99_ms, 3),
            f"{r.input_tokens} / {fmt(r.server_prompt_tokens, 6)}",
            f"{r.output_tokens} / {fmt(r.server_generation_tokens, 6)}",
            fmt(r.server_ttft_p95_ms, 4), fmt(r.server_itl_p95_ms, 3), fmt(r.client_cpu_s, 3), fmt(r.server_cpu_s, 3),
            r.foreign_engines, fmt(r.wall_s, 3),
        ])
    return md_table(["run", "schedule", "client", "TTFT p95 ms (90% bootstrap)", "TPOT p95 ms (90% bootstrap)",
                     "TTFT ours/vllm", "TPOT ours/vllm", "completed/sent", "offered req/s as sent",
                     "send lag p99 ms", "input tokens (client / server)",
                     "output tokens (client / server)", "server TTFT p95 ms", "server ITL p95 ms",
                     "client CPU s", "server CPU s", "other engines", "wall s"], rows)


def interval_text(interval: tuple[float, float] | None) -> str:
    return "-" if interval is None else f"{interval[0]:.4g}-{interval[1]:.4g}"


def sampling_spread(runs: Sequence[RunFigures], metric: str) -> tuple[float, float] | None:
    """Median over runs of a p95's 90% bootstrap interval relative to the p95 itself
    (e.g. (0.8, 1.1): one run's figure could as well have been 20% lower or 10% higher)."""
    interval_field = metric.replace("_ms", "_interval")  # ttft_p95_ms -> ttft_p95_interval
    lows, highs = [], []
    for r in runs:
        value, interval = getattr(r, metric), getattr(r, interval_field)
        if value and interval is not None:
            lows.append(interval[0] / value)
            highs.append(interval[1] / value)
    if not lows:
        return None
    return float(np.median(lows)), float(np.median(highs))


def reading(runs: Sequence[RunFigures], comparison: dict[str, Any], together: dict[str, Any] | None) -> list[str]:
    """What the figures say about the gap between the clients, in lines for the notes."""
    lines = []
    for metric, name in (("ttft_p95_ms", "TTFT p95"), ("tpot_p95_ms", "TPOT p95")):
        c = comparison[metric]
        if c["ratio_of_medians"] is None:
            continue
        noise = sampling_spread([r for r in runs if r.schedule == "alternate"], metric)
        line = (f"{name}, one client at a time: ours / vllm {c['ratio_of_medians']:.3g} (per pair "
                f"{', '.join(fmt(p, 3) for p in c['paired_ratios'])}); each client's own runs range "
                f"{fmt(c['ours_range'], 2)} (ours) and {fmt(c['vllm_range'], 2)} (vllm) of their median")
        if noise is not None:
            line += (f", and one run's p95 alone could have been x{noise[0]:.2f} to x{noise[1]:.2f} of itself "
                     "(90% bootstrap over its requests, median over runs)")
        if together is not None and together[metric]["ratio_of_medians"] is not None:
            t = together[metric]
            line += (f"; both at once, under one server state: {t['ratio_of_medians']:.3g} (per pair "
                     f"{', '.join(fmt(p, 3) for p in t['paired_ratios'])})")
        lines.append(line + ".")
    return lines


def summary_table(comparison: dict[str, Any]) -> list[str]:
    rows = []
    for metric, name in (("ttft_p95_ms", "TTFT p95 ms"), ("tpot_p95_ms", "TPOT p95 ms")):
        c = comparison[metric]
        rows.append([name, fmt(c["ours_median"], 4), fmt(c["vllm_median"], 4), fmt(c["ratio_of_medians"], 3),
                     ", ".join(fmt(p, 3) for p in c["paired_ratios"]) or "-",
                     {True: "yes", False: "**no**", None: "-"}[c["within_tolerance"]],
                     f"{fmt(c['ours_range'], 2)} / {fmt(c['vllm_range'], 2)}"])
    server = comparison["ttft_p95_over_server"]
    return md_table(["metric", "ours (median)", "vllm bench serve (median)", "ours / vllm (medians)",
                     "ours / vllm per pair", f"within {TOLERANCE:.0%}",
                     "run-to-run range / median (ours / vllm)"], rows) + [
        "", f"Client TTFT p95 over the server's own (histogram) TTFT p95 in the same run, median over "
        f"runs: ours {fmt(server['ours'], 3)}, vllm bench serve {fmt(server['vllm'], 3)}."]


# -- the measurement ----------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    """What one benchmark run does, from the command line."""

    config: ServerConfig
    window: Trace
    slos: list[SLO]
    ladder: LadderSettings
    rate_rps: float | None  # given; None: from one ladder
    runs: int
    requests: int
    arrivals: Arrivals
    work: Path
    together_pairs: int = 0  # pairs of together-runs after the alternating runs
    max_run_s: float = 30.0  # fewer requests (not fewer than MIN_REQUESTS) where more take longer

    def requests_at(self, rate_rps: float) -> int:
        """Requests per run at `rate_rps`: `requests`, fewer where they would take over
        `max_run_s` at that rate, never fewer than MIN_REQUESTS."""
        return max(MIN_REQUESTS, min(self.requests, int(rate_rps * self.max_run_s) + 1))


@dataclasses.dataclass
class Measured:
    capacity: CapacityResult | None
    rate_rps: float
    speedup: float
    runs: list[RunFigures]
    trace: Trace
    ready_s: float
    commands: dict[str, str]


def start_server(plan: Plan) -> ServerProcess:
    """Our server with the config, started as a trial's is (`TrialServer` command and flags)."""
    kind = TrialServer()
    config_path = kind.write_config(plan.config, plan.work)
    plan.config.write(config_path)
    launcher = ServerLauncher(command=kind.command(sys.executable),
                              extra_args=kind.extra_args("127.0.0.1", plan.config), startup_timeout_s=900)
    return launcher.start(config_path, plan.work / "server.log")


async def warm_up(url: str) -> None:
    """A few short unmeasured requests, as a trial's warm-up sends."""
    warm = Trace.from_requests([TraceRequest(timestamp=0.0, input_length=WARMUP_INPUT_TOKENS,
                                             output_length=WARMUP_OUTPUT_TOKENS)] * 4, source="warm-up")
    await replay(warm, url, ReplayOptions(mode="concurrency=4"))


async def find_capacity(plan: Plan, server: ServerProcess, scraper: MetricsScraper) -> CapacityResult:
    ladder = LoadLadder(plan.ladder, url=server.url, replay=ReplayOptions(slos=tuple(plan.slos)),
                        scraper=scraper, on_sample=server.track_children, say=say,
                        cpu_reading=server.cpu_reading)
    capacity = await ladder.run(plan.window)
    say(f"ladder: {capacity.describe()}")
    return capacity


async def run_ours(plan: Plan, trace: Trace, url: str, run: int) -> RunFigures:
    options = ReplayOptions(mode="timed", benchmark_mode=True, slos=tuple(plan.slos),
                            prompts=PromptFactory(seed=PROMPT_SEED_BASE + run))
    cpu_before = time.process_time()
    result = await replay(trace, url, options)
    cpu_s = time.process_time() - cpu_before
    # Beside vLLM's detailed result, in the work folder (kept only with --keep).
    result.write(plan.work / f"ours-{run}.requests.jsonl", plan.work / f"ours-{run}.summary.json")
    return ours_figures(result, run).model_copy(update={"client_cpu_s": cpu_s})


def vllm_run_command(plan: Plan, trace: Trace, url: str, rate_rps: float, tag: str,
                     first_hash_id: int, arrivals: Arrivals) -> tuple[list[str], Path]:
    """Write the dataset for one vLLM run; its command and result path."""
    dataset = plan.work / f"vllm-{tag}.timed_trace.jsonl"
    write_timed_trace(trace, dataset, first_hash_id=first_hash_id)
    result_path = plan.work / f"vllm-{tag}.json"
    command = vllm_command(dataset, len(trace), url, result_path, arrivals=arrivals, rate_rps=rate_rps,
                           seed=first_hash_id // HASH_ID_STRIDE,
                           model=str(plan.config.engine.get("model") or DEFAULT_MODEL_DIR))
    return command, result_path


def vllm_failed(code: int | None, log_path: Path) -> SystemExit:
    tail = log_path.read_text(errors="replace").splitlines()[-15:]
    return SystemExit(f"capacity_fidelity: vllm bench serve exited {code}; last lines of {log_path}:\n"
                      + "\n".join(tail))


START_LINE = b"Starting main benchmark run"  # vLLM prints it, then starts its clock
RESULT_LINE = b"Serving Benchmark Result"  # vLLM prints it once every request is done


class VllmRun:
    """One `vllm bench serve` process: its output into a log file, the start of its main run
    awaited (`start`), and the CPU seconds it used from there to its result table (`cpu_s`:
    its run without its start-up, which imports vLLM)."""

    def __init__(self, command: Sequence[str], log_path: Path) -> None:
        self.command = list(command)
        self.log_path = log_path
        self.cpu_s: float | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._started_cpu: float | None = None

    async def start(self) -> None:
        process = await asyncio.create_subprocess_exec(*self.command, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
                                                       stderr=asyncio.subprocess.STDOUT)
        self._process = process
        if not await self._read_until(START_LINE):
            raise vllm_failed(await process.wait(), self.log_path)
        self._started_cpu = self._cpu_now()

    async def finish(self) -> int:
        """Read the rest of its output; its exit code."""
        assert self._process is not None
        if await self._read_until(RESULT_LINE) and self._started_cpu is not None:
            now = self._cpu_now()
            self.cpu_s = None if now is None else now - self._started_cpu
        await self._read_until(None)
        return await self._process.wait()

    async def _read_until(self, marker: bytes | None) -> bool:
        """Log lines until one holds `marker` (True) or the output ends (False)."""
        assert self._process is not None and self._process.stdout is not None
        with open(self.log_path, "ab") as log:
            async for line in self._process.stdout:
                log.write(line)
                if marker is not None and marker in line:
                    return True
        return False

    def _cpu_now(self) -> float | None:
        assert self._process is not None
        try:
            times = psutil.Process(self._process.pid).cpu_times()
        except psutil.Error as error:  # it exited already: its run's CPU is not known
            logger.info("vllm bench serve's CPU times unreadable: %s", error)
            return None
        return times.user + times.system


async def run_vllm(plan: Plan, trace: Trace, url: str, rate_rps: float, run: int) -> tuple[RunFigures, str]:
    command, result_path = vllm_run_command(plan, trace, url, rate_rps, str(run), run * HASH_ID_STRIDE,
                                            plan.arrivals)
    vllm = VllmRun(command, plan.work / f"vllm-{run}.log")
    await vllm.start()
    code = await vllm.finish()
    if code != 0 or not result_path.exists():
        raise vllm_failed(code, vllm.log_path)
    scheduled = list(trace.timestamps_ms) if plan.arrivals == "recorded" else None  # poisson: vLLM's own
    figures = vllm_figures(parse_vllm_result(result_path), run, scheduled)
    return figures.model_copy(update={"client_cpu_s": vllm.cpu_s}), shown_command(command, plan.work)


async def run_together(plan: Plan, trace: Trace, ours_idx: np.ndarray, vllm_idx: np.ndarray, url: str,
                       rate_rps: float, tag: str, seed: int) -> tuple[RunFigures, RunFigures, tuple, tuple]:
    """Both clients at once: vLLM sends the requests `vllm_idx`, ours `ours_idx`, each at its
    time in `trace`. Ours starts when vLLM prints that its main run starts (its clock starts
    right after: one GET /metrics later), so both schedules share t=0 within tens of ms.
    Returns each client's figures for its half and its per-request TTFTs and TPOTs."""
    # Self-timed on the file: the same schedule as ours, whatever --arrivals.
    command, result_path = vllm_run_command(plan, trace.subset(vllm_idx), url, rate_rps / 2, tag,
                                            seed * HASH_ID_STRIDE, "recorded")
    vllm = VllmRun(command, plan.work / f"vllm-{tag}.log")
    await vllm.start()
    options = ReplayOptions(mode="timed", benchmark_mode=True, slos=tuple(plan.slos),
                            prompts=PromptFactory(seed=PROMPT_SEED_BASE + seed))
    cpu_before = time.process_time()
    ours_task = asyncio.create_task(replay(trace.subset(ours_idx), url, options))
    code = await vllm.finish()
    ours = await ours_task
    ours_cpu = time.process_time() - cpu_before
    if code != 0 or not result_path.exists():
        raise vllm_failed(code, vllm.log_path)
    ours.write(plan.work / f"ours-{tag}.requests.jsonl", plan.work / f"ours-{tag}.summary.json")
    theirs = parse_vllm_result(result_path)
    return (ours_figures(ours, 0).model_copy(update={"client_cpu_s": ours_cpu}),
            vllm_figures(theirs, 0, list(trace.subset(vllm_idx).timestamps_ms)).model_copy(
                update={"client_cpu_s": vllm.cpu_s}),
            ours_per_request(ours), vllm_per_request(theirs))


async def together_pair(plan: Plan, trace: Trace, pair: int, url: str, rate_rps: float,
                        settler: ServerSettler) -> list[RunFigures]:
    """Two together-runs with the halves swapped: each client measures every request once,
    under the same server state as the other. Returns ours and theirs for the pair."""
    even, odd = np.arange(0, len(trace), 2), np.arange(1, len(trace), 2)
    halves: dict[Client, list[tuple[list[float], list[float]]]] = {"ours": [], "vllm": []}
    sent: dict[Client, list[RunFigures]] = {"ours": [], "vllm": []}
    for half, (ours_idx, vllm_idx) in enumerate(((even, odd), (odd, even))):
        await settler.wait(f"before together pair {pair}, half {half + 1}")
        started = time.monotonic()
        ours, theirs, ours_values, their_values = await run_together(
            plan, trace, ours_idx, vllm_idx, url, rate_rps, f"together-{pair}-{half + 1}", seed=100 + 2 * pair + half)
        wall = round(time.monotonic() - started, 1)
        halves["ours"].append(ours_values)
        halves["vllm"].append(their_values)
        sent["ours"].append(ours.model_copy(update={"wall_s": wall}))
        sent["vllm"].append(theirs.model_copy(update={"wall_s": wall}))
    figures = [together_figures(client, pair, halves[client], sent[client]) for client in ("ours", "vllm")]
    for f in figures:
        say(f"together pair {pair}, {f.client}: TTFT p95 {fmt(f.ttft_p95_ms, 4)} ms, TPOT p95 "
            f"{fmt(f.tpot_p95_ms, 4)} ms over {f.completed}/{f.requests}, {fmt(f.offered_rps, 3)} req/s per half as sent, "
            f"client CPU {fmt(f.client_cpu_s, 3)} s")
    return figures


async def one_run(plan: Plan, client: Client, run: int, trace: Trace, server: ServerProcess,
                  scraper: MetricsScraper, settler: ServerSettler, rate_rps: float) -> tuple[RunFigures, str]:
    await settler.wait(f"before {client} run {run}")
    others = EngineWatch.foreign_engines()
    before = await scraper.scrape()
    server_before = server.cpu_reading()
    started = time.monotonic()
    command = ""
    if client == "ours":
        figures = await run_ours(plan, trace, server.url, run)
    else:
        figures, command = await run_vllm(plan, trace, server.url, rate_rps, run)
    wall = time.monotonic() - started
    server_cpu = sum(p.cpu_s for p in cpu_use(server_before, server.cpu_reading()))
    after = await scraper.scrape()
    figures = with_server_view(figures, before, after).model_copy(
        update={"wall_s": round(wall, 1), "foreign_engines": others, "server_cpu_s": round(server_cpu, 2)})
    say(f"{client} run {run}: TTFT p95 {fmt(figures.ttft_p95_ms, 4)} ms, TPOT p95 {fmt(figures.tpot_p95_ms, 4)} ms, "
        f"{figures.completed}/{figures.requests} completed at {fmt(figures.offered_rps, 4)} req/s as sent, "
        f"tokens in {figures.input_tokens} (server {fmt(figures.server_prompt_tokens, 6)}) out "
        f"{figures.output_tokens} (server {fmt(figures.server_generation_tokens, 6)}), CPU s client "
        f"{fmt(figures.client_cpu_s, 3)} server {fmt(figures.server_cpu_s, 3)}")
    return figures, command


async def measure(plan: Plan, server: ServerProcess) -> Measured:
    async with httpx.AsyncClient(trust_env=False) as client:
        scraper = MetricsScraper(client, server.url)
        await warm_up(server.url)
        capacity = None
        rate = plan.rate_rps
        if rate is None:
            capacity = await find_capacity(plan, server, scraper)
            if capacity.capacity_rps <= 0:
                raise SystemExit(f"capacity_fidelity: the ladder found no capacity ({capacity.describe()})")
            rate = capacity.capacity_rps
        speedup = rate / recorded_rate(plan.window)
        requests = plan.requests_at(rate)
        trace = measured_trace(plan.window, rate, requests, plan.arrivals)
        say(f"at {rate:.3g} req/s (x{speedup:.3g} the window's {recorded_rate(plan.window):.3g}): "
            f"{len(trace)} requests over {trace.duration_s():.1f} s, {plan.arrivals} arrivals, {plan.runs} runs per "
            f"client, then {plan.together_pairs} pairs of runs with both at once")
        settler = ServerSettler(url=server.url, replay=ReplayOptions(), replay_fn=replay, scraper=scraper,
                                timeout_s=plan.ladder.drain_timeout_s, slack_ms=plan.ladder.settle_slack_ms,
                                check_alive=lambda _when: None)
        await settler.wait("before the first run")  # nothing of the ladder still running
        await settler.calibrate()
        runs: list[RunFigures] = []
        commands: dict[str, str] = {}
        for run in range(1, plan.runs + 1):
            for client_name in ("ours", "vllm"):
                # Poisson: each of our runs on its own seed, as each vLLM run draws its own.
                sent = trace if plan.arrivals == "recorded" else measured_trace(
                    plan.window, rate, requests, "poisson", seed=run)
                figures, command = await one_run(plan, client_name, run, sent, server, scraper, settler, rate)
                runs.append(figures)
                if command:
                    commands["vllm"] = command
        for pair in range(1, plan.together_pairs + 1):
            runs += await together_pair(plan, trace, pair, server.url, rate, settler)
        return Measured(capacity, rate, speedup, runs, trace, server.ready_at - server.spawned_at, commands)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(SAMPLE))
    parser.add_argument("--config", help="server config YAML (default: the embedded model, vLLM's defaults)")
    parser.add_argument("--rate", type=float, help="req/s to compare at (default: one ladder's capacity)")
    parser.add_argument("--runs", type=int, default=3, help="runs per client, one at a time, interleaved")
    parser.add_argument("--requests", type=int, default=120,
                        help="requests per run (fewer where they would take over --max-run-s, at least 40)")
    parser.add_argument("--max-run-s", type=float, default=30.0)
    parser.add_argument("--together", type=int, default=2,
                        help="then this many pairs of runs with both clients at once, halves swapped")
    parser.add_argument("--arrivals", choices=("recorded", "poisson"), default="recorded")
    parser.add_argument("--tuning-window-s", type=float, default=30.0)
    parser.add_argument("--holdout-window-s", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="1 run per client, 40 requests")
    parser.add_argument("--name", default="capacity_fidelity")
    parser.add_argument("--keep", type=Path, help="keep the work files (server log, both clients' "
                        "per-request results) in this folder instead of a temporary one")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.requests, args.together = 1, 40, 1
    if args.runs < 1 or args.requests < 10:
        parser.error("--runs must be >= 1 and --requests >= 10")
    if args.rate is not None and not args.rate > 0:
        parser.error("--rate must be > 0 req/s")
    return args


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args()
    recorder = Recorder(args.name, "Capacity fidelity: TTFT and TPOT p95 at our capacity, our replayer "
                        "against `vllm bench serve` on one server (issue 57, item 6)",
                        "quick" if args.quick else "full")
    config = ServerConfig.load(args.config) if args.config else ServerConfig.default()
    slos = default_slos("cpu")
    window = choose_window(load_trace(args.trace), config, slos, args.tuning_window_s, args.holdout_window_s)
    say(f"window: {len(window)} requests over {window.duration_s():.0f} s, {recorded_rate(window):.3g} req/s recorded")
    work = contextlib.nullcontext(str(args.keep)) if args.keep else tempfile.TemporaryDirectory(
        prefix="capacity-fidelity-")
    with work as scratch:
        Path(scratch).mkdir(parents=True, exist_ok=True)
        plan = Plan(config=config, window=window, slos=slos, ladder=LadderSettings.for_accelerator("cpu"),
                    rate_rps=args.rate, runs=args.runs, requests=args.requests, arrivals=args.arrivals,
                    work=Path(scratch), together_pairs=args.together, max_run_s=args.max_run_s)
        server = start_server(plan)
        try:
            measured = asyncio.run(measure(plan, server))
        finally:
            server.stop()
    write_results(recorder, args, plan, measured)
    return 0


def write_results(recorder: Recorder, args: argparse.Namespace, plan: Plan, measured: Measured) -> None:
    comparison = {**compare(measured.runs), "ttft_p95_over_server": against_server(measured.runs)}
    together = compare(measured.runs, "together") if plan.together_pairs else None
    capacity = measured.capacity
    results = {
        "rate_rps": measured.rate_rps, "speedup": measured.speedup,
        "rate_source": "--rate" if capacity is None else "one ladder on this server",
        "capacity": None if capacity is None else {
            "capacity_rps": capacity.capacity_rps, "first_fail_rps": capacity.first_fail_rps,
            "bracketed": capacity.bracketed, "steps": len(capacity.steps), "describe": capacity.describe()},
        "window": {"requests": len(plan.window), "duration_s": plan.window.duration_s(),
                   "recorded_rps": recorded_rate(plan.window)},
        "sent": {"requests": len(measured.trace), "duration_s": measured.trace.duration_s(),
                 "input_tokens": int(measured.trace.input_lengths.sum()),
                 "output_tokens": int(measured.trace.output_lengths.sum())},
        "runs": [r.model_dump() for r in measured.runs],
        "comparison": comparison,
        "comparison_together": together,
        "engine_start_s": round(measured.ready_s, 1),
    }
    settings = {"trace": str(Path(args.trace).resolve().relative_to(ROOT)) if Path(args.trace).resolve().is_relative_to(ROOT) else args.trace,
                "config": args.config or "embedded model, vLLM's defaults (ServerConfig.default())",
                "engine": plan.config.engine, "slos": [s.spec() for s in plan.slos],
                "ladder": plan.ladder.model_dump(), "runs": plan.runs, "requests": plan.requests,
                "max_run_s": plan.max_run_s, "together_pairs": plan.together_pairs,
                "arrivals": plan.arrivals, "tolerance": TOLERANCE,
                "vllm_bench_command": measured.commands.get("vllm", "")}
    capacity_line = (f"Rate: {measured.rate_rps:.3g} req/s from --rate" if capacity is None else
                     f"Rate: the ladder's capacity on this server, {capacity.describe()} "
                     f"({len(capacity.steps)} steps, first fail {fmt(capacity.first_fail_rps)} req/s)")
    notes = reading(measured.runs, comparison, together) + [
        capacity_line + f"; x{measured.speedup:.3g} the window's recorded {recorded_rate(plan.window):.3g} req/s.",
        f"Sent per run: {len(measured.trace)} requests over {measured.trace.duration_s():.1f} s ({plan.arrivals} "
        f"arrivals), {int(measured.trace.input_lengths.sum())} input and {int(measured.trace.output_lengths.sum())} "
        "output tokens; both clients the same requests and lengths.",
        "Runs alternate ours, vllm, ours, vllm ...; the server is idle before each (ServerSettler). Both clients run "
        "on this machine's 2 CPUs beside the server (and other engineers' work: load averages above).",
        f"Then {plan.together_pairs} pair(s) of runs with both clients at once (`together`): vLLM sends the odd "
        "positions and ours the even ones, each at its time in the same schedule (each client half the rate, the "
        "server the whole), then the halves swap; each client's p95 is over every request once, measured under "
        "the same server state as the other's. The server's counters cover both clients there: not shown per client.",
        f"`vllm bench serve` command (per run, the dataset and result paths change): `{measured.commands.get('vllm', '')}`.",
        "Definitions: TTFT from the client's send to the first streamed chunk with a token (ours) / with a "
        "choice (vLLM); TPOT per request (E2E - TTFT) / (output tokens - 1), E2E ending at `[DONE]` (ours) / "
        "at the last chunk with a choice (vLLM); p95 numpy linear over completed requests, in both.",
        "Server columns: vLLM's own /metrics over each run (counters diffed; TTFT and ITL p95 from its "
        "bucketed histograms, interpolated as Prometheus does: coarse, but the same server-side ruler "
        "for both clients' runs).",
        "Send lag p99: ours from its own records (send time against the schedule); vLLM from its detailed "
        "result, each send against the file's timestamps measured from its first send (poisson runs: its own "
        "schedule, not known here).",
    ]
    tables = ["## At the capacity, one client at a time: medians over runs", ""] + summary_table(comparison)
    if together is not None:
        tables += ["", "## At the capacity, both clients at once (halves swapped): medians over pairs", ""] + \
            summary_table({**together, "ttft_p95_over_server": {"ours": None, "vllm": None}})[:-2]
    tables += ["", "## Per run (in the order run)", ""] + runs_table(measured.runs)
    recorder.write(recorder.result(settings=settings, goals=goals(comparison, together), results=results,
                                   notes=notes), "\n".join(tables))


if __name__ == "__main__":
    raise SystemExit(main())
