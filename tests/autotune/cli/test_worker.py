"""Several workers on one study (SQLite-backed, fake runner): the logic of `autotune worker`
and `autotune finalize`, fast. The real thing (PostgreSQL, two CPU engines, a SIGKILLed
worker) is tests/autotune/cli/test_worker_engine.py.

What a user would notice: a study created for workers holds everything they need; a trial
whose worker died is failed and measured again by another worker, once; a worker that leaves
with Ctrl-C/SIGTERM hands its trial back; finalize validates and exports once, with each
trial's host in the report; a killed worker's server is ended by the next worker on its host.
"""

from __future__ import annotations

import json
import math
import sqlite3
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
import psutil
import pytest
from optuna.trial import TrialState

from autotune.cli import main
from autotune.distributed import (
    WorkerIdentity,
    WorkerRoster,
    connect,
    create_shared_study,
    finalize,
    load_shared,
    run_worker,
)
from autotune.errors import AutotuneError
from autotune.measure.ladder import LadderSettings
from autotune.measure.server_registry import RegisteredServer, StaleServerRegistry
from autotune.plan import TuningPlan
from autotune.search.objective import default_slos, parse_objective
from autotune.search.space import SearchSpace
from server.config import ServerConfig, default_engine_settings
from tests.factories import replay_summary, trial_outcome, trial_timing
from workloads.trace import Trace, TraceRequest

EFFECTIVE = {"max_num_seqs": 128, "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.3,
             "max_model_len": 2048, "enable_chunked_prefill": True}
NAME = "shared"
# The tests play dead workers with Study.ask(), which warns that heartbeats go with optimize().
pytestmark = pytest.mark.filterwarnings("ignore:Heartbeat of storage")


def window(seconds: float) -> Trace:
    return Trace.from_requests(
        [TraceRequest(timestamp=i * 500.0, input_length=50 + i, output_length=20, hash_ids=[i])
         for i in range(int(seconds * 2))],
        source=f"test[{seconds:g}s]",
    )


class FakeRunner:
    """Scores a config by a formula, writes what the report reads; `hook(call)` runs first."""

    def __init__(self, *, interrupt_on_call: int | None = None, hook=None):
        self.seen: list[dict[str, Any]] = []
        self.interrupt_on_call = interrupt_on_call
        self.hook = hook

    def run(self, config, window, trial_dir, *, should_prune=None):
        self.seen.append(dict(config.engine))
        trial_dir = Path(trial_dir)
        trial_dir.mkdir(parents=True, exist_ok=True)
        if self.hook is not None:
            self.hook(len(self.seen))
        if len(self.seen) == self.interrupt_on_call:
            raise KeyboardInterrupt
        seqs = config.engine.get("max_num_seqs") or 128
        distance = abs(math.log2(seqs) - 3)
        summary = replay_summary(request_goodput=2.0 - 0.3 * distance, p95_ttft_ms=400 + 300 * distance,
                                 p95_tpot_ms=20.0)
        return trial_outcome(trial_dir, summary=summary, timing=trial_timing())


def make_plan(tmp_path: Path, url: str, n_trials: int) -> TuningPlan:
    slos = default_slos("cpu")
    return TuningPlan(
        study_name=NAME, output_dir=tmp_path / "creator", storage=url,
        n_trials=n_trials, time_budget_s=None, seed=0, top_k=1, repeats=2,
        accelerator="cpu",
        slos=slos,
        objective=parse_objective("goodput", slos),
        space=SearchSpace.default("cpu"),
        baseline=ServerConfig(engine={"model": "/models/tiny", "max_model_len": 2048}),
        baseline_source="vLLM's defaults",
        effective_defaults=EFFECTIVE,
        tuning_window=window(10),
        holdout_window=window(6),
        workload={"source": "trace.jsonl", "fingerprint": "f00d", "mode": "timed", "speedup": 1.0},
        profile_text="a profile",
        mode="timed", speedup=1.0, startup_timeout_s=60,
        command_line=["autotune", "run", "--workers-only"],
    )


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'study.db'}"


def storage_for(url: str) -> optuna.storages.RDBStorage:
    return connect(url, heartbeat_interval_s=1, grace_period_s=30, max_retry=2)


def create(tmp_path: Path, url: str, n_trials: int = 4, *, command_line: list[str] | None = None) -> TuningPlan:
    plan = make_plan(tmp_path, url, n_trials)
    if command_line is not None:
        plan = plan.model_copy(update={"command_line": command_line})
    create_shared_study(plan, say=lambda line: None)
    return plan


def age_heartbeats(url: str) -> None:
    """As if every running trial's worker had stopped beating an hour ago."""
    with sqlite3.connect(url.removeprefix("sqlite:///")) as db:
        db.execute("UPDATE trial_heartbeats SET heartbeat = datetime('now', '-1 hour')")


def worker(storage, url: str, tmp_path: Path, host: str, runner: FakeRunner, lines: list[str] | None = None):
    return run_worker(
        storage, NAME, url=url, identity=WorkerIdentity(host=host, worker="gpu0"),
        output_dir=tmp_path / host, max_retry=2, runner=runner,
        say=(lines.append if lines is not None else lambda line: None), sleep=lambda s: None,
    )


def test_created_study_holds_everything_a_worker_needs_and_measures_nothing(tmp_path: Path, url: str) -> None:
    plan = create(tmp_path, url, command_line=["autotune", "run", "--storage", "postgresql://tuner:s3cret@db/x"])
    storage = storage_for(url)
    rebuilt = load_shared(storage, NAME, url, tmp_path / "w")
    for key in ("tuning_window", "holdout_window"):
        rebuilt_window, window_made = getattr(rebuilt, key), getattr(plan, key)
        assert rebuilt_window.timestamps_ms.tolist() == window_made.timestamps_ms.tolist()
        assert rebuilt_window.input_lengths.tolist() == window_made.input_lengths.tolist()
        assert [rebuilt_window.request(i).hash_ids for i in range(3)] == [[0], [1], [2]]
    assert rebuilt.space.fingerprint() == plan.space.fingerprint()
    assert rebuilt.objective.spec() == plan.objective.spec()
    assert rebuilt.slos == plan.slos and rebuilt.effective_defaults == EFFECTIVE
    assert rebuilt.baseline == plan.baseline
    assert rebuilt.n_trials == 4 and rebuilt.top_k == 1
    assert rebuilt.output_dir == tmp_path / "w" and rebuilt.resume
    assert "s3cret" not in json.dumps(rebuilt.command_line) and rebuilt.command_line[-1].startswith("postgresql://tuner:")
    trials = optuna.load_study(study_name=NAME, storage=storage).trials
    assert [(t.state, t.user_attrs.get("baseline")) for t in trials] == [(TrialState.WAITING, True)]
    assert not (tmp_path / "creator" / "trials").exists()


def test_a_dead_workers_trial_is_retried_once_and_a_leaving_worker_hands_its_trial_back(
    tmp_path: Path, url: str
) -> None:
    create(tmp_path, url, n_trials=4)
    storage = storage_for(url)
    # A worker takes the baseline, beats once, and dies (no more heartbeats).
    ghost = optuna.load_study(study_name=NAME, storage=storage)
    taken = ghost.ask()
    taken.set_user_attr("host", "ghost")
    storage.record_heartbeat(taken._trial_id)
    age_heartbeats(url)

    # Worker A finds it stale, retries it, measures one more, then leaves mid-trial (Ctrl-C).
    lines: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        worker(storage, url, tmp_path, "host-a", FakeRunner(interrupt_on_call=3), lines)
    assert any("trial-0000: ghost stopped heartbeating" in line for line in lines)
    # Worker B joins later and finishes the study, the handed-back trial first.
    runner_b = FakeRunner()
    study = worker(storage, url, tmp_path, "host-b", runner_b)

    t = study.trials
    assert [x.state for x in t] == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE,
                                    TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    assert t[1].system_attrs["failed_trial"] == 0 and t[1].user_attrs["baseline"] is True
    assert t[1].user_attrs["host"] == "host-a" and t[2].user_attrs["host"] == "host-a"
    assert t[3].user_attrs["interrupted"] and t[3].user_attrs["host"] == "host-a"
    assert t[4].system_attrs["failed_trial"] == 3 and t[4].params == t[3].params
    assert t[4].user_attrs["host"] == "host-b" and not t[4].user_attrs.get("interrupted")
    assert runner_b.seen[0] == {"model": "/models/tiny", "max_model_len": 2048, **t[3].user_attrs["overrides"]}
    complete = [x for x in t if x.state == TrialState.COMPLETE]
    assert len(complete) == 4  # what was asked, lost trials not counted
    # Never twice: each lost trial has exactly one measured retry, the baseline one result.
    origins = [x.system_attrs.get("failed_trial") for x in complete if "failed_trial" in x.system_attrs]
    assert sorted(origins) == [0, 3]
    assert sum(bool(x.user_attrs.get("baseline")) for x in complete) == 1
    assert (tmp_path / "host-a" / "trials" / "trial-0001").is_dir()
    assert (tmp_path / "host-b" / "trials" / "trial-0004").is_dir()


def test_a_late_result_from_a_worker_presumed_dead_is_discarded(tmp_path: Path, url: str) -> None:
    create(tmp_path, url, n_trials=2)
    storage = storage_for(url)
    other = storage_for(url)  # another worker's connection

    def presumed_dead(call: int) -> None:
        if call == 1:  # while trial 0 is measured, another worker declares it stale
            age_heartbeats(url)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(optuna.load_study(study_name=NAME, storage=other))

    lines: list[str] = []
    study = worker(storage, url, tmp_path, "slow", FakeRunner(hook=presumed_dead), lines)
    assert any("this measurement is discarded" in line for line in lines)
    t = study.trials
    assert t[0].state == TrialState.FAIL and t[0].values is None
    assert t[1].state == TrialState.COMPLETE and t[1].system_attrs["failed_trial"] == 0
    assert sum(x.state == TrialState.COMPLETE for x in t) == 2


def test_finalize_validates_once_and_reports_each_trials_host(tmp_path: Path, url: str) -> None:
    create(tmp_path, url, n_trials=3)
    storage = storage_for(url)
    ghost = optuna.load_study(study_name=NAME, storage=storage).ask()
    ghost.set_user_attr("host", "ghost")
    ghost.set_user_attr("worker", "gpu3")
    storage.record_heartbeat(ghost._trial_id)
    age_heartbeats(url)
    worker(storage, url, tmp_path, "host-a", FakeRunner())

    out = tmp_path / "final"
    lines: list[str] = []
    identity = WorkerIdentity(host="boss", worker="gpu0")
    runner = FakeRunner()
    outcome = finalize(storage, NAME, url=url, output_dir=out, identity=identity, runner=runner,
                       say=lines.append, sleep=lambda s: None)
    assert outcome.best_yaml == out / "best.yaml" and outcome.report.exists()
    assert len(runner.seen) == 4  # top 1 and the baseline, 2 repeats each: the gate ran here
    best = ServerConfig.load(out / "best.yaml")
    assert best.provenance["study"]["workers"] == ["ghost/gpu3", "host-a/gpu0"]
    assert best.provenance["command_line"] == "autotune run --workers-only"
    report = (out / "report.md").read_text()
    assert "| trial | host |" in report
    assert "| trial-0000 (baseline) | ghost/gpu3 |" in report
    assert "worker lost (no heartbeat)" in report and "retried as trial-0001" in report
    assert "| trial-0001 (baseline) | host-a/gpu0 |" in report and "retry of trial-0000" in report
    assert "trials lost with their worker (no heartbeat) and retried: 1" in report

    with pytest.raises(AutotuneError, match="already finalised at .* by boss/gpu0.*--again"):
        finalize(storage, NAME, url=url, output_dir=out, identity=identity, runner=FakeRunner())
    again = FakeRunner()
    finalize(storage, NAME, url=url, output_dir=out, identity=identity, runner=again,
             again=True, say=lambda line: None)
    assert len(again.seen) == 4


def test_finalize_refuses_an_unfinished_study_with_nobody_measuring(tmp_path: Path, url: str, capsys) -> None:
    create(tmp_path, url, n_trials=3)
    code = main(["finalize", "--storage", url, "--study", NAME, "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "0 of 3 trials measured, none running (1 queued)" in err and "--partial" in err
    # A failed finalize leaves no claim behind.
    assert NAME + ".finalize" not in optuna.get_all_study_names(url)


def test_worker_errors_are_one_line(tmp_path: Path, url: str, capsys) -> None:
    optuna.create_study(study_name="plain", storage=url)
    code = main(["worker", "--storage", url, "--study", "nope", "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "no study 'nope'" in err and "plain" in err and "--workers-only" in err
    code = main(["worker", "--storage", url, "--study", "plain", "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "not created for workers" in err
    code = main(["worker", "--storage", "postgresql://u:secret@127.0.0.1:1/x", "--study", "s"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "cannot open it" in err and "secret" not in err
    code = main(["worker", "--storage", url, "--study", "s", "--grace-period", "5",
                 "--heartbeat-interval", "10"])
    assert code == 2 and "grace period longer" in capsys.readouterr().err


def test_a_dead_workers_server_is_ended_by_the_next_worker_on_its_host(tmp_path: Path) -> None:
    folder = tmp_path / "workers"
    # The dead worker: a process that is gone, with a lease and a registered server.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                              start_new_session=True)
    try:
        me = WorkerIdentity.detect("gpu1")
        lease = {"host": me.host, "worker": "gpu0", "pid": dead.pid, "create_time": time.time() - 5,
                 "started": "earlier"}
        folder.mkdir()
        (folder / f"{me.host}--gpu0.json").write_text(json.dumps(lease))
        StaleServerRegistry(folder / f"{me.host}--gpu0.servers.json").add(RegisteredServer(
            pid=server.pid, pgid=server.pid, create_time=psutil.Process(server.pid).create_time()))
        # A live worker on another host shares the folder: its entry is not ours to touch.
        (folder / "elsewhere--gpu0.json").write_text(json.dumps({**lease, "host": "elsewhere"}))

        lines: list[str] = []
        roster = WorkerRoster(folder, me, say=lines.append)
        roster.join()
        assert server.wait(timeout=20) is not None
        assert any(str(server.pid) in line and "gpu0" in line for line in lines)
        assert {p.name for p in folder.iterdir()} == {f"{me.host}--gpu1.json", "elsewhere--gpu0.json"}
        with pytest.raises(AutotuneError, match="already running here"):
            WorkerRoster(folder, me).join()
        roster.leave()
        assert not roster.lease_path.exists()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_run_workers_only_creates_the_study_from_the_command_line(tmp_path: Path, capsys) -> None:
    sample = Path(__file__).resolve().parents[3] / "workloads" / "samples" / "translation_trace.jsonl"
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    code = main(["run", "--workload", str(sample), "--workers-only", "--storage", url,
                 "--study-name", "cli", "--trials", "5", "--tuning-window", "8",
                 "--holdout-window", "6", "--output-dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"autotune worker --storage '{url}' --study cli" in out
    shared = load_shared(storage_for(url), "cli", url, tmp_path / "w")
    assert shared.n_trials == 5 and shared.workload["source"] == str(sample)
    assert shared.baseline.engine["model"] == default_engine_settings()["model"]
    assert len(shared.tuning_window) and shared.effective_defaults
    assert not (tmp_path / "out" / "trials").exists()


def test_passwords_stay_out_of_logs_and_exported_files() -> None:
    from autotune.redact import redact, redact_argv

    url = "postgresql://tuner:s3cret@db:5432/autotune"
    assert "s3cret" not in redact(url) and "tuner@db" in redact(url).replace(":***", "")
    shown = redact_argv(["autotune", "run", "--storage", url, f"--storage={url}", "--trials", "4"])
    assert not any("s3cret" in arg for arg in shown) and shown[-2:] == ["--trials", "4"]


def test_a_min_memory_study_hands_its_headroom_and_single_step_to_workers(tmp_path: Path, url: str) -> None:
    plan = make_plan(tmp_path, url, 4)
    objective = parse_objective("min-memory", plan.slos, headroom=2.0)
    plan = plan.model_copy(update={
        "objective": objective, "space": SearchSpace.default("cpu", wide_memory=True),
        "ladder": LadderSettings.for_accelerator("cpu").single(2.0),
    })
    create_shared_study(plan, say=lambda line: None)
    storage = storage_for(url)
    rebuilt = load_shared(storage, NAME, url, tmp_path / "w")
    assert rebuilt.objective == objective and rebuilt.objective.spec() == "min-memory:2x"
    assert rebuilt.ladder is not None and rebuilt.ladder.single_step and rebuilt.ladder.start_speedup == 2.0
    assert rebuilt.space.params["gpu_memory_utilization"].low == 0.05
    study = optuna.load_study(study_name=NAME, storage=storage)
    assert [d.name for d in study.directions] == ["MINIMIZE"]
