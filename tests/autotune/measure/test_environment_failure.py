"""Environment failures stop the study (issue 58): a trial whose server dies of the install (a
missing module, a CUDA or driver error) is classified `environment`, not `invalid_config` or
`crash`, and ends the study after that trial with one line naming the module, exit 13, and
every trial measured before it kept.

The tuner is the real CLI in its own process (tests/autotune/missing_module_tuner.py); its
servers are real processes: the baseline's a fake server, the next one a server whose start
fails on a real import (tests/autotune/missing_module_server.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
from optuna.trial import TrialState

from autotune.errors import EXIT_ENVIRONMENT
from autotune.measure.server_start import classify_exit
from autotune.search.objective import CONFIG_FAILURES

HELPERS = Path(__file__).resolve().parents[1]  # tests/autotune: the fake servers, the tuners, fixtures/
ROOT = HELPERS.parents[1]
SAMPLE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"
TUNER = HELPERS / "missing_module_tuner.py"
METRICS = HELPERS / "fixtures" / "metrics_vllm_0_32.txt"
MISSING = "autotune_test_module_not_installed"


def test_a_server_that_fails_on_import_ends_the_study_as_environment(tmp_path: Path) -> None:
    behaviour = tmp_path / "behaviour.json"
    behaviour.write_text(json.dumps({"metrics_file": str(METRICS), "token_delay_s": 0.005}))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, str(TUNER), str(tmp_path / "launches"), "1", str(behaviour),
         "run", "--workload", str(SAMPLE), "--objective", "goodput", "--trials", "4",
         "--tuning-window", "8", "--holdout-window", "6", "--top-k", "1", "--repeats", "1",
         "--slo", "ttft_p50_ms=1000", "--slo", "tpot_p50_ms=100", "--output-dir", str(out),
         "--study-name", "env"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )
    assert done.returncode == EXIT_ENVIRONMENT, done.stderr[-3000:]
    [line] = [line for line in done.stderr.splitlines() if line.startswith("autotune: environment failure: ")]
    assert line.startswith("autotune: environment failure: trial-0001: ")
    assert f"missing module '{MISSING}'" in line and "--resume" in line
    # Stopped after that trial: no further trial, no gate, nothing exported.
    assert not (out / "trials" / "trial-0002").exists()
    assert not (out / "validation").exists() and not (out / "best.yaml").exists()
    # Nothing measured is lost: the baseline's measurement is in the study, the failed trial
    # is FAIL (TPE learns nothing about a config from the install) and says why.
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name="env", storage=f"sqlite:///{out / 'study.db'}")
    baseline, failed = study.trials
    assert baseline.state == TrialState.COMPLETE and baseline.user_attrs.get("score", 0) > 0
    assert failed.state == TrialState.FAIL and failed.user_attrs["failure"] == "environment"
    assert MISSING in failed.user_attrs["failure_detail"]
    outcome = json.loads((out / "trials" / "trial-0001" / "outcome.json").read_text())
    assert outcome["failure"] == "environment"


def test_the_h200_loguru_failure_is_the_environment_not_the_config() -> None:
    # What our server printed on the H200 when vLLM's fp8 path could not import loguru (exit 2,
    # which alone reads as a config vLLM rejected).
    tail = ["server: error: trial-0003/config.yaml: vLLM rejected the engine settings: "
            "No module named 'loguru'"]
    assert classify_exit(2, tail) == "environment"
    assert classify_exit(1, ["RuntimeError: Found no NVIDIA driver on your system."]) == "environment"
    assert classify_exit(1, ["torch.OutOfMemoryError: CUDA out of memory."]) == "oom"
    assert classify_exit(2, ["pydantic_core._pydantic_core.ValidationError: 1 validation error for SchedulerConfig"]) == "invalid_config"
    assert "environment" not in CONFIG_FAILURES
