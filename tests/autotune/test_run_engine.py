"""`autotune run` end to end on the real CPU engine (slow: each engine start is ~30-60 s).

A tuner SIGKILLed mid-trial then resumed (completed trials intact, no orphan server, study
finishes): three engine starts, each trial's own, as in production.

Where the rest of the end-to-end run is proved: a searched config vLLM refuses is classified
`invalid_config` by the real server (test_trial_engine.py), a study whose searched configs
fail goes on and keeps the baseline, loudly, in best.yaml, report.md and the history plot
(test_faults_engine.py), with every failure kind (test_study.py, fake runner).
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

from server.config import ServerConfig, default_engine_settings

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"
SHORT = ["--tuning-window", "8", "--holdout-window", "6", "--top-k", "1", "--repeats", "1"]


def autotune(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "autotune", "run", "--workload", str(SAMPLE), *SHORT, *map(str, args)]


def load(out: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{(out / 'study.db').resolve()}")


@pytest.mark.engine(starts=3)
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
    # A small KV-cache share (~0.6 GiB of KV; the default holds ~3 GiB): the orphan and the
    # resumed run's server are up at once.
    baseline = tmp_path / "baseline.yaml"
    ServerConfig(engine={**default_engine_settings(), "gpu_memory_utilization": 0.15}).write(baseline)
    # An SLO nothing meets: no candidate reaches the gate, which keeps this test to 3 starts.
    args = ("--trials", "2", "--slo", "ttft_p95_ms=1", "--output-dir", out, "--study-name", "kill",
            "--baseline", baseline)
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
