"""`autotune retune`'s own logic: drift gate, warm start, versioned output, exit codes.

The trial runner is a fake here (what it measures is not the subject); the real engine
end to end is in test_retune_engine.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import optuna
import pytest

from autotune.cli import build_parser, retune
from autotune.cli.exit_status import USER_ERRORS
from autotune.decide.capacity_check import CHECK_FILE
from autotune.errors import NothingMeasured
from autotune.measure.ladder import CapacityResult, LadderStep, recorded_rate
from autotune.measure.trial import TrialOutcome
from autotune.search import warm_start
from autotune.search.space import SearchSpace
from server.config import RecorderSettings, ServerConfig, ServingSettings, default_engine_settings
from tests.factories import ladder_step, replay_summary, trial_outcome, trial_timing
from workloads.profile import profile_trace
from workloads.synthetic import TranslationSpec, translation
from workloads.trace import Trace
from workloads.trace_io import write_trace

SLOS = ["ttft_p95_ms=1000", "tpot_p95_ms=100"]
FAST = ["--tuning-window", "20", "--holdout-window", "15", "--top-k", "1", "--repeats", "2"]


class NeverRun:
    """A runner for paths that must not start any server."""

    def __init__(self) -> None:
        self.calls = 0

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise AssertionError("a server would have been started")


class ScoringRunner:
    """Goodput peaks at max_num_seqs=8 (as in test_study); remembers each engine it ran."""

    def __init__(self, *, flat: bool = False) -> None:
        self.seen: list[dict[str, Any]] = []
        self.flat = flat

    def run(self, config, window, trial_dir, *, should_prune=None):
        self.seen.append(dict(config.engine))
        assert config.serving.recorder is None, "trial servers must not record production traffic"
        Path(trial_dir).mkdir(parents=True, exist_ok=True)
        seqs = config.engine.get("max_num_seqs") or 128
        distance = 0.0 if self.flat else abs(math.log2(seqs) - 3)
        summary = replay_summary(request_goodput=2.0 - 0.3 * distance, p95_ttft_ms=400 + 100 * distance,
                                 p95_tpot_ms=20.0)
        return trial_outcome(trial_dir, summary=summary, timing=trial_timing())


def reference_trace() -> Trace:
    # Long enough for two windows of 200+ requests each, what a p95 SLO needs (autotune.preflight).
    return translation(TranslationSpec(duration_s=400, mean_rps=2), seed=0)


def drifted_trace() -> Trace:
    return translation(TranslationSpec(duration_s=400, mean_rps=6, median_input=120), seed=1)


def deploy(
    folder: Path, *, max_num_seqs: int = 2, profile: bool = True, objective: str = "goodput"
) -> Path:
    """A deployed best.yaml as `autotune run` would leave it, plus a recorder section."""
    folder.mkdir(parents=True, exist_ok=True)
    provenance: dict[str, Any] = {"slos": SLOS, "objective": objective, "date": "2025-01-01"}
    if profile:
        provenance["profile"] = profile_trace(reference_trace()).model_dump(mode="json")
    config = ServerConfig(
        engine={**default_engine_settings(), "max_num_seqs": max_num_seqs},
        serving=ServingSettings(recorder=RecorderSettings(directory=str(folder / "traffic"))),
        provenance=provenance,
    )
    path = folder / "best.yaml"
    config.write(path)
    return path


def cli(argv: list[str], runner: Any) -> int:
    """`autotune retune ARGV` as autotune.cli.main runs it (user errors -> 2)."""
    args = build_parser().parse_args(["retune", *map(str, argv)])  # the real CLI's parser
    try:
        return retune.retune_command(args, runner=runner)
    except USER_ERRORS:
        return 2


@pytest.fixture
def traces(tmp_path: Path) -> dict[str, Path]:
    paths = {"same": tmp_path / "same.jsonl", "drifted": tmp_path / "drifted.jsonl"}
    write_trace(paths["same"], reference_trace())
    write_trace(paths["drifted"], drifted_trace())
    return paths


def test_no_drift_launches_nothing_and_writes_nothing(tmp_path, traces, capsys) -> None:
    deployed = deploy(tmp_path / "deploy")
    before = sorted(p.name for p in deployed.parent.iterdir())
    runner = NeverRun()
    assert cli(["--current", traces["same"], "--config", deployed], runner) == 0
    assert runner.calls == 0
    assert sorted(p.name for p in deployed.parent.iterdir()) == before
    assert "no drift" in capsys.readouterr().out


def test_dry_run_reports_drift_and_the_plan_without_a_server(tmp_path, traces, capsys) -> None:
    deployed = deploy(tmp_path / "deploy")
    before = sorted(p.name for p in deployed.parent.iterdir())
    runner = NeverRun()
    code = cli(["--current", traces["drifted"], "--config", deployed, "--dry-run", *FAST], runner)
    assert code == retune.EXIT_DRY_RUN_DRIFT
    assert runner.calls == 0
    assert sorted(p.name for p in deployed.parent.iterdir()) == before
    out = capsys.readouterr().out
    assert "DRIFT" in out and "neighbour max_num_seqs 2 -> 4" in out
    assert "ttft_p95_ms=1000" in out  # the deployed config's SLOs are kept


@pytest.mark.slow
def test_drift_retunes_from_the_deployed_config_and_publishes_a_winner(tmp_path, traces) -> None:
    deployed = deploy(tmp_path / "deploy", max_num_seqs=2)
    original = deployed.read_text()
    runner = ScoringRunner()
    argv = ["--current", traces["drifted"], "--config", deployed, "--trials", "4", *FAST]
    assert cli(argv, runner) == retune.EXIT_NEW_CONFIG

    # Trial 0 was the deployed config as deployed; the warm starts came next, in order.
    assert runner.seen[0] == ServerConfig.load(deployed.parent / "best-v0.yaml").engine
    [study_dir] = [p for p in deployed.parent.iterdir() if p.name.startswith("retune-v1-")]
    study = optuna.load_study(
        study_name=study_dir.name, storage=f"sqlite:///{study_dir / 'study.db'}"
    )
    assert study.trials[0].user_attrs["baseline"] is True
    assert [t.user_attrs.get("warm_start") for t in study.trials[1:3]] == [
        "neighbour max_num_seqs 2 -> 1",
        "neighbour max_num_seqs 2 -> 4",
    ]
    assert [engine["max_num_seqs"] for engine in runner.seen[1:3]] == [1, 4]

    # The winner is versioned, best.yaml is the same file, the old one kept for rollback.
    new = deployed.parent / "best-v1.yaml"
    assert new.read_text() == deployed.read_text()
    assert (deployed.parent / "best-v0.yaml").read_text() == original
    config = ServerConfig.load(new)
    assert config.engine["max_num_seqs"] != 2
    assert config.serving.recorder is not None  # serving settings as deployed
    assert config.provenance["retune"]["trigger"] == "drift"
    # Its provenance holds the new traffic's profile: retuning again on it finds no drift.
    assert cli(["--current", traces["drifted"], "--config", deployed], NeverRun()) == 0


def test_drift_without_a_better_config_keeps_the_deployed_one(tmp_path, traces) -> None:
    deployed = deploy(tmp_path / "deploy")
    original = deployed.read_text()
    argv = ["--current", traces["drifted"], "--config", deployed, "--trials", "3", *FAST]
    assert cli(argv, ScoringRunner(flat=True)) == retune.EXIT_KEPT_DEPLOYED
    assert deployed.read_text() == original
    assert not list(deployed.parent.glob("best-v*.yaml"))
    # Not the capacity objective: the study ran without a capacity check first.
    assert not list(deployed.parent.glob(f"*/{CHECK_FILE}"))


def test_force_retunes_without_drift(tmp_path, traces) -> None:
    deployed = deploy(tmp_path / "deploy")
    runner = ScoringRunner()
    argv = ["--current", traces["same"], "--config", deployed, "--force", "--trials", "3", *FAST]
    assert cli(argv, runner) == retune.EXIT_NEW_CONFIG
    assert runner.seen
    config = ServerConfig.load(deployed)
    assert config.provenance["retune"]["trigger"] == "forced"


def test_a_recorder_folder_is_accepted_as_current_traffic(tmp_path, traces) -> None:
    deployed = deploy(tmp_path / "deploy")
    recording = tmp_path / "traffic"
    recording.mkdir()
    write_trace(recording / "traffic-1700000000000-000000.jsonl", reference_trace())
    assert cli(["--current", recording, "--config", deployed], NeverRun()) == 0


def test_output_dir_leaves_the_deployed_folder_alone(tmp_path, traces) -> None:
    deployed = deploy(tmp_path / "deploy")
    before = sorted(p.name for p in deployed.parent.iterdir())
    out = tmp_path / "versions"
    argv = [
        "--current",
        traces["drifted"],
        "--config",
        deployed,
        "--output-dir",
        out,
        "--trials",
        "3",
        *FAST,
    ]
    assert cli(argv, ScoringRunner()) == retune.EXIT_NEW_CONFIG
    assert sorted(p.name for p in deployed.parent.iterdir()) == before
    assert (out / "best-v1.yaml").read_text() == (out / "best.yaml").read_text()


@pytest.mark.parametrize(
    "argv",
    [
        ["--current", "missing.jsonl"],
        ["--trials", "0"],
        ["--ks-threshold", "7"],
        ["--headroom", "0.5"],
        ["--headroom", "nan"],
    ],
)
def test_bad_input_is_exit_2(tmp_path, traces, argv) -> None:
    deployed = deploy(tmp_path / "deploy")
    full = ["--current", traces["drifted"], "--config", deployed, *argv]
    assert cli(full, NeverRun()) == 2


def test_a_config_without_a_reference_asks_for_one(tmp_path, traces, capsys) -> None:
    deployed = deploy(tmp_path / "deploy", profile=False)
    assert cli(["--current", traces["drifted"], "--config", deployed], NeverRun()) == 2
    argv = ["--current", traces["same"], "--config", deployed, "--reference", traces["same"]]
    assert cli(argv, NeverRun()) == 0


def test_neighbours_step_each_parameter_within_the_space(large_numa_node) -> None:
    space = SearchSpace.default("cpu")
    engine = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "gpu_memory_utilization": 0.12}
    found = {start.why for start in warm_start.neighbours(space, engine)}
    assert found == {
        "neighbour max_num_seqs 8 -> 4",
        "neighbour max_num_seqs 8 -> 16",
        "neighbour max_num_batched_tokens 256 -> 128",
        "neighbour max_num_batched_tokens 256 -> 512",
        "neighbour gpu_memory_utilization 0.12 -> 0.112",
        "neighbour gpu_memory_utilization 0.12 -> 0.128",
    }
    edge = {"max_num_seqs": 32, "max_num_batched_tokens": 4096, "gpu_memory_utilization": 0.12}
    whys = {start.why for start in warm_start.neighbours(space, edge)}
    assert "neighbour max_num_seqs 32 -> 64" not in whys  # outside the space
    assert "neighbour max_num_seqs 32 -> 16" in whys


# -- the capacity check: the deployed config measured once before any re-tune -------------------


class CapacityRunner:
    """A fake ladder: capacity = `headroom(max_num_seqs)` x the window's recorded rate, with
    one passing step there and a failing one 10% above; remembers every run it was asked for."""

    def __init__(self, headroom: Any, *, fail: bool = False) -> None:
        self.headroom = headroom
        self.fail = fail
        self.runs: list[tuple[dict[str, Any], Path]] = []

    def run(self, config, window, trial_dir, **kwargs) -> TrialOutcome:
        self.runs.append((dict(config.engine), Path(trial_dir)))
        assert config.serving.recorder is None, "trial servers must not record production traffic"
        Path(trial_dir).mkdir(parents=True, exist_ok=True)
        recorded = recorded_rate(window)
        factor = float(self.headroom(config.engine.get("max_num_seqs") or 128))
        steps = [fake_step(0, factor, recorded, True), fake_step(1, factor * 1.1, recorded, False)]
        capacity = CapacityResult(
            capacity_rps=factor * recorded,
            capacity_speedup=factor,
            recorded_rps=recorded,
            first_fail_rps=factor * 1.1 * recorded,
            bracketed=True,
            steps=steps,
            stopped_by="crash" if self.fail else None,
        )
        (Path(trial_dir) / "ladder.json").write_text(capacity.model_dump_json())
        if self.fail:
            return trial_outcome(trial_dir, failure="crash", failure_detail="engine died at x2", capacity=capacity)
        return trial_outcome(trial_dir, capacity=capacity)


def fake_step(index: int, speedup: float, recorded: float, passed: bool) -> LadderStep:
    return ladder_step(index=index, speedup=speedup, offered_rps=speedup * recorded, requests=60,
                       passed=passed, reason="fake", seconds=6,
                       measured_ms={SLOS[0]: 500.0 if passed else 1500.0, SLOS[1]: 20.0})


def study_dir(deployed: Path) -> Path:
    [found] = [p for p in deployed.parent.iterdir() if p.name.startswith("retune-v1-")]
    return found


def test_drift_with_headroom_keeps_the_deployed_config_after_one_launch(
    tmp_path, traces, capsys
) -> None:
    deployed = deploy(tmp_path / "deploy", objective="capacity")
    original = deployed.read_text()
    runner = CapacityRunner(lambda seqs: 3.0)
    argv = ["--current", traces["drifted"], "--config", deployed, *FAST]
    assert cli(argv, runner) == retune.EXIT_KEPT_DEPLOYED

    # One launch: the deployed config as deployed (recorder off), nothing else.
    [(engine, trial_dir)] = runner.runs
    assert engine == ServerConfig.load(deployed).engine
    out = capsys.readouterr().out
    kept = [line for line in out.splitlines() if line.startswith("traffic drifted, but")]
    assert len(kept) == 1
    assert kept[0].startswith("traffic drifted, but the deployed config still carries 3x it (capacity ")
    assert kept[0].endswith(" req/s, needs 1.5x): keeping it")
    assert "re-tuning" not in out
    # Nothing published, no study; the measurement is kept beside the launch's own files.
    assert deployed.read_text() == original
    assert not list(deployed.parent.glob("best-v*.yaml"))
    folder = study_dir(deployed)
    assert not (folder / "study.db").exists()
    check = json.loads((folder / CHECK_FILE).read_text())
    assert check["keep"] is True and check["needed_headroom"] == 1.5
    assert check["headroom"] == pytest.approx(3.0)
    assert check["capacity_rps"] == pytest.approx(3.0 * check["recorded_rps"])
    assert len(check["ladder"]["steps"]) == 2
    assert Path(check["trial_dir"]) == trial_dir and (trial_dir / "ladder.json").is_file()


@pytest.mark.slow
def test_drift_under_the_headroom_retunes_and_the_check_is_the_baseline(
    tmp_path, traces, capsys
) -> None:
    deployed = deploy(tmp_path / "deploy", max_num_seqs=2, objective="capacity")
    # The deployed 2 sequences carry 1.2x the new traffic; 4 carry 2x, 8 carry 2.8x.
    runner = CapacityRunner(lambda seqs: 0.4 + 0.4 * min(seqs, 8))
    argv = ["--current", traces["drifted"], "--config", deployed, "--trials", "3", *FAST]
    assert cli(argv, runner) == retune.EXIT_NEW_CONFIG

    folder = study_dir(deployed)
    check = json.loads((folder / CHECK_FILE).read_text())
    assert check["keep"] is False and check["headroom"] == pytest.approx(1.2)
    out = capsys.readouterr().out
    assert "the deployed config must be re-tuned: it carries 1.2x the current traffic" in out
    # The check's launch is the study's trial 0: the deployed config ran once on the tuning window.
    study = optuna.load_study(study_name=folder.name, storage=f"sqlite:///{folder / 'study.db'}")
    baseline = study.trials[0]
    assert baseline.user_attrs["baseline"] is True
    assert baseline.user_attrs["capacity_rps"] == pytest.approx(check["capacity_rps"])
    assert Path(baseline.user_attrs["trial_dir"]) == Path(check["trial_dir"])
    search = [engine for engine, path in runner.runs if path.parent.name == "trials"]
    assert [engine["max_num_seqs"] for engine in search] == [2, 1, 4]  # 2: the check, once
    assert ServerConfig.load(deployed).engine["max_num_seqs"] == 4


def test_headroom_sets_the_bar_the_deployed_config_must_clear(tmp_path, traces, capsys) -> None:
    deployed = deploy(tmp_path / "deploy", max_num_seqs=8, objective="capacity")
    runner = CapacityRunner(lambda seqs: 3.0 if seqs == 8 else 1.0)
    argv = ["--current", traces["drifted"], "--config", deployed, "--trials", "2",
            "--headroom", "4", *FAST]
    # 3x is not the 4x asked: the study runs (and keeps the deployed config, the best it found).
    assert cli(argv, runner) == retune.EXIT_KEPT_DEPLOYED
    assert "needs 4x" in capsys.readouterr().out
    assert (study_dir(deployed) / "study.db").exists()
    assert len(runner.runs) > 1


def test_force_skips_the_capacity_check(tmp_path, traces) -> None:
    deployed = deploy(tmp_path / "deploy", objective="capacity")
    runner = CapacityRunner(lambda seqs: 3.0)
    argv = ["--current", traces["same"], "--config", deployed, "--force", "--trials", "2", *FAST]
    assert cli(argv, runner) == retune.EXIT_KEPT_DEPLOYED  # the study ran; nothing beat 3x
    assert not (study_dir(deployed) / CHECK_FILE).exists()
    assert (study_dir(deployed) / "study.db").exists()


def test_a_check_that_fails_is_the_failed_baseline_exit_12(tmp_path, traces) -> None:
    deployed = deploy(tmp_path / "deploy", objective="capacity")
    runner = CapacityRunner(lambda seqs: 3.0, fail=True)
    argv = ["--current", traces["drifted"], "--config", deployed, *FAST]
    with pytest.raises(NothingMeasured, match="engine died at x2"):
        cli(argv, runner)
    assert len(runner.runs) == 1  # not launched a second time by the study
    folder = study_dir(deployed)
    check = json.loads((folder / CHECK_FILE).read_text())
    assert check["keep"] is False and check["failure"] == "crash"
    assert (folder / "report.md").is_file()
    assert not list(deployed.parent.glob("best-v*.yaml"))


def test_dry_run_names_the_capacity_check_and_launches_nothing(tmp_path, traces, capsys) -> None:
    deployed = deploy(tmp_path / "deploy", objective="capacity")
    runner = NeverRun()
    argv = ["--current", traces["drifted"], "--config", deployed, "--dry-run", *FAST]
    assert cli(argv, runner) == retune.EXIT_DRY_RUN_DRIFT
    assert runner.calls == 0
    assert "first launch the deployed config once" in capsys.readouterr().out
    assert not list(deployed.parent.glob(f"*/{CHECK_FILE}"))


def test_a_min_memory_config_is_retuned_under_its_own_headroom(tmp_path, traces, capsys) -> None:
    deployed = deploy(tmp_path / "deploy", objective="min-memory:2x")
    code = cli(["--current", traces["drifted"], "--config", deployed, "--dry-run", *FAST], NeverRun())
    assert code == retune.EXIT_DRY_RUN_DRIFT
    out = capsys.readouterr().out
    assert "objective min-memory:2x" in out
    assert "gpu_memory_utilization (float 0.05..0.35, step 0.05)" in out  # the widened space
    assert "keep it (exit 11" not in out  # no capacity check: min-memory re-tunes on drift


def test_warm_starts_from_a_min_memory_study_come_least_memory_first(tmp_path) -> None:
    from optuna.distributions import FloatDistribution

    storage = f"sqlite:///{tmp_path / 'old.db'}"
    old = optuna.create_study(study_name="old", storage=storage, direction="minimize")
    memory = FloatDistribution(0.05, 0.35, step=0.05)
    for value, feasible in ((0.3, True), (0.1, False), (0.2, True), (0.15, True)):
        old.add_trial(optuna.trial.create_trial(
            value=value if feasible else math.inf, params={"gpu_memory_utilization": value},
            distributions={"gpu_memory_utilization": memory},
            user_attrs={"score": value, "overrides": {"gpu_memory_utilization": value}},
            system_attrs={"constraints": [0.0 if feasible else 1.0]},
        ))
    deployed = ServerConfig(engine=default_engine_settings(),
                            provenance={"study": {"name": "old", "storage": storage}})
    space = SearchSpace.default("cpu", wide_memory=True)
    starts = warm_start.previous_best(deployed, space, {"gpu_memory_utilization": 0.3})
    assert [s.params["gpu_memory_utilization"] for s in starts] == [0.15, 0.2, 0.3]
