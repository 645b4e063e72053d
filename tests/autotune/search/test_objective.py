"""Scoring a run: goodput, SLO constraints, failures, the Pareto pair."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from autotune.errors import AutotuneError
from autotune.measure.trial import TrialOutcome
from autotune.search.objective import evaluate, parse_objective
from tests.factories import replay_summary, trial_outcome
from workloads.slo import parse_slos

SLOS = parse_slos(["ttft_p95_ms=500", "tpot_p95_ms=50"])


def outcome(tmp_path: Path, *, ttft_p95: float, goodput: float = 3.0, ok: bool = True) -> TrialOutcome:
    # throughput 4 req/s: the value of the throughput and pareto objectives
    summary = replay_summary(completed=40, request_throughput=4.0, request_goodput=goodput,
                             p95_ttft_ms=ttft_p95, p95_tpot_ms=20.0)
    if not ok:
        return trial_outcome(tmp_path, failure="oom", failure_detail="KV cache too small")
    return trial_outcome(tmp_path, summary=summary)


def test_goodput_is_the_value_and_slos_are_relative_constraints(tmp_path: Path) -> None:
    result = evaluate(outcome(tmp_path, ttft_p95=750.0), parse_objective("goodput", SLOS), SLOS)
    assert result.values == [3.0]
    assert result.constraints["slo:ttft_p95_ms=500"] == pytest.approx(0.5)  # 50% over
    assert result.constraints["slo:tpot_p95_ms=50"] == pytest.approx(-0.6)
    assert result.margins_ms["ttft_p95_ms=500"] == pytest.approx(250.0)
    assert not result.slo_met and not result.feasible


def test_met_slos_make_a_feasible_trial(tmp_path: Path) -> None:
    result = evaluate(outcome(tmp_path, ttft_p95=400.0), parse_objective("throughput", SLOS), SLOS)
    assert result.values == [4.0] and result.slo_met and result.feasible


def test_failed_run_scores_zero_and_is_infeasible(tmp_path: Path) -> None:
    result = evaluate(outcome(tmp_path, ttft_p95=0, ok=False), parse_objective("goodput", SLOS), SLOS)
    assert result.values == [0.0] and result.constraints["ran"] == 1.0
    assert result.failure == "oom"


def test_percentile_missing_from_the_summary_comes_from_requests(tmp_path: Path) -> None:
    lines = [{"ttft_ms": float(v), "e2e_ms": v + 100.0, "itl_ms": [], "output_tokens": 1, "error": None}
             for v in range(1, 101)]
    (tmp_path / "requests.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    slos = parse_slos(["ttft_p75_ms=60"])
    result = evaluate(outcome(tmp_path, ttft_p95=95.0), parse_objective("goodput", slos), slos)
    assert result.measured_ms["ttft_p75_ms=60"] == pytest.approx(75.25)
    assert not result.slo_met


def test_pareto_pairs_throughput_with_a_latency(tmp_path: Path) -> None:
    objective = parse_objective("pareto", SLOS)
    assert objective.directions == ["maximize", "minimize"]
    assert objective.latency_name() == "ttft_p95_ms"
    assert evaluate(outcome(tmp_path, ttft_p95=300.0), objective, SLOS).values == [4.0, 300.0]
    failed = evaluate(outcome(tmp_path, ttft_p95=0, ok=False), objective, SLOS)
    assert failed.values[0] == 0.0 and math.isinf(failed.values[1])


def test_unknown_objective_is_a_user_error() -> None:
    with pytest.raises(AutotuneError, match="--objective 'latency'"):
        parse_objective("latency", SLOS)
