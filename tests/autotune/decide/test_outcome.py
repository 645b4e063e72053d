"""Honest outcomes (issue 20): a study whose baseline was never measured stops at once, writes
no best.yaml and exits 12, on every path (`run`, `retune`, `worker` + `finalize`); report.md's
first line says which of the three outcomes a study had, and a kept baseline comes with its
measured standing. The runner is a fake here (what a trial measures is not the subject);
tests/autotune/measure/test_hard_stops.py runs the real CLI against a server answering errors.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from autotune.cli import build_parser, retune
from autotune.distributed import WorkerIdentity, connect, create_shared_study, finalize, run_worker
from autotune.errors import NothingMeasured
from autotune.pipeline import execute
from autotune.plan import TuningPlan
from autotune.prepare import prepare_plan
from autotune.request import TuningRequest
from server.config import ServerConfig, default_engine_settings
from tests.factories import replay_summary, trial_outcome, trial_timing
from workloads.profile import profile_trace
from workloads.trace_io import load_trace

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"
HTTP_400 = ("28 of 38 requests failed (limit 5%); first: HTTP 400: 8094 prompt tokens + max_tokens "
            "547 exceed the model's context of 2048 tokens")
TIMING = trial_timing()


class Runner:
    """Goodput peaks at 8 sequences (flat: the same for every config); the calls listed in
    `fail` fail with HTTP errors, as the failed user's baseline did."""

    def __init__(self, *, fail: tuple[int, ...] = (), flat: bool = False) -> None:
        self.fail = fail
        self.flat = flat
        self.calls = 0

    def run(self, config, window, trial_dir, *, should_prune=None):
        self.calls += 1
        Path(trial_dir).mkdir(parents=True, exist_ok=True)
        if self.calls in self.fail:
            return trial_outcome(trial_dir, failure="http_errors", failure_detail=HTTP_400, timing=TIMING)
        seqs = config.engine.get("max_num_seqs") or 128
        distance = 0.0 if self.flat else abs(math.log2(seqs) - 3)
        summary = replay_summary(request_goodput=2.0 - 0.3 * distance, p95_ttft_ms=400 + 100 * distance,
                                 p95_tpot_ms=20.0)
        return trial_outcome(trial_dir, summary=summary, timing=TIMING)


def plan(tmp_path: Path, *, trials: int = 4, resume: bool = False, name: str = "s", **values: Any) -> TuningPlan:
    # The fake runner replays once (goodput); the outcome rules are the same for capacity.
    values.setdefault("objective", "goodput")
    return prepare_plan(TuningRequest(workload=str(SAMPLE), trials=trials, study_name=name, output_dir=tmp_path,
                                      command_line=["autotune", "run"], top_k=1, repeats=2, resume=resume,
                                      **values))


@pytest.mark.slow
def test_a_baseline_that_fails_stops_the_run_at_once_and_exports_nothing(tmp_path: Path, capsys) -> None:
    runner = Runner(fail=(1,))
    with pytest.raises(NothingMeasured, match="the baseline's trial trial-0000 failed") as raised:
        execute(plan(tmp_path), runner=runner, reap=None)
    assert "HTTP 400" in str(raised.value) and "no best.yaml written" in str(raised.value)
    assert runner.calls == 1  # stopped at once: no search trial, no gate
    assert not (tmp_path / "best.yaml").exists()
    report = (tmp_path / "report.md").read_text()
    assert report.splitlines()[0].startswith("# Nothing could be measured")
    assert "**RESULT: NOTHING COULD BE MEASURED.**" in report and "http_errors" in report
    assert "Deploy:" not in report
    assert "NOTHING COULD BE MEASURED" in capsys.readouterr().out

    # --resume measures the baseline again (the failure may have been the machine's) and goes on.
    again = Runner()
    assert execute(plan(tmp_path, resume=True), runner=again, reap=None).best_yaml.exists()
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}")
    baselines = [t for t in study.trials if t.user_attrs.get("baseline")]
    assert [t.user_attrs["failure"] for t in baselines] == ["http_errors", None]
    assert (tmp_path / "best.yaml").exists()


def test_the_cli_exits_12_and_documents_its_exit_codes(tmp_path: Path, capsys) -> None:
    for command in ("run", "retune", "worker", "finalize"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        text = capsys.readouterr().out
        assert "exit status:" in text and "12   nothing could be measured" in text and "143 by SIGTERM" in text


def test_a_kept_baseline_reports_its_measured_standing(tmp_path: Path, capsys) -> None:
    assert execute(plan(tmp_path), runner=Runner(flat=True), reap=None).verdict == "kept"
    report = (tmp_path / "report.md").read_text()
    assert report.splitlines()[0].startswith("# The baseline was kept")
    standing = next(line for line in report.splitlines() if line.startswith("Baseline measured: "))
    assert "req/s goodput on the held-out window (median of 2 repeats" in standing
    assert "ttft_p95_ms=1000 met (400 ms)" in standing and "tpot_p95_ms=100 met (20 ms)" in standing
    best = ServerConfig.load(tmp_path / "best.yaml")
    assert best.provenance["decision"]["baseline_standing"] == standing.removeprefix("Baseline measured: ").rstrip(".")
    assert "# baseline measured: " in (tmp_path / "best.yaml").read_text()
    assert "baseline measured: " in capsys.readouterr().out


def test_a_better_config_is_named_on_the_first_line(tmp_path: Path) -> None:
    assert execute(plan(tmp_path, trials=8), runner=Runner(), reap=None).verdict == "validated"
    first = (tmp_path / "report.md").read_text().splitlines()[0]
    assert first.startswith("# A better config was validated")


def test_retune_publishes_nothing_when_the_deployed_config_cannot_be_measured(tmp_path: Path) -> None:
    deploy_dir = tmp_path / "deploy"
    deploy_dir.mkdir()
    trace = load_trace(SAMPLE)
    ServerConfig(engine=default_engine_settings(),
                 provenance={"profile": profile_trace(trace).model_dump(mode="json"),
                             "slos": ["ttft_p95_ms=1000"], "objective": "goodput"}).write(deploy_dir / "best.yaml")
    before = (deploy_dir / "best.yaml").read_text()
    args = build_parser().parse_args(["retune", "--current", str(SAMPLE), "--config", str(deploy_dir / "best.yaml"),
                                      "--force", "--trials", "3", "--top-k", "1", "--repeats", "1"])
    runner = Runner(fail=(1,))
    with pytest.raises(NothingMeasured, match="trial-0000 failed"):
        retune.retune_command(args, runner=runner)
    assert runner.calls == 1
    assert (deploy_dir / "best.yaml").read_text() == before
    assert not list(deploy_dir.glob("best-v*.yaml"))


def test_workers_stop_and_finalize_refuses_when_the_baseline_failed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    shared = plan(tmp_path / "creator", name="shared", storage=url)
    shared = shared.model_copy(update={"effective_defaults": {"max_num_seqs": 128},
                                       "command_line": ["autotune", "run", "--workers-only"]})
    create_shared_study(shared, say=lambda line: None)
    storage = connect(url, heartbeat_interval_s=1, grace_period_s=30, max_retry=2)
    runner = Runner(fail=(1,))
    with pytest.raises(NothingMeasured, match="trial-0000 failed"):
        run_worker(storage, "shared", url=url, identity=WorkerIdentity(host="h", worker="gpu0"),
                   output_dir=tmp_path / "w", max_retry=2, runner=runner, say=lambda line: None,
                   sleep=lambda s: None)
    assert runner.calls == 1  # the worker stopped once the baseline had failed
    out = tmp_path / "final"
    gate = Runner()
    with pytest.raises(NothingMeasured, match="trial-0000 failed"):
        finalize(storage, "shared", url=url, output_dir=out, identity=WorkerIdentity(host="h", worker="gpu0"),
                 partial=True, runner=gate, say=lambda line: None, sleep=lambda s: None)
    assert gate.calls == 0 and not (out / "best.yaml").exists()
    assert (out / "report.md").read_text().startswith("# Nothing could be measured")
    assert "shared.finalize" not in optuna.get_all_study_names(url)  # a later finalize may retry

    # A baseline that never finished (the study cut short, --partial) is no better.
    url2 = f"sqlite:///{tmp_path / 'empty.db'}"
    empty_plan = plan(tmp_path / "c2", name="empty", storage=url2)
    create_shared_study(empty_plan.model_copy(update={"effective_defaults": {}, "command_line": ["autotune"]}),
                        say=lambda line: None)
    empty = connect(url2, heartbeat_interval_s=1, grace_period_s=30, max_retry=2)
    with pytest.raises(NothingMeasured, match="never completed"):
        finalize(empty, "empty", url=url2, output_dir=tmp_path / "f2", identity=WorkerIdentity(host="h", worker="g"),
                 partial=True, runner=Runner(), say=lambda line: None, sleep=lambda s: None)
    assert not (tmp_path / "f2" / "best.yaml").exists()
    trials = optuna.load_study(study_name="empty", storage=url2).trials
    assert [t.state for t in trials] == [TrialState.WAITING]
