"""Pre-flight checks: what the trace, the windows and the SLOs must satisfy before any engine
starts. A study that cannot measure what it was asked to is refused in seconds, in one line
naming the figure and the fix (AutotuneError: exit code 2), rather than after an engine start
with a result nobody should trust.

1. Context: every request's input + output must fit the model's context (`max_model_len`),
   or the server answers HTTP 400 and the trial measures the errors. Requests that do not fit
   are refused by default; `--over-context drop` leaves them out of the trace and
   `--over-context cap` cuts their prompts to fit (outputs kept, where they alone fit). Both
   are counted, printed, and stored in the report and best.yaml's provenance.
2. Sample size: a percentile SLO is judged on each window's own requests, so each window must
   hold enough of them for the percentile to mean something. The rule (MIN_TAIL_REQUESTS):
   at least 10 requests beyond the percentile, n >= 10 / (1 - p/100): p50 20, p90 100,
   p95 200, p99 1,000 (AIPerf's advice for p99), p99.9 10,000. TPOT counts requests of two or
   more output tokens; ITL counts inter-token gaps. Windows too short for it are lengthened
   where the trace has room (and the run says so); otherwise the run is refused with the
   numbers. p100 (the slowest request) is refused: no number of requests pins it down.
3. Windows that do not fit in the trace are refused by `workloads.windows.select_windows`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from autotune.errors import AutotuneError
from workloads.errors import WorkloadError
from workloads.slo import MIN_TAIL_SAMPLES, SLO, min_samples
from workloads.trace import Trace
from workloads.windows import WindowInfo, select_windows

MIN_TAIL_REQUESTS = MIN_TAIL_SAMPLES
RULE = f"at least {MIN_TAIL_REQUESTS} requests beyond the percentile: n >= {MIN_TAIL_REQUESTS} / (1 - p/100)"
OverContext = Literal["refuse", "drop", "cap"]
OVER_CONTEXT_CHOICES: tuple[str, ...] = ("refuse", "drop", "cap")
# Keys of a model's config.json that bound its context, as vLLM reads them.
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                  "max_sequence_length", "max_seq_length", "seq_len")
_LENGTHEN_ROUNDS = 12
_GROWTH_MARGIN = 1.05  # a lengthened window's new pick may hold a few requests fewer


# ---------------------------------------------------------------------------------------------
# 1. The model's context


class ContextFit(BaseModel):
    """How the trace fits the model's context; stored in the provenance (workload.preflight)."""

    model_config = ConfigDict(extra="forbid")

    context_tokens: int
    context_source: str
    policy: OverContext
    requests: int  # in the trace, before anything was dropped or capped
    over: int  # requests whose input + output exceed the context
    largest_tokens: int  # input + output of the longest request
    dropped: int = 0
    capped: int = 0

    @property
    def share(self) -> float:
        return self.over / self.requests if self.requests else 0.0

    def describe(self) -> str:
        """One line for the log and the report ('' when every request fits)."""
        if self.over == 0:
            return ""
        what = (f"{self.dropped:,} dropped (--over-context drop)" if self.dropped
                else f"{self.capped:,} capped: prompts cut to fit (--over-context cap)")
        return (f"{self.over:,} of {self.requests:,} requests ({self.share:.1%}) exceed the model's "
                f"context of {self.context_tokens:,} tokens ({self.context_source}; longest "
                f"{self.largest_tokens:,}): {what}")


def model_position_limit(model: str | None) -> int | None:
    """The longest context a local model's config.json allows (None when unknown)."""
    if not model:
        return None
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    config = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    limits = [config[key] for key in _POSITION_KEYS if isinstance(config.get(key), int) and config[key] > 0]
    return min(limits) if limits else None


def fit_context(
    trace: Trace,
    context_tokens: int,
    *,
    source: str,
    policy: OverContext = "refuse",
    model_limit: int | None = None,
) -> tuple[Trace, ContextFit]:
    """The trace as it will be replayed, and how it fits; AutotuneError when requests do not
    fit and `policy` is "refuse"."""
    if policy not in OVER_CONTEXT_CHOICES:
        raise AutotuneError(f"--over-context {policy!r}: expected one of {', '.join(OVER_CONTEXT_CHOICES)}")
    totals = trace.input_lengths + trace.output_lengths
    over = totals > context_tokens
    fit = ContextFit(
        context_tokens=context_tokens,
        context_source=source,
        policy=policy,
        requests=len(trace),
        over=int(over.sum()),
        largest_tokens=int(totals.max()) if len(trace) else 0,
    )
    if fit.over == 0:
        return trace, fit
    if policy == "drop":
        kept = trace.subset(~over)
        if len(kept) == 0:
            raise AutotuneError(
                f"{trace.source}: --over-context drop leaves no request: all {fit.requests:,} "
                f"exceed the model's context of {context_tokens:,} tokens ({source}); raise "
                f"--max-model-len or use a model with a longer context"
            )
        return kept, fit.model_copy(update={"dropped": fit.over})
    if policy == "cap":
        return cap_prompts(trace, context_tokens), fit.model_copy(update={"capped": fit.over})
    raise AutotuneError(_over_context_message(trace, fit, model_limit))


def cap_prompts(trace: Trace, context_tokens: int) -> Trace:
    """Every request cut to fit: the prompt shortened, the output kept where it fits with a
    prompt of one token (else it is cut to context - 1). Prefix blocks (hash_ids) stay: the
    replayer's prompts take the leading blocks that fit."""
    outputs = np.minimum(trace.output_lengths, context_tokens - 1)
    inputs = np.maximum(1, np.minimum(trace.input_lengths, context_tokens - outputs))
    capped = trace.replace()
    capped.input_lengths = inputs.astype(np.int64)
    capped.output_lengths = outputs.astype(np.int64)
    return capped


def _over_context_message(trace: Trace, fit: ContextFit, model_limit: int | None) -> str:
    ctx = fit.context_tokens
    outputs_alone = int((trace.output_lengths >= ctx).sum())
    parts = [
        f"{trace.source}: {fit.over:,} of {fit.requests:,} requests ({fit.share:.1%}) need more "
        f"than the model's context of {ctx:,} tokens ({fit.context_source}): input + output up to "
        f"{fit.largest_tokens:,} tokens",
    ]
    if outputs_alone:
        parts.append(f", {outputs_alone:,} of them ask for {ctx:,}+ output tokens alone")
    totals = trace.input_lengths + trace.output_lengths
    if model_limit is not None and model_limit > ctx:
        still = int((totals > model_limit).sum())
        raise_to = min(model_limit, fit.largest_tokens)
        after = f"; {still:,} would still not fit" if still else ", which fits every request"
        parts.append(f"; the server would refuse them (HTTP 400). Pass --max-model-len {raise_to} "
                     f"(the model allows up to {model_limit:,}{after})")
    else:
        parts.append("; the server would refuse them (HTTP 400). Use a model with a longer context")
    parts.append(", or --over-context drop (leave them out) or --over-context cap (cut their "
                 "prompts to fit); either is counted in the report and best.yaml")
    return "".join(parts)


# ---------------------------------------------------------------------------------------------
# 2. Enough requests for each percentile


class Requirement(BaseModel):
    """A percentile the study judges each window by, and the samples it needs there."""

    model_config = ConfigDict(frozen=True)

    spec: str  # "ttft_p95_ms=500" or "pareto:e2el_p95"
    metric: str
    percentile: float
    needed: int

    @property
    def unit(self) -> str:
        return {"tpot": "requests of 2+ output tokens", "itl": "inter-token gaps"}.get(
            self.metric, "requests")


def requirements(slos: Sequence[SLO], objective: Any = None) -> list[Requirement]:
    """One per SLO, plus the Pareto objective's latency percentile; p100 is refused."""
    wanted = [(slo.spec(), slo.metric, slo.percentile) for slo in slos]
    latency = getattr(objective, "latency_metric", None)
    if latency is not None and getattr(objective, "latency_percentile", None) is not None:
        wanted.append((objective.spec(), latency, float(objective.latency_percentile)))
    found = []
    for spec, metric, percentile in wanted:
        if percentile >= 100:
            raise AutotuneError(
                f"SLO {spec}: p100 is the slowest request of a run, which no number of requests "
                f"pins down (the rule is {RULE}); use p99 or p99.9"
            )
        found.append(Requirement(spec=spec, metric=metric, percentile=percentile,
                                 needed=min_samples(percentile)))
    return found


def samples(window: Trace, metric: str) -> int:
    """How many values of `metric` a replay of `window` yields."""
    if metric == "tpot":
        return int((window.output_lengths >= 2).sum())
    if metric == "itl":
        return int(np.maximum(window.output_lengths - 1, 0).sum())
    return len(window)


class WindowFit(BaseModel):
    """The windows used, and why they differ from the ones asked for; stored in provenance."""

    model_config = ConfigDict(extra="forbid")

    asked_s: tuple[float, float]
    used_s: tuple[float, float]
    requests: tuple[int, int]
    needed: dict[str, int]  # requirement spec -> samples each window needs
    rule: str = RULE

    @property
    def lengthened(self) -> bool:
        return self.used_s != self.asked_s

    def describe(self) -> str:
        if not self.lengthened:
            return ""
        strictest = max(self.needed.items(), key=lambda item: item[1])
        return (
            f"windows lengthened to hold enough requests for the SLO percentiles ({RULE}; "
            f"{strictest[0]} needs {strictest[1]:,}): tuning {self.asked_s[0]:g} -> "
            f"{self.used_s[0]:g} s ({self.requests[0]:,} requests), held-out "
            f"{self.asked_s[1]:g} -> {self.used_s[1]:g} s ({self.requests[1]:,} requests)"
        )


def fit_windows(
    trace: Trace,
    tuning_s: float,
    holdout_s: float,
    needs: Sequence[Requirement],
    *,
    label: str | None = None,
) -> tuple[Trace, Trace, WindowInfo, WindowFit]:
    """`select_windows`, lengthening either window until it holds what every requirement
    needs; AutotuneError with the numbers when the trace cannot give that. `label` names the
    trace in messages (default: its source)."""
    label = label or trace.source
    tuning, holdout, info = select_windows(trace, tuning_s, holdout_s)  # refuses what cannot fit
    _check_whole_trace(trace, needs, label)
    lengths = [float(tuning_s), float(holdout_s)]
    span = trace.duration_s()
    for _ in range(_LENGTHEN_ROUNDS):
        grow = [_shortfall(window, needs) for window in (tuning, holdout)]
        if max(grow) <= 1.0:
            fit = WindowFit(
                asked_s=(float(tuning_s), float(holdout_s)),
                used_s=(lengths[0], lengths[1]),
                requests=(len(tuning), len(holdout)),
                needed={need.spec: need.needed for need in needs},
            )
            return tuning, holdout, info, fit
        wanted = [math.ceil(length * factor * _GROWTH_MARGIN) if factor > 1 else length
                  for length, factor in zip(lengths, grow, strict=True)]
        if sum(wanted) > span:
            room = span - sum(lengths)
            if room <= 1e-3:
                break
            # Share the room left in proportion to what each window still wants; never shrink.
            extra = [w - length for w, length in zip(wanted, lengths, strict=True)]
            wanted = [length + math.floor(e * room / sum(extra) * 1000) / 1000
                      for length, e in zip(lengths, extra, strict=True)]
        lengths = [float(w) for w in wanted]
        try:
            tuning, holdout, info = select_windows(trace, *lengths)
        except WorkloadError:
            break  # no disjoint placement of windows this long: as good as too long
    raise AutotuneError(_too_few_message(trace, needs, span, label, (tuning_s, holdout_s)))


def _shortfall(window: Trace, needs: Sequence[Requirement]) -> float:
    """How many times longer the window must be (<= 1: long enough)."""
    factors = [need.needed / max(samples(window, need.metric), 1) for need in needs]
    return max(factors, default=0.0)


def _strictest(trace: Trace, needs: Sequence[Requirement]) -> Requirement:
    return max(needs, key=lambda need: need.needed / max(samples(trace, need.metric), 1))


def _check_whole_trace(trace: Trace, needs: Sequence[Requirement], label: str) -> None:
    """The trace must hold two windows' worth of samples for every requirement."""
    for need in needs:
        have = samples(trace, need.metric)
        if have < 2 * need.needed:
            raise AutotuneError(
                f"{label}: {have:,} {need.unit} in all, but {need.spec} needs at least "
                f"{need.needed:,} in each of the tuning and held-out windows ({RULE}), "
                f"{2 * need.needed:,} in all; use a longer trace or a lower percentile"
                f"{_supported(have)}"
            )


def _too_few_message(
    trace: Trace, needs: Sequence[Requirement], span: float, label: str, asked: tuple[float, float]
) -> str:
    need = _strictest(trace, needs)
    rate = samples(trace, need.metric) / span if span > 0 else 0.0
    per_window = need.needed / rate if rate > 0 else math.inf
    return (
        f"{label}: {need.spec} needs at least {need.needed:,} {need.unit} in each of the "
        f"tuning and held-out windows ({RULE}); at this trace's {rate:.3g} per second that is "
        f"about {per_window:.0f} s per window, and the {span:.0f} s trace has no room to lengthen "
        f"the windows asked for ({asked[0]:g} s and {asked[1]:g} s) that far; use a longer "
        f"trace, a lower percentile{_supported(samples(trace, need.metric))}, or shorter "
        f"--tuning-window / --holdout-window to lengthen"
    )


def _supported(have: int) -> str:
    """The highest whole percentile `have` samples (two windows' worth) support, as a hint."""
    per_window = have // 2
    if per_window < min_samples(50):
        return ""
    best = math.floor(100 * (1 - MIN_TAIL_REQUESTS / per_window))
    while best > 50 and min_samples(best) > per_window:
        best -= 1
    return f" (this trace supports at most p{best})"
