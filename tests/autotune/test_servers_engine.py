"""One real trial on stock `vllm serve` (`--server vllm`): the embedded tiny model on the CPU
engine, started through the launcher, a short timed window replayed through it, /metrics
scraped, the process group stopped.

    .venv/bin/python -m pytest tests/autotune/test_servers_engine.py -m engine -s
prints the trial's wall-time breakdown (engine start of `vllm serve` included).
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from autotune.launcher import SERVER_NICE, StaleServerRegistry
from autotune.servers import TrialServer
from autotune.trial import TrialOutcome, TrialRunner
from server.config import ServerConfig, default_engine_settings
from workloads.replay import ReplaySummary, RequestRecord
from workloads.trace import Trace, TraceRequest

WINDOW_S = 8.0
REQUESTS = 16
KV_CACHE_SHARE = 0.15  # as test_trial_engine.py: little memory held beside other engines


def window() -> Trace:
    spacing_ms = WINDOW_S * 1000 / REQUESTS
    return Trace.from_requests(
        [TraceRequest(timestamp=i * spacing_ms, input_length=10 + (i * 37) % 191,
                      output_length=8 + (i * 13) % 33) for i in range(REQUESTS)],
        source="vllm serve engine test window",
    )


def server_tree(config_path: Path) -> list[psutil.Process]:
    """The `vllm serve` process started with `config_path` and all its descendants."""
    for process in psutil.process_iter(["cmdline"]):
        if str(config_path) in (process.info["cmdline"] or []):
            return [process, *process.children(recursive=True)]
    return []


@pytest.mark.engine(starts=1)
def test_stock_vllm_serve_runs_a_trial_with_forced_lengths_and_its_metrics(tmp_path: Path) -> None:
    study_dir = tmp_path / "study"
    trial_dir = study_dir / "trial-0000"
    registry = study_dir / "servers.json"
    served = trial_dir / "vllm-serve.yaml"
    config = ServerConfig(
        engine={**default_engine_settings(), "max_num_seqs": 8, "gpu_memory_utilization": KV_CACHE_SHARE}
    )
    nice_seen: dict[int, int] = {}

    def look_at_the_server(elapsed_s: float, summary: ReplaySummary) -> bool:
        # While the window runs: every process of the server (engine core included) runs
        # below the load client's priority.
        for process in server_tree(served):
            try:
                nice_seen[process.pid] = process.nice()
            except psutil.NoSuchProcess:
                pass
        return False

    runner = TrialRunner(startup_timeout_s=240, stale_registry=registry,
                         server=TrialServer(kind="vllm"))
    outcome = runner.run(config, window(), trial_dir, should_prune=look_at_the_server)

    log = (trial_dir / "server.log").read_text()
    assert outcome.ok, f"{outcome.failure}: {outcome.failure_detail}\n{log[-3000:]}"
    assert outcome.server == "vllm serve (stock vLLM)"
    assert TrialOutcome.model_validate_json((trial_dir / "outcome.json").read_text()) == outcome
    assert "server.vllm_serve serve --config" in log and "Starting vLLM server on http://127.0.0.1:" in log

    # Served by stock vLLM with the lengths the trace recorded, every token counted.
    records = [RequestRecord.model_validate_json(line)
               for line in (trial_dir / "requests.jsonl").read_text().splitlines()]
    assert len(records) == REQUESTS and all(r.error is None for r in records)
    assert [r.output_tokens for r in records] == [int(n) for n in window().output_lengths]
    assert [len(r.itl_ms) for r in records] == [int(n) - 1 for n in window().output_lengths]

    # The scrape found vLLM's own counters and histograms, diffed over exactly this window.
    metrics = outcome.server_metrics
    assert metrics is not None
    assert metrics.ttft_mean_ms is not None and metrics.itl_mean_ms is not None
    assert metrics.e2e_mean_ms is not None and metrics.queue_mean_ms is not None
    assert metrics.preemptions == 0
    assert metrics.kv_cache_usage_max is not None and 0 <= metrics.kv_cache_usage_max <= 1
    assert metrics.num_running_max is not None and 0 <= metrics.num_running_max <= 8
    assert outcome.summary is not None and metrics.e2e_mean_ms <= outcome.summary.mean_e2el_ms

    assert len(nice_seen) >= 2, nice_seen  # the API server and its engine core at least
    assert set(nice_seen.values()) == {SERVER_NICE}, nice_seen

    # The whole group is gone: nothing of it left, the registry empty.
    assert outcome.teardown is not None and outcome.teardown.leftover_pids == []
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in nice_seen)
    assert server_tree(served) == []
    assert StaleServerRegistry(registry).entries() == []

    timing = outcome.timing
    assert timing is not None
    print("\nvllm serve trial:", json.dumps({
        "ready_s": round(timing.ready_s, 2), "warmup_s": round(timing.warmup_s, 2),
        "measure_s": round(timing.measure_s, 2), "teardown_s": round(timing.teardown_s, 2),
        "strongest_signal": outcome.teardown.strongest_signal,
        "ttft_p95_ms": outcome.summary.p95_ttft_ms, "server_ttft_mean_ms": metrics.ttft_mean_ms,
    }, indent=2))
