"""What a trial is worth: the objective (capacity, goodput, throughput or a Pareto pair) and
the SLOs.

- `capacity` (default): the highest request rate at which every SLO holds, measured by the
  load ladder (`autotune.measure.ladder`) in one launch; shown as headroom over the recorded rate.
  Maximised. A run "meets the SLOs" when its capacity covers the recorded rate (headroom >= 1).
- `capacity-per-gpu`: that capacity over the GPUs one engine of the config holds (tensor x
  pipeline x data parallel size: `trial_records.engine_devices`), req/s per GPU. Maximised, and
  what the gate compares: on a multi-GPU host it asks which topology serves the most per GPU
  (a TP=2 config carrying 1.5x a one-GPU config's traffic ranks below it), where `capacity`
  asks which carries the most with the GPUs it takes. Headroom stays the whole capacity's.
- `min-memory[:Hx]`: the smallest `gpu_memory_utilization` at which every SLO still holds at
  the recorded rate times H (`--headroom`, default 1.5), measured by one ladder step at speed-up
  H. Minimised; a config that misses an SLO there is infeasible (value +inf and a violated
  constraint), so the sampler learns where memory runs short. For several models on one GPU.
- `goodput`: requests per second that meet every per-request SLO, the same number
  `vllm bench serve --goodput` reports. Maximised.
- `throughput`: completed requests per second. Maximised.
- `pareto[:METRIC_pPCT]`: throughput (maximised) against a latency percentile (minimised,
  default the first SLO's metric and percentile): a two-objective study.

SLO feasibility is an Optuna constraint per SLO: `(measured percentile - threshold) /
threshold`, <= 0 when met. Relative rather than raw milliseconds because TPE ranks infeasible
trials by the *sum* of violations, and a 100 ms TTFT miss and a 10 ms TPOT miss are equally bad
for a 500 ms / 50 ms pair of SLOs. The raw margins in ms are stored too (report, headroom).

Over 400 lines because the five objectives share one evaluation record and one way to read
their SLOs; split by objective, each part would re-import the others' helpers.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from autotune.errors import AutotuneError
from autotune.measure.limits import what_broke_first
from workloads.slo import SLO, parse_slo, request_tpot_ms

ObjectiveKind = Literal["capacity", "goodput", "throughput", "pareto", "min-memory"]

# Default SLOs for the embedded tiny model on a 2-core CPU under the sample translation trace
# (measured, see docs in the report): a sane config keeps p95 TTFT well under a second and
# per-token time in the tens of ms; starved configs (1-2 seqs) queue and blow TTFT up.
DEFAULT_CPU_SLOS: tuple[str, ...] = ("ttft_p95_ms=1000", "tpot_p95_ms=100")
# The reference user's service on a GPU: interactive translation.
DEFAULT_GPU_SLOS: tuple[str, ...] = ("ttft_p95_ms=500", "tpot_p95_ms=50")

# Failures that say something about the config itself: the sampler should learn to avoid its
# region (COMPLETE + violated constraint). The others (a busy port, a Ctrl-C) say nothing about
# the config and are recorded as FAIL, which TPE ignores.
CONFIG_FAILURES = frozenset({"oom", "start_timeout", "crash", "http_errors", "invalid_config"})
# Failures of the install or the machine (a missing module, a CUDA or driver error): they say
# nothing about the config and would fail every trial alike, so the study stops after one.
STUDY_STOPPING_FAILURES = frozenset({"environment"})

_MIN_MEMORY = re.compile(r"^min-memory(?::(?P<headroom>.+?)x?)?$")
# The engine argument min-memory minimises (on CPU: the share of NUMA-node memory vLLM reserves).
MEMORY_KNOB = "gpu_memory_utilization"
CAPACITY_PER_GPU = "capacity-per-gpu"
_PARETO = re.compile(r"^pareto(?::(?P<metric>ttft|tpot|itl|e2el)_p(?P<pct>[0-9.]+))?$")


class Objective(BaseModel):
    """The study's objective(s)."""

    model_config = ConfigDict(frozen=True)

    kind: ObjectiveKind = "capacity"
    per_gpu: bool = False  # capacity only: scored per GPU the config's engine holds
    latency_metric: str | None = None  # pareto only
    latency_percentile: float | None = None
    headroom: float | None = None  # min-memory only: the SLOs must hold at recorded rate x this

    @property
    def directions(self) -> list[str]:
        if self.kind == "pareto":
            return ["maximize", "minimize"]
        return ["minimize"] if self.minimize else ["maximize"]

    @property
    def minimize(self) -> bool:
        """True when the scalar the gate and the rankings compare is better lower."""
        return self.kind == "min-memory"

    def rank_key(self, score: float) -> float:
        """Sort key that puts the better score first (ascending sort)."""
        return score if self.minimize else -score

    @property
    def worst(self) -> float:
        """The score a failed or infeasible trial is told."""
        return math.inf if self.minimize else 0.0

    @property
    def label(self) -> str:
        """Name of the scalar the gate compares (pareto: its throughput side)."""
        if self.per_gpu:
            return "capacity per GPU"
        if self.kind in ("capacity", "goodput"):
            return self.kind
        if self.kind == "min-memory":
            return MEMORY_KNOB
        return "throughput"

    @property
    def uses_ladder(self) -> bool:
        """Trials are measured by the load ladder (min-memory: a single step at H)."""
        return self.kind in ("capacity", "min-memory")

    @property
    def measures_capacity(self) -> bool:
        """Trials climb the whole ladder to a capacity (first moves, hinted starts, headroom)."""
        return self.kind == "capacity"

    @property
    def unit(self) -> str:
        if self.per_gpu:
            return "req/s per GPU"
        return "fraction" if self.kind == "min-memory" else "req/s"

    def format_score(self, score: float) -> str:
        """A score as a progress line shows it."""
        if self.kind == "min-memory":
            return f"{MEMORY_KNOB} {score:.3g}"
        if self.per_gpu:
            return f"{score:.3g} {self.unit}"
        return f"{score:.3g} {self.unit} {self.label}"

    def spec(self) -> str:
        if self.kind == "min-memory":
            # H is part of the name: a study resumed with another H is refused.
            return f"min-memory:{self.headroom:g}x"
        if self.per_gpu:
            return CAPACITY_PER_GPU
        if self.kind != "pareto":
            return self.kind
        return f"pareto:{self.latency_metric}_p{self.latency_percentile:g}"

    def latency_name(self) -> str:
        return f"{self.latency_metric}_p{self.latency_percentile:g}_ms"


def parse_objective(text: str, slos: Sequence[SLO], *, headroom: float | None = None) -> Objective:
    """`capacity`, `capacity-per-gpu`, `goodput`, `throughput`, `pareto`, `pareto:e2el_p99`,
    `min-memory` (H from `headroom`, i.e. `--headroom`) or `min-memory:2x` (H in the name, as a
    study stores it)."""
    spec = text.strip().lower()
    if spec in ("capacity", CAPACITY_PER_GPU, "min-memory") and not slos:
        raise AutotuneError(f"--objective {spec} needs at least one --slo (e.g. ttft_p95_ms=500)")
    if spec == CAPACITY_PER_GPU:
        return Objective(kind="capacity", per_gpu=True)
    memory = _MIN_MEMORY.match(spec)
    if memory is not None:
        return Objective(kind="min-memory", headroom=_headroom(memory["headroom"], headroom))
    if spec in ("capacity", "goodput", "throughput"):
        return Objective(kind=spec)  # type: ignore[arg-type]
    match = _PARETO.match(spec)
    if match is None:
        raise AutotuneError(
            f"--objective {text!r}: expected capacity, capacity-per-gpu, goodput, throughput, "
            f"min-memory, pareto or pareto:METRIC_pPCT (e.g. pareto:e2el_p95)"
        )
    if match["metric"]:
        return Objective(kind="pareto", latency_metric=match["metric"], latency_percentile=float(match["pct"]))
    first = slos[0] if slos else SLO(metric="e2el", percentile=95, threshold_ms=1)
    return Objective(kind="pareto", latency_metric=first.metric, latency_percentile=first.percentile)


def _headroom(written: str | None, flag: float | None) -> float:
    """H of min-memory: the one in its name (a stored study's), else --headroom's."""
    if written is not None:
        try:
            value = float(written)
        except ValueError:
            raise AutotuneError(f"--objective min-memory:{written}: expected e.g. min-memory:1.5x") from None
    elif flag is not None:
        value = float(flag)
    else:
        raise AutotuneError("--objective min-memory needs --headroom H (e.g. 1.5)")
    if not (value > 0 and math.isfinite(value)):
        raise AutotuneError(
            f"--headroom {value:g}: must be above 0 (1.5 = every SLO held at 1.5x the recorded rate)"
        )
    return value


def default_slos(accelerator: str) -> list[SLO]:
    return [parse_slo(text) for text in (DEFAULT_GPU_SLOS if accelerator == "gpu" else DEFAULT_CPU_SLOS)]


class Evaluation(BaseModel):
    """One measured run scored: what is told to Optuna and shown in the report."""

    values: list[float]  # one per study direction
    score: float  # the scalar the gate compares (goodput or throughput), 0 when it failed
    measured_ms: dict[str, float | None]  # SLO spec -> measured percentile
    margins_ms: dict[str, float | None]  # SLO spec -> measured - threshold (<= 0 met)
    constraints: dict[str, float]  # Optuna constraint name -> value (<= 0 feasible)
    slo_met: bool  # ran and met every SLO
    ok: bool  # the run completed (no failure)
    failure: str | None = None
    failure_detail: str | None = None
    # capacity objective: req/s the config carries with every SLO met, and / recorded rate
    capacity_rps: float | None = None
    headroom: float | None = None
    broke_first: str | None = None  # the SLO that broke first above the capacity (what_broke_first)
    # The capacity's bracket: the first failing step's offered rate above it, and the bracket's
    # relative width (CapacityResult.resolution); None where no step failed above it.
    first_fail_rps: float | None = None
    resolution: float | None = None
    infeasible: str | None = None  # no load the ladder tried met the SLOs (CapacityResult.infeasible)
    # Ladder steps not scored (client lag, counts that did not reconcile): how many, the last why.
    unscored: str | None = None
    # No step passed: what the ladder found instead (CapacityResult.describe), for the live line.
    capacity_note: str | None = None
    # min-memory: the config's gpu_memory_utilization and the KV cache vLLM made of it
    memory: float | None = None
    kv_cache_gib: float | None = None
    kv_cache_tokens: int | None = None
    # capacity: the GPUs one engine of the config holds (TP x PP x DP); per GPU, score is
    # capacity_rps over this
    devices: int | None = None
    # Prefix-cache hits over queries, in tokens, over the measured steps (vLLM's counters);
    # None where the server exposes no such counters
    prefix_cache_hit_rate: float | None = None

    @property
    def feasible(self) -> bool:
        return all(value <= 0 for value in self.constraints.values())

    @classmethod
    def of(cls, outcome: Any, **scored: Any) -> Evaluation:
        """`outcome` (a TrialOutcome) scored: whether it ran and why not, and its prefix-cache
        hit rate, as the outcome says; the rest as `scored` says."""
        return cls(ok=bool(outcome.ok), failure=outcome.failure,
                   failure_detail=outcome.failure_detail,
                   prefix_cache_hit_rate=getattr(outcome, "prefix_cache_hit_rate", None), **scored)


def measured_percentile(
    summary: Any, trial_dir: str | Path | None, metric: str, percentile: float
) -> float | None:
    """The run's `percentile` of `metric` in ms: from the summary when it carries that
    percentile, else from the run's requests.jsonl."""
    name = {50.0: "median", 90.0: "p90", 95.0: "p95", 99.0: "p99"}.get(float(percentile))
    if summary is not None and name is not None:
        value = getattr(summary, f"{name}_{metric}_ms", None)
        if value is not None:
            return float(value)
    if trial_dir is None:
        return None
    values = _record_values(Path(trial_dir) / "requests.jsonl", metric)
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), percentile))


def _record_values(path: Path, metric: str) -> list[float]:
    if not path.exists():
        return []
    values: list[float] = []
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            record = _Record.model_validate(json.loads(line))
            if record.error is not None:
                continue
            if metric == "itl":
                values.extend(record.itl_ms)
                continue
            value = {
                "ttft": record.ttft_ms,
                "e2el": record.e2e_ms,
                "tpot": request_tpot_ms(record),
            }[metric]
            if value is not None:
                values.append(value)
    return values


class _Record(BaseModel):
    """The fields of a requests.jsonl line the objective reads."""

    model_config = ConfigDict(extra="ignore")

    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = []
    output_tokens: int = 0
    error: str | None = None


def evaluate(
    outcome: Any, objective: Objective, slos: Sequence[SLO], *, memory: float | None = None,
    devices: int = 1,
) -> Evaluation:
    """Score a TrialOutcome. A failed or unmeasured run scores 0 and violates a 'ran'
    constraint, so the sampler ranks it below every run that worked. `memory`: the config's
    gpu_memory_utilization (min-memory's score); `devices`: the GPUs its engine holds
    (capacity-per-gpu divides by them)."""
    if objective.kind == "capacity":
        return _evaluate_capacity(outcome, slos, devices=devices, per_gpu=objective.per_gpu)
    if objective.kind == "min-memory":
        return _evaluate_min_memory(outcome, slos, memory)
    summary = outcome.summary if outcome.ok else None
    measured: dict[str, float | None] = {}
    margins: dict[str, float | None] = {}
    constraints: dict[str, float] = {"ran": 0.0 if summary is not None else 1.0}
    slo_met = summary is not None
    for slo in slos:
        spec = slo.spec()
        value = (
            measured_percentile(summary, outcome.trial_dir, slo.metric, slo.percentile)
            if summary is not None
            else None
        )
        measured[spec] = value
        margins[spec] = None if value is None else value - slo.threshold_ms
        # Unmeasurable (no request finished) counts as a full miss.
        relative = 1.0 if value is None else (value - slo.threshold_ms) / slo.threshold_ms
        constraints[f"slo:{spec}"] = relative
        slo_met = slo_met and value is not None and value <= slo.threshold_ms
    if summary is None:
        throughput = goodput = 0.0
    else:
        throughput = float(summary.request_throughput)
        goodput = float(summary.request_goodput) if summary.request_goodput is not None else throughput
    score = goodput if objective.kind == "goodput" else throughput
    if objective.kind == "pareto":
        latency = (
            measured_percentile(summary, outcome.trial_dir, objective.latency_metric or "e2el",
                                objective.latency_percentile or 95.0)
            if summary is not None
            else None
        )
        values = [throughput, latency if latency is not None else math.inf]
    else:
        values = [score]
    return Evaluation.of(
        outcome,
        values=values,
        score=score,
        measured_ms=measured,
        margins_ms=margins,
        constraints=constraints,
        slo_met=slo_met,
    )


def step_percentiles(
    step: Any, slos: Sequence[SLO]
) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """Each SLO's measured percentile in one ladder step and its margin (measured - threshold);
    None where the step is missing or did not measure it."""
    measured = {slo.spec(): (step.measured_ms.get(slo.spec()) if step else None) for slo in slos}
    margins = {
        slo.spec(): None if measured[slo.spec()] is None else measured[slo.spec()] - slo.threshold_ms
        for slo in slos
    }
    return measured, margins


def _evaluate_capacity(outcome: Any, slos: Sequence[SLO], *, devices: int, per_gpu: bool) -> Evaluation:
    """Capacity found by the ladder (per GPU: over `devices`). A ladder a crash cut short
    keeps what it measured (the capacity below the crash), but the run is not `ok`: the gate
    never exports it."""
    capacity = getattr(outcome, "capacity", None)
    rps = float(capacity.capacity_rps) if capacity is not None else 0.0
    step = capacity.passing_step() if capacity is not None else None
    measured, margins = step_percentiles(step, slos)
    headroom = capacity.headroom if capacity is not None else 0.0
    devices = max(1, int(devices))
    score = rps / devices if per_gpu else rps
    return Evaluation.of(
        outcome,
        values=[score],
        score=score,
        devices=devices,
        measured_ms=measured,
        margins_ms=margins,
        # Carrying anything at all is the only hard constraint: SLOs are inside the number.
        constraints={"ran": 0.0 if rps > 0 else 1.0},
        slo_met=bool(outcome.ok) and rps > 0 and headroom >= 1.0,
        capacity_rps=rps,
        headroom=headroom,
        broke_first=what_broke_first(capacity, slos) if capacity is not None else None,
        first_fail_rps=capacity.first_fail_rps if capacity is not None else None,
        resolution=capacity.resolution if capacity is not None else None,
        infeasible=capacity.infeasible if capacity is not None else None,
        unscored=unscored_note(capacity),
        capacity_note=capacity.describe() if capacity is not None and capacity.capacity_rps <= 0 else None,
    )


def unscored_note(capacity: Any) -> str | None:
    """"2 steps not scored (last: the replayer's send-lag p99 was 80 ms ...)", or None."""
    steps = list(getattr(capacity, "unscored", None) or [])
    if not steps:
        return None
    why = steps[-1].reason.removeprefix("not scored: ")
    return f"{len(steps)} step{'s' if len(steps) > 1 else ''} not scored (last: {why})"


def _evaluate_min_memory(outcome: Any, slos: Sequence[SLO], memory: float | None) -> Evaluation:
    """One ladder step at speed-up H. Feasible only when that step met every SLO; then the
    value told to Optuna is the config's memory, otherwise +inf. The constraints keep the
    relative SLO misses so that the sampler ranks near-misses above far ones."""
    if memory is None:
        raise AutotuneError(f"min-memory: the config's {MEMORY_KNOB} is unknown; set it in --baseline")
    capacity = getattr(outcome, "capacity", None)
    step = capacity.steps[0] if capacity is not None and capacity.steps else None
    measured, margins = step_percentiles(step, slos)
    constraints: dict[str, float] = {"ran": 0.0 if outcome.ok and step is not None else 1.0}
    for slo in slos:
        margin = margins[slo.spec()]
        constraints[f"slo:{slo.spec()}"] = 1.0 if margin is None else margin / slo.threshold_ms
    passed = bool(outcome.ok) and step is not None and step.passed
    # A step can fail with every measured percentile under its threshold (abandoned early,
    # too many errors, a client that lagged): the step's own verdict is a constraint too.
    constraints["step"] = 0.0 if passed else 1.0
    kv = getattr(outcome, "kv_cache", None)
    return Evaluation.of(
        outcome,
        values=[float(memory) if passed else math.inf],
        score=float(memory),
        measured_ms=measured,
        margins_ms=margins,
        constraints=constraints,
        slo_met=passed,
        memory=float(memory),
        kv_cache_gib=kv.gib if kv is not None else None,
        kv_cache_tokens=kv.tokens if kv is not None else None,
    )


def invalid_config_evaluation(objective: Objective, slos: Sequence[SLO], reason: str) -> Evaluation:
    """The score of a config that breaks a relation and was never launched."""
    constraints = {"ran": 1.0, **{f"slo:{slo.spec()}": 1.0 for slo in slos}}
    values = [0.0, math.inf] if objective.kind == "pareto" else [objective.worst]
    if objective.kind == "capacity":
        constraints = {"ran": 1.0}
    if objective.kind == "min-memory":
        constraints["step"] = 1.0
    return Evaluation(
        values=values,
        score=0.0,
        measured_ms={slo.spec(): None for slo in slos},
        margins_ms={slo.spec(): None for slo in slos},
        constraints=constraints,
        slo_met=False,
        ok=False,
        failure="invalid_config",
        failure_detail=reason,
    )
