"""`autotune run --server vllm --trials 1` end to end on stock `vllm serve`: the embedded tiny
model on the CPU engine, started through the launcher, the sample trace's short tuning window
replayed through it, /metrics scraped, the process group stopped, best.yaml and report.md
written. One engine start: with one trial there is no candidate for the gate to re-measure.

    .venv/bin/python -m pytest tests/autotune/measure/test_servers_engine.py -m engine -s
prints the trial's wall-time breakdown (engine start of `vllm serve` included).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from autotune.measure.server_registry import StaleServerRegistry
from autotune.measure.server_start import SERVER_NICE
from autotune.measure.trial import TrialOutcome
from server.config import ServerConfig
from workloads.replay_summary import RequestRecord
from workloads.trace_io import load_trace

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"
# Short goodput windows and p50 SLOs, as test_run_engine.py: one replay of the window.
RUN = ["--trials", "1", "--tuning-window", "8", "--holdout-window", "6", "--top-k", "1",
       "--repeats", "1", "--objective", "goodput", "--slo", "ttft_p50_ms=1000",
       "--slo", "tpot_p50_ms=100"]


def server_tree(config_path: Path) -> list[psutil.Process]:
    """The `vllm serve` process started with `config_path` and all its descendants."""
    for process in psutil.process_iter(["cmdline"]):
        try:
            if str(config_path) in (process.info["cmdline"] or []):
                return [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return []


@pytest.mark.engine(starts=1, seconds=69)
def test_autotune_run_on_stock_vllm_serve(tmp_path: Path) -> None:
    out = tmp_path / "out"
    trial_dir = out / "trials" / "trial-0000"
    served = trial_dir / "vllm-serve.yaml"
    tuner = subprocess.Popen(
        [sys.executable, "-m", "autotune", "run", "--workload", str(SAMPLE), *RUN,
         "--server", "vllm", "--output-dir", str(out), "--study-name", "vllm"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )
    # While the trial runs: every process of the server (engine core included) runs below
    # the load client's priority, as ours does.
    nice_seen: dict[int, int] = {}
    try:
        while tuner.poll() is None:
            for process in server_tree(served):
                try:
                    nice_seen[process.pid] = process.nice()
                except psutil.NoSuchProcess:
                    pass
            try:
                tuner.wait(0.25)
            except subprocess.TimeoutExpired:
                pass
    finally:
        if tuner.poll() is None:
            tuner.kill()
        output = tuner.communicate(timeout=60)[0]
    assert tuner.returncode == 0, output[-3000:]

    log = (trial_dir / "server.log").read_text()
    outcome = TrialOutcome.model_validate_json((trial_dir / "outcome.json").read_text())
    assert outcome.ok, f"{outcome.failure}: {outcome.failure_detail}\n{log[-3000:]}"
    assert outcome.server == "vllm serve (stock vLLM)"
    assert "server.vllm_serve serve --config" in log and "Starting vLLM server on http://127.0.0.1:" in log

    # Served by stock vLLM with the lengths the trace recorded, every token counted.
    records = [RequestRecord.model_validate_json(line)
               for line in (trial_dir / "requests.jsonl").read_text().splitlines()]
    best = ServerConfig.load(out / "best.yaml")
    window = best.provenance["workload"]["tuning_window"]  # where in the trace it was cut
    trace = load_trace(SAMPLE)
    arrivals_s = (trace.timestamps_ms - trace.timestamps_ms[0]) / 1000
    recorded = trace.output_lengths[(arrivals_s >= window["start_s"]) & (arrivals_s < window["end_s"])]
    assert len(records) == window["requests"] == len(recorded) and all(r.error is None for r in records)
    assert [r.output_tokens for r in records] == [int(n) for n in recorded]
    assert all(len(r.itl_ms) == r.output_tokens - 1 for r in records)

    # The scrape found vLLM's own histograms, counters and gauges, diffed over the window.
    metrics = json.loads((trial_dir / "server_metrics.json").read_text())
    for name in ("ttft_mean_ms", "itl_mean_ms", "e2e_mean_ms", "queue_mean_ms",
                 "kv_cache_usage_max", "num_running_max"):
        assert metrics[name] is not None, name
    assert metrics["preemptions"] == 0
    assert metrics["e2e_mean_ms"] <= outcome.summary.mean_e2el_ms

    assert len(nice_seen) >= 2, nice_seen  # the API server and its engine core at least
    assert set(nice_seen.values()) == {SERVER_NICE}, nice_seen

    # The whole group is gone: nothing of it left, the registry empty.
    assert outcome.teardown is not None and outcome.teardown.leftover_pids == []
    assert server_tree(served) == []
    assert StaleServerRegistry(out / "servers.json").entries() == []

    # best.yaml is the usual file, and it and the report say what ran the trials.
    assert best.provenance["trial_server"] == {"kind": "vllm", "api_server_count": None,
                                               "ran": "vllm serve (stock vLLM)"}
    assert "# measured on: vllm serve (stock vLLM)" in (out / "best.yaml").read_text()
    assert "Trials measured on: vllm serve (stock vLLM)." in (out / "report.md").read_text()

    timing = outcome.timing
    assert timing is not None
    print("\nvllm serve trial:", json.dumps({
        "ready_s": round(timing.ready_s, 2), "warmup_s": round(timing.warmup_s, 2),
        "measure_s": round(timing.measure_s, 2), "teardown_s": round(timing.teardown_s, 2),
        "strongest_signal": outcome.teardown.strongest_signal,
        "ttft_p50_ms": outcome.summary.median_ttft_ms, "server_ttft_mean_ms": metrics["ttft_mean_ms"],
    }, indent=2))
