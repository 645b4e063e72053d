"""`autotune run --objective min-memory` end to end: the real CLI in its own process, every
trial server a fake whose capacity grows with its gpu_memory_utilization (under 0.05 it has one
slot and misses the SLOs at 1.5x the recorded rate; from 0.05 up it has eight and meets them).
Plus the refusals a user can cause, each one line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autotune.cli import main

HELPERS = Path(__file__).resolve().parents[1]  # tests/autotune: the fake servers, the tuners, fixtures/
ROOT = HELPERS.parents[1]
SAMPLE = str(ROOT / "workloads" / "samples" / "translation_trace.jsonl")
# On a 32 GiB NUMA node, whatever this machine's: the CPU baseline's memory share (0.1 there)
# and the searched band follow the node's size (server.config.cpu_memory_share).
TUNER = HELPERS / "node_memory_tuner.py"
NODE_BYTES = str(32 * 2**30)
ARGS = ["--workload", SAMPLE, "--objective", "min-memory", "--trials", "4", "--tuning-window", "8",
        "--holdout-window", "6", "--top-k", "1", "--repeats", "1", "--step-requests", "30", "--step-seconds", "1",
        "--slo", "ttft_p50_ms=1000", "--slo", "tpot_p50_ms=100",
        "--study-name", "mm"]


def tuner(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    behaviour = tmp_path / "behaviour.json"
    behaviour.write_text(json.dumps({"memory_slots": [[0, 1], [0.05, 8]], "token_delay_s": 0.005}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(TUNER), NODE_BYTES, str(behaviour), "run", *args], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=600)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    tmp_path = tmp_path_factory.mktemp("min-memory")
    out = tmp_path / "out"
    return out, tuner(tmp_path, *ARGS, "--output-dir", str(out))


@pytest.mark.slow
def test_min_memory_exports_less_memory_than_the_baseline_that_still_meets_the_slos(tuned) -> None:
    out, done = tuned
    assert done.returncode == 0, done.stderr[-3000:]
    best = yaml.safe_load((out / "best.yaml").read_text())
    memory = best["gpu-memory-utilization"]
    # Less than the baseline's 0.1 (the embedded default on CPU), and not below what the fake
    # needs at 1.5x (0.05): a config that missed the SLOs there was never exported.
    assert 0.05 <= memory < 0.1 and len(repr(memory)) <= 4
    provenance = best["additional-config"]["vllm_autotune"]["provenance"]
    figures = provenance["memory"]
    assert provenance["objective"] == "min-memory:1.5x"
    assert figures["winner_gpu_memory_utilization"] == memory and figures["baseline_gpu_memory_utilization"] == 0.1
    assert figures["baseline_meets_slos"] is True and figures["headroom"] == 1.5
    assert figures["winner_kv_cache_gib"] == round(memory * 2.3, 2)  # from the trial's server.log
    report = (out / "report.md").read_text().splitlines()
    assert report[2].startswith(
        f"**Memory: the exported config meets every SLO at 1.5x your recorded traffic with "
        f"gpu_memory_utilization {memory:g} (KV cache {figures['winner_kv_cache_gib']:g} GiB, "
        f"{figures['winner_kv_cache_tokens']:,} tokens) vs the baseline's 0.1**"
    )
    # Every trial is one step at 1.5x; the progress line ranks the least memory best.
    ladders = [json.loads(p.read_text()) for p in sorted((out / "trials").glob("trial-*/ladder.json"))]
    assert ladders and all(len(ladder["steps"]) == 1 and ladder["steps"][0]["speedup"] == 1.5 for ladder in ladders)
    outcome = json.loads((out / "trials" / "trial-0000" / "outcome.json").read_text())
    assert outcome["kv_cache"] == {"gib": 0.23, "tokens": 120_960}
    assert "best gpu_memory_utilization" in done.stdout + done.stderr


@pytest.mark.slow
def test_resuming_a_min_memory_study_with_another_headroom_is_refused_in_one_line(tuned, tmp_path: Path) -> None:
    out, first = tuned
    assert first.returncode == 0
    done = tuner(tmp_path, *ARGS, "--output-dir", str(out), "--resume", "--headroom", "2")
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("autotune: error: ")]
    assert len(errors) == 1 and "Traceback" not in done.stderr
    assert '"min-memory:1.5x"' in errors[0] and '"min-memory:2x"' in errors[0]


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["run", "--workload", SAMPLE, "--objective", "min-memory", *args])
    return code, capsys.readouterr().err.strip()


def test_a_headroom_not_above_zero_is_refused(tmp_path: Path, capsys) -> None:
    code, err = run(capsys, "--headroom", "0", "--output-dir", str(tmp_path / "out"))
    assert code == 2 and err == ("autotune: error: --headroom 0: must be above 0 (1.5 = 50% more than "
                                 "the recorded rate)")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_min_memory_with_a_space_that_does_not_vary_memory_is_refused(tmp_path: Path, capsys) -> None:
    space = tmp_path / "space.yaml"
    space.write_text("params:\n  gpu_memory_utilization: null\n")
    code, err = run(capsys, "--space", str(space), "--output-dir", str(tmp_path / "out"),
                    "--tuning-window", "8", "--holdout-window", "6", "--slo", "ttft_p50_ms=1000")
    assert code == 2 and "\n" not in err
    assert err.startswith("autotune: error: --objective min-memory searches gpu_memory_utilization")
    assert not (tmp_path / "out" / "trials").exists()
