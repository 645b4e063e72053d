"""The capacity ladder against AsyncLLM in this process: no HTTP, no server, no other process
between the load and the engine. The reference column of `benchmarks/frontend_capacity.py`.

    python benchmarks/inprocess_ladder.py --config C.yaml --window W.jsonl \
        --ladder L.json --slo ttft_p95_ms=500 --slo tpot_p95_ms=50 --out result.json

What is the same as a trial's ladder (`autotune.measure.ladder.LoadLadder`, unchanged): the
steps, their speed-ups, the early verdicts, the drain between steps and the SLO arithmetic.
What differs is the transport, and only that:

- requests go to `AsyncLLM.generate` (through the server's own `server.engine.Engine`, so
  the engine is built exactly as our server builds it) on the replayer's schedule, in the
  same event loop as AsyncLLM's output handler;
- the replayer's timing loop is `workloads.replay.ReplayRun` itself: `InProcessRun` only
  replaces how one request is sent and read (a delta of tokens instead of an SSE chunk);
- /metrics is this process's Prometheus registry, where vLLM's stat logger records.

The engine runs in this script's own process (started by the benchmark as a child), so it
goes away with it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

from autotune.measure.ladder import CapacityResult, LadderSettings, LoadLadder
from autotune.measure.scraper import MetricsSnapshot, parse_metrics, parse_scalars
from server.config import ServerConfig
from server.engine import Engine, Generation
from workloads.errors import OneLineErrorParser
from workloads.files import write_text_atomic
from workloads.prompts import PromptFactory
from workloads.replay import ProgressCallback, ReplayOptions, ReplayRun, _Stream
from workloads.replay_summary import ReplayResult
from workloads.slo import SLO, parse_slos
from workloads.trace import Trace
from workloads.trace_io import load_trace


class InProcessRun(ReplayRun):
    """A replay whose requests go straight to the engine: same schedule, tally, early stop
    and records as over HTTP; TTFT and token gaps read from the engine's deltas."""

    def __init__(
        self,
        engine: Engine,
        trace: Trace,
        options: ReplayOptions,
        *,
        on_progress: ProgressCallback | None = None,
    ) -> None:
        # No HTTP session: send() is replaced.
        super().__init__(trace, None, "in-process", options, on_progress=on_progress)  # type: ignore[arg-type]
        self.engine = engine

    def body(self, i: int) -> tuple[list[int], int]:  # type: ignore[override]
        trace = self.trace
        hash_ids = None if trace.hash_ids is None else trace.hash_ids[i]
        prompt = self.options.prompts.prompt(self.index_of(i), int(trace.input_lengths[i]), hash_ids)
        return prompt, int(trace.output_lengths[i])

    async def send(self, i: int, scheduled_s: float, body: tuple[list[int], int]) -> None:  # type: ignore[override]
        prompt, output_len = body
        # What the replayer asks of a server in benchmark mode: exactly output_len tokens.
        generation = Generation(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                                min_tokens=output_len)
        sent = time.monotonic()
        stream = _Stream()
        self.open[i] = (sent, stream)
        error: str | None = None
        try:
            async with asyncio.timeout(self.options.timeout_s):
                async for delta in self.engine.generate(
                    prompt, generation, f"bench-{uuid.uuid4().hex}", stream=True
                ):
                    stream.add_chunk(time.monotonic(), {"choices": [{"token_ids": delta.token_ids}]})
            stream.done = True
            stream.end_s = time.monotonic()
            stream.usage_prompt_tokens = len(prompt)
        except asyncio.CancelledError:
            self._record(i, scheduled_s, sent, stream, None, "cancelled: replay stopped", True)
            raise
        except TimeoutError:
            error = f"timeout: no complete answer within {self.options.timeout_s:g} s"
        except Exception as exc:  # the engine failed this request: a measurement, not a crash
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if error is None and stream.first_token_s is None:
            error = "the engine returned no token"
        self._record(i, scheduled_s, sent, stream, 200 if error is None else None, error, False)


def engine_replay(engine: Engine):
    """A `LoadLadder.replay_fn` (`autotune.measure.ladder.ReplayFunction`) that sends each
    step to `engine` in this process."""

    async def replay_fn(
        trace: Trace,
        _url: str,
        options: ReplayOptions,
        *,
        on_progress: ProgressCallback | None = None,
    ) -> ReplayResult:
        assert options.mode.kind == "timed" and options.benchmark_mode, \
            "the ladder replays timed, benchmark mode"
        return await InProcessRun(engine, trace, options, on_progress=on_progress).run()

    return replay_fn


class RegistryScraper:
    """`MetricsScraper` for this process: vLLM's stat logger records into prometheus_client's
    default registry, which is what our server's /metrics exposes too."""

    async def scrape(self, only: Iterable[str] | None = None) -> MetricsSnapshot:
        from prometheus_client import REGISTRY, generate_latest

        text = generate_latest(REGISTRY).decode()
        return parse_scalars(text, only) if only is not None else parse_metrics(text)


async def run_ladder(engine: Engine, window: Trace, settings: LadderSettings,
                     slos: Sequence[SLO]) -> CapacityResult:
    ladder = LoadLadder(settings, url="in-process", replay=ReplayOptions(slos=slos),
                        scraper=RegistryScraper(),  # type: ignore[arg-type]
                        say=lambda line: print(line, flush=True), replay_fn=engine_replay(engine))
    return await ladder.run(window)


async def warm_up(engine: Engine, requests: int = 4) -> None:
    """A few requests before the first step, as a trial warms its server up."""
    factory = PromptFactory(seed=0)
    generation = Generation(max_tokens=8, temperature=0.0, ignore_eos=True, min_tokens=8)

    async def one(k: int) -> None:
        async for _ in engine.generate(factory.prompt(k, 32), generation, f"warmup-{k}", stream=True):
            pass

    await asyncio.gather(*(one(k) for k in range(requests)))


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="our server's YAML (its engine settings)")
    parser.add_argument("--window", required=True, help="the ladder's window (trace JSONL)")
    parser.add_argument("--ladder", required=True, help="LadderSettings as JSON")
    parser.add_argument("--slo", action="append", required=True)
    parser.add_argument("--out", required=True, help="where the CapacityResult JSON goes")
    args = parser.parse_args(argv)
    config = ServerConfig.load(args.config)
    window = load_trace(args.window)
    settings = LadderSettings.model_validate_json(Path(args.ladder).read_text())
    slos = parse_slos(args.slo)

    started = time.monotonic()
    engine = Engine.start(config)
    ready_s = time.monotonic() - started

    async def measure() -> CapacityResult:
        await engine.finish_start()
        await warm_up(engine)
        return await run_ladder(engine, window, settings, slos)

    try:
        started = time.monotonic()
        capacity = asyncio.run(measure())
        ladder_s = time.monotonic() - started
    finally:
        engine.shutdown()
    write_text_atomic(Path(args.out), json.dumps({
        "capacity": capacity.model_dump(mode="json"), "ready_s": ready_s, "ladder_s": ladder_s,
    }) + "\n")
    print(capacity.describe(), flush=True)
    return 0


if __name__ == "__main__":  # vLLM may spawn processes that import this module: guard main
    raise SystemExit(main())
