"""The study's own logic, with a fake TrialRunner that returns constructed outcomes.

What a user would notice: the baseline is measured first and labelled; a config that breaks a
relation never reaches a server; --resume keeps what was measured and closes trials a killed
tuner left RUNNING; Ctrl-C loses nothing; the gate re-runs candidates interleaved.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import sqlite3
from pathlib import Path
from typing import Any

import optuna
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from optuna.trial import TrialState

from autotune.errors import AutotuneError
from autotune.search.objective import default_slos, parse_objective
from autotune.search.space import ParamSpec, SearchSpace
from autotune.search.study import SearchInputs, StudyOptions, TuningStudy
from server.config import ServerConfig
from tests.factories import replay_summary, trial_outcome, trial_timing
from workloads.replay_summary import ReplaySummary
from workloads.slo import parse_slo
from workloads.trace import Trace, TraceRequest

EFFECTIVE = {
    "max_num_seqs": 128,
    "max_num_batched_tokens": 2048,
    "gpu_memory_utilization": 0.3,
    "max_model_len": 2048,
    "enable_chunked_prefill": True,
}


def window(seconds: float = 10.0) -> Trace:
    return Trace.from_requests(
        [TraceRequest(timestamp=i * 500.0, input_length=50, output_length=20) for i in range(int(seconds * 2))],
        source="test",
    )


def summary(goodput: float, ttft_p95: float, tpot_p95: float = 20.0) -> ReplaySummary:
    return replay_summary(request_goodput=goodput, p95_ttft_ms=ttft_p95, p95_tpot_ms=tpot_p95)


class FakeRunner:
    """Scores a config by a fixed formula; remembers every config it was asked to run."""

    def __init__(self, *, interrupt_on_call: int | None = None, fail: dict[int, str] | None = None):
        self.seen: list[dict[str, Any]] = []
        self.dirs: list[Path] = []
        self.interrupt_on_call = interrupt_on_call
        self.fail = fail or {}

    def score(self, engine: dict[str, Any]) -> tuple[float, float]:
        seqs = engine.get("max_num_seqs") or EFFECTIVE["max_num_seqs"]
        # Best around 8 sequences; far from it, less goodput and slower first tokens.
        distance = abs(math.log2(seqs) - 3)
        return 2.0 - 0.3 * distance, 400 + 300 * distance

    def run(self, config, window, trial_dir, *, should_prune=None):
        call = len(self.seen) + 1
        self.seen.append(dict(config.engine))
        self.dirs.append(Path(trial_dir))
        Path(trial_dir).mkdir(parents=True, exist_ok=True)
        if call == self.interrupt_on_call:
            raise KeyboardInterrupt
        timing = trial_timing()
        if call in self.fail:
            return trial_outcome(trial_dir, failure=self.fail[call], failure_detail="boom", timing=timing)
        goodput, ttft = self.score(config.engine)
        return trial_outcome(trial_dir, summary=summary(goodput, ttft), timing=timing)


def make_study(tmp_path: Path, runner, *, n_trials: int = 5, resume: bool = False,
               space: SearchSpace | None = None, slos=None, name: str = "s") -> TuningStudy:
    slos = slos if slos is not None else default_slos("cpu")
    baseline = ServerConfig(engine={"model": "/models/tiny", "max_model_len": 2048})
    return TuningStudy(
        options=StudyOptions(study_name=name, output_dir=tmp_path, n_trials=n_trials, resume=resume,
                             top_k=2, repeats=2),
        inputs=SearchInputs(
            space=space or SearchSpace.default("cpu"),
            objective=parse_objective("goodput", slos),
            slos=slos,
            baseline=baseline,
            baseline_source="vLLM defaults",
            tuning_window=window(10),
            holdout_window=window(6),
            effective_defaults=EFFECTIVE,
        ),
        runner=runner,
        say=lambda line: None,
    )


def test_baseline_is_trial_zero_labelled_and_run_unchanged(tmp_path: Path) -> None:
    runner = FakeRunner()
    study = make_study(tmp_path, runner, n_trials=3).run_search()
    first = study.trials[0]
    assert first.user_attrs["baseline"] is True
    assert first.user_attrs["overrides"] == {}
    # The baseline's engine arguments are the baseline file's, nothing added.
    assert runner.seen[0] == {"model": "/models/tiny", "max_model_len": 2048}
    # It is recorded with what vLLM would use, so the report can say which defaults it had.
    assert first.user_attrs["engine_params"]["max_num_seqs"] == 128
    assert [t.user_attrs.get("baseline", False) for t in study.trials] == [True, False, False]
    assert all((tmp_path / "trials" / f"trial-{n:04d}").is_dir() for n in range(3))


def test_relation_breaking_configs_never_reach_a_server(tmp_path: Path) -> None:
    # Wide max_num_seqs, small step budgets: many proposals break batched_tokens >= seqs.
    space = SearchSpace({
        "max_num_seqs": ParamSpec(type="int", low=16, high=512, log=True),
        "max_num_batched_tokens": ParamSpec(type="pow2", low=32, high=512),
    })
    runner = FakeRunner()
    study = make_study(tmp_path, runner, n_trials=12, space=space).run_search()
    for engine in runner.seen[1:]:
        assert engine["max_num_batched_tokens"] >= engine["max_num_seqs"]
    invalid = [t for t in study.trials if t.user_attrs.get("failure") == "invalid_config"]
    assert invalid, "the space should have produced at least one invalid proposal"
    for trial in invalid:
        assert "max_num_batched_tokens >= max_num_seqs" in trial.user_attrs["failure_detail"]
        # Told as an infeasible complete trial, so TPE learns to avoid the region.
        assert trial.state == TrialState.COMPLETE
        assert trial.constraints["ran"] > 0
    assert len(runner.seen) == 12 - len(invalid)


def test_existing_study_needs_resume_and_resume_needs_a_study(tmp_path: Path) -> None:
    make_study(tmp_path, FakeRunner(), n_trials=1).run_search()
    with pytest.raises(AutotuneError, match="--resume"):
        make_study(tmp_path, FakeRunner(), n_trials=2).open()
    with pytest.raises(AutotuneError, match="no study 'other'"):
        make_study(tmp_path, FakeRunner(), n_trials=2, resume=True, name="other").open()


def test_resume_keeps_completed_trials_and_runs_the_rest(tmp_path: Path) -> None:
    first = make_study(tmp_path, FakeRunner(), n_trials=3).run_search()
    before = [(t.number, t.params, t.values) for t in first.trials]
    runner = FakeRunner()
    study = make_study(tmp_path, runner, n_trials=5, resume=True).run_search()
    assert [(t.number, t.params, t.values) for t in study.trials[:3]] == before
    assert len(study.trials) == 5
    assert len(runner.seen) == 2  # only the new trials ran
    assert sum(bool(t.user_attrs.get("baseline")) for t in study.trials) == 1


def test_resume_refuses_changed_slos(tmp_path: Path) -> None:
    make_study(tmp_path, FakeRunner(), n_trials=1).run_search()
    with pytest.raises(AutotuneError, match="slos"):
        make_study(tmp_path, FakeRunner(), resume=True, slos=[parse_slo("ttft_p95_ms=10")]).open()


def test_stale_running_trial_is_failed_on_resume_and_not_counted(tmp_path: Path) -> None:
    make_study(tmp_path, FakeRunner(), n_trials=2).run_search()
    # A tuner killed mid-trial leaves its trial RUNNING in the storage.
    url = f"sqlite:///{(tmp_path / 'study.db').resolve()}"
    killed = optuna.load_study(study_name="s", storage=url)
    killed.ask()
    reaped: list[Path] = []
    tuning = make_study(tmp_path, FakeRunner(), n_trials=3, resume=True)
    tuning.store.reap = lambda path: reaped.append(path) or []
    study = tuning.run_search()
    assert reaped == [tmp_path / "servers.json"]  # stale servers are looked for first
    stale = study.trials[2]
    assert stale.state == TrialState.FAIL
    assert "tuner stopped" in stale.user_attrs["interrupted"]
    assert len(study.trials) == 4  # the stale one did not count toward the 3


@pytest.mark.slow
def test_ctrl_c_marks_the_running_trial_and_loses_nothing(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        make_study(tmp_path, FakeRunner(interrupt_on_call=3), n_trials=4).run_search()
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{(tmp_path / 'study.db').resolve()}")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.FAIL]
    assert study.trials[2].user_attrs["interrupted"]
    resumed = make_study(tmp_path, FakeRunner(), n_trials=4, resume=True).run_search()
    assert sum(t.state == TrialState.COMPLETE for t in resumed.trials) == 4


def test_failed_start_is_infeasible_and_the_study_goes_on(tmp_path: Path) -> None:
    runner = FakeRunner(fail={2: "oom", 3: "port_in_use"})
    study = make_study(tmp_path, runner, n_trials=4).run_search()
    oom, port = study.trials[1], study.trials[2]
    assert oom.state == TrialState.COMPLETE and oom.constraints["ran"] > 0 and oom.user_attrs["failure"] == "oom"
    # A busy port says nothing about the config: FAIL, which the sampler ignores.
    assert port.state == TrialState.FAIL
    assert len(runner.seen) == 4  # a FAIL still counts toward --trials (or a busy port loops)


def test_gate_runs_candidates_interleaved_and_keeps_records(tmp_path: Path) -> None:
    runner = FakeRunner()
    tuning = make_study(tmp_path, runner, n_trials=5)
    study = tuning.run_search()
    searched = len(runner.seen)
    result = tuning.validate(study)
    runs = runner.dirs[searched:]
    names = [d.parent.name for d in runs]
    assert len(names) == 2 * len(result.candidates)
    # Every repeat runs every config once before the next repeat starts.
    half = len(names) // 2
    assert sorted(names[:half]) == sorted(names[half:]) == sorted(result.candidates)
    assert names[:half] != names[half:]  # the first config rotates
    saved = json.loads((tmp_path / "validation" / "measurements.json").read_text())
    assert len(saved) == len(names)


class PruningRunner(FakeRunner):
    """Reports goodput-so-far each second, as the real runner does, and stops when told."""

    def run(self, config, window, trial_dir, *, should_prune=None):
        goodput, ttft = self.score(config.engine)
        self.seen.append(dict(config.engine))
        self.pruner_offered = getattr(self, "pruner_offered", []) + [should_prune is not None]
        for second in range(10):
            if should_prune is not None and should_prune(float(second), summary(goodput, ttft)):
                return trial_outcome(trial_dir, failure="pruned", failure_detail=f"pruned at {second} s")
        return trial_outcome(trial_dir, summary=summary(goodput, ttft))


def test_weak_trials_are_pruned_mid_window_but_never_the_baseline(tmp_path: Path) -> None:
    runner = PruningRunner()
    study = make_study(tmp_path, runner, n_trials=12).run_search()
    assert runner.pruner_offered[0] is False  # the baseline always runs to the end
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED]
    assert pruned, "some weak configs should have been stopped early"
    best_complete = max(t.values[0] for t in study.trials if t.state == TrialState.COMPLETE)
    for trial in pruned:
        # Stopped only past the first 40% of the 9.5 s window, below the best complete one.
        assert max(trial.intermediate_values) >= int(0.4 * 9.5)
        assert trial.intermediate_values[max(trial.intermediate_values)] < best_complete


@pytest.fixture(scope="module")
def study_database(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A study.db with three measured trials (fake runner), as bytes."""
    folder = tmp_path_factory.mktemp("study")
    make_study(folder, FakeRunner(), n_trials=3).run_search()
    return (folder / "study.db").read_bytes()


@pytest.mark.slow  # 60 hypothesis examples, each a real study database
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
# Found by hypothesis in two fresh clones: one byte inside an index's copy of an attribute key.
@example(damage="overwrite", where=0.5703125, length=1, seed=0)
# And in a third: one byte of a trial's start time (see test_a_bad_value_inside_an_intact_database...).
@example(damage="overwrite", where=0.392578125, length=1, seed=1)
# And in a fourth: one byte of the stored search space ("utilizaEion"), refused as a changed space
# without naming the database.
@example(damage="overwrite", where=0.24828017957524054, length=1, seed=162100)
@given(
    damage=st.sampled_from(["truncate", "overwrite", "zero"]),
    where=st.floats(0, 1, exclude_max=True),
    length=st.integers(1, 512),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_damaged_study_database_is_refused_in_one_line_or_resumed(
    tmp_path_factory: pytest.TempPathFactory,
    study_database: bytes,
    reliability,
    damage: str,
    where: float,
    length: int,
    seed: int,
) -> None:
    reliability.start(
        "Study database corrupted (hypothesis)",
        group="Bad input",
        injected=(
            "hypothesis: a real study.db (3 trials) truncated, or 1-512 bytes overwritten with "
            "random bytes or zeros at any offset, then resumed for one more trial"
        ),
    )
    folder = tmp_path_factory.mktemp("damaged")
    data = bytearray(study_database)
    at = int(where * len(data))
    if damage == "truncate":
        data = data[:at]
    else:
        noise = random.Random(seed).randbytes(length) if damage == "overwrite" else bytes(length)
        data[at : at + length] = noise[: len(data) - at]
    (folder / "study.db").write_bytes(bytes(data))
    reliability.count({"truncate": "truncated", "overwrite": "overwritten (random bytes)", "zero": "zeroed"}[damage] + " files")
    try:
        study = make_study(folder, FakeRunner(), n_trials=4, resume=True).run_search()
    except AutotuneError as error:
        assert "\n" not in str(error) and str(folder) in str(error), str(error)
        reliability.count("refused with one line naming the file")
    else:
        assert len(study.trials) >= 4  # the damage was in unused space: the study went on
        reliability.count("resumed (damage in unused pages)")
    reliability.held(
        "no traceback: every damaged database was refused before any trial with one line "
        "naming the file, or (damage in unused space) the study resumed"
    )


# Values SQLite's own page checks pass, each of which failed Optuna's load (or a later read)
# with a traceback: an attribute key that is not UTF-8 (written through the table, so its index
# agrees; hypothesis found the index-only case, pinned above), and a JSON value cut short.
@pytest.mark.parametrize("update, problem", [
    ("UPDATE trial_user_attributes SET key = CAST(X'63FF6E737472' AS TEXT) WHERE rowid = 1",
     "trial_user_attributes.key of row 1 is not UTF-8 text"),
    ("UPDATE trial_user_attributes SET value_json = '{\"broken' WHERE rowid = 1",
     "trial_user_attributes.value_json of row 1 is not valid JSON"),
    # Hypothesis found it (one byte of a start time overwritten): SQLAlchemy's "Invalid isoformat string".
    ("UPDATE trials SET datetime_start = '2026-11-28 01:58:39.\"06023' WHERE rowid = 1",
     "trials.datetime_start of row 1 is not a date and time"),
], ids=["key-not-utf8", "broken-json", "broken-datetime"])
def test_a_bad_value_inside_an_intact_database_is_refused_up_front(
    tmp_path: Path, update: str, problem: str
) -> None:
    make_study(tmp_path, FakeRunner(), n_trials=2).run_search()
    with contextlib.closing(sqlite3.connect(tmp_path / "study.db")) as db:
        db.execute(update)
        db.commit()
    with pytest.raises(AutotuneError) as raised:
        make_study(tmp_path, FakeRunner(), n_trials=3, resume=True).run_search()
    message = str(raised.value)
    assert "\n" not in message and problem in message
    assert str(tmp_path / "study.db") in message
