"""Faults injected into real `autotune run` studies and real servers (CPU engine, real processes).

- The baseline's server is SIGKILLed in the middle of its measured window, and the searched
  config reserves too little memory for the KV cache: both trials are classified, the study
  finishes (the baseline kept, and said so on the terminal and in report.md), and no server
  process (engine core included) is left.
- A server still starting its engine at the readiness deadline: timed out, its whole group
  (engine core included) stopped, classified.
- The port the launcher was asked for is held by another process: the real server says so
  within seconds (before any engine start), and the launcher moves to a free port.

The SIGKILLed *tuner* (orphaned server, --resume) is test_run_engine.py's. Each study here
needs engines of its own (every trial launches its server: that is what is under test); the
launcher tests start one server each and stop it before it is ready.
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
from optuna.trial import TrialState
from prometheus_client.parser import text_string_to_metric_families

from autotune.launcher import ServerLauncher, ServerStartFailed, StaleServerRegistry, free_port
from server.config import ServerConfig, default_engine_settings

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"
SHORT = ["--tuning-window", "8", "--holdout-window", "6", "--top-k", "1", "--repeats", "1"]
FAULTS = "Faults during a study"
WARMUP_REQUESTS = 4  # TrialRunner's default
# A small KV-cache share (~0.6 GiB of KV, see tests/server/conftest.py) for the servers that
# must start: little memory held while other engines start beside them.
KV_CACHE_SHARE = 0.15


def small_engine() -> ServerConfig:
    return ServerConfig(engine={**default_engine_settings(), "gpu_memory_utilization": KV_CACHE_SHARE})


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


@pytest.mark.engine(starts=2)
def test_server_killed_mid_window_and_a_config_out_of_memory_are_classified_and_the_study_finishes(
    tmp_path: Path, reliability
) -> None:
    # A KV-cache share below what the engine itself already holds (64 MiB of this machine's
    # RAM): vLLM's CPU worker refuses it while sizing the KV cache, after loading the model.
    share = 64 * 2**20 / psutil.virtual_memory().total
    space = tmp_path / "space.yaml"
    space.write_text(
        "extend_defaults: false\nparams:\n"
        f"  gpu_memory_utilization: {{type: float, low: {share:.6f}, high: {1.5 * share:.6f}}}\n"
    )
    reliability.start(
        "Server SIGKILLed mid-trial; a config that runs out of memory",
        group=FAULTS,
        injected=(
            "`autotune run --trials 2`: SIGKILL to the baseline server's main process once its "
            f"measured window was under way (> {WARMUP_REQUESTS} warm-up + 3 requests answered); "
            f"the searched trial's gpu_memory_utilization = {share:.5f} (64 MiB of RAM for "
            "weights, activations and KV cache)"
        ),
    )
    out = tmp_path / "out"
    log = tmp_path / "tuner.log"
    baseline = tmp_path / "baseline.yaml"
    small_engine().write(baseline)
    # A 12 s window (~50 requests) killed 3 requests in (under a second): the kill lands inside
    # the window even when a busy machine delays this loop by seconds.
    args = ("--trials", "2", "--space", space, "--output-dir", out, "--study-name", "faults",
            "--tuning-window", "12", "--baseline", baseline)
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
    assert tuner.returncode == 0, output[-3000:]

    study = load(out, "faults")
    baseline, starved = study.trials
    assert baseline.user_attrs["baseline"]
    assert baseline.user_attrs["failure"] in ("oom", "crash")
    assert "server died" in baseline.user_attrs["failure_detail"]  # during (or right after) the window
    assert "-9" in baseline.user_attrs["failure_detail"]
    reliability.held(
        f"the killed baseline trial was classified `{baseline.user_attrs['failure']}` "
        f"(\"{baseline.user_attrs['failure_detail'][:110]}...\"); a SIGKILL is what the kernel's "
        "OOM killer sends, so the launcher cannot tell the two apart"
    )
    assert starved.user_attrs["failure"] == "oom", starved.user_attrs
    assert "memory" in starved.user_attrs["failure_detail"]
    reliability.held(
        f"the starved config was classified `oom` (\"{starved.user_attrs['failure_detail'][:120]}...\")"
    )
    for trial in (baseline, starved):
        # A config failure is an infeasible measured trial: the sampler learns to avoid it.
        assert trial.state == TrialState.COMPLETE and trial.constraints["ran"] > 0
    reliability.held("both trials were kept as COMPLETE but infeasible (constraint `ran` violated)")
    best = ServerConfig.load(out / "best.yaml")
    assert best.provenance["decision"]["kept_baseline"] is True
    assert best.engine["gpu_memory_utilization"] == KV_CACHE_SHARE  # the baseline file's
    # Nothing beat the baseline, so best.yaml holds it and the run says so, loudly.
    assert "KEPT THE BASELINE" in output
    report = (out / "report.md").read_text()
    assert "THE BASELINE WAS KEPT" in report and "trial-0001" in report
    assert (out / "history.png").stat().st_size > 0
    reliability.held(
        "the study went on and finished: exit 0, best.yaml (the baseline, kept, as the terminal "
        "and report.md say) and the history plot"
    )

    assert watcher.survivors() == []
    assert json.loads((out / "servers.json").read_text())["servers"] == []
    reliability.held("no server process (main or engine core) of either trial survived; the registry is empty")
    outcome = json.loads((out / "trials" / "trial-0000" / "outcome.json").read_text())
    requests = [json.loads(line) for line in (out / "trials" / "trial-0000" / "requests.jsonl").open()]
    assert outcome["summary"]["completed"] >= 1 and outcome["summary"]["failed"] >= 1
    reliability.held("the killed trial kept what it had measured: requests.jsonl and summary.json were written")

    reliability.figure("trials kept", f"{len(study.trials)} of 2")
    reliability.figure(
        "baseline window before the kill",
        f"{outcome['summary']['completed']} requests completed, {outcome['summary']['failed']} failed after",
    )
    reliability.figure("requests recorded for the killed trial", len(requests))
    reliability.figure("OOM trial: spawn to classified failure", starved.user_attrs["wall_s"], "s")
    reliability.figure("server processes seen (both trials, engine cores included)", len(watcher.seen))
    reliability.figure("server processes left", len(watcher.survivors()))
    reliability.figure("tuner run, kill to exit", time.monotonic() - killed_at, "s (includes the OOM trial)")


@pytest.mark.engine(starts=1)  # stopped once its engine core exists, before it is ready
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
    small_engine().write(config_path)
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
        "study goes on (tests/autotune/test_study.py, test_failed_start_is_infeasible_and_the_study_goes_on)"
    )
    reliability.figure("readiness deadline (after the engine core appeared)", timeout_s, "s")
    reliability.figure("processes at the deadline / left", f"{len(processes)} / {len(teardown.leftover_pids)}")
    reliability.figure("teardown", teardown.seconds, f"s ({teardown.strongest_signal} needed)")


@pytest.mark.engine(starts=0)  # real servers, refused or stopped before any engine
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
