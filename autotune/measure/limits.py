"""What limited a config, read from its capacity ladder: the step where its limit showed, the
SLO that broke first there, and whether that SLO broke only in front of the engine.

The search's first phase picks its moves from these (autotune.search.first_moves) and the
report's trial table shows them (`broke_first`).
"""

from __future__ import annotations

from collections.abc import Sequence

from autotune.measure.ladder import CapacityResult, LadderStep, step_rate
from workloads.slo import SLO


def limiting_step(capacity: CapacityResult) -> LadderStep | None:
    """The lowest failing step above the capacity: where the config's limit showed."""
    passing = capacity.passing_step()
    failing = [s for s in capacity.steps if not s.passed and (passing is None or s.speedup > passing.speedup)]
    return min(failing, key=lambda s: s.speedup) if failing else None


def front_end_lag(capacity: CapacityResult, slos: Sequence[SLO]) -> str | None:
    """Why the front end, not the engine, limited the config (None when it did not): at the
    limiting step TTFT broke first, over its threshold at the client but within it by vLLM's
    own histogram (which starts when the front end hands the request to the engine), with no
    request waiting in the engine. vLLM's side is read at p95 (what the scraper keeps), so only
    a p95 TTFT SLO is judged."""
    step = limiting_step(capacity)
    return None if step is None else _front_end_lag_at(step, slos)


def what_broke_first(capacity: CapacityResult, slos: Sequence[SLO]) -> str | None:
    """For the report: the SLO metric that broke first, and where when the engine's own
    latency still met it ("ttft (outside the engine)": `front_end_lag`)."""
    step = limiting_step(capacity)
    metric = None if step is None else _broke_first_at(step, slos)
    if metric is None:
        return None
    return f"{metric} (outside the engine)" if _front_end_lag_at(step, slos) else metric


def limiting_slo(capacity: CapacityResult, slos: Sequence[SLO]) -> str | None:
    """The SLO metric that broke first: the one furthest over its threshold at the lowest
    failing step above the capacity (by missed-request counts when the step was abandoned)."""
    step = limiting_step(capacity)
    return None if step is None else _broke_first_at(step, slos)


def _broke_first_at(step: LadderStep, slos: Sequence[SLO]) -> str | None:
    worst: tuple[float, str] | None = None
    for slo in slos:
        value = step.measured_ms.get(slo.spec())
        misses = step.summary.slo_violations.get(slo.spec())
        if step.abandoned and misses is not None:
            score = misses / max(step.requests, 1)
        elif value is not None:
            score = value / slo.threshold_ms
        else:
            continue
        if worst is None or score > worst[0]:
            worst = (score, slo.metric)
    return None if worst is None else worst[1]


def _front_end_lag_at(step: LadderStep, slos: Sequence[SLO]) -> str | None:
    slo = next((slo for slo in slos if slo.metric == "ttft" and slo.percentile == 95), None)
    if slo is None or step.server is None or _broke_first_at(step, slos) != "ttft":
        return None
    client = step.measured_ms.get(slo.spec())
    engine = step.server.ttft_p95_ms
    waiting = step.server.num_waiting_max
    if client is None or engine is None or waiting is None or waiting > 0:
        return None
    if not engine <= slo.threshold_ms < client:
        return None
    return (f"ttft broke first at {step_rate(step):.3g} req/s only outside the engine: "
            f"{client:.0f} ms at the client, {engine:.0f} by vLLM's count, none waiting in it: "
            f"the front end fell behind")
