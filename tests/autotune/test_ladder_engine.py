"""The capacity ladder on the real CPU engine: one launch per config, and a config that can
run one sequence at a time carries measurably less than vLLM's defaults (side by side, same
window, same SLOs, one run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.ladder import LadderSettings
from autotune.trial import TrialRunner
from server.config import ServerConfig, default_engine_settings
from workloads.slo import parse_slo
from workloads.trace import Trace, TraceRequest


def translation_like_window(requests: int = 40, seconds: float = 10.0) -> Trace:
    spacing_ms = seconds * 1000 / requests
    return Trace.from_requests(
        [TraceRequest(timestamp=i * spacing_ms, input_length=10 + (i * 37) % 191,
                      output_length=8 + (i * 13) % 33) for i in range(requests)],
        source="ladder engine window",
    )


@pytest.mark.engine
@pytest.mark.slow
def test_one_sequence_at_a_time_carries_less_than_the_defaults(tmp_path: Path) -> None:
    slos = [parse_slo("ttft_p95_ms=1000"), parse_slo("tpot_p95_ms=100")]
    # Coarse on purpose (50% resolution): the claim is an order, not a figure.
    settings = LadderSettings(step_requests=24, min_step_s=3.0, resolution=0.5, max_steps=7)
    runner = TrialRunner(startup_timeout_s=300, stale_registry=tmp_path / "servers.json",
                         slos=slos, ladder=settings)
    window = translation_like_window()
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
    assert capacities["one-seq"].capacity_rps < capacities["defaults"].capacity_rps
    assert capacities["defaults"].capacity_rps > 0
