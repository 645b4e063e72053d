"""A gate cut short (tuner killed, machine taken back) goes on with `autotune run --resume`
after the runs it already measured on this host, instead of measuring them again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.measure.trial import TrialOutcome
from autotune.search.objective import Objective
from autotune.search.space import ParamSpec, SearchSpace
from autotune.search.study import SearchInputs, StudyOptions, TuningStudy
from server.config import ServerConfig
from tests.factories import replay_summary, trial_outcome
from workloads.slo import parse_slo
from workloads.trace import Trace, TraceRequest

WINDOW = Trace.from_requests(
    [TraceRequest(timestamp=i * 100.0, input_length=50, output_length=20) for i in range(50)])
SPACE = SearchSpace({"max_num_seqs": ParamSpec(type="int", low=1, high=64, log=True)}, [])


class Runner:
    """Goodput grows with sequences; raises KeyboardInterrupt on call `stop_at`."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.stop_at = stop_at
        self.calls: list[str] = []

    def run(self, config: ServerConfig, window: Trace, trial_dir: Path, *, should_prune=None) -> TrialOutcome:
        self.calls.append(Path(trial_dir).parent.name)
        if self.stop_at is not None and len(self.calls) == self.stop_at:
            raise KeyboardInterrupt
        Path(trial_dir).mkdir(parents=True, exist_ok=True)
        seqs = config.engine.get("max_num_seqs") or 8
        summary = replay_summary(request_goodput=min(seqs, 32) / 10, p95_ttft_ms=100)
        return trial_outcome(trial_dir, summary=summary)


def study(tmp_path: Path, runner: Runner, *, resume: bool) -> TuningStudy:
    return TuningStudy(
        options=StudyOptions(study_name="g", output_dir=tmp_path, n_trials=3, top_k=1, repeats=3,
                             resume=resume, resume_gate=resume),
        inputs=SearchInputs(
            space=SPACE, objective=Objective(kind="goodput"), slos=[parse_slo("ttft_p95_ms=500")],
            baseline=ServerConfig(engine={"model": "fake"}), baseline_source="defaults",
            tuning_window=WINDOW, holdout_window=WINDOW, effective_defaults={"max_num_seqs": 8}),
        runner=runner, say=lambda line: None,
    )


def test_resumed_gate_measures_only_what_the_interrupted_one_did_not(tmp_path: Path) -> None:
    first = study(tmp_path, Runner(stop_at=3 + 4), resume=False)  # 3 search trials, then 4th gate run
    first.run_search()
    with pytest.raises(KeyboardInterrupt):
        first.validate()
    kept = json.loads((tmp_path / "validation" / "measurements.json").read_text())
    assert len(kept) == 3
    runner = Runner()
    second = study(tmp_path, runner, resume=True)
    second.run_search()  # the search is complete: nothing runs
    result = second.validate()
    assert len(runner.calls) == 6 - 3  # 2 configs x 3 repeats, 3 already measured
    assert len(result.measurements) == 6
    # Measured elsewhere (another machine, e.g. a lent GPU host that went back): round 1 is
    # whole and kept; the part of round 2 is not mixed in, that round is measured again here.
    for m in kept:
        m["host"] = "another-machine"
    (tmp_path / "validation" / "measurements.json").write_text(json.dumps(kept[:3]))
    again = Runner()
    third = study(tmp_path, again, resume=True)
    third.run_search()
    third.validate()
    assert len(again.calls) == 6 - 2


def test_whole_rounds_from_another_machine_are_kept_and_the_rest_is_measured_here(tmp_path: Path) -> None:
    first = study(tmp_path, Runner(stop_at=3 + 6), resume=False)  # stopped in round 3's 2nd run
    first.run_search()
    with pytest.raises(KeyboardInterrupt):
        first.validate()
    record = tmp_path / "validation" / "measurements.json"
    kept = json.loads(record.read_text())
    assert [m["repeat"] for m in kept] == [0, 0, 1, 1, 2]
    for m in kept:
        m["host"] = "the-machine-that-went-back"
        m["wall_s"], m["server_s"] = 100.0, 90.0  # as if each run took 100 s there
    record.write_text(json.dumps(kept))
    runner = Runner()
    resumed = study(tmp_path, runner, resume=True)
    resumed.run_search()
    searched_s = sum(t.user_attrs["wall_s"] for t in resumed.study.trials)
    assert resumed.search_wall_s >= searched_s  # the first process's trials count
    result = resumed.validate()
    assert len(runner.calls) == 2  # round 3 again, wholly on this machine
    assert len(result.measurements) == 6
    # The reused runs count in the gate's time with what they took when measured.
    assert result.wall_s >= 4 * 100.0 and result.server_s >= 4 * 90.0
    hosts = [m["host"] for m in json.loads(record.read_text())]
    assert hosts[:4] == ["the-machine-that-went-back"] * 4
    assert len(set(hosts[4:])) == 1 and hosts[4] != hosts[0]
