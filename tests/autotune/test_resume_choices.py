"""`autotune run --resume` compares what the user chose, not what the machine derived.

A changed trace, model, baseline, comparison, SLOs, objective or space file is refused in one
line naming each change (exit 2, before any server starts); with nothing changed the study goes
on with the space, baseline and defaults it was created with, even where this machine derives
other ones (on CPU the memory share and its band follow the NUMA node's RAM)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import server.config
from autotune.cli import main
from autotune.prepare import prepare_plan
from autotune.request import TuningRequest
from server.config import DEFAULT_MODEL_DIR
from workloads.trace_io import read_trace, write_trace

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SAMPLE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"
GIB = 2**30
# Nodes whose embedded memory shares differ (server.config.cpu_memory_share: 0.19 and 0.15).
SMALL_NODE, LARGER_NODE = 8 * GIB, 10 * GIB


def args(out: Path, *extra: str, workload: Path = SAMPLE) -> list[str]:
    return ["run", "--workload", str(workload), "--trials", "1", "--tuning-window", "8",
            "--holdout-window", "6", "--top-k", "1", "--repeats", "1", "--objective", "goodput",
            "--slo", "ttft_p50_ms=1000", "--slo", "tpot_p50_ms=100", "--study-name", "s",
            "--output-dir", str(out), *extra]


def on_node(monkeypatch: pytest.MonkeyPatch, node_bytes: int) -> None:
    monkeypatch.setattr(server.config, "cpu_node_memory", lambda: node_bytes)


@pytest.fixture
def created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> Path:
    """A study created (baseline queued, nothing measured) on a node of SMALL_NODE bytes."""
    on_node(monkeypatch, SMALL_NODE)
    out = tmp_path / "out"
    assert main(args(out, "--workers-only")) == 0
    capsys.readouterr()
    return out


def refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("autotune: error:")]
    assert len(lines) == 1
    assert lines[0].startswith("autotune: error: --resume: study 's' in sqlite:///")
    assert "was created with other inputs: " in lines[0]
    return lines[0]


def other_trace(tmp_path: Path) -> Path:
    """The sample with every output one token longer: same arrivals, other traffic."""
    trace = read_trace(SAMPLE).trace
    trace.output_lengths[:] += 1
    path = tmp_path / "other.jsonl"
    write_trace(path, trace)
    return path


def test_a_changed_trace_is_refused_naming_the_trace(created: Path, tmp_path: Path, capsys) -> None:
    line = refusal(capsys, args(created, "--resume", workload=other_trace(tmp_path)))
    assert "other inputs: trace (fingerprint " in line and "; resume with" in line


def test_the_same_trace_under_another_name_resumes_its_plan(created: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.jsonl"
    shutil.copy(SAMPLE, copy)
    plan = prepare_plan(TuningRequest(workload=str(copy), study_name="s", output_dir=created,
                                      command_line=[], resume=True, trials=1, objective="goodput",
                                      slos=["ttft_p50_ms=1000", "tpot_p50_ms=100"],
                                      tuning_window_s=8, holdout_window_s=6))
    assert plan.study_name == "s"


def test_changed_slos_and_objective_are_refused_naming_both(created: Path, capsys) -> None:
    argv = args(created, "--resume")
    argv[argv.index("ttft_p50_ms=1000")] = "ttft_p50_ms=800"
    argv[argv.index("goodput")] = "throughput"
    line = refusal(capsys, argv)
    assert 'SLOs (["ttft_p50_ms=1000", "tpot_p50_ms=100"], now ["ttft_p50_ms=800", "tpot_p50_ms=100"])' in line
    assert 'objective ("goodput", now "throughput")' in line


def test_a_changed_model_is_refused_naming_the_model(created: Path, tmp_path: Path, capsys) -> None:
    model = tmp_path / "another-model"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    line = refusal(capsys, args(created, "--resume", "--model", str(model), "--load-format", "dummy",
                                "--max-model-len", "2048"))
    assert f'model ("{DEFAULT_MODEL_DIR}", now "{model}")' in line
    assert "--load-format/--max-model-len (load_format: none, now \"dummy\"; max_model_len: none, now 2048)" in line


def test_a_baseline_added_or_edited_is_refused_naming_its_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    on_node(monkeypatch, SMALL_NODE)
    baseline = tmp_path / "deployed.yaml"
    baseline.write_text("max-num-seqs: 16\n")
    out = tmp_path / "out"
    assert main(args(out, "--workers-only", "--baseline", str(baseline))) == 0
    capsys.readouterr()
    line = refusal(capsys, args(out, "--resume"))
    assert "baseline ({" in line and ", now none)" in line
    baseline.write_text("max-num-seqs: 32\nmax-num-batched-tokens: 2048\n")
    line = refusal(capsys, args(out, "--resume", "--baseline", str(baseline)))
    assert "baseline (engine: " in line and '"max_num_seqs": 16' in line and '"max_num_seqs": 32' in line


def test_a_changed_space_or_compare_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    on_node(monkeypatch, SMALL_NODE)
    space = tmp_path / "space.yaml"
    space.write_text("params:\n  max_num_seqs: {type: int, low: 1, high: 64}\n")
    hand = tmp_path / "hand.yaml"
    hand.write_text("max-num-seqs: 8\n")
    out = tmp_path / "out"
    assert main(args(out, "--workers-only", "--space", str(space), "--compare", str(hand))) == 0
    capsys.readouterr()
    space.write_text("params:\n  max_num_seqs: {type: int, low: 1, high: 16}\n")
    hand.write_text("max-num-seqs: 4\n")
    line = refusal(capsys, args(out, "--resume", "--space", str(space), "--compare", str(hand)))
    assert f"--compare files ({hand}: " in line and "--space file (params: " in line


def test_nothing_changed_on_a_machine_with_other_memory_resumes_as_created(
    created: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    on_node(monkeypatch, LARGER_NODE)
    fresh = prepare_plan(TuningRequest(workload=str(SAMPLE), study_name="t", output_dir=created,
                                       command_line=[], trials=1, objective="goodput",
                                       slos=["ttft_p50_ms=1000", "tpot_p50_ms=100"],
                                       tuning_window_s=8, holdout_window_s=6))
    resumed = prepare_plan(fresh_request := TuningRequest(
        workload=str(SAMPLE), study_name="s", output_dir=created, command_line=[], resume=True,
        trials=1, objective="goodput", slos=["ttft_p50_ms=1000", "tpot_p50_ms=100"],
        tuning_window_s=8, holdout_window_s=6))
    assert fresh_request.resume
    assert fresh.baseline.engine["gpu_memory_utilization"] == 0.15  # this machine's share
    assert resumed.baseline.engine["gpu_memory_utilization"] == 0.19  # the study's
    band = resumed.space.params["gpu_memory_utilization"]
    assert (band.low, band.high) == (0.152, 0.304) != (fresh.space.params["gpu_memory_utilization"].low,
                                                       fresh.space.params["gpu_memory_utilization"].high)
    out = capsys.readouterr().out
    assert "the study's space as created: gpu_memory_utilization float 0.152..0.304 (this machine's: float 0.12..0.24)" in out


@pytest.mark.slow
def test_resume_after_the_machine_changed_measures_the_stored_baseline(tmp_path: Path) -> None:
    """The real CLI in its own processes, trial servers faked: created on one node size,
    resumed on another, it runs the baseline the study stored and exits 0."""
    behaviour = tmp_path / "behaviour.json"
    behaviour.write_text(json.dumps({"slots": 8, "token_delay_s": 0.005}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(HERE),
                                                                      os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "out"

    def tuner(node_bytes: int, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(HERE / "node_memory_tuner.py"), str(node_bytes),
                               str(behaviour), *args(out, *extra)],
                              capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)

    created = tuner(SMALL_NODE, "--workers-only")
    assert created.returncode == 0, created.stderr[-3000:]
    done = tuner(LARGER_NODE, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--resume: the study's space as created" in done.stdout
    config = yaml.safe_load((out / "trials" / "trial-0000" / "config.yaml").read_text())
    assert config["gpu-memory-utilization"] == 0.19


def test_a_changed_allow_is_refused(created: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    import autotune.prepare

    monkeypatch.setattr(autotune.prepare, "check_supported", lambda allow, accelerator: None)  # fp8 on a CPU
    line = refusal(capsys, args(created, "--resume", "--allow", "fp8"))
    assert '--allow ([], now ["fp8"])' in line
