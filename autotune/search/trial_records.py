"""A trial as the study stores it: its label, the user attributes the tuner writes on it and
reads back (baseline, failure, interrupted, score, overrides, ...), the config it ran, what it
cost, and the one line that describes it."""

from __future__ import annotations

import math
from typing import Any

from optuna.trial import FrozenTrial, Trial, TrialState

from autotune.measure.kv_cache import KVCacheSize
from autotune.search.numerics import describe_changes
from autotune.search.objective import MEMORY_KNOB, Evaluation, Objective
from autotune.search.topology import engine_gpus
from server.config import ServerConfig


def trial_label(number: int) -> str:
    return f"trial-{number:04d}"


def is_baseline(trial: FrozenTrial) -> bool:
    return bool(trial.user_attrs.get("baseline"))


def feasible(trial: FrozenTrial) -> bool:
    return trial.state == TrialState.COMPLETE and all(v <= 0 for v in trial.constraints.values())


def lost_worker(trial: FrozenTrial) -> bool:
    """A trial failed from outside: its worker stopped heartbeating (killed, host lost).

    Every failure the tuner records itself sets `failure` or `interrupted` before telling;
    Optuna's stale-trial check sets only the state.
    """
    return (
        trial.state == TrialState.FAIL
        and not trial.user_attrs.get("failure")
        and not trial.user_attrs.get("interrupted")
    )


def counts_toward_budget(trial: FrozenTrial) -> bool:
    """Finished trials, minus those a Ctrl-C, a killed tuner or a lost worker cut short."""
    return (
        trial.state.is_finished()
        and not trial.user_attrs.get("interrupted")
        and not lost_worker(trial)
    )


def record_evaluation(trial: Trial, evaluation: Evaluation, *, wall_s: float, server_s: float) -> None:
    """Store a scored trial's constraints and results (told COMPLETE next)."""
    for name, value in evaluation.constraints.items():
        trial.set_constraint(name, value)
    trial.set_user_attr("score", evaluation.score)
    if evaluation.capacity_rps is not None:
        trial.set_user_attr("capacity_rps", evaluation.capacity_rps)
        trial.set_user_attr("headroom", evaluation.headroom)
        trial.set_user_attr("broke_first", evaluation.broke_first)
        trial.set_user_attr("first_fail_rps", evaluation.first_fail_rps)
        trial.set_user_attr("resolution", evaluation.resolution)
        trial.set_user_attr("devices", evaluation.devices)
        if evaluation.infeasible:
            trial.set_user_attr("infeasible", evaluation.infeasible)
        if evaluation.unscored:
            trial.set_user_attr("unscored", evaluation.unscored)
        if evaluation.capacity_note:
            trial.set_user_attr("capacity_note", evaluation.capacity_note)
    if evaluation.memory is not None:
        trial.set_user_attr("memory", evaluation.memory)
        trial.set_user_attr("kv_cache_gib", evaluation.kv_cache_gib)
        trial.set_user_attr("kv_cache_tokens", evaluation.kv_cache_tokens)
    if evaluation.prefix_cache_hit_rate is not None:  # absent counters: no figure, never a 0
        trial.set_user_attr("prefix_cache_hit_rate", evaluation.prefix_cache_hit_rate)
    trial.set_user_attr("slo_met", evaluation.slo_met)
    trial.set_user_attr("measured_ms", evaluation.measured_ms)
    trial.set_user_attr("margins_ms", evaluation.margins_ms)
    record_failure(trial, evaluation.failure, evaluation.failure_detail, wall_s=wall_s, server_s=server_s)


def record_failure(
    trial: Trial, failure: str | None, detail: str | None, *, wall_s: float, server_s: float
) -> None:
    """Store why a trial failed (None: it did not) and what it cost."""
    trial.set_user_attr("failure", failure)
    trial.set_user_attr("failure_detail", detail)
    trial.set_user_attr("wall_s", wall_s)
    trial.set_user_attr("server_s", server_s)


def server_seconds(outcome: Any) -> float:
    """Seconds a server process existed for this trial (engine start to teardown)."""
    timing = getattr(outcome, "timing", None)
    if timing is None:
        return 0.0
    return float(timing.ready_s + timing.warmup_s + timing.measure_s + timing.teardown_s)


def engine_devices(engine: dict[str, Any]) -> int:
    """Accelerators one engine of this config holds: tensor x pipeline x data parallel size
    (1 unless the config sets them; on CPU, the engine's wall time is what is counted)."""
    return engine_gpus(engine)


def explicit_engine(config: ServerConfig) -> dict[str, Any]:
    """The engine settings `config` sets (the rest are vLLM's defaults)."""
    return {k: v for k, v in config.engine.items() if v is not None}


def trial_config(baseline: ServerConfig, params: dict[str, Any]) -> ServerConfig:
    """The baseline with `params` on top (ServerConfig.with_overrides), in benchmark mode (exact
    output lengths)."""
    config = baseline.with_overrides(params)
    serving = config.serving.model_copy(update={"benchmark_mode": True})
    return config.model_copy(update={"serving": serving, "provenance": None})


def memory_of(config: ServerConfig, effective_defaults: dict[str, Any]) -> float | None:
    """The gpu_memory_utilization `config` runs with (vLLM's default when it sets none)."""
    value = config.searchable_values(effective_defaults).get(MEMORY_KNOB)
    return None if value is None else float(value)


def memory_status(evaluation: Evaluation, objective: Objective) -> str:
    """A min-memory run's line: SLOs at H, and the KV cache."""
    at = f"at {objective.headroom:g}x the recorded rate"
    text = f"SLOs met {at}" if evaluation.slo_met else f"{slo_text(evaluation)} {at}"
    kv = KVCacheSize(gib=evaluation.kv_cache_gib, tokens=evaluation.kv_cache_tokens)
    if kv.gib is not None or kv.tokens is not None:
        text += f", KV cache {kv.describe()}"
    return text


def slo_text(evaluation: Evaluation) -> str:
    if not evaluation.ok:
        return f"failed ({evaluation.failure}: {evaluation.failure_detail})"
    missed = [spec for spec, margin in evaluation.margins_ms.items() if margin is None or margin > 0]
    return "missed " + ", ".join(missed) if missed else "SLOs met"


def describe_trial(trial: FrozenTrial, objective: Objective) -> str:
    """One line: the overrides, the score, SLO status or the failure."""
    overrides = trial.user_attrs.get("overrides") or {}
    # None: the knob left to vLLM's default (e.g. kv_cache_dtype beside --allow fp8's weights).
    params = (", ".join(f"{k}={_fmt(v)}" for k, v in overrides.items() if v is not None)
              or "baseline (no overrides)")
    if trial.state == TrialState.PRUNED:
        return f"pruned ({params})"
    if trial.state == TrialState.FAIL:
        return f"failed: {trial.user_attrs.get('failure_detail') or trial.user_attrs.get('interrupted')} ({params})"
    failure = trial.user_attrs.get("failure")
    if failure:
        return f"{failure}: {trial.user_attrs.get('failure_detail')} ({params})"
    score = trial.user_attrs.get("score", 0.0)
    status = "SLOs met" if trial.user_attrs.get("slo_met") else "SLO missed"
    if objective.kind == "min-memory":
        status = ("SLOs met" if trial.user_attrs.get("slo_met") else "SLO missed") + f" at {objective.headroom:g}x the recorded rate"
        kv = KVCacheSize(gib=trial.user_attrs.get("kv_cache_gib"), tokens=trial.user_attrs.get("kv_cache_tokens"))
        if kv.gib is not None or kv.tokens is not None:
            status += f", KV cache {kv.describe()}"
    elif trial.user_attrs.get("infeasible") or trial.user_attrs.get("capacity_note"):
        status = trial.user_attrs.get("infeasible") or trial.user_attrs["capacity_note"]
    elif trial.user_attrs.get("headroom") is not None:
        # The bracket in whole req/s (under capacity-per-gpu the score is per GPU).
        status = headroom_status(trial.user_attrs["headroom"], trial.user_attrs.get("broke_first"),
                                 capacity_interval(trial.user_attrs.get("capacity_rps", score),
                                                   trial.user_attrs.get("first_fail_rps")))
        if objective.per_gpu and trial.user_attrs.get("devices"):
            status += "; " + on_gpus(trial.user_attrs.get("capacity_rps") or 0.0, trial.user_attrs["devices"])
    if trial.user_attrs.get("move"):
        params = f"first move {trial.user_attrs['move']}: {params}"
    numerics = describe_changes(trial.user_attrs.get("changes_numerics") or {})
    return f"{objective.format_score(score)}, {status} ({params})" + (f"; {numerics}" if numerics else "")


def headroom_status(headroom: float, broke_first: str | None, interval: str | None = None) -> str:
    """A capacity measurement in a live line: "1.35x the recorded rate (passed 12.1, failed
    13.4 req/s offered); above it tpot broke first"."""
    return (f"{headroom:.2f}x the recorded rate" + (f" ({interval})" if interval else "")
            + (f"; above it {broke_first} broke first" if broke_first else ""))


def on_gpus(capacity_rps: float, devices: int) -> str:
    """A per-GPU score's whole: "9.1 req/s on 2 GPUs"."""
    return f"{capacity_rps:.3g} req/s on {devices} GPU{'' if devices == 1 else 's'}"


def capacity_interval(capacity_rps: float | None, first_fail_rps: float | None) -> str | None:
    """The capacity's bracket as offered: "passed 12.1, failed 13.4 req/s offered"; "passed
    12.1 req/s offered, none failed above" without a failing step; None without a capacity."""
    if not capacity_rps:
        return None
    if first_fail_rps is None:
        return f"passed {capacity_rps:.3g} req/s offered, none failed above"
    return f"passed {capacity_rps:.3g}, failed {first_fail_rps:.3g} req/s offered"


def _fmt(value: Any) -> str:
    if isinstance(value, float) and not math.isnan(value):
        return f"{value:.3g}"
    return str(value)
