"""`--gpu-seconds`: the search stops starting trials once their engines have held that many
accelerator-seconds (wall time x the GPUs a trial's config uses), like `--time-budget`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from autotune import prepare
from autotune.cli import main
from autotune.errors import AutotuneError
from autotune.request import DEFAULT_TRIALS
from autotune.search.objective import default_slos, parse_objective
from autotune.search.space import SearchSpace
from autotune.search.study import SearchInputs, StudyOptions, TuningStudy
from autotune.search.trial_records import engine_devices
from server.config import ServerConfig
from tests.factories import replay_summary, trial_outcome, trial_timing
from workloads.trace import Trace, TraceRequest

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = str(ROOT / "workloads" / "samples" / "translation_trace.jsonl")
EFFECTIVE = {"max_num_seqs": 128, "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.3,
             "max_model_len": 2048, "enable_chunked_prefill": True}
TRIAL_S = 10.0  # every fake trial holds its engine this long (virtual clock)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedRunner:
    """Every trial takes TRIAL_S on the study's clock and meets the SLOs."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.launches = 0

    def run(self, config, window, trial_dir, *, should_prune=None):
        self.launches += 1
        self.clock.now += TRIAL_S
        Path(trial_dir).mkdir(parents=True, exist_ok=True)
        summary = replay_summary(request_goodput=2.0, p95_ttft_ms=300.0, p95_tpot_ms=20.0)
        return trial_outcome(trial_dir, summary=summary, timing=trial_timing(measure_s=8.0))


def timed_study(tmp_path: Path, *, engine: dict[str, Any], n_trials: int | None = None,
                gpu_seconds: float | None = None, repeats: int = 1) -> tuple[TuningStudy, TimedRunner, list[str]]:
    """A study whose every trial takes TRIAL_S on its clock, and the lines it says."""
    clock = Clock()
    runner = TimedRunner(clock)
    lines: list[str] = []
    slos = default_slos("cpu")
    window = Trace.from_requests(
        [TraceRequest(timestamp=i * 500.0, input_length=50, output_length=20) for i in range(20)])
    study = TuningStudy(
        options=StudyOptions(study_name="budget", output_dir=tmp_path, n_trials=n_trials, top_k=1, repeats=repeats,
                             gpu_seconds=gpu_seconds, prune=False,
                             storage=optuna.storages.InMemoryStorage()),
        inputs=SearchInputs(
            space=SearchSpace.default("cpu"),
            objective=parse_objective("goodput", slos),
            slos=slos,
            baseline=ServerConfig(engine={"model": "/models/tiny", **engine}),
            baseline_source="vLLM defaults",
            tuning_window=window,
            holdout_window=window,
            effective_defaults=EFFECTIVE,
        ),
        runner=runner,
        say=lines.append,
        clock=clock,
    )
    return study, runner, lines


def searched(tmp_path: Path, gpu_seconds: float, engine: dict[str, Any]) -> tuple[int, list[str]]:
    """Launches a budget-limited search made, and what it said."""
    study, runner, lines = timed_study(tmp_path, engine=engine, gpu_seconds=gpu_seconds)
    study.run_search()
    return runner.launches, lines


@pytest.mark.slow
def test_the_search_stops_before_a_trial_that_would_overrun_the_budget(tmp_path: Path) -> None:
    # 10 s per trial: after 5 trials 50 GPU-seconds are spent; a 6th would reach 60 > 55.
    launches, lines = searched(tmp_path / "one", 55.0, {})
    assert launches == 5
    assert any("GPU-seconds budget 55 reached after 5 trials (50 spent)" in line for line in lines)


def test_a_config_on_several_gpus_spends_the_budget_as_fast(tmp_path: Path) -> None:
    # Tensor parallel 2 x pipeline parallel 2: 4 GPUs held for 10 s = 40 GPU-seconds a trial.
    launches, _ = searched(tmp_path / "four", 100.0, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    assert launches == 2
    assert engine_devices({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}) == 4
    assert engine_devices({"data_parallel_size": None}) == 1


def test_the_baseline_is_measured_whatever_the_budget(tmp_path: Path) -> None:
    launches, _ = searched(tmp_path, 1.0, {})
    assert launches == 1


@pytest.mark.parametrize("value, why", [("-5", "must be more than 0"), ("0", "must be more than 0"),
                                        ("lots", "expected a number")])
def test_a_bad_gpu_seconds_is_refused_in_one_line(value: str, why: str, tmp_path: Path, capsys) -> None:
    code = main(["run", "--workload", SAMPLE, "--gpu-seconds", value, "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith(f"autotune: error: --gpu-seconds '{value}': ") and why in err
    assert "\n" not in err
    assert not (tmp_path / "trials").exists()


def test_gpu_seconds_reaches_the_study_and_lifts_the_default_trial_count(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def prepare_plan(request):
        seen.update(gpu_seconds=request.gpu_seconds, trials=request.trials)
        raise AutotuneError("planned")  # nothing to measure here

    monkeypatch.setattr(prepare, "prepare_plan", prepare_plan)
    assert main(["run", "--workload", SAMPLE, "--gpu-seconds", "2h", "--output-dir", str(tmp_path)]) == 2
    assert seen["gpu_seconds"] == 7200 and seen["trials"] is None
    assert main(["run", "--workload", SAMPLE, "--output-dir", str(tmp_path)]) == 2
    assert seen["gpu_seconds"] is None and seen["trials"] == DEFAULT_TRIALS
    capsys.readouterr()


def test_each_gate_line_says_when_the_gate_ends_from_its_own_runs(tmp_path: Path) -> None:
    """A gate run costs what the gate's runs cost, not what a search trial did (the H200 fp8
    run's trials took 115-193 s, its gate runs 66-81 s): 2 configs x 2 repeats at TRIAL_S each."""
    study, _, lines = timed_study(tmp_path, engine={}, n_trials=2, repeats=2)
    study.validate(study.run_search())
    gate = [line for line in lines if line.startswith("gate ") and "/4  repeat" in line]
    assert [line.split("  ")[2] if "ETA" in line else None for line in gate] == [
        "ETA 30s", "ETA 20s", "ETA 10s", None]  # 3, 2, 1 runs left at 10 s each; none after the last
