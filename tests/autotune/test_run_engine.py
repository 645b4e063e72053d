"""`autotune run` end to end on the real CPU engine (slow: each engine start is ~30-60 s).

Kept to five engine starts in all: a short study whose searched config cannot start (the
failure is classified, the study goes on, best.yaml and report.md are written), and a tuner
SIGKILLed mid-trial then resumed (completed trials intact, no orphan server, study finishes).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest
from optuna.trial import TrialState

from server.config import ServerConfig

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"
SHORT = ["--tuning-window", "8", "--holdout-window", "6", "--top-k", "1", "--repeats", "1"]


def autotune(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "autotune", "run", "--workload", str(SAMPLE), *SHORT, *map(str, args)]


def load(out: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{(out / 'study.db').resolve()}")


def test_a_config_that_cannot_start_is_classified_and_the_study_finishes(tmp_path: Path) -> None:
    # vLLM refuses a memory share above 1: the server exits at start.
    space = tmp_path / "space.yaml"
    space.write_text(
        "extend_defaults: false\nparams:\n  gpu_memory_utilization: {type: float, low: 1.5, high: 1.6}\n"
    )
    out = tmp_path / "out"
    done = subprocess.run(
        autotune("--trials", "2", "--space", space, "--output-dir", out, "--study-name", "e2e"),
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    study = load(out, "e2e")
    baseline, broken = study.trials
    assert baseline.user_attrs["baseline"] and baseline.user_attrs["failure"] is None
    assert broken.user_attrs["failure"] in ("invalid_config", "crash")
    assert broken.user_attrs["failure_detail"]  # one line saying why
    assert broken.state == TrialState.COMPLETE and broken.constraints["ran"] > 0
    # Nothing beat the baseline, so best.yaml holds it and says so, loudly.
    best = ServerConfig.load(out / "best.yaml")
    assert best.provenance["decision"]["kept_baseline"] is True
    assert "gpu_memory_utilization" not in best.engine or best.engine["gpu_memory_utilization"] <= 1
    assert "KEPT THE BASELINE" in done.stdout
    report = (out / "report.md").read_text()
    assert "THE BASELINE WAS KEPT" in report and "trial-0001" in report
    assert (out / "history.png").stat().st_size > 0


def test_sigkilled_tuner_resumes_without_orphans_or_lost_trials(tmp_path: Path, reliability) -> None:
    reliability.start(
        "Tuner SIGKILLed mid-trial, then resumed",
        group="Faults during a study",
        injected=(
            "SIGKILL to the `autotune run --trials 2` process (not its group) as trial-0001's "
            "server was spawned; that server is left running, orphaned; then `--resume`"
        ),
    )
    out = tmp_path / "out"
    # An SLO nothing meets: no candidate reaches the gate, which keeps this test to 3 starts.
    args = ("--trials", "2", "--slo", "ttft_p95_ms=1", "--output-dir", out, "--study-name", "kill")
    log = (tmp_path / "first.log").open("w")
    tuner = subprocess.Popen(autotune(*args), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                             start_new_session=True)
    registry = out / "servers.json"
    deadline = time.monotonic() + 400
    orphan: int | None = None
    try:
        while time.monotonic() < deadline and tuner.poll() is None:
            second = out / "trials" / "trial-0001" / "server.log"
            if second.exists() and registry.exists():
                servers = json.loads(registry.read_text())["servers"]
                if servers:
                    orphan = servers[0]["pid"]
                    break
            time.sleep(0.2)
        assert orphan is not None, (tmp_path / "first.log").read_text()[-3000:]
        os.kill(tuner.pid, signal.SIGKILL)  # the tuner only: its server is left behind
        tuner.wait(30)
    finally:
        if tuner.poll() is None:
            os.killpg(tuner.pid, signal.SIGKILL)
        log.close()
    assert psutil.pid_exists(orphan)  # the situation --resume must clean up
    # The orphan goes on starting its engine: wait for its engine core, so that the resumed
    # run has a whole process tree to end, not just the server's main process.
    orphans = {orphan}
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and len(orphans) == 1:
        with contextlib.suppress(psutil.NoSuchProcess):
            orphans |= {child.pid for child in psutil.Process(orphan).children(recursive=True)}
        time.sleep(0.2)
    assert len(orphans) > 1, "the orphaned server never started an engine core"
    reliability.held(
        f"the orphaned server outlived its tuner and started its engine core ({len(orphans)} processes)"
    )
    before = load(out, "kill").trials[0]
    assert before.state == TrialState.COMPLETE and before.user_attrs["baseline"]

    resumed_at = time.monotonic()
    done = subprocess.run(autotune(*args, "--resume"), capture_output=True, text=True, timeout=600, cwd=ROOT)
    resume_s = time.monotonic() - resumed_at
    assert done.returncode == 0, done.stderr[-3000:]
    left = sorted(pid for pid in orphans if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    assert left == []
    assert "left behind" in done.stdout
    reliability.held(
        "the resumed run found the orphan in the study's stale-server registry and ended its whole "
        f"process tree before measuring anything (\"{next(line for line in done.stdout.splitlines() if 'left behind' in line)}\")"
    )
    study = load(out, "kill")
    assert study.trials[0].values == before.values and study.trials[0].params == before.params
    reliability.held("the completed baseline trial is intact (same values and parameters)")
    assert study.trials[1].state == TrialState.FAIL and study.trials[1].user_attrs["interrupted"]
    reliability.held(
        f"the interrupted trial is marked FAIL with \"{study.trials[1].user_attrs['interrupted']}\" "
        "and does not count toward --trials"
    )
    assert study.trials[2].state == TrialState.COMPLETE
    assert (out / "best.yaml").exists() and (out / "report.md").exists()
    assert json.loads(registry.read_text())["servers"] == []
    reliability.held("the study finished: a new trial ran in its place, best.yaml and report.md written, registry empty")
    reliability.figure("trials kept", f"{len(study.trials)} (1 completed before the kill, 1 marked interrupted, 1 new)")
    reliability.figure("orphaned processes found / left after --resume", f"{len(orphans)} / {len(left)}")
    reliability.figure("resumed run, start to finish", resume_s, "s")
