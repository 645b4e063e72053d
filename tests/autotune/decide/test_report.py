"""report.md from a study run against a fake runner that writes what a real trial writes."""

from __future__ import annotations

import json
import math
from pathlib import Path

from autotune.decide.export import build_provenance
from autotune.decide.report import changed_lines, write_report
from autotune.decide.report_plots import ReportInputs
from autotune.measure.trial import TrialOutcome, TrialTiming
from autotune.search.objective import parse_objective
from autotune.search.space import SearchSpace
from autotune.search.study import SearchInputs, StudyOptions, TuningStudy
from server.config import ServerConfig
from workloads.replay_summary import ReplaySummary
from workloads.slo import parse_slos
from workloads.trace import Trace, TraceRequest

SLOS = parse_slos(["ttft_p95_ms=1000", "tpot_p95_ms=100"])


class FilesRunner:
    """Goodput peaks at 8 sequences; writes requests.jsonl and server_metrics.json."""

    def run(self, config, window, trial_dir, *, should_prune=None):
        trial_dir = Path(trial_dir)
        trial_dir.mkdir(parents=True, exist_ok=True)
        seqs = config.engine.get("max_num_seqs") or 128
        distance = abs(math.log2(seqs) - 3)
        ttft = 200 + 250 * distance
        records = [{"ttft_ms": ttft * (0.5 + i / 40), "e2e_ms": ttft + 500, "itl_ms": [10.0],
                    "output_tokens": 20, "error": None} for i in range(40)]
        (trial_dir / "requests.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
        timeline = [{"t_s": t, "kv_cache_usage": 0.1 * t / (1 + distance), "num_running": 2, "num_waiting": 0}
                    for t in range(10)]
        (trial_dir / "server_metrics.json").write_text(json.dumps({"timeline": timeline}))
        summary = ReplaySummary(
            duration=10, completed=40, failed=0, total_input_tokens=2000, total_output_tokens=800,
            request_throughput=4.0, output_throughput=80, total_token_throughput=280,
            request_goodput=4.0 - 0.6 * distance, p95_ttft_ms=ttft * 1.45, p95_tpot_ms=15.0,
        )
        timing = TrialTiming(launch_s=0.1, ready_s=30, warmup_s=1, measure_s=10, teardown_s=2)
        return TrialOutcome(ok=True, summary=summary, timing=timing, trial_dir=str(trial_dir))


def test_report_says_what_won_what_was_tried_and_what_it_cost(tmp_path: Path, large_numa_node) -> None:
    window = Trace.from_requests(
        [TraceRequest(timestamp=i * 250.0, input_length=50, output_length=20) for i in range(40)]
    )
    objective = parse_objective("goodput", SLOS)
    tuning = TuningStudy(
        options=StudyOptions(study_name="r", output_dir=tmp_path, n_trials=8, top_k=2, repeats=3),
        inputs=SearchInputs(
            space=SearchSpace.default("cpu"),
            objective=objective,
            slos=SLOS,
            baseline=ServerConfig(engine={"model": "/m", "gpu_memory_utilization": 0.1}),
            baseline_source="vLLM's defaults",
            tuning_window=window,
            holdout_window=window,
            effective_defaults={"max_num_seqs": 128, "max_num_batched_tokens": 2048,
                                "gpu_memory_utilization": 0.1, "usage_context": "OPENAI_API_SERVER"},
        ),
        runner=FilesRunner(),
        say=lambda line: None,
    )
    study = tuning.run_search()
    result = tuning.validate(study)
    provenance = build_provenance(
        decision=result.decision, winner_overrides={}, objective=objective, slos=SLOS,
        study_name="r", storage_url="sqlite:///r.db", command_line=["autotune", "run"],
        model="/m", workload={"source": "t.jsonl", "fingerprint": "f00"},
        baseline_source="vLLM's defaults", effective_defaults=tuning.inputs.effective_defaults,
        validation=[], search={},
    )
    path = write_report(tmp_path, ReportInputs(
        study=study, objective=objective, slos=SLOS, decision=result.decision,
        measurements=result.measurements, run_dirs=result.run_dirs, provenance=provenance,
        best_yaml=tmp_path / "best.yaml", search_wall_s=tuning.search_wall_s,
        gate_wall_s=result.wall_s, gate_server_s=result.server_s,
    ))
    text = path.read_text()
    assert text.count("| trial-00") >= 8  # every trial in the table
    assert "trial-0000 (baseline) | 128* |" in text  # vLLM's default, marked as not chosen
    assert "0.1 |" in text and "0.1* |" not in text  # the baseline set this one itself
    assert "max_num_seqs=128" in text and "OPENAI_API_SERVER" in text
    assert "bootstrap CI" in text and "SLO headroom" in text
    assert "accelerator time" in text
    for plot in ("history.png", "importances.png", "latency_cdf.png", "kv_cache.png"):
        assert f"]({plot})" in text and (tmp_path / plot).stat().st_size > 1000


def test_a_headroom_the_ladder_capped_is_reported_as_a_lower_bound() -> None:
    from autotune.decide.report import capacity_line

    measured = {"recorded_rps": 4.0, "baseline_rps": 16.0, "baseline_headroom": 4.0,
                "winner_rps": 32.0, "winner_headroom": 8.0}
    assert "carries 4x your recorded traffic" in capacity_line(measured, kept_baseline=True)
    capped = capacity_line({**measured, "baseline_lower_bound": True}, kept_baseline=True)
    assert "the baseline carries at least 4x your recorded traffic" in capped
    won = capacity_line({**measured, "winner_lower_bound": True}, kept_baseline=False)
    assert "the exported config carries at least 8x" in won and "the baseline carries 4x" in won


def test_changed_arguments_are_those_that_differ_from_what_the_baseline_ran_with() -> None:
    # The H200 fp8 run (results/h200-2026-12-02-fp8): the winner sets the scheduler knobs to
    # vLLM's resolved defaults and leaves kv_cache_dtype to vLLM; only the weights changed.
    ran = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.92,
           "usage_context": "OPENAI_API_SERVER"}
    winner = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.92,
              "quantization": "fp8", "kv_cache_dtype": None}
    assert changed_lines(winner, ran) == [
        "", "Changed engine arguments: `quantization=fp8` (set as the baseline ran: `max_num_seqs`, "
        "`max_num_batched_tokens`, `gpu_memory_utilization`)"]
    assert changed_lines({"max_num_seqs": 512, "api_processes": 2}, ran) == [
        "", "Changed engine arguments: `max_num_seqs=512`", "", "Changed serving settings: `api_processes=2`"]
    # Unknown resolved defaults (a CPU run that could not read them): every set value is named.
    assert changed_lines({"max_num_seqs": 1024}, {}) == ["", "Changed engine arguments: `max_num_seqs=1024`"]
