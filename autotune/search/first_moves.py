"""The search's first phase: one-knob moves from the baseline that its own measurement says
are worth a launch, queued before the sampler proposes anything.

A launch costs 40-80 s on a GPU, so the first few must count. What vLLM's scheduler does
predicts which knob matters, and the baseline's capacity ladder says which SLO broke first:

- **TPOT / ITL broke first** (decodes stall behind long prefill chunks): shrink the
  chunked-prefill budget, `max_num_batched_tokens` / 2 and / 4 (on the H100 probe of long
  prompts, 8192 -> 2048 carried 1.67x the load), then fewer sequences.
- **TTFT broke first** with requests waiting while the running batch was full: more
  sequences (x2, x4), and a larger prefill budget (x2) so a burst of prompts clears faster.
- **TTFT broke first** without a full batch (prefill-bound, or prefills stuck behind
  decodes): half the budget and a larger one, one move each.
- **TTFT broke only outside the engine** (`autotune.measure.limits.front_end_lag`: over its
  threshold at the client, within it by vLLM's own count, nothing waiting in the engine),
  where the space searches `api_processes`: more front-end processes (x2, x4) before the
  engine's knobs. vLLM's TTFT starts when its front end hands the request on, so what made the
  miss was spent in the API process. The one case recorded with `vllm serve`: its held-out
  baseline on an H200 missed this way at 136 req/s (608 ms at the client, 414 in vLLM) and at
  193 (1,402 against 460, TPOT p95 16 ms), and four API processes carried 537 req/s on the
  same window (results/h200-2026-11-28-front-ends). On our server with one front end the same
  signature shows at some limiting steps (results/benchmarks/frontends-h200/*-settle*), where
  four front ends have not carried more: the move is measured like any other.
- **With `--allow fp8`** (the space holds `quantization: [baseline's, fp8]`): fp8 weights
  first, before the moves above (on an H200, Llama-3.1-8B shape, Azure conversation traffic:
  1.41x vLLM's defaults alone, 1.77x with 1024 batched tokens); the moves above then start from
  it when it paid off, which is how fp8 + a smaller chunk budget is reached in a few launches.
Moves outside the search space are clamped to it; moves equal to the baseline or to one
already queued are dropped. A move that beats everything measured before it is followed one
step further the same way (`follow_up`: 8192 -> 2048 paid off, so 1024 next), until a step
no longer pays. The moves still planned then start from the best config so far, not from
the baseline (`rebase`: a coordinate search), and one along a direction that already paid off
is dropped, since following it searched that line; a move that lands on a config already
measured or queued, or on one vLLM refuses (a relation of the space), is skipped without a
launch. On the H200 long-prompt grid this reached the grid's best in 4 launches (batched
8192 -> 2048 -> 1024, then half the sequences from there), where moves from the baseline
never combined the two knobs. Then TPE proposes, learning from these trials as from any other.

The min-memory objective asks a different question (the least memory that still meets every
SLO at H x the recorded rate), and memory is monotone in it: more never hurts. So its first
phase bisects `gpu_memory_utilization` alone (`memory_descent`), between the least memory
that met the SLOs (the baseline's to start) and the most that did not (or the space's lower
bound), down to the space's step (else 0.02), before TPE looks at the other knobs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from autotune.measure.ladder import CapacityResult
from autotune.measure.limits import front_end_lag, limiting_slo
from autotune.search.space import ParamSpec, SearchSpace
from workloads.slo import SLO

logger = logging.getLogger(__name__)

BATCHED = "max_num_batched_tokens"
SEQS = "max_num_seqs"
MEMORY = "gpu_memory_utilization"
FRONT_ENDS = "api_processes"
QUANTIZATION = "quantization"
MAX_MOVES = 3
MEMORY_RESOLUTION = 0.02  # of the device's memory, when the space's memory has no step


class Move(BaseModel):
    """One queued config: the best config so far (at first the baseline) with one knob changed."""

    name: str  # e.g. "max_num_batched_tokens=2048"
    why: str
    values: dict[str, Any]  # engine values of every space parameter the move sets
    knob: str
    factor: float
    follow: bool = False  # a step further along a move that paid off
    to: str | None = None  # set the knob to this choice (e.g. quantization=fp8) instead of scaling it

    @property
    def direction(self) -> str:
        """The knob and which way it moves, e.g. "max_num_batched_tokens-", "quantization=fp8"."""
        if self.to is not None:
            return f"{self.knob}={self.to}"
        return f"{self.knob}{'+' if self.factor > 1 else '-'}"


def follow_up(move: Move, space: SearchSpace) -> Move | None:
    """The next step along a move that paid off: the same knob, half the factor's step
    again (x2 after a growth, / 2 after a shrink), the rest unchanged."""
    if move.to is not None:
        return None  # a choice set has no further step
    step = 2.0 if move.factor > 1 else 0.5
    nxt = _move(space, move.values, move.knob, step, f"{move.name} paid off: one step further")
    return None if nxt is None else nxt.model_copy(update={"follow": True})


def rebase(move: Move, space: SearchSpace, best_values: Mapping[str, Any]) -> Move | None:
    """The move's knob change applied to the best config so far instead of the config it was
    planned from (None when the change leaves that config as it is)."""
    moved = (_set_move(space, best_values, move.knob, move.to, move.why) if move.to is not None
             else _move(space, best_values, move.knob, move.factor, move.why))
    return None if moved is None else moved.model_copy(update={"follow": move.follow})


def first_moves(
    capacity: CapacityResult | None,
    slos: Sequence[SLO],
    space: SearchSpace,
    baseline_values: Mapping[str, Any],
) -> list[Move]:
    """Up to MAX_MOVES one-knob moves from the baseline, most promising first."""
    if capacity is None:
        return []
    limit = limiting_slo(capacity, slos)
    step = capacity.passing_step() or (capacity.steps[0] if capacity.steps else None)
    server = step.server if step is not None else None
    seqs = baseline_values.get(SEQS)
    batch_full = bool(
        server is not None
        and seqs
        and (server.num_waiting_max or 0) > 0
        and (server.num_running_max or 0) >= 0.9 * float(seqs)
    )
    wanted: list[tuple[str, float, str]] = []  # (knob, factor, why)
    front_end = front_end_lag(capacity, slos) if FRONT_ENDS in space.params else None
    if front_end is not None:
        wanted += [(FRONT_ENDS, 2.0, front_end), (FRONT_ENDS, 4.0, front_end)]
    if limit in ("tpot", "itl"):
        why = f"{limit} broke first: smaller prefill chunks stall decodes less"
        wanted += [(BATCHED, 0.25, why), (BATCHED, 0.5, why), (SEQS, 0.5, f"{limit} broke first")]
    elif limit == "ttft" and batch_full:
        why = "ttft broke first with requests waiting behind a full batch"
        wanted += [(SEQS, 2.0, why), (SEQS, 4.0, why), (BATCHED, 2.0, why)]
    else:
        why = f"{limit or 'an SLO'} broke first"
        wanted += [(BATCHED, 0.5, why), (BATCHED, 2.0, why), (SEQS, 2.0, why)]
    moves: list[Move] = []
    seen: list[dict[str, Any]] = []
    # With --allow fp8 (autotune.search.numerics): fp8 weights first, beside the scheduler's
    # moves, which then start from it when it paid off (`rebase`): on an H200, fp8 carried
    # 1.41x the defaults and fp8 with a quarter of the chunk budget 1.77x.
    fp8 = _set_move(space, baseline_values, QUANTIZATION, "fp8",
                    "fp8 weights (--allow fp8): cheaper GEMMs, the largest lever measured on an H200")
    if fp8 is not None:
        seen.append(fp8.values)
        moves.append(fp8)
    for knob, factor, reason in wanted:
        move = _move(space, baseline_values, knob, factor, reason)
        if move is None or move.values in seen:
            continue
        seen.append(move.values)
        moves.append(move)
        if len(moves) == MAX_MOVES + (fp8 is not None):
            break
    return moves


def _set_move(
    space: SearchSpace, baseline: Mapping[str, Any], knob: str, to: str, why: str
) -> Move | None:
    """The baseline with `knob` set to the choice `to`; None where the space has no such
    choice or the baseline already uses it."""
    param = space.params.get(knob)
    if param is None or not param.contains(to) or baseline.get(knob) == to:
        return None
    values = _clamped_baseline(space, baseline)
    values[knob] = to
    return Move(name=f"{knob}={to}", why=why, values=values, knob=knob, factor=1.0, to=to)


def _move(
    space: SearchSpace, baseline: Mapping[str, Any], knob: str, factor: float, why: str
) -> Move | None:
    param = space.params.get(knob)
    current = baseline.get(knob)
    if param is not None and param.type == "categorical":
        return _categorical_move(space, baseline, knob, factor, why)
    if param is None or current is None or param.low is None or param.high is None:
        return None
    target = float(current) * factor
    target = min(max(target, param.low), param.high)
    value: Any = int(round(target)) if param.type in ("int", "pow2") else target
    if param.type == "pow2":
        value = 1 << max(0, int(round(target)).bit_length() - 1)  # a power of two at or below
    if value == current:
        return None
    values = _clamped_baseline(space, baseline)
    values[knob] = value
    label = f"{knob}={value}"
    return Move(name=label, why=why, values=values, knob=knob, factor=factor)


def _categorical_move(
    space: SearchSpace, baseline: Mapping[str, Any], knob: str, factor: float, why: str
) -> Move | None:
    """A move among numeric choices (e.g. `api_processes: [1, 2, 4]`): the choice nearest to
    the baseline's value x `factor`, on the side the factor points to."""
    current = baseline.get(knob)
    choices = [c for c in space.params[knob].choices or []
               if isinstance(c, int | float) and not isinstance(c, bool)]
    if not isinstance(current, int | float) or isinstance(current, bool) or not choices:
        return None
    target = float(current) * factor
    side = [c for c in choices if (c > current if factor > 1 else c < current)]
    if not side:
        return None
    value = min(side, key=lambda c: (abs(float(c) - target), c))
    values = _clamped_baseline(space, baseline)
    values[knob] = value
    return Move(name=f"{knob}={value}", why=why, values=values, knob=knob, factor=factor)


def _clamped_baseline(space: SearchSpace, baseline: Mapping[str, Any]) -> dict[str, Any]:
    """The baseline's values, clamped into the space: the knobs a move leaves alone. A space
    built from the baseline contains them (space.covering), so a move changes its knob and
    nothing else; a `--space` file that excludes one is represented by the nearest bound, and
    said so (SearchSpace.clamps: the live line and the report)."""
    values: dict[str, Any] = {}
    for name, spec in space.params.items():
        if name not in baseline:
            continue
        if spec.contains(baseline[name]):  # None included, where it is a choice (vLLM's default)
            values[name] = baseline[name]
        elif spec.clamp(baseline[name]) is not None:
            values[name] = spec.clamp(baseline[name])
    return values


def memory_descent(
    points: Sequence[tuple[float, bool]], space: SearchSpace, baseline_values: Mapping[str, Any]
) -> Move | None:
    """min-memory: the next memory to try, or None when the bisection is done.

    `points`: (memory, met every SLO at the headroom) of the finished trials that differ from
    the baseline in memory alone, the baseline included. Nothing to descend from when no
    point met the SLOs."""
    param = space.params.get(MEMORY)
    if param is None or param.low is None or param.high is None:
        return None
    met = [memory for memory, ok in points if ok]
    if not met:
        return None
    lowest_met = min(met)
    missed_below = [memory for memory, ok in points if not ok and memory < lowest_met]
    resolution = param.step or MEMORY_RESOLUTION
    if missed_below:
        floor = max(missed_below)
        if lowest_met - floor <= resolution + 1e-9:
            return None
        target = (floor + lowest_met) / 2
    elif lowest_met - param.low <= resolution + 1e-9:
        target = param.low  # the space's bound itself, once
    else:
        target = (param.low + lowest_met) / 2
    target = _on_grid(param, target)
    if any(abs(target - memory) < 1e-9 for memory, _ in points) or target >= lowest_met:
        return None
    values = _clamped_baseline(space, baseline_values)
    values[MEMORY] = target
    why = (f"met every SLO at {lowest_met:g}" + (f", missed at {max(missed_below):g}" if missed_below else "")
           + ": bisecting memory")
    return Move(name=f"{MEMORY}={target:g}", why=why, values=values, knob=MEMORY,
                factor=target / lowest_met)


def _on_grid(param: ParamSpec, value: float) -> float:
    """`value` rounded up onto the parameter's step grid (else hundredths): less memory than
    the grid allows is not a config the space has, and more only errs on the safe side."""
    low = float(param.low or 0.0)
    step = param.step or 0.01
    steps = -(-round((value - low) / step, 9) // 1)  # ceil, robust to float noise
    return round(low + steps * step, 10)
