"""The search's first phase: which one-knob moves the baseline's ladder points to."""

from __future__ import annotations

from autotune.first_moves import first_moves, limiting_slo
from autotune.ladder import CapacityResult, LadderStep
from autotune.scraper import ServerMetrics
from autotune.space import ParamSpec, SearchSpace
from workloads.replay import ReplaySummary
from workloads.slo import parse_slo

SLOS = [parse_slo("ttft_p95_ms=500"), parse_slo("tpot_p95_ms=50")]
SPACE = SearchSpace({
    "max_num_seqs": ParamSpec(type="int", low=8, high=1024, log=True),
    "max_num_batched_tokens": ParamSpec(type="pow2", low=1024, high=16384),
    "gpu_memory_utilization": ParamSpec(type="float", low=0.3, high=0.92),
}, [])
DEFAULTS = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.9}


def step(speedup: float, passed: bool, ttft: float, tpot: float, *, waiting: float = 0,
         running: float = 10) -> LadderStep:
    summary = ReplaySummary(duration=1, completed=100, failed=0, total_input_tokens=1,
                            total_output_tokens=1, request_throughput=1, output_throughput=1,
                            total_token_throughput=1)
    return LadderStep(index=0, speedup=speedup, offered_rps=speedup, requests=100, passed=passed,
                      reason="", measured_ms={"ttft_p95_ms=500": ttft, "tpot_p95_ms=50": tpot},
                      summary=summary, seconds=1,
                      server=ServerMetrics(num_waiting_max=waiting, num_running_max=running))


def capacity(*steps: LadderStep) -> CapacityResult:
    return CapacityResult(capacity_rps=1, capacity_speedup=1, recorded_rps=1, first_fail_rps=2,
                          bracketed=True, steps=list(steps))


def test_decode_stalls_shrink_the_prefill_budget_first() -> None:
    """The H100 long-prompt probe: TPOT broke first at 8192 batched tokens; 2048 carried 1.67x.
    The first move the tuner makes is exactly that quarter of the budget."""
    measured = capacity(step(1, True, 200, 40), step(2, False, 450, 76))
    assert limiting_slo(measured, SLOS) == "tpot"
    moves = first_moves(measured, SLOS, SPACE, DEFAULTS)
    assert [m.values["max_num_batched_tokens"] for m in moves[:2]] == [2048, 4096]
    assert moves[2].values["max_num_seqs"] == 512
    for move in moves:  # one knob at a time, the rest as the baseline
        changed = {k for k, v in move.values.items() if v != DEFAULTS[k]}
        assert len(changed) == 1


def test_a_queue_behind_a_full_batch_asks_for_more_sequences() -> None:
    small = {**DEFAULTS, "max_num_seqs": 16}
    measured = capacity(step(1, True, 300, 20, waiting=40, running=16), step(2, False, 2000, 22))
    moves = first_moves(measured, SLOS, SPACE, small)
    assert [m.values["max_num_seqs"] for m in moves[:2]] == [32, 64]


def test_moves_stay_inside_the_space_and_are_never_the_baseline() -> None:
    at_floor = {**DEFAULTS, "max_num_batched_tokens": 1024}
    measured = capacity(step(1, True, 200, 40), step(2, False, 300, 90))
    moves = first_moves(measured, SLOS, SPACE, at_floor)
    assert all(m.values != at_floor for m in moves)
    assert all(1024 <= m.values["max_num_batched_tokens"] <= 16384 for m in moves)
    assert first_moves(None, SLOS, SPACE, DEFAULTS) == []
