"""Two `autotune worker` processes on one study in a real PostgreSQL, each with its own CPU
engine; one is SIGKILLed mid-trial. Slow: three engine starts, two of them at once (about
3-4.5 minutes on 2 cores).

What a user would notice: the dead worker's trial is failed and measured by the other worker,
the study still ends with the trials asked for, nothing measured twice, the dead worker's
server does not outlive it, and finalize writes best.yaml and a report naming each host.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import optuna
import psutil
import pytest
from optuna.trial import TrialState
from prometheus_client.parser import text_string_to_metric_families

from autotune.measure.server_registry import reap_stale_servers
from autotune.search.trial_records import lost_worker
from server.config import ServerConfig, cpu_memory_share, cpu_node_memory, default_engine_settings

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"


def autotune(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "autotune", *map(str, args)]


def wait_for(condition, timeout_s: float, what: str, logs: list[Path]):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.5)
    tails = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in logs if p.exists())
    raise AssertionError(f"timed out waiting for {what}\n{tails}")


def completions_answered(port: int) -> float:
    """`server_requests_total` of /v1/completions on a trial server (no token on trial servers)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2, trust_env=False).text
    except httpx.HTTPError:
        return 0.0
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "server_requests_total" and sample.labels.get("route") == "/v1/completions"
    )


# Each worker starts its own engine per trial (that is the design under test): three starts.
@pytest.mark.engine(starts=3, seconds=60)
def test_two_workers_one_killed_mid_trial_study_completes_without_duplicates(
    tmp_path: Path, postgres_url: str
) -> None:
    database = postgres_url
    # The embedded default as the baseline, one searched argument.
    baseline = tmp_path / "baseline.yaml"
    ServerConfig(engine=default_engine_settings()).write(baseline)
    space = tmp_path / "space.yaml"
    space.write_text("extend_defaults: false\nparams:\n  max_num_seqs: {type: int, low: 2, high: 16, log: true}\n")
    out = tmp_path / "out"
    created = subprocess.run(
        autotune("run", "--workload", SAMPLE, "--workers-only", "--storage", database,
                 "--study-name", "dist", "--trials", "2", "--tuning-window", "5",
                 "--holdout-window", "6", "--top-k", "1", "--repeats", "1", "--baseline", baseline,
                 "--objective", "goodput",
                 "--space", space, "--slo", "ttft_p50_ms=1", "--output-dir", tmp_path / "creator"),
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert created.returncode == 0, created.stderr[-3000:]

    workers: dict[str, subprocess.Popen] = {}
    logs = {name: tmp_path / f"worker-{name}.log" for name in ("A", "B")}
    handles = []
    try:
        for name in ("A", "B"):
            handle = logs[name].open("w")
            handles.append(handle)
            workers[name] = subprocess.Popen(
                autotune("worker", "--storage", database, "--study", "dist", "--output-dir", out,
                         "--worker-id", name, "--heartbeat-interval", "1", "--grace-period", "5"),
                stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            )
        study = optuna.load_study(study_name="dist", storage=database)

        def a_is_measuring() -> tuple[optuna.trial.FrozenTrial, dict] | None:
            """A's trial once its server answers /health (the engine is up)."""
            registry = next((out / "workers").glob("*--A.servers.json"), None) if (out / "workers").exists() else None
            servers = json.loads(registry.read_text())["servers"] if registry is not None else []
            if not servers:
                return None
            try:
                healthy = httpx.get(f"http://127.0.0.1:{servers[0]['port']}/health", timeout=1,
                                    trust_env=False).status_code == 200
            except httpx.HTTPError:
                return None
            running = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                       if t.user_attrs.get("worker") == "A"]
            return (running[0], servers[0]) if healthy and running else None

        killed, orphan = wait_for(a_is_measuring, 400, "worker A's server to be ready", list(logs.values()))
        # Into the warm-up / measured window: A's server has answered a request.
        wait_for(lambda: completions_answered(orphan["port"]) >= 1, 120,
                 "worker A's server to answer its first request", list(logs.values()))
        assert psutil.pid_exists(orphan["pid"])
        os.kill(workers["A"].pid, signal.SIGKILL)  # the worker only: nobody stops its server for it
        workers["A"].wait(10)
        # The orphaned server notices its worker is gone and stops itself (server.lifeline); a
        # server that did not (an older version) would be ended by worker B's reap_departed.
        gone = wait_for(lambda: not psutil.pid_exists(orphan["pid"])
                        or psutil.Process(orphan["pid"]).status() == psutil.STATUS_ZOMBIE,
                        15, "the orphaned server to be gone", [logs["B"]])
        assert gone

        assert workers["B"].wait(420) == 0, logs["B"].read_text()[-3000:]

        trials = optuna.load_study(study_name="dist", storage=database).trials
        lost = trials[killed.number]
        assert lost.state == TrialState.FAIL and lost_worker(lost) and lost.user_attrs["worker"] == "A"
        retries = [t for t in trials if t.system_attrs.get("failed_trial") == killed.number]
        assert len(retries) == 1
        retry = retries[0]
        assert retry.state == TrialState.COMPLETE and retry.user_attrs["worker"] == "B"
        assert retry.params == lost.params
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        assert len(complete) == 2  # as asked
        assert all(t.user_attrs["worker"] == "B" for t in complete)
        # Nothing measured twice: one result per configuration slot, one folder per trial.
        origins = [t.system_attrs.get("failed_trial", t.number) for t in complete]
        assert len(set(origins)) == len(origins)
        assert len({t.user_attrs["trial_dir"] for t in complete}) == len(complete)
        assert sum(bool(t.user_attrs.get("baseline")) for t in complete) == 1

        final = subprocess.run(
            autotune("finalize", "--storage", database, "--study", "dist", "--output-dir", tmp_path / "final"),
            capture_output=True, text=True, timeout=600, cwd=ROOT,
        )
        assert final.returncode == 0, final.stderr[-3000:] + final.stdout[-2000:]
        best = ServerConfig.load(tmp_path / "final" / "best.yaml")
        assert best.provenance["decision"]["kept_baseline"] is True  # nothing meets a 1 ms TTFT
        assert best.engine["gpu_memory_utilization"] == cpu_memory_share(cpu_node_memory())  # the default
        assert sorted(w.rsplit("/", 1)[1] for w in best.provenance["study"]["workers"]) == ["A", "B"]
        report = (tmp_path / "final" / "report.md").read_text()
        assert "| trial | host |" in report and "/A |" in report and "/B |" in report
        assert "worker lost (no heartbeat)" in report
        assert f"retry of trial-{killed.number:04d}" in report
        # Every registry is empty: no server outlived the test.
        for path in (out / "workers").glob("*.servers.json"):
            assert json.loads(path.read_text())["servers"] == [], path
    finally:
        for process in workers.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        for path in (out / "workers").glob("*.servers.json") if (out / "workers").exists() else []:
            reap_stale_servers(path)
        for handle in handles:
            handle.close()
