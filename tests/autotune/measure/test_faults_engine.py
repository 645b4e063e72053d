"""Faults injected into real `autotune run` studies and real servers (CPU engine, real processes).

- The baseline's server is SIGKILLed in the middle of its measured window: the failure is
  classified, and since nothing can be judged without a measured baseline the run stops at
  once (exit 12), writes no best.yaml, says why in report.md, and leaves no server process
  (engine core included). A searched config that runs out of memory is test_run_engine.py's.
- A server still starting its engine at the readiness deadline: timed out, its whole group
  (engine core included) stopped, classified.
- The port the launcher was asked for is held by another process: the real server says so
  within seconds (before any engine start), and the launcher moves to a free port.

The SIGKILLed *tuner* (orphaned server, --resume) is test_run_engine.py's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import optuna
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from autotune.measure.launcher import ServerLauncher, ServerStartFailed
from autotune.measure.server_registry import StaleServerRegistry
from autotune.measure.server_start import free_port
from server.config import ServerConfig, default_engine_settings

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"
# Fault flows do not depend on the objective: goodput (one replay per trial) keeps them short;
# the capacity ladder end to end is test_ladder_engine.py's.
SHORT = ["--tuning-window", "8", "--holdout-window", "6", "--top-k", "1", "--repeats", "1",
         "--objective", "goodput"]
FAULTS = "Faults during a study"
WARMUP_REQUESTS = 4  # TrialRunner's default


def autotune(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "autotune", "run", "--workload", str(SAMPLE), *SHORT, *map(str, args)]


def load(out: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{(out / 'study.db').resolve()}")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class ServerWatcher:
    """Follows the servers a tuner registers in its stale-server registry and remembers every
    process they had (server and engine core), to check afterwards that none is left."""

    def __init__(self, registry: Path) -> None:
        self.registry = registry
        self.seen: dict[int, str] = {}  # pid -> trial
        self.ports: dict[str, int] = {}  # trial -> port

    def poll(self) -> list[dict]:
        try:
            servers = json.loads(self.registry.read_text())["servers"]
        except (OSError, ValueError, KeyError):
            return []
        for entry in servers:
            self.ports[entry["trial"]] = entry["port"]
            self.seen.setdefault(entry["pid"], entry["trial"])
            try:
                children = psutil.Process(entry["pid"]).children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for child in children:
                self.seen.setdefault(child.pid, entry["trial"])
        return servers

    def survivors(self) -> list[int]:
        return sorted(pid for pid in self.seen if alive(pid))


def completions_answered(port: int) -> float:
    """`server_requests_total` of /v1/completions on a trial server (no token on trial servers)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2, trust_env=False).text
    except httpx.HTTPError:
        return 0.0
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "server_requests_total" and sample.labels.get("route") == "/v1/completions":
                total += sample.value
    return total


def run_tuner(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as handle:
        return subprocess.Popen(
            args, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )


def end_tuner(tuner: subprocess.Popen[bytes]) -> None:
    if tuner.poll() is None:
        os.killpg(tuner.pid, signal.SIGKILL)
        tuner.wait()


@pytest.mark.engine(seconds=21)
def test_baseline_server_killed_mid_window_is_classified_and_stops_the_run_with_nothing_exported(
    tmp_path: Path, reliability
) -> None:
    reliability.start(
        "Baseline server SIGKILLed mid-trial",
        group=FAULTS,
        injected=(
            "`autotune run --trials 2`: SIGKILL to the baseline server's main process once its "
            f"measured window was under way (> {WARMUP_REQUESTS} warm-up + 3 requests answered)"
        ),
    )
    out = tmp_path / "out"
    log = tmp_path / "tuner.log"
    # A 20 s window (~90 requests) killed 3 requests in: the kill lands inside the window even
    # when a busy machine delays this loop by seconds (8 s windows were over before it). p50
    # SLOs: a p95 would need 200 requests per window (autotune.preflight).
    args = ("--trials", "2", "--output-dir", out, "--study-name", "faults", "--tuning-window", "20",
            "--slo", "ttft_p50_ms=1000", "--slo", "tpot_p50_ms=100")
    tuner = run_tuner(autotune(*args), log)
    watcher = ServerWatcher(out / "servers.json")
    killed_at: float | None = None
    killed_pid: int | None = None
    deadline = time.monotonic() + 600
    try:
        while tuner.poll() is None and time.monotonic() < deadline:
            for entry in watcher.poll():
                if killed_pid is None and entry["trial"] == "trial-0000":
                    if completions_answered(entry["port"]) >= WARMUP_REQUESTS + 3:
                        watcher.poll()  # the engine core too, right before the kill
                        os.kill(entry["pid"], signal.SIGKILL)
                        killed_pid, killed_at = entry["pid"], time.monotonic()
            time.sleep(0.2)
        assert tuner.poll() is not None, "the tuner did not finish within 600 s"
    finally:
        end_tuner(tuner)
    output = log.read_text(errors="replace")
    assert killed_pid is not None, output[-3000:]
    assert tuner.returncode == 12, output[-3000:]

    study = load(out, "faults")
    [baseline] = study.trials  # stopped at once: no searched trial was started
    assert baseline.user_attrs["baseline"]
    assert baseline.user_attrs["failure"] in ("oom", "crash")
    assert "server died" in baseline.user_attrs["failure_detail"]  # during (or right after) the window
    assert "-9" in baseline.user_attrs["failure_detail"]
    reliability.held(
        f"the killed baseline trial was classified `{baseline.user_attrs['failure']}` "
        f"(\"{baseline.user_attrs['failure_detail'][:110]}...\"); a SIGKILL is what the kernel's "
        "OOM killer sends, so the launcher cannot tell the two apart"
    )
    [line] = [x for x in output.splitlines() if x.startswith("autotune: nothing could be measured: ")]
    assert "trial-0000 failed" in line
    reliability.held(f"the run stopped at once with exit 12: \"{line[:160]}...\"")
    assert not (out / "best.yaml").exists() and not (out / "trials" / "trial-0001").exists()
    assert (out / "report.md").read_text().startswith("# Nothing could be measured")
    reliability.held("no searched trial, no gate, no best.yaml; report.md's first line: nothing could be measured")

    assert watcher.survivors() == []
    assert json.loads((out / "servers.json").read_text())["servers"] == []
    reliability.held("no server process (main or engine core) survived; the registry is empty")
    outcome = json.loads((out / "trials" / "trial-0000" / "outcome.json").read_text())
    requests = [json.loads(line) for line in (out / "trials" / "trial-0000" / "requests.jsonl").open()]
    # The window stops once the server is seen dead: requests cut off by the kill either
    # failed or were cancelled with the rest of the window, depending on which came first.
    summary = outcome["summary"]
    assert summary["completed"] >= 1 and summary["failed"] + summary["cancelled"] >= 1
    reliability.held("the killed trial kept what it had measured: requests.jsonl and summary.json were written")

    reliability.figure(
        "baseline window before the kill",
        f"{summary['completed']} requests completed, {summary['failed']} failed and "
        f"{summary['cancelled']} cancelled after",
    )
    reliability.figure("requests recorded for the killed trial", len(requests))
    reliability.figure("server processes seen (engine core included)", len(watcher.seen))
    reliability.figure("server processes left", len(watcher.survivors()))
    reliability.figure("tuner run, kill to exit", time.monotonic() - killed_at, "s")


@pytest.mark.engine(seconds=20)
def test_server_never_ready_is_timed_out_killed_and_classified(tmp_path: Path, reliability) -> None:
    reliability.start(
        "Server that never becomes ready",
        group=FAULTS,
        injected=(
            "a real server whose readiness deadline passes while its engine is still starting "
            "(the deadline is set once the engine core process exists, so the whole tree is "
            "there to be stopped); the launcher's own start() path: wait_ready, then stop"
        ),
    )
    config_path = tmp_path / "config.yaml"
    ServerConfig(engine=default_engine_settings()).write(config_path)
    registry = StaleServerRegistry(tmp_path / "servers.json")
    launcher = ServerLauncher(startup_timeout_s=240, registry=registry, study="slow")
    server = launcher.spawn(config_path, tmp_path / "server.log", port=free_port(), trial="trial-0000")
    try:
        deadline = time.monotonic() + 240
        while len(server.known_pids()) == 1 and server.alive() and time.monotonic() < deadline:
            server.track_children()
            time.sleep(0.1)
        processes = server.known_pids()
        assert len(processes) > 1, "the server never started an engine core"
        timeout_s = time.monotonic() - server.spawned_at + 1.0
        with pytest.raises(ServerStartFailed) as raised:
            server.wait_ready(timeout_s)
    finally:
        teardown = server.stop()
    assert raised.value.kind == "start_timeout"
    assert f"not 200 after {timeout_s:g} s" in raised.value.detail
    reliability.held(f"classified `start_timeout` (\"{raised.value.detail[:90]}...\")")
    assert teardown.leftover_pids == []
    assert [pid for pid in processes if alive(pid)] == []
    assert registry.entries() == []
    reliability.held(
        "the whole process group, engine core included, was stopped; the registry is empty"
    )
    reliability.held(
        "a trial whose start fails this way is told to the study as an infeasible trial and the "
        "study goes on (tests/autotune/search/test_study.py, test_failed_start_is_infeasible_and_the_study_goes_on)"
    )
    reliability.figure("readiness deadline (after the engine core appeared)", timeout_s, "s")
    reliability.figure("processes at the deadline / left", f"{len(processes)} / {len(teardown.leftover_pids)}")
    reliability.figure("teardown", teardown.seconds, f"s ({teardown.strongest_signal} needed)")


def test_port_taken_by_another_process_is_named_fast_and_avoided(tmp_path: Path, reliability) -> None:
    reliability.start(
        "Port taken by another process",
        group=FAULTS,
        injected="another process listens on the port the launcher was asked to use",
    )
    config_path = tmp_path / "config.yaml"
    ServerConfig(engine=default_engine_settings()).write(config_path)
    registry = StaleServerRegistry(tmp_path / "servers.json")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]

        # The race the launcher cannot rule out: the port is taken when the server binds.
        launcher = ServerLauncher(startup_timeout_s=240, registry=registry, study="ports")
        log = tmp_path / "race.log"
        started = time.monotonic()
        server = launcher.spawn(config_path, log, port=taken)
        try:
            with pytest.raises(ServerStartFailed) as raised:
                server.wait_ready(240)
        finally:
            teardown = server.stop()
        detected_s = time.monotonic() - started
        assert raised.value.kind == "port_in_use", raised.value.detail
        assert f"127.0.0.1:{taken}" in raised.value.detail
        assert "EngineCore" not in log.read_text()  # refused before any engine started
        assert teardown.leftover_pids == [] and registry.entries() == []
        reliability.held(
            f"the real server refused to start before building an engine; classified `port_in_use` "
            f"(\"{raised.value.detail}\")"
        )

        # Asked for the taken port, the launcher picks a free one instead. A 3 s readiness
        # deadline keeps this cheap: the server only has to be spawned to show its port.
        short = ServerLauncher(startup_timeout_s=3, registry=registry, study="ports")
        moved = tmp_path / "moved.log"
        with pytest.raises(ServerStartFailed) as timed_out:
            short.start(config_path, moved, port=taken)
        header = moved.read_text().splitlines()[0]
        assert f"--port {taken} " not in header and "--port " in header
        assert timed_out.value.kind == "start_timeout"
        assert timed_out.value.teardown is not None and timed_out.value.teardown.leftover_pids == []
        assert registry.entries() == []
        reliability.held(
            "asked for the taken port, the launcher started the server on a free one "
            f"({header.split('--port ')[1].split()[0]} instead of {taken}); nothing was left running"
        )
    reliability.figure("spawn to classified port_in_use", detected_s, "s")
    reliability.figure("server processes left", len(teardown.leftover_pids))
