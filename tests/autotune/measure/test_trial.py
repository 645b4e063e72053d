"""TrialRunner's own logic (steps, classification, files, teardown) against a fake server
subprocess that streams completions; the real-engine trial is in test_trial_engine.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from autotune.measure import trial as trial_module
from autotune.measure.launcher import ServerStartFailed
from autotune.measure.server_registry import StaleServerRegistry
from autotune.measure.trial import TrialOutcome, TrialRunner, _Failed
from server.config import ServerConfig
from workloads.replay_summary import ReplaySummary, RequestRecord
from workloads.trace import Trace, TraceRequest

HELPERS = Path(__file__).resolve().parents[1]  # tests/autotune: the fake servers, the tuners, fixtures/
FAKE_SERVER = HELPERS / "fake_server.py"
METRICS = HELPERS / "fixtures" / "metrics_vllm_0_32.txt"


@pytest.fixture(scope="module")
def config() -> ServerConfig:
    return ServerConfig(engine={"model": "fake", "max_num_seqs": 8})


def window(n: int = 12, spacing_ms: float = 100.0, output_length: int = 5) -> Trace:
    return Trace.from_requests(
        [
            TraceRequest(timestamp=i * spacing_ms, input_length=10 + i, output_length=output_length)
            for i in range(n)
        ],
        source="test window",
    )


def runner(tmp_path: Path, **behaviour: object) -> TrialRunner:
    behaviour.setdefault("metrics_file", str(METRICS))
    path = tmp_path / "behaviour.json"
    path.write_text(json.dumps(behaviour))
    return TrialRunner(
        server_command=[sys.executable, str(FAKE_SERVER), "--behaviour", str(path)],
        startup_timeout_s=10,
        warmup_requests=2,
        scrape_interval_s=0.2,
        stale_registry=tmp_path / "servers.json",
    )


def server_pids(trial_dir: Path) -> list[int]:
    """Processes still running with this trial's config.yaml on their command line."""
    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and str(trial_dir / "config.yaml") in p.info["cmdline"]
    ]


def window_requests_answered(registry: Path, warmup_requests: int = 2) -> int:
    """Completions the registered fake server received after its warm-up (0 if none yet)."""
    try:
        servers = StaleServerRegistry(registry).entries()
        if not servers:
            return 0
        stats = httpx.get(f"http://127.0.0.1:{servers[0].port}/stats", timeout=2, trust_env=False)
        return stats.json()["completions"] - warmup_requests
    except (OSError, ValueError, httpx.HTTPError):  # not there yet, or gone
        return 0


def assert_outcome_file_matches(outcome: TrialOutcome, trial_dir: Path) -> None:
    on_disk = TrialOutcome.model_validate_json((trial_dir / "outcome.json").read_text())
    assert on_disk == outcome


@pytest.mark.slow
def test_ok_trial_writes_every_file_and_stops_the_server(tmp_path: Path, config: ServerConfig) -> None:
    trial_dir = tmp_path / "study" / "trial-0000"
    outcome = runner(tmp_path).run(config, window(), trial_dir)

    assert outcome.ok, outcome.failure_detail
    assert outcome.failure is None
    assert sorted(p.name for p in trial_dir.iterdir()) == [
        "config.yaml",
        "outcome.json",
        "requests.jsonl",
        "server.log",
        "server_metrics.json",
        "summary.json",
    ]
    assert ServerConfig.load(trial_dir / "config.yaml").engine["max_num_seqs"] == 8
    records = [
        RequestRecord.model_validate_json(line)
        for line in (trial_dir / "requests.jsonl").read_text().splitlines()
    ]
    assert [r.index for r in records] == list(range(12))
    assert all(r.error is None and r.output_tokens == 5 for r in records)
    summary = ReplaySummary.model_validate_json((trial_dir / "summary.json").read_text())
    assert summary.completed == 12 and summary == outcome.summary
    assert_outcome_file_matches(outcome, trial_dir)

    timing = outcome.timing
    assert timing is not None
    assert 0 <= timing.launch_s <= timing.ready_s
    # The window's last request is scheduled at 1.1 s: measuring cannot take less.
    assert timing.measure_s >= 1.1
    assert timing.warmup_s > 0 and timing.teardown_s > 0
    assert outcome.server_metrics is not None and len(outcome.server_metrics.timeline) >= 3
    assert outcome.teardown is not None and outcome.teardown.leftover_pids == []
    assert server_pids(trial_dir) == []
    assert StaleServerRegistry(tmp_path / "servers.json").entries() == []


@pytest.mark.slow
def test_too_many_http_errors_fail_the_trial_but_keep_the_summary(
    tmp_path: Path, config: ServerConfig
) -> None:
    trial_dir = tmp_path / "trial-0001"
    # Every 4th completion fails: 25% of the window, well above the 5% limit.
    outcome = runner(tmp_path, fail_every=4).run(config, window(), trial_dir)
    assert not outcome.ok
    assert outcome.failure == "http_errors"
    assert "HTTP 500" in outcome.failure_detail
    assert outcome.summary is not None and outcome.summary.failed >= 2
    assert (trial_dir / "summary.json").exists() and (trial_dir / "requests.jsonl").exists()
    assert outcome.timing is not None  # the window was measured
    assert_outcome_file_matches(outcome, trial_dir)


@pytest.mark.slow
def test_server_dying_in_the_window_is_a_crash_with_its_last_words(
    tmp_path: Path, config: ServerConfig
) -> None:
    trial_dir = tmp_path / "trial-0002"
    message = "RuntimeError: EngineCore died unexpectedly"
    # 2 warm-up requests, then 3 of the window, then the process exits.
    long_window = window(n=200, spacing_ms=100.0)  # 20 s if sent to the end
    outcome = runner(tmp_path, die_after=5, message=message).run(config, long_window, trial_dir)
    assert outcome.failure == "crash"
    assert "during the window" in outcome.failure_detail
    assert message in outcome.failure_detail
    assert server_pids(trial_dir) == []
    assert_outcome_file_matches(outcome, trial_dir)
    # The window ended with the server: most of its requests were never sent to a dead port.
    records = (trial_dir / "requests.jsonl").read_text().splitlines()
    assert 3 <= len(records) < len(long_window) / 2


@pytest.mark.slow
def test_start_timeout_is_an_outcome_not_an_exception(tmp_path: Path, config: ServerConfig) -> None:
    trial_dir = tmp_path / "trial-0003"
    trial_runner = runner(tmp_path, ready_after_s=None, spawn_child=True)
    trial_runner.startup_timeout_s = 1.5
    outcome = trial_runner.run(config, window(), trial_dir)
    assert outcome.failure == "start_timeout"
    assert outcome.summary is None and outcome.timing is None
    assert outcome.teardown is not None and outcome.teardown.leftover_pids == []
    assert sorted(p.name for p in trial_dir.iterdir()) == ["config.yaml", "outcome.json", "server.log"]
    assert server_pids(trial_dir) == []
    assert StaleServerRegistry(tmp_path / "servers.json").entries() == []


@pytest.mark.slow
def test_pruner_stops_the_window(tmp_path: Path, config: ServerConfig) -> None:
    trial_dir = tmp_path / "trial-0004"
    asked: list[float] = []

    def should_prune(elapsed_s: float, summary: ReplaySummary) -> bool:
        asked.append(elapsed_s)
        return elapsed_s >= 1.0

    long_window = window(n=60, spacing_ms=100.0)  # 6 s if not stopped
    outcome = runner(tmp_path).run(config, long_window, trial_dir, should_prune=should_prune)
    assert outcome.failure == "pruned"
    assert asked and asked[-1] >= 1.0
    assert outcome.summary is not None and outcome.summary.stopped_early
    # Stopped: the window's later requests were never sent.
    records = (trial_dir / "requests.jsonl").read_text().splitlines()
    assert len(records) < len(long_window)
    assert outcome.timing is not None
    assert server_pids(trial_dir) == []


@pytest.mark.slow
def test_ctrl_c_stops_the_server_records_interrupted_and_reraises(
    tmp_path: Path, config: ServerConfig
) -> None:
    trial_dir = tmp_path / "trial-0005"
    long_window = window(n=100, spacing_ms=100.0)  # 10 s; interrupted once it is under way
    trial_runner = runner(tmp_path, spawn_child=True)

    sent: list[int] = []
    finished = threading.Event()  # the trial returned (or raised): the watcher gives up

    def interrupt_once_measuring() -> None:
        # The fake server's port is in the registry; it counts the completions it received:
        # past the 2 warm-up requests, the measured window is under way.
        while not finished.wait(0.05):
            answered = window_requests_answered(tmp_path / "servers.json")
            if answered >= 1:
                sent.append(answered)
                os.kill(os.getpid(), signal.SIGINT)
                return

    # Ctrl-C as a terminal sends it: Python's own handler (whatever an earlier test left).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    thread = threading.Thread(target=interrupt_once_measuring, daemon=True)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            try:
                trial_runner.run(config, long_window, trial_dir)
            finally:
                finished.set()
                assert sent, "the watcher never saw the window start: no Ctrl-C was sent"
    finally:
        thread.join()
        signal.signal(signal.SIGINT, previous)
    outcome = TrialOutcome.model_validate_json((trial_dir / "outcome.json").read_text())
    assert outcome.failure == "interrupted" and not outcome.ok
    assert outcome.teardown is not None and outcome.teardown.leftover_pids == []
    assert server_pids(trial_dir) == []
    assert StaleServerRegistry(tmp_path / "servers.json").entries() == []


class ExitsLate:
    """A server killed while a scrape was under way: alive() (waitpid) turns False only
    `exit_shows_after_s` after its sockets closed, as on a loaded machine."""

    def __init__(self, exit_shows_after_s: float | None):
        self.exit_shows_at = (
            None if exit_shows_after_s is None else time.monotonic() + exit_shows_after_s
        )

    def alive(self) -> bool:
        return self.exit_shows_at is None or time.monotonic() < self.exit_shows_at

    def failure(self) -> ServerStartFailed:
        return ServerStartFailed("crash", "server exited with code -9 (killed by SIGKILL)")


class ClosedSocketScraper:
    async def scrape(self) -> None:
        raise httpx.ReadError("")


def test_failed_scrape_of_a_server_whose_exit_shows_late_is_its_death(tmp_path: Path) -> None:
    server = ExitsLate(exit_shows_after_s=0.5)
    with pytest.raises(_Failed) as failed:
        asyncio.run(runner(tmp_path)._scrape(ClosedSocketScraper(), server, "after the window"))
    assert failed.value.kind == "crash"
    assert failed.value.detail.startswith("server died after the window: server exited with code -9")


def test_failed_scrape_of_a_server_still_running_after_the_grace_is_a_scrape_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trial_module, "EXIT_GRACE_S", 0.3)
    with pytest.raises(_Failed) as failed:
        asyncio.run(runner(tmp_path)._scrape(ClosedSocketScraper(), ExitsLate(None), "after the window"))
    assert failed.value.kind == "crash"
    assert failed.value.detail == "GET /metrics after the window failed: ReadError('')"
