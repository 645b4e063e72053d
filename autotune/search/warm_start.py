"""The warm start of a re-tune: the trials `autotune retune` enqueues after the deployed
baseline and before the sampler's own (the previous study's best, the deployed config's
neighbours one step along each searched parameter)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.config import ServerConfig

# Optuna is imported inside previous_best: `autotune --help` imports this module.
PREVIOUS_BEST = 2  # of the warm-start trials, at most this many from the previous study


@dataclass(frozen=True)
class WarmStart:
    """A trial enqueued before the sampler's own: Optuna params and why."""

    params: dict[str, Any]
    why: str


def step_values(param: Any, value: Any) -> list[Any]:
    """Values one step below and above `value` in the parameter's own terms."""
    if param.type == "categorical":
        return [choice for choice in param.choices if choice != value]
    if param.type == "pow2":
        candidates: list[Any] = [int(value) // 2, int(value) * 2]
    elif param.type == "int":
        if param.log:
            candidates = [max(1, round(value / 2)), int(value) * 2]
        else:
            step = max(int(param.step or 1), round(0.1 * (param.high - param.low)))
            candidates = [int(value) - step, int(value) + step]
    else:
        delta = 0.1 * (param.high - param.low)
        candidates = [round(value - delta, 4), round(value + delta, 4)]
    return [c for c in candidates if c != value and param.contains(c)]


def neighbours(space: Any, engine: dict[str, Any]) -> list[WarmStart]:
    """The configs one step from `engine` along each searched parameter, the others kept;
    interleaved (down, up per parameter) so a small budget still covers every parameter."""
    base = space.fixed_params(engine)
    found: list[WarmStart] = []
    for name, param in space.params.items():
        value = engine.get(name)
        if value is None or not param.contains(value):
            continue
        for candidate in step_values(param, value):
            context = {**engine, name: candidate}
            if space.broken_relations(context):
                continue
            params = {**base, **space.fixed_params({name: candidate})}
            found.append(WarmStart(params, f"neighbour {name} {value} -> {candidate}"))
    return found


def previous_best(deployed: ServerConfig, space: Any, engine: dict[str, Any]) -> list[WarmStart]:
    """The previous study's best feasible trials, if its storage is still reachable."""
    import optuna

    from autotune.search.trial_records import feasible, is_baseline

    study_info = (deployed.provenance or {}).get("study") or {}
    name, storage = study_info.get("name"), study_info.get("storage")
    if not name or not storage:
        return []
    if storage.startswith("sqlite:///") and not Path(storage.removeprefix("sqlite:///")).is_file():
        return []  # do not let optuna create an empty database where the old one was
    try:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.load_study(study_name=name, storage=storage)
    except Exception as error:  # noqa: BLE001 - a missing old study only costs the warm start
        print(
            f"autotune: note: previous study {name!r} not readable ({error}); "
            "warm start from neighbours only",
            file=sys.stderr,
        )
        return []
    trials = [t for t in study.get_trials(deepcopy=False) if feasible(t)]
    # Best first in the old study's own direction (min-memory: least memory first).
    minimize = [d.name for d in study.directions] == ["MINIMIZE"]
    trials.sort(key=lambda t: ((1 if minimize else -1) * float(t.user_attrs.get("score", 0.0)), t.number))
    found = []
    for trial in trials:
        if is_baseline(trial):
            continue
        overrides = trial.user_attrs.get("overrides") or {}
        params = space.fixed_params({**engine, **overrides})
        found.append(WarmStart(params, f"previous study {name} trial {trial.number}"))
    return found


def warm_start_trials(
    deployed: ServerConfig, space: Any, effective: dict[str, Any], limit: int
) -> list[WarmStart]:
    """At most `limit` distinct warm starts, none equal to the deployed config itself."""
    engine = deployed.searchable_values(effective)
    own = space.fixed_params(engine)
    chosen: list[WarmStart] = []
    seen = [own]
    for group, cap in (
        (previous_best(deployed, space, engine), PREVIOUS_BEST),
        (neighbours(space, engine), limit),
    ):
        taken = 0
        for start in group:
            if len(chosen) >= limit or taken >= cap:
                break
            if start.params in seen:
                continue
            seen.append(start.params)
            chosen.append(start)
            taken += 1
    return chosen
