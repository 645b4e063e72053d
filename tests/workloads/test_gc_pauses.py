"""Full garbage collections are kept out of timed loops: the replayer's heap is frozen for the
span of a run (and only then), a server's stays frozen once its engine is ready."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from workloads.gc_pauses import freeze_heap, heap_frozen
from workloads.replay import ReplayOptions
from workloads.replay_workers import replay_with_workers
from workloads.trace import Trace, TraceRequest


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def trace_of(n: int, spacing_ms: float) -> Trace:
    return Trace.from_requests(
        TraceRequest(timestamp=i * spacing_ms, input_length=8, output_length=4) for i in range(n)
    )


def test_a_block_freezes_what_is_alive_and_unfreezes_after() -> None:
    alive = [[k] for k in range(1000)]  # tracked containers
    with heap_frozen():
        assert gc.get_freeze_count() >= len(alive)
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_before_the_block_stays_frozen() -> None:
    freeze_heap()
    before = gc.get_freeze_count()
    with heap_frozen():
        pass
    assert gc.get_freeze_count() >= before > 0


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_replay_runs_with_the_heap_frozen_and_leaves_it_as_it_was(echo: str, workers: int) -> None:
    during: list[int] = []

    def look(_elapsed: float, _summary: object) -> bool:
        during.append(gc.get_freeze_count())
        return False

    # 2.5 s of requests: the progress callback runs at least twice inside the run.
    result = asyncio.run(replay_with_workers(trace_of(26, 100.0), echo + "/itl=1",
                                             ReplayOptions(), workers=workers, on_progress=look))
    assert result.summary.completed == 26
    assert during and all(count > 0 for count in during)
    assert gc.get_freeze_count() == 0

