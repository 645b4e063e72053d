"""The in-process column of benchmarks/frontend_capacity.py: the ladder sends its steps to an
engine object in the same process. A stand-in engine (the `Engine.generate` contract: deltas
of token ids) shows what the records and the ladder make of it; no vLLM runs here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from autotune.measure.ladder import LadderSettings, LoadLadder
from autotune.measure.scraper import MetricsSnapshot
from benchmarks import inprocess_ladder as bench
from server.engine import Delta, Generation
from workloads.prompts import PromptFactory
from workloads.replay import ReplayOptions
from workloads.slo import parse_slo
from workloads.trace import Trace, TraceRequest


class StandInEngine:
    """Answers one token per `token_s`, up to `slots` requests at once (others queue): the
    more requests a step sends per second, the longer they wait for their first token."""

    def __init__(self, token_s: float = 0.002, slots: int = 4, fail_every: int = 0) -> None:
        self.token_s = token_s
        self.slots = asyncio.Semaphore(slots)
        self.fail_every = fail_every
        self.calls = 0
        self.running = 0
        self.prompt_lengths: list[int] = []

    async def generate(self, prompt: list[int], generation: Generation, request_id: str, *,
                       stream: bool) -> AsyncIterator[Delta]:
        self.calls += 1
        self.prompt_lengths.append(len(prompt))
        assert stream and generation.ignore_eos and generation.min_tokens == generation.max_tokens
        if self.fail_every and self.calls % self.fail_every == 0:
            raise RuntimeError("engine refused the request\nsecond line")
        async with self.slots:
            self.running += 1
            try:
                for k in range(generation.max_tokens):
                    await asyncio.sleep(self.token_s)
                    yield Delta(text="", token_ids=[k], prompt_tokens=len(prompt),
                                finish_reason="length" if k == generation.max_tokens - 1 else None)
            finally:
                self.running -= 1


class IdleScraper:
    """The engine's /metrics as the ladder reads them: nothing running between steps."""

    def __init__(self, engine: StandInEngine) -> None:
        self.engine = engine

    async def scrape(self, only: object = None) -> MetricsSnapshot:
        return MetricsSnapshot(scalars={"vllm:num_requests_running": float(self.engine.running),
                                        "vllm:num_requests_waiting": 0.0}, taken_at=0.0)


def window(n: int, spacing_ms: float, output_length: int = 5) -> Trace:
    return Trace.from_requests(
        [TraceRequest(timestamp=i * spacing_ms, input_length=12 + i % 3, output_length=output_length)
         for i in range(n)],
        source="test window",
    )


def test_records_carry_the_engine_s_tokens_and_timings() -> None:
    engine = StandInEngine()
    trace = window(12, 5.0, output_length=6)
    run = bench.InProcessRun(engine, trace, ReplayOptions(slos=[parse_slo("ttft_p95_ms=5000")],
                                                          timeout_s=30, prompts=PromptFactory(seed=1)))
    result = asyncio.run(run.run())
    assert [r.index for r in result.records] == list(range(12))
    assert engine.prompt_lengths and sorted(engine.prompt_lengths) == sorted(12 + i % 3 for i in range(12))
    for record in result.records:
        assert record.error is None and not record.cancelled
        assert record.output_tokens == 6 and len(record.itl_ms) == 5
        assert record.ttft_ms is not None and record.e2e_ms is not None and record.e2e_ms >= record.ttft_ms
        assert record.input_tokens == 12 + record.index % 3
    assert result.summary.completed == 12 and result.summary.failed == 0


def test_an_engine_error_is_a_failed_request_not_a_crash() -> None:
    engine = StandInEngine(fail_every=3)
    run = bench.InProcessRun(engine, window(9, 5.0), ReplayOptions(timeout_s=30, prompts=PromptFactory(seed=1)))
    result = asyncio.run(run.run())
    failed = [r for r in result.records if r.error is not None]
    assert len(failed) == 3 and result.summary.completed == 6
    assert all(r.error == "RuntimeError: engine refused the request" for r in failed)


@pytest.mark.slow
def test_a_stop_from_the_ladder_cancels_what_is_in_flight() -> None:
    engine = StandInEngine(token_s=0.05)  # 40 tokens: 2 s per request
    stops: list[float] = []

    def stop_at_once(elapsed: float, _summary: object) -> bool:
        stops.append(elapsed)
        return True

    run = bench.InProcessRun(engine, window(8, 1.0, output_length=40),
                             ReplayOptions(timeout_s=30, prompts=PromptFactory(seed=1)),
                             on_progress=stop_at_once)
    result = asyncio.run(run.run())
    assert stops and result.summary.stopped_early
    assert result.summary.cancelled >= 1 and engine.running == 0


@pytest.mark.slow
def test_the_ladder_finds_a_capacity_in_process() -> None:
    """The trial's own ladder on the stand-in: slow steps fail on TTFT, light ones pass, and
    the capacity lies between them, bracketed."""
    # One slot, 8 tokens of 25 ms: 5 req/s at most, whatever the machine's load adds. At x1
    # (20 req/s) the queue grows by ~15 requests a second, far past the SLO; at x1/8 (2.5 req/s)
    # it never forms. Scheduling delays of a busy CI machine (tens of ms) are small beside both.
    engine = StandInEngine(token_s=0.025, slots=1)
    settings = LadderSettings(step_requests=10, min_step_s=1.0, start_speedup=1.0, growth=2.0,
                              resolution=0.5, max_steps=8, drain_timeout_s=30)
    slos = [parse_slo("ttft_p95_ms=1000")]
    ladder = LoadLadder(settings, url="in-process", replay=ReplayOptions(slos=slos),
                        scraper=IdleScraper(engine),  # type: ignore[arg-type]
                        say=lambda _line: None, replay_fn=bench.engine_replay(engine))
    result = asyncio.run(ladder.run(window(40, 50.0, output_length=8)))  # 20 req/s recorded
    assert any(s.passed for s in result.steps) and any(not s.passed for s in result.steps)
    assert result.capacity_rps > 0 and result.bracketed
    assert result.first_fail_rps is not None and result.first_fail_rps > result.capacity_rps
