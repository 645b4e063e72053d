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


def bursty_trace(path: Path, bursts: int = 14, every_s: float = 3.0) -> Path:
    """Bursts of 20 translation-sized requests within a second, then idle to the next: the
    first requests of a window are far busier than the window (the case where crediting
    speed-up x the window's rate claimed load no step offered)."""
    from workloads.trace_io import write_trace

    requests = [
        TraceRequest(timestamp=burst * every_s * 1000.0 + i * 50.0, input_length=10 + (i * 37) % 191,
                     output_length=8 + (burst * 7 + i * 13) % 33)
        for burst in range(bursts) for i in range(20)
    ]
    write_trace(path, Trace.from_requests(requests, source="bursty"))
    return path


def passing_offered(ladder: dict) -> float:
    return max((step["offered_rps"] for step in ladder["steps"] if step["passed"]), default=0.0)


# 8 launches: the baseline, one first move, then the gate's 3 repeats of each.
@pytest.mark.engine(starts=8, seconds=300)
@pytest.mark.slow
def test_a_study_on_bursty_traffic_credits_only_offered_load_and_states_its_noise(tmp_path: Path) -> None:
    """The default objective end to end on bursty arrivals: every capacity (trials and gate
    repeats) is a rate a passing step offered as sent, the headroom in report.md and best.yaml
    is no more than the baseline's passing steps offered, and the gate's three repeats of
    the defaults report a non-zero noise that its message states."""
    import subprocess
    import sys

    import yaml

    out = tmp_path / "study"
    trace = bursty_trace(tmp_path / "bursty.jsonl")
    # The claim is the crediting, not a capacity figure: p50 SLOs 10x the CPU defaults' (20
    # requests a step suffice for a p50), 3 s steps at x1 (a burst, its gap and the next burst's
    # first request: a step's own rate below the window's), a ladder capped at 2x the recorded rate.
    done = subprocess.run(
        [sys.executable, "-m", "autotune", "run", "--workload", str(trace), "--trials", "2",
         "--top-k", "1", "--repeats", "3", "--tuning-window", "12", "--holdout-window", "12",
         "--step-requests", "20", "--step-seconds", "3", "--ladder-resolution", "0.5", "--max-speedup", "2",
         "--output-dir", str(out), "--study-name", "bursty",
         "--slo", "ttft_p50_ms=10000", "--slo", "tpot_p50_ms=1000"],
        capture_output=True, text=True, timeout=1500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ladders = {path: json.loads(path.read_text()) for path in out.rglob("ladder.json")}
    assert len(ladders) >= 8, sorted(ladders)
    # The case under test arises: passing steps whose own schedule is quieter than the window
    # (seen: 15.0 req/s at x2 of a window recorded at 7.94), where crediting the speed-up times
    # the window's rate would claim load no step offered.
    assert any(step["passed"] and step["planned_rps"] < 0.99 * step["speedup"] * ladder["recorded_rps"]
               for ladder in ladders.values() for step in ladder["steps"]), ladders
    for path, ladder in ladders.items():
        assert ladder["capacity_rps"] <= passing_offered(ladder) + 1e-9, path
        for step in ladder["steps"]:  # a step sent whole offered about what it planned
            if not step["summary"]["stopped_early"]:
                assert step["offered_rps"] == pytest.approx(step["planned_rps"], rel=0.25), (path, step)
    best = yaml.safe_load((out / "best.yaml").read_text())
    capacity = best["additional-config"]["vllm_autotune"]["provenance"]["capacity"]
    baseline_runs = [ladder for path, ladder in ladders.items() if "validation" in path.parts and "baseline" in path.parts]
    assert len(baseline_runs) == 3
    assert 0 < capacity["baseline_rps"] <= max(passing_offered(ladder) for ladder in baseline_runs) + 1e-9
    assert capacity["baseline_headroom"] == pytest.approx(capacity["baseline_rps"] / capacity["recorded_rps"], rel=1e-2)
    # Three repeats that may land on one step still carry the ladder's resolution as noise.
    assert capacity["noise"] > 0
    gate_line = next(line for line in done.stdout.splitlines() if "noise used" in line)
    assert f"noise used {capacity['noise']:.1%}" in gate_line
    report = (out / "report.md").read_text()
    lines = report.splitlines()
    assert lines[2].startswith("**Headroom: the ")
    assert "req/s offered with every SLO met" in lines[2]
    assert "passed-failed step offered" in report  # the held-out table's per-repeat brackets
    # Per-process CPU accounting names the engine core by vLLM's process title, also in a server
    # forked from the fork server (where the title must be set before the environment).
    baseline_ladder = ladders[out / "trials" / "trial-0000" / "ladder.json"]
    roles = {process["role"] for step in baseline_ladder["steps"]
             for process in (step["server"] or {}).get("processes", [])}
    assert "engine core" in roles and "main" in roles, roles
    # The tuner checked the baseline's config with vLLM itself, and its trial server still forked
    # its engine core: the check left no start method behind for the server to inherit.
    log = (out / "trials" / "trial-0000" / "server.log").read_text(errors="replace").splitlines()
    [ready] = [line for line in log if "engine ready: " in line]
    assert json.loads(ready.split("engine ready: ", 1)[1])["engine_core_start"] == "fork"
