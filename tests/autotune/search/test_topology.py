"""Topology on a multi-GPU host (issue 62): what a user of a host of N GPUs notices.

The host's GPUs are counted from CUDA_VISIBLE_DEVICES or `nvidia-smi -L` (faked here through
the counting function's inputs); the built-in space searches tensor and data parallelism only
with two GPUs or more; a study launches only topologies that fit the host (never even as a
not-launched trial); a space file that cannot fit is refused in one line; a relation may be
a product against `host_gpus`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from autotune.cli import main
from autotune.decide.export import build_provenance
from autotune.decide.report import write_report
from autotune.decide.report_plots import ReportInputs
from autotune.errors import AutotuneError
from autotune.measure.gpus import count_gpus
from autotune.measure.ladder import CapacityResult
from autotune.pipeline import capacity_figures
from autotune.search.objective import parse_objective
from autotune.search.relations import BUILTIN_RELATIONS
from autotune.search.space import SearchSpace, default_params
from autotune.search.study import SearchInputs, StudyOptions, TuningStudy
from autotune.search.topology import TOPOLOGY_RELATION
from server.config import ServerConfig
from tests.factories import trial_outcome, trial_timing
from workloads.slo import parse_slos
from workloads.trace import Trace, TraceRequest

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = str(ROOT / "workloads" / "samples" / "translation_trace.jsonl")
SLOS = parse_slos(["ttft_p95_ms=1000"])
SMI = ("GPU 0: NVIDIA H200 (UUID: GPU-1)\n"
       "  MIG 3g.71gb     Device  0: (UUID: MIG-1)\n"
       "GPU 1: NVIDIA H200 (UUID: GPU-2)\n")


def smi(listing: str):
    def run(command):
        assert list(command) == ["nvidia-smi", "-L"]
        return listing
    return run


def no_smi(command):
    raise FileNotFoundError(2, "No such file or directory", "nvidia-smi")


@pytest.mark.parametrize(("environ", "run", "expected"), [
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, no_smi, 4),
    ({"CUDA_VISIBLE_DEVICES": "2"}, smi(SMI), 1),  # the variable narrows what nvidia-smi lists
    ({"CUDA_VISIBLE_DEVICES": ""}, smi(SMI), 0),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, smi(SMI), 0),
    ({}, smi(SMI), 2),  # MIG slices are listed under their GPU, not counted
    ({}, no_smi, 0),  # a CPU host
])
def test_the_host_s_gpus_are_counted_without_torch(environ: dict[str, str], run, expected: int) -> None:
    assert count_gpus(environ, run) == expected


def test_a_failing_nvidia_smi_counts_no_gpu() -> None:
    def broken(command):
        raise subprocess.CalledProcessError(9, list(command), "", "NVIDIA-SMI has failed")
    assert count_gpus({}, broken) == 0


@pytest.mark.parametrize("accelerator,gpus", [("gpu", 1), ("gpu", 0), ("cpu", 0), ("cpu", 4)])
def test_on_one_gpu_or_a_cpu_the_built_in_space_is_as_it_was(accelerator: str, gpus: int) -> None:
    space = SearchSpace.default(accelerator, host_gpus=gpus)  # type: ignore[arg-type]
    assert space.params == default_params(accelerator)  # type: ignore[arg-type]
    assert [r.text for r in space.relations] == list(BUILTIN_RELATIONS)


def test_on_four_gpus_the_built_in_space_searches_the_topology_within_them() -> None:
    space = SearchSpace.default("gpu", host_gpus=4)
    assert space.describe()["tensor_parallel_size"] == "powers of two 1..4"
    assert space.describe()["data_parallel_size"] == "int 1..4"
    assert TOPOLOGY_RELATION in [r.text for r in space.relations]
    assert space.broken_relations({"tensor_parallel_size": 2, "data_parallel_size": 3}) == [TOPOLOGY_RELATION]
    assert space.broken_relations({"tensor_parallel_size": 2, "data_parallel_size": 2}) == []
    # A parallel size a config leaves unset is vLLM's 1.
    assert space.fits_host({"tensor_parallel_size": 4}) and not space.fits_host({"data_parallel_size": 8})


class TopologyRunner:
    """A capacity that grows with the topology: tensor parallelism answers 1.5x faster,
    each data-parallel replica carries as much again. Remembers every engine it was given."""

    def __init__(self, *, hits: bool = True) -> None:
        self.seen: list[dict[str, Any]] = []
        self.hits = hits  # the server exposes vLLM's prefix-cache counters

    def run(self, config, window, trial_dir, *, should_prune=None, start_speedup=None):
        Path(trial_dir).mkdir(parents=True, exist_ok=True)
        self.seen.append(dict(config.engine))
        tp = config.engine.get("tensor_parallel_size") or 1
        dp = config.engine.get("data_parallel_size") or 1
        rps = 10.0 * 1.5 ** (tp.bit_length() - 1) * dp
        capacity = CapacityResult(capacity_rps=rps, capacity_speedup=rps / 2, recorded_rps=2.0,
                                  first_fail_rps=rps * 1.05, first_fail_speedup=rps / 2 * 1.05,
                                  bracketed=True, steps=[])
        return trial_outcome(trial_dir, capacity=capacity, timing=trial_timing(),
                             prefix_cache_hit_rate=0.5 / dp if self.hits else None)


def window() -> Trace:
    return Trace.from_requests([TraceRequest(timestamp=i * 500.0, input_length=50, output_length=20)
                                for i in range(20)], source="test")


def topology_study(tmp_path: Path, space: SearchSpace, runner: TopologyRunner, *, objective: str,
                   n_trials: int, baseline: dict[str, Any] | None = None) -> TuningStudy:
    return TuningStudy(
        options=StudyOptions(study_name="topology", output_dir=tmp_path, n_trials=n_trials, top_k=1, repeats=2),
        inputs=SearchInputs(
            space=space, objective=parse_objective(objective, SLOS), slos=SLOS,
            baseline=ServerConfig(engine={"model": "/models/tiny", **(baseline or {})}),
            baseline_source="test", tuning_window=window(), holdout_window=window(),
            effective_defaults={"max_num_seqs": 128},
        ),
        runner=runner,
        say=lambda line: None,
    )


@pytest.mark.parametrize("gpus,fitting", [(2, 3), (4, 7)])
def test_a_study_launches_only_the_topologies_that_fit_the_host(tmp_path: Path, gpus: int, fitting: int) -> None:
    """Only TP and DP searched: of the pairs their ranges make, those within the host's GPUs
    (2 GPUs: 3 of 4, 4 GPUs: 7 of 12); as many trials as there are fitting pairs measure each
    once, and none is spent on a pair that cannot start."""
    built_in = SearchSpace.default("gpu", host_gpus=gpus)
    space = SearchSpace({name: built_in.params[name] for name in ("tensor_parallel_size", "data_parallel_size")},
                        host_gpus=gpus)
    runner = TopologyRunner()
    study = topology_study(tmp_path, space, runner, objective="capacity", n_trials=fitting).run_search()
    topologies = [(e.get("tensor_parallel_size", 1), e.get("data_parallel_size", 1)) for e in runner.seen]
    assert all(tp * dp <= gpus for tp, dp in topologies), topologies
    assert len(set(topologies)) == len(topologies) == fitting, topologies
    assert not [t for t in study.trials if t.user_attrs.get("failure") == "invalid_config"]


def test_the_whole_built_in_space_of_a_two_gpu_host_launches_nothing_that_does_not_fit(tmp_path: Path) -> None:
    runner = TopologyRunner()
    study = topology_study(tmp_path, SearchSpace.default("gpu", host_gpus=2), runner, objective="capacity",
                           n_trials=8).run_search()
    assert all((e.get("tensor_parallel_size") or 1) * (e.get("data_parallel_size") or 1) <= 2 for e in runner.seen)
    # Other relations are still told as not-launched trials (TPE learns their region); the host's never.
    assert not [t for t in study.trials if TOPOLOGY_RELATION in (t.user_attrs.get("failure_detail") or "")]


def test_per_gpu_a_tp2_config_carrying_1_5x_ranks_below_one_gpu_and_the_gate_says_so(tmp_path: Path) -> None:
    """The baseline splits the model over both GPUs (TP=2, 15 req/s); one GPU carries 10. By
    capacity the TP=2 baseline is best; per GPU (7.5 vs 10) it ranks below one GPU, and the
    gate emits the one-GPU config on the per-GPU figure."""
    def space() -> SearchSpace:
        return SearchSpace({"tensor_parallel_size": SearchSpace.default("gpu", host_gpus=2).params["tensor_parallel_size"]},
                           host_gpus=2)

    (tmp_path / "capacity").mkdir()
    (tmp_path / "per-gpu").mkdir()
    whole = topology_study(tmp_path / "capacity", space(), TopologyRunner(), objective="capacity", n_trials=2,
                           baseline={"tensor_parallel_size": 2})
    study = whole.run_search()
    best = whole.gate.best_trials(study, 2, include_baseline=True)
    assert [t.user_attrs.get("baseline", False) for t in best] == [True, False]
    assert [t.user_attrs["score"] for t in best] == [15.0, 10.0]

    per_gpu = topology_study(tmp_path / "per-gpu", space(), TopologyRunner(), objective="capacity-per-gpu",
                             n_trials=2, baseline={"tensor_parallel_size": 2})
    study = per_gpu.run_search()
    best = per_gpu.gate.best_trials(study, 2, include_baseline=True)
    assert [t.user_attrs.get("baseline", False) for t in best] == [False, True]
    assert [t.user_attrs["score"] for t in best] == [10.0, 7.5]
    assert [t.user_attrs["capacity_rps"] for t in best] == [10.0, 15.0]
    assert [t.user_attrs["devices"] for t in best] == [1, 2]
    result = per_gpu.validate(study)
    assert not result.decision.keep_baseline
    assert result.candidates[result.decision.winner].engine.get("tensor_parallel_size") == 1
    assert (result.decision.baseline_median, result.decision.candidate_median) == (7.5, 10.0)
    assert {(m.candidate == "baseline", m.capacity_rps, m.devices) for m in result.measurements} == {
        (True, 15.0, 2), (False, 10.0, 1)}


def per_gpu_report(tmp_path: Path, runner: TopologyRunner) -> str:
    """report.md of a per-GPU study on a 2-GPU host whose baseline splits the model (TP=2)."""
    space = SearchSpace({"tensor_parallel_size": SearchSpace.default("gpu", host_gpus=2).params["tensor_parallel_size"]},
                        host_gpus=2)
    tuning = topology_study(tmp_path, space, runner, objective="capacity-per-gpu", n_trials=2,
                            baseline={"tensor_parallel_size": 2})
    study = tuning.run_search()
    result = tuning.validate(study)
    inputs = tuning.inputs
    provenance = build_provenance(
        decision=result.decision, winner_overrides={"tensor_parallel_size": 1}, objective=inputs.objective,
        slos=SLOS, study_name="topology", storage_url="sqlite:///t.db", command_line=["autotune", "run"],
        model="/models/tiny", workload={"source": "t.jsonl", "fingerprint": "f00"}, baseline_source="test",
        effective_defaults=inputs.effective_defaults, validation=[], search={})
    plan = SimpleNamespace(objective=inputs.objective, tuning_window=inputs.tuning_window,
                           holdout_window=inputs.holdout_window)
    provenance["capacity"] = capacity_figures(plan, result.decision, result.measurements,  # type: ignore[arg-type]
                                              baseline_trial=tuning.gate.baseline_trial(study))
    path = write_report(tmp_path, ReportInputs(
        study=study, objective=inputs.objective, slos=SLOS, decision=result.decision,
        measurements=result.measurements, run_dirs=result.run_dirs, provenance=provenance,
        best_yaml=tmp_path / "best.yaml", search_wall_s=tuning.search_wall_s,
        gate_wall_s=result.wall_s, gate_server_s=result.server_s))
    return path.read_text()


def test_the_report_shows_capacity_per_gpu_the_gpus_held_and_the_prefix_cache_hit_rate(tmp_path: Path) -> None:
    text = per_gpu_report(tmp_path, TopologyRunner())
    assert "Objective: **capacity-per-gpu** (req/s per GPU)" in text
    assert "is better than the baseline** (+33.3% capacity per GPU)" in text
    # Headroom is the whole capacity's (10 req/s against 2 recorded); the per-GPU figures beside it.
    assert "carries 5x your recorded traffic" in text
    assert "; per GPU: the exported config 10 req/s (1 GPU), the baseline 7.5 req/s (2 GPUs)." in text
    assert "| trial | tensor_parallel_size | capacity per GPU | capacity (req/s) | GPUs | prefix cache hits | SLOs |" in text
    assert "| trial-0000 (baseline) | 2 | 7.5 | 15 | 2 | 50% | met |" in text
    assert "| trial-0001 | 1 | 10 | 10 | 1 | 50% | met |" in text
    validation = text.split("## Validation on the held-out window")[1].split("## Trials")[0]
    assert "| GPUs | prefix cache hits (median) |" in validation
    # Per repeat: the per-GPU capacity and the first failing step, both over the GPUs held.
    assert "| baseline | 7.5-7.88, 7.5-7.88 | 7.5 |" in validation
    assert "| 2 | 50% |" in validation and "| 1 | 50% |" in validation


def test_a_server_without_prefix_cache_counters_shows_no_hit_rate(tmp_path: Path) -> None:
    text = per_gpu_report(tmp_path, TopologyRunner(hits=False))
    assert "prefix cache" not in text and "| 0% |" not in text


def test_capacity_per_gpu_is_its_own_objective_and_the_others_are_as_they_were() -> None:
    objective = parse_objective("capacity-per-gpu", SLOS)
    assert objective.spec() == "capacity-per-gpu" and objective.measures_capacity
    assert objective.label == "capacity per GPU" and objective.format_score(4.25) == "4.25 req/s per GPU"
    assert parse_objective(objective.spec(), SLOS) == objective  # as a stored study reads it back
    capacity = parse_objective("capacity", SLOS)
    assert (capacity.spec(), capacity.label, capacity.unit) == ("capacity", "capacity", "req/s")
    with pytest.raises(AutotuneError, match="needs at least one --slo"):
        parse_objective("capacity-per-gpu", [])


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path


def test_a_space_file_whose_topology_cannot_fit_the_host_is_refused_in_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "params:\n  tensor_parallel_size: {type: pow2, low: 4, high: 8}\n")
    with pytest.raises(AutotuneError) as refused:
        SearchSpace.load(path, "gpu", host_gpus=2)
    assert str(refused.value) == (
        f"{path}: field 'params.tensor_parallel_size' = powers of two 4..8: no topology fits this host's "
        "2 GPUs (counted from CUDA_VISIBLE_DEVICES or nvidia-smi -L): the smallest one the space proposes "
        "(tensor_parallel_size 4 x pipeline_parallel_size 1 x data_parallel_size 1) holds 4; lower its "
        "'low' or drop it")
    # A parallel size the file does not search counts at the baseline's value.
    path = write(tmp_path, "extend_defaults: false\nparams:\n  tensor_parallel_size: {type: pow2, low: 2, high: 2}\n")
    SearchSpace.load(path, "gpu", host_gpus=2)
    with pytest.raises(AutotuneError, match="data_parallel_size 2\\) holds 4"):
        SearchSpace.load(path, "gpu", host_gpus=2, baseline={"data_parallel_size": 2})


def test_a_space_file_may_bound_a_product_of_engine_arguments(tmp_path: Path) -> None:
    path = write(tmp_path, "extend_defaults: false\nparams:\n"
                           "  tensor_parallel_size: {type: pow2, low: 1, high: 8}\n"
                           "  data_parallel_size: {type: int, low: 1, high: 8}\n"
                           "relations:\n  - tensor_parallel_size * data_parallel_size <= 4\n"
                           "  - {left: tensor_parallel_size * data_parallel_size, op: '>=', right: 2}\n")
    space = SearchSpace.load(path, "gpu", host_gpus=8)
    assert space.broken_relations({"tensor_parallel_size": 4, "data_parallel_size": 2}) == [
        "tensor_parallel_size * data_parallel_size <= 4"]
    assert space.broken_relations({"tensor_parallel_size": 1, "data_parallel_size": 1}) == [
        "tensor_parallel_size * data_parallel_size >= 2"]
    assert space.fits_host({"tensor_parallel_size": 8, "data_parallel_size": 1})  # the host holds 8
    bad = write(tmp_path, "relations:\n  - tensor_parallel_size * <= 4\n")
    with pytest.raises(AutotuneError) as refused:
        SearchSpace.load(bad, "gpu", host_gpus=2)
    assert str(refused.value) == (f"{bad}: field 'relations.0' = 'tensor_parallel_size * <= 4': expected a name, "
                                  "a number or A * B, got 'tensor_parallel_size *'")


@pytest.mark.slow
def test_autotune_run_refuses_a_space_that_cannot_fit_the_host_before_any_trial(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    path = write(tmp_path, "params:\n  data_parallel_size: {type: int, low: 3, high: 4}\n")
    code = main(["run", "--workload", SAMPLE, "--space", str(path), "--output-dir", str(tmp_path / "out"),
                 "--tuning-window", "8", "--holdout-window", "6", "--slo", "ttft_p50_ms=1000"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err == (f"autotune: error: {path}: field 'params.data_parallel_size' = int 3..4: no topology fits "
                   "this host's 2 GPUs (counted from CUDA_VISIBLE_DEVICES or nvidia-smi -L): the smallest one "
                   "the space proposes (tensor_parallel_size 1 x pipeline_parallel_size 1 x data_parallel_size 3) "
                   "holds 3; lower its 'low' or drop it")
    assert not (tmp_path / "out" / "trials").exists()
