"""The capacity ladder on the real CPU engine: one launch per config, and a config that can
run one sequence at a time carries measurably less than vLLM's defaults (side by side, same
window, same SLOs, one run). The SLOs scale with how fast this machine is right now (a lone
request measured first), so a busy neighbour on 2 cores moves the capacities, not the order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.measure.ladder import LadderSettings
from autotune.measure.trial import TrialRunner
from server.config import ServerConfig, default_engine_settings
from workloads.replay import ReplayOptions
from workloads.replay_summary import ReplaySummary
from workloads.slo import SLO
from workloads.trace import Trace, TraceRequest


def translation_like_window(requests: int = 40, seconds: float = 10.0,
                            output_tokens: tuple[int, int] = (8, 40)) -> Trace:
    spacing_ms = seconds * 1000 / requests
    low, high = output_tokens
    return Trace.from_requests(
        [TraceRequest(timestamp=i * spacing_ms, input_length=10 + (i * 37) % 191,
                      output_length=low + (i * 13) % (high - low + 1)) for i in range(requests)],
        source="ladder engine window",
    )


# When the SLOs were fixed (TTFT p95 1 s, TPOT p95 100 ms), a lone answer of 200-260 tokens took
# ~0.65 s (~2.7 ms a token): these multiples of the lone request keep those ratios.
TTFT_PER_LONE_LATENCY = 1.5
TPOT_PER_LONE_TPOT = 40.0


def slos_scaled_to(lone: ReplaySummary) -> list[SLO]:
    """TTFT within 1.5 lone answers: a queue of one sequence at a time misses it as soon as
    it holds two; TPOT 40x a lone sequence's: only a server batching far past its means."""
    assert lone.failed == 0 and lone.median_e2el_ms and lone.median_tpot_ms, lone
    return [SLO(metric="ttft", percentile=95, threshold_ms=TTFT_PER_LONE_LATENCY * lone.median_e2el_ms),
            SLO(metric="tpot", percentile=95, threshold_ms=TPOT_PER_LONE_TPOT * lone.median_tpot_ms)]


# Load-sensitive: beside the tests without an engine a lone answer of 200-260 tokens took 3.5 s
# instead of 0.65 s and the test 105 s instead of 58 s.
@pytest.mark.engine(starts=3, seconds=41, load_sensitive=True)
@pytest.mark.slow
def test_one_sequence_at_a_time_carries_less_than_the_defaults(tmp_path: Path, fork_servers) -> None:
    # Answers of 100-130 tokens at 6 req/s: one sequence at a time needs 0.3-0.7 s each (2.7-5.5
    # ms a token on the 2-core VMs seen), two to four times the recorded rate's spacing, so its
    # queue (and TTFT) grows through the step, while the defaults decode several side by side
    # (TTFT p95 110-134 ms at 1x and 2x against a 1.07 s SLO, one sequence abandoned at 1x and
    # 0.5x). The same tokens a second as 200-260 tokens at 3 req/s, in half the decode steps a
    # ladder step: 82 CPU-s alone against 121. With answers of 8-40 tokens both hit the
    # replayer's own limit on 2 cores and tied. 21 requests a step: p95 tolerates one outlier.
    window = translation_like_window(requests=60, seconds=10.0, output_tokens=(100, 130))
    # A busy neighbour on 2 cores made a lone answer take several times as long, and the
    # fixed SLOs then failed every config at every rate (capacity 0 for both): the SLOs are
    # multiples of a lone request's latency, measured first on the defaults, one at a time.
    probe = TrialRunner(startup_timeout_s=300, stale_registry=tmp_path / "servers.json",
                        replay=ReplayOptions(mode="concurrency=1", max_send_lag_ms=5000),
                        preload_server=fork_servers)
    lone = probe.run(ServerConfig(engine=default_engine_settings()), window.subset(range(5)),
                     tmp_path / "lone")
    assert lone.ok and lone.summary is not None, f"{lone.failure}: {lone.failure_detail}"
    slos = slos_scaled_to(lone.summary)
    # Coarse on purpose (a factor of 2): the claim is an order, not a figure. At 50% the one-seq
    # ladder bisected once more (0.25 passed, 0.5 failed: 0.35 next), 13 s for no claim.
    # Capped at 2x the recorded rate, where one sequence already fails 1x: the defaults' own
    # capacity (~16x here) is not the claim (a 4x step cost ~5,000 decoded tokens more).
    # Floored at half of it: one sequence failed 1x and 0.5x, and its step at 0.25x (21 arrivals
    # 1.3 s apart) took 27 s to pass; below the floor its capacity reads 0, still the order.
    settings = LadderSettings(step_requests=21, min_step_s=3.0, resolution=1.0, max_steps=7,
                              min_speedup=0.5, max_speedup=2.0)
    # The claim is an order of capacities, not the client: a busy neighbour on 2 cores made the
    # replayer lag 127 ms (limit 100) and left every step unscored; test_client_lag.py has the rule.
    runner = TrialRunner(startup_timeout_s=300, stale_registry=tmp_path / "servers.json",
                         replay=ReplayOptions(slos=slos, max_send_lag_ms=5000), ladder=settings,
                         preload_server=fork_servers)
    capacities = {}
    for name, extra in (("defaults", {}), ("one-seq", {"max_num_seqs": 1})):
        trial_dir = tmp_path / name
        outcome = runner.run(ServerConfig(engine={**default_engine_settings(), **extra}),
                             window, trial_dir)
        log = (trial_dir / "server.log").read_text()
        assert outcome.ok, f"{outcome.failure}: {outcome.failure_detail}\n{log[-2000:]}"
        assert outcome.capacity is not None and len(outcome.capacity.steps) >= 2
        assert (trial_dir / "ladder.json").is_file()
        capacities[name] = outcome.capacity
    # One sequence at a time queues everything behind the request being decoded.
    found = {name: capacity.capacity_rps for name, capacity in capacities.items()}
    assert found["one-seq"] < found["defaults"], (slos, found)
    assert found["defaults"] > 0, (slos, found)


@pytest.mark.engine(starts=1, seconds=58)
def test_autotune_run_reports_the_baselines_capacity_and_headroom(tmp_path: Path) -> None:
    """The default objective end to end with one launch: the baseline's ladder, the
    headroom line first in report.md and in the last lines, capacity in best.yaml."""
    import subprocess
    import sys

    import yaml

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "study"
    # The claim is the report, not a capacity figure: SLOs 10x the CPU defaults (TTFT p95 1 s,
    # TPOT p95 100 ms), which a busy neighbour on 2 cores made the baseline miss at every rate.
    # The ladder stops at 4x the recorded rate (unloaded the defaults carried ~32x, and the
    # steps above 8x, abandoned, took a minute): a capacity met there is a lower bound.
    done = subprocess.run(
        [sys.executable, "-m", "autotune", "run", "--workload",
         str(root / "workloads" / "samples" / "translation_trace.jsonl"), "--trials", "1",
         "--step-requests", "20", "--ladder-resolution", "0.5", "--max-speedup", "4",
         "--output-dir", str(out), "--study-name", "capacity-e2e",
         "--slo", "ttft_p95_ms=10000", "--slo", "tpot_p95_ms=1000"],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Headroom: the baseline carries" in done.stdout
    report = (out / "report.md").read_text().splitlines()
    assert report[2].startswith("**Headroom: the baseline carries")
    steps = json.loads((out / "trials" / "trial-0000" / "ladder.json").read_text())["steps"]
    assert max(step["speedup"] for step in steps) <= 4.0
    if all(step["passed"] for step in steps):  # met every SLO at the cap (the usual case here)
        assert report[2].startswith("**Headroom: the baseline carries at least 4x")
    ladder = out / "trials" / "trial-0000" / "ladder.json"
    assert ladder.is_file()
    # Per-process CPU accounting names the engine core by vLLM's process title, also in a server
    # forked from the fork server (where the title must be set before the environment).
    roles = {process["role"] for step in json.loads(ladder.read_text())["steps"]
             for process in (step["server"] or {}).get("processes", [])}
    assert "engine core" in roles and "main" in roles, roles
    best = yaml.safe_load((out / "best.yaml").read_text())
    capacity = best["additional-config"]["vllm_autotune"]["provenance"]["capacity"]
    assert capacity["baseline_rps"] > 0 and capacity["recorded_rps"] > 0
    # The tuner checked the baseline's config with vLLM itself, and its trial server still forked
    # its engine core: the check left no start method behind for the server to inherit.
    log = (out / "trials" / "trial-0000" / "server.log").read_text(errors="replace").splitlines()
    [ready] = [line for line in log if "engine ready: " in line]
    assert json.loads(ready.split("engine ready: ", 1)[1])["engine_core_start"] == "fork"
