"""`autotune run` end to end on the real CPU engine (slow: each engine start is ~30-60 s).

Kept to five engine starts in all: a short study whose searched config cannot start (the
failure is classified, the study goes on, best.yaml and report.md are written), and a tuner
SIGKILLed mid-trial then resumed (completed trials intact, no orphan server, study finishes).
"""

from __future__ import annotations

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


def test_sigkilled_tuner_resumes_without_orphans_or_lost_trials(tmp_path: Path) -> None:
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
    before = load(out, "kill").trials[0]
    assert before.state == TrialState.COMPLETE and before.user_attrs["baseline"]

    done = subprocess.run(autotune(*args, "--resume"), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
    study = load(out, "kill")
    assert study.trials[0].values == before.values and study.trials[0].params == before.params
    assert study.trials[1].state == TrialState.FAIL and study.trials[1].user_attrs["interrupted"]
    assert study.trials[2].state == TrialState.COMPLETE
    assert (out / "best.yaml").exists() and (out / "report.md").exists()
    assert json.loads(registry.read_text())["servers"] == []
