"""One real trial: `python -m server` with the embedded model on the CPU vLLM engine, a ~10 s
timed window, the trial folder, the timing breakdown, and no process left afterwards.

    .venv/bin/python -m pytest tests/autotune/measure/test_trial_engine.py -m engine -s
prints the wall-time breakdown of the trial (start, ready, warm-up, measure, teardown).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest

from autotune.measure.server_registry import StaleServerRegistry
from autotune.measure.trial import TrialOutcome, TrialRunner
from server.config import ServerConfig, default_engine_settings
from workloads.replay_summary import RequestRecord
from workloads.trace import Trace, TraceRequest

WINDOW_S = 10.0
REQUESTS = 20


def translation_like_window() -> Trace:
    """20 requests over 10 s, 10-200 input tokens, 8-40 output tokens (the reference shape)."""
    spacing_ms = WINDOW_S * 1000 / REQUESTS
    return Trace.from_requests(
        [
            TraceRequest(
                timestamp=i * spacing_ms,
                input_length=10 + (i * 37) % 191,
                output_length=8 + (i * 13) % 33,
            )
            for i in range(REQUESTS)
        ],
        source="engine test window",
    )


@pytest.mark.engine(starts=1, seconds=25)  # its own: the trial launches and stops the server itself
def test_real_trial_measures_and_leaves_nothing_behind(tmp_path: Path, fork_servers) -> None:
    study_dir = tmp_path / "study"
    trial_dir = study_dir / "trial-0000"
    registry = study_dir / "servers.json"
    config = ServerConfig(
        engine={**default_engine_settings(), "max_num_seqs": 8}
    )
    # Forked from the session's fork server, as `autotune run` starts its trial servers.
    runner = TrialRunner(startup_timeout_s=240, stale_registry=registry, preload_server=fork_servers)

    started = time.monotonic()
    outcome = runner.run(config, translation_like_window(), trial_dir)
    total_s = time.monotonic() - started

    log = (trial_dir / "server.log").read_text()
    assert outcome.ok, f"{outcome.failure}: {outcome.failure_detail}\n{log[-3000:]}"
    assert sorted(p.name for p in trial_dir.iterdir()) == [
        "config.yaml",
        "outcome.json",
        "requests.jsonl",
        "server.log",
        "server_metrics.json",
        "summary.json",
    ]
    assert TrialOutcome.model_validate_json((trial_dir / "outcome.json").read_text()) == outcome
    records = [
        RequestRecord.model_validate_json(line)
        for line in (trial_dir / "requests.jsonl").read_text().splitlines()
    ]
    window = translation_like_window()
    assert len(records) == REQUESTS and all(r.error is None for r in records)
    # Benchmark mode: every request produced exactly the output length the trace recorded.
    assert [r.output_tokens for r in records] == [int(n) for n in window.output_lengths]

    # Server-side view of the same window: the histograms saw exactly its requests.
    metrics = outcome.server_metrics
    assert metrics is not None
    assert metrics.ttft_mean_ms is not None and metrics.ttft_mean_ms > 0
    assert metrics.itl_mean_ms is not None and metrics.itl_p95_ms is not None
    assert metrics.e2e_mean_ms is not None and metrics.queue_mean_ms is not None
    assert metrics.preemptions == 0
    # Sampled about once a second during the window (a loaded machine makes fewer samples;
    # a sample can fall between two short requests, so what it saw may be 0).
    assert 1 <= len(metrics.timeline) <= outcome.timing.measure_s + 1
    assert metrics.num_running_max is not None and 0 <= metrics.num_running_max <= 8
    assert metrics.kv_cache_usage_max is not None and 0 <= metrics.kv_cache_usage_max <= 1
    # The server sees each request inside the client's span of it (send .. [DONE]), so its
    # means cannot exceed the client's: a diff against the wrong scrape would break this.
    assert outcome.summary is not None
    assert metrics.e2e_mean_ms <= outcome.summary.mean_e2el_ms
    assert metrics.ttft_mean_ms <= outcome.summary.mean_ttft_ms

    timing = outcome.timing
    assert timing is not None
    assert 0 <= timing.launch_s < timing.ready_s < 240
    assert timing.measure_s >= WINDOW_S * (REQUESTS - 1) / REQUESTS
    assert timing.warmup_s > 0 and timing.teardown_s > 0
    parts = timing.ready_s + timing.warmup_s + timing.measure_s + timing.teardown_s
    assert parts <= total_s

    # Nothing of the server is left, and the registry says so.
    assert outcome.teardown is not None and outcome.teardown.leftover_pids == []
    leftover = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and str(trial_dir / "config.yaml") in p.info["cmdline"]
    ]
    assert leftover == []
    assert StaleServerRegistry(registry).entries() == []

    breakdown = {
        "launch_s": round(timing.launch_s, 3),
        "ready_s": round(timing.ready_s, 2),
        "warmup_s": round(timing.warmup_s, 2),
        "measure_s": round(timing.measure_s, 2),
        "teardown_s": round(timing.teardown_s, 2),
        "total_s": round(total_s, 2),
        "teardown": outcome.teardown.model_dump(),
    }
    print("\ntrial wall-time breakdown:", json.dumps(breakdown, indent=2))


@pytest.mark.engine(starts=0, seconds=5)  # the real server, but it exits before building an engine
@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "SchedulerConfig"),
        # A memory share above 1 (what test_run_engine's study once searched, end to end).
        ({"gpu_memory_utilization": 1.5}, "CacheConfig"),
    ],
    ids=["batched-tokens-below-seqs", "memory-share-above-1"],
)
def test_values_vllm_rejects_are_an_invalid_config_outcome(
    tmp_path: Path, values: dict, named: str, fork_servers
) -> None:
    # No engine start: the real server, forked as `autotune run` forks its trial servers, checks
    # the values with vLLM and exits 2 first.
    engine = {**default_engine_settings(), **values}
    trial_dir = tmp_path / "trial-0001"
    outcome = TrialRunner(startup_timeout_s=240, preload_server=fork_servers).run(
        ServerConfig(engine=engine), translation_like_window(), trial_dir
    )
    assert outcome.failure == "invalid_config", (outcome.failure, outcome.failure_detail)
    assert named in outcome.failure_detail
    assert outcome.teardown is not None and outcome.teardown.exit_code == 2
    assert sorted(p.name for p in trial_dir.iterdir()) == ["config.yaml", "outcome.json", "server.log"]
