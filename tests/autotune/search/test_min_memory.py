"""The min-memory objective's parts: the gate rule, the KV cache read from a real vLLM start
log, the score and feasibility of one step at H, the single-step ladder, the memory grid."""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pytest

from autotune.errors import AutotuneError
from autotune.measure.kv_cache import KVCacheSize, parse_kv_cache, read_kv_cache
from autotune.measure.ladder import CapacityResult, LadderSettings
from autotune.measure.trial import TrialOutcome
from autotune.search.gate import BASELINE, Measurement, decide_min_memory
from autotune.search.objective import evaluate, invalid_config_evaluation, parse_objective
from autotune.search.space import SearchSpace
from tests.factories import ladder_step, trial_outcome
from workloads.slo import parse_slos

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SLOS = parse_slos(["ttft_p95_ms=500", "tpot_p95_ms=50"])


def runs(name: str, memory: float, met: list[bool], *, ok: bool = True) -> list[Measurement]:
    return [Measurement(candidate=name, repeat=i, value=memory, slo_met=m, ok=ok) for i, m in enumerate(met)]


# -- the gate ------------------------------------------------------------------------------


def test_the_least_memory_that_met_every_slo_in_every_repeat_wins() -> None:
    measured = (runs(BASELINE, 0.3, [True, True]) + runs("trial-0002", 0.15, [True, True])
                + runs("trial-0005", 0.1, [True, False]) + runs("trial-0007", 0.2, [True, True]))
    decision = decide_min_memory(measured, headroom=1.5)
    assert decision.winner == "trial-0002" and not decision.keep_baseline
    assert decision.baseline_median == 0.3 and decision.candidate_median == 0.15
    assert decision.effect == pytest.approx(-0.5)
    assert "0.15 vs the baseline's 0.3" in decision.reason and "1.5x" in decision.reason
    # The cheaper config that missed once is not eligible, and the table says why.
    why = {s.candidate: s.why_not for s in decision.stats}
    assert why["trial-0005"] == "missed an SLO in repeat 2"


def test_a_candidate_needing_no_less_memory_than_the_baseline_keeps_it() -> None:
    decision = decide_min_memory(runs(BASELINE, 0.3, [True]) + runs("trial-0001", 0.3, [True]), headroom=2)
    assert decision.keep_baseline and decision.winner == BASELINE
    assert "no less than the baseline's 0.3" in decision.reason


def test_a_baseline_missing_the_slo_at_the_headroom_loses_to_any_feasible_config_and_is_named() -> None:
    measured = runs(BASELINE, 0.3, [True, False]) + runs("trial-0003", 0.35, [True, True])
    decision = decide_min_memory(measured, headroom=1.5)
    assert decision.winner == "trial-0003"
    assert "the baseline (0.3) missed an SLO in repeat 2 at 1.5x" in decision.reason


def test_nothing_eligible_keeps_the_baseline_and_says_when_it_missed_too() -> None:
    measured = runs(BASELINE, 0.3, [False]) + runs("trial-0001", 0.1, [False]) + runs("trial-0002", 0.05, [True], ok=False)
    decision = decide_min_memory(measured, headroom=1.5)
    assert decision.keep_baseline
    assert decision.reason.startswith("no candidate met every SLO at 1.5x the recorded rate in every repeat")
    assert "the baseline (0.3) missed an SLO" in decision.reason


# -- the KV cache in vLLM's start log --------------------------------------------------------


def test_the_kv_cache_is_read_from_a_real_cpu_and_a_real_h100_start_log() -> None:
    # Real server.log excerpts: this repo's CPU engine (vLLM 0.32, gpu_memory_utilization 0.1)
    # and results/h100-2026-11-23c (vLLM 0.24 on an H100).
    assert read_kv_cache(FIXTURES / "server_log_cpu_vllm032.log") == KVCacheSize(gib=0.23, tokens=120_960)
    assert read_kv_cache(FIXTURES / "server_log_h100_vllm024.log") == KVCacheSize(gib=56.74, tokens=464_816)
    assert KVCacheSize(gib=0.23, tokens=120_960).describe() == "0.23 GiB, 120,960 tokens"


def test_a_log_without_kv_cache_lines_or_no_log_gives_none(tmp_path: Path) -> None:
    assert parse_kv_cache("INFO: Application startup complete.\n") is None
    assert read_kv_cache(tmp_path / "missing.log") is None
    # Only the tokens line (another backend): the GiB stays unknown.
    assert parse_kv_cache("XPU KV cache size: 1,024 tokens, Maximum") == KVCacheSize(tokens=1024)


# -- the objective ---------------------------------------------------------------------------


def test_min_memory_is_minimised_and_its_name_records_the_headroom() -> None:
    objective = parse_objective("min-memory", SLOS, headroom=1.5)
    assert objective.directions == ["minimize"] and objective.minimize
    assert objective.spec() == "min-memory:1.5x"
    assert parse_objective(objective.spec(), SLOS) == objective  # a stored study's name reads back
    assert parse_objective("min-memory:2x", SLOS, headroom=1.5).headroom == 2
    assert sorted([0.3, 0.1, 0.2], key=objective.rank_key) == [0.1, 0.2, 0.3]


@pytest.mark.parametrize("text, headroom, needle", [
    ("min-memory", 0.0, "--headroom 0: must be above 0"),
    ("min-memory", -1.0, "--headroom -1: must be above 0"),
    ("min-memory:abc", 1.5, "expected e.g. min-memory:1.5x"),
])
def test_a_bad_headroom_is_one_line(text: str, headroom: float, needle: str) -> None:
    with pytest.raises(AutotuneError, match=needle):
        parse_objective(text, SLOS, headroom=headroom)


def test_min_memory_needs_an_slo() -> None:
    with pytest.raises(AutotuneError, match="needs at least one --slo"):
        parse_objective("min-memory", [], headroom=1.5)


def step_outcome(tmp_path: Path, *, passed: bool, ttft: float, ok: bool = True) -> TrialOutcome:
    step = ladder_step(speedup=1.5, offered_rps=6.0, requests=60, passed=passed,
                       measured_ms={"ttft_p95_ms=500": ttft, "tpot_p95_ms=50": 20.0}, seconds=10.0)
    capacity = CapacityResult(capacity_rps=6.0 if passed else 0.0, capacity_speedup=1.5 if passed else None,
                              recorded_rps=4.0, first_fail_rps=None, bracketed=False, steps=[step])
    return trial_outcome(tmp_path, ok=ok, capacity=capacity,
                         kv_cache=KVCacheSize(gib=0.23, tokens=120_960))


def test_a_step_that_met_every_slo_scores_its_memory_and_one_that_missed_is_infeasible(tmp_path: Path) -> None:
    objective = parse_objective("min-memory", SLOS, headroom=1.5)
    met = evaluate(step_outcome(tmp_path, passed=True, ttft=300), objective, SLOS, memory=0.15)
    assert met.values == [0.15] and met.score == 0.15 and met.slo_met and met.feasible
    assert (met.kv_cache_gib, met.kv_cache_tokens) == (0.23, 120_960)
    missed = evaluate(step_outcome(tmp_path, passed=False, ttft=750), objective, SLOS, memory=0.1)
    assert missed.values == [math.inf] and not missed.slo_met and not missed.feasible
    assert missed.constraints["slo:ttft_p95_ms=500"] == pytest.approx(0.5)  # how far: TPE ranks it
    # A step abandoned with its percentiles still under the thresholds is infeasible all the same.
    abandoned = evaluate(step_outcome(tmp_path, passed=False, ttft=100), objective, SLOS, memory=0.1)
    assert not abandoned.feasible and abandoned.constraints["step"] == 1.0
    broken = invalid_config_evaluation(objective, SLOS, "breaks a relation")
    assert broken.values == [math.inf] and not broken.feasible


def test_optuna_ranks_the_least_feasible_memory_best(tmp_path: Path) -> None:
    """What the study stores: +inf for an infeasible trial, the memory otherwise."""
    objective = parse_objective("min-memory", SLOS, headroom=1.5)
    study = optuna.create_study(directions=objective.directions)
    for memory, passed in ((0.3, True), (0.05, False), (0.15, True)):
        evaluation = evaluate(step_outcome(tmp_path, passed=passed, ttft=300 if passed else 900),
                              objective, SLOS, memory=memory)
        study.add_trial(optuna.trial.create_trial(values=evaluation.values, params={}, distributions={}))
    assert study.best_trial.values == [0.15]


# -- the single-step ladder and the memory grid ----------------------------------------------


def test_single_step_settings_start_at_the_headroom_and_ignore_a_capacity_hint() -> None:
    settings = LadderSettings.for_accelerator("cpu").single(1.5)
    assert (settings.single_step, settings.start_speedup, settings.max_steps) == (True, 1.5, 1)
    assert settings.hinted(7.0) == settings
    assert settings.step_requests == 60  # the accelerator's step size is kept


def test_the_min_memory_space_widens_memory_and_proposes_clean_values() -> None:
    cpu = SearchSpace.default("cpu", wide_memory=True).params["gpu_memory_utilization"]
    gpu = SearchSpace.default("gpu", wide_memory=True).params["gpu_memory_utilization"]
    assert (cpu.low, cpu.high, gpu.low, gpu.high) == (0.05, 0.35, 0.05, 0.95)
    space = SearchSpace({"gpu_memory_utilization": gpu})
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen = set()
    for _ in range(40):
        trial = study.ask()
        seen.add(space.suggest(trial)["gpu_memory_utilization"])
        study.tell(trial, 0.0)
    assert seen <= {round(0.05 * k, 2) for k in range(1, 20)}
    assert all(len(repr(value)) <= 4 for value in seen)  # 0.15, never 0.15000000000000002


# -- the report's first line -----------------------------------------------------------------

FIGURES = {"headroom": 1.5, "measured_on": "held-out window, every repeat of the gate", "recorded_rps": 4.0,
           "target_rps": 6.0, "baseline_gpu_memory_utilization": 0.3, "baseline_meets_slos": True,
           "baseline_kv_cache_gib": 0.69, "baseline_kv_cache_tokens": 362_880}


def test_the_memory_line_names_the_winner_the_kept_baseline_or_a_baseline_that_misses() -> None:
    from autotune.decide.report import memory_line

    won = {**FIGURES, "winner_gpu_memory_utilization": 0.15, "winner_kv_cache_gib": 1.2,
           "winner_kv_cache_tokens": 9_800}
    assert memory_line(won, False).startswith(
        "**Memory: the exported config meets every SLO at 1.5x your recorded traffic with "
        "gpu_memory_utilization 0.15 (KV cache 1.2 GiB, 9,800 tokens) vs the baseline's 0.3**")
    missed = {**won, "baseline_meets_slos": False}
    assert "vs the baseline's 0.3, which misses an SLO there**" in memory_line(missed, False)
    assert memory_line(FIGURES, True).startswith(
        "**Memory: the baseline meets every SLO at 1.5x your recorded traffic with "
        "gpu_memory_utilization 0.3 (KV cache 0.69 GiB, 362,880 tokens); no config with less memory")
    assert memory_line({**FIGURES, "baseline_meets_slos": False}, True).startswith(
        "**Memory: the baseline, gpu_memory_utilization 0.3 (KV cache 0.69 GiB, 362,880 tokens), misses an "
        "SLO at 1.5x your recorded traffic, and no searched config met them all in every repeat**")
