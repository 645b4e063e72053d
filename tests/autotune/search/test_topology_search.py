"""`autotune run --objective capacity-per-gpu` end to end on a faked 2-GPU host: the real CLI
in its own process (CUDA_VISIBLE_DEVICES=0,1 is the host it counts), every trial server a fake
whose capacity follows its topology (tensor parallelism answers 1.5x faster, each
data-parallel replica carries as much again) and that exposes vLLM's prefix-cache counters.

The user splits the model over both GPUs today (tensor_parallel_size 2). Per GPU that is the
worst topology (1.5x the traffic on 2x the GPUs): the study measures the three that fit (never
TP=2 x DP=2), exports one that carries more per GPU, and the report says by how much, on how
many GPUs, and how often the prompts' shared prefixes hit the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from server.config import ServerConfig
from workloads.trace import Trace, TraceRequest
from workloads.trace_io import write_trace

HELPERS = Path(__file__).resolve().parents[1]  # tests/autotune: the fake servers, the tuners, fixtures/
ROOT = HELPERS.parents[1]
TUNER = HELPERS / "fake_server_tuner.py"
SPACE = ("extend_defaults: false\nparams:\n"
         "  tensor_parallel_size: {type: pow2, low: 1, high: 2}\n"
         "  data_parallel_size: {type: int, low: 1, high: 2}\n")


def shared_prefix_trace(path: Path) -> Path:
    """60 s at 2 req/s: 600-token prompts whose first 512-token block is one of three (a system
    prompt per conversation kind, `hash_ids`), then 88 tokens of their own; 20-token answers."""
    requests = [TraceRequest(timestamp=i * 500.0, input_length=600, output_length=20, hash_ids=[i % 3])
                for i in range(120)]
    write_trace(path, Trace.from_requests(requests, source="shared prefixes"))
    return path


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    tmp_path = tmp_path_factory.mktemp("topology")
    behaviour, space, baseline, out = (tmp_path / "behaviour.json", tmp_path / "space.yaml",
                                       tmp_path / "baseline.yaml", tmp_path / "out")
    behaviour.write_text(json.dumps({"slots": 2, "token_delay_s": 0.01, "topology": {"tp_speedup": 1.5},
                                     "prefix_cache": True}))
    space.write_text(SPACE)
    baseline.write_text("tensor_parallel_size: 2\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    args = ["run", "--workload", str(shared_prefix_trace(tmp_path / "trace.jsonl")), "--objective", "capacity-per-gpu",
            "--space", str(space), "--baseline", str(baseline), "--trials", "3", "--tuning-window", "30",
            "--holdout-window", "20", "--top-k", "1", "--repeats", "1", "--step-requests", "30", "--step-seconds", "1",
            "--slo", "ttft_p50_ms=150", "--study-name", "topology", "--output-dir", str(out)]
    done = subprocess.run([sys.executable, str(TUNER), str(behaviour), *args], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=900)
    return out, done


def topologies(out: Path) -> dict[str, tuple[int, int]]:
    """Each search trial's (tensor, data) parallel size, as its server started with them."""
    found = {}
    for path in sorted((out / "trials").glob("trial-*/config.yaml")):
        engine = ServerConfig.load(path).engine
        found[path.parent.name] = (engine.get("tensor_parallel_size", 1), engine.get("data_parallel_size", 1))
        assert f"fake server: topology {found[path.parent.name][0]}x{found[path.parent.name][1]}" in (
            path.parent / "server.log").read_text()
    return found


@pytest.mark.slow
def test_a_per_gpu_study_on_two_gpus_measures_the_topologies_that_fit_and_exports_the_best_per_gpu(tuned) -> None:
    out, done = tuned
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    measured = topologies(out)
    assert measured["trial-0000"] == (2, 1)  # the baseline, as the user runs it
    assert sorted(measured.values()) == [(1, 1), (1, 2), (2, 1)]  # never 2 x 2 on two GPUs
    best = yaml.safe_load((out / "best.yaml").read_text())
    assert best.get("tensor-parallel-size", 1) == 1, best  # one engine per GPU, not split
    figures = best["additional-config"]["vllm_autotune"]["provenance"]["capacity"]
    assert figures["baseline_gpus"] == 2 and figures["winner_rps_per_gpu"] > figures["baseline_rps_per_gpu"]
    assert figures["winner_gpus"] == best.get("data-parallel-size", 1)
    report = (out / "report.md").read_text()
    assert f"per GPU: the exported config {figures['winner_rps_per_gpu']:.3g} req/s ({figures['winner_gpus']} GPU" in report
    assert "| capacity per GPU | capacity (req/s) | GPUs | prefix cache hits |" in report


@pytest.mark.slow
def test_the_shared_prefixes_hit_the_cache_and_the_report_says_how_often(tuned) -> None:
    out, done = tuned
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    outcome = json.loads((out / "trials" / "trial-0000" / "outcome.json").read_text())
    rate = outcome["prefix_cache_hit_rate"]
    # 512 of each 600-token prompt is the block of its kind, which every third prompt shares:
    # a hit but for the first prompt of each kind in a step (each step draws fresh tokens); a
    # step longer than the window repeats it, and the repeated prompts hit whole.
    assert 0.5 < rate < 1, rate
    rows = [line for line in (out / "report.md").read_text().splitlines() if line.startswith("| trial-0000")]
    assert rows and f"| {rate:.0%} |" in rows[0], rows
