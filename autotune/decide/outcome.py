"""Honest outcomes: what a study may claim, from what it measured.

Every figure of a study is relative to the baseline (the config the user runs today, or
vLLM's defaults): the gate compares candidates against it and `best.yaml` either improves on
it or is it. A baseline that was never measured (its trial failed: request errors over the
limit, a crash, an engine that would not start) makes every one of those claims empty, so:

- the search stops as soon as the baseline's trial has failed (`stop_if_baseline_failed`,
  run between trials), and no later path exports anything: `NothingMeasured`, exit 12;
- a study ends in one of three verdicts, the first line of report.md:
  "a better config was validated", "the baseline was kept" (with its measured standing),
  or "nothing could be measured".
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import NothingMeasured
from autotune.search.gate import BASELINE, Measurement
from autotune.search.trial_records import is_baseline, trial_label
from workloads.slo import SLO


def baseline_failure(trials: Sequence[FrozenTrial], *, infeasible_ok: bool = False) -> str | None:
    """Why the baseline's latest trial failed, or None: it was measured, is still to run (queued
    or running), or was cut short from outside (Ctrl-C, a lost worker) and will run again.
    A baseline whose ladder found no load that meets the SLOs (`infeasible`) has nothing to be
    compared with either, unless `infeasible_ok` (`--search-anyway`)."""
    baselines = [t for t in trials if is_baseline(t)]
    if any(t.state in (TrialState.WAITING, TrialState.RUNNING) for t in baselines):
        return None
    finished = [t for t in baselines if t.state.is_finished()]
    if not finished:
        return None
    last = finished[-1]
    failure = last.user_attrs.get("failure")
    if not failure and last.user_attrs.get("infeasible") and not infeasible_ok:
        return (f"the baseline's trial {trial_label(last.number)}: {last.user_attrs['infeasible']} "
                f"(--search-anyway searches all the same)")
    if not failure or last.user_attrs.get("interrupted"):
        return None
    detail = last.user_attrs.get("failure_detail")
    why = f"{failure}: {detail}" if detail else str(failure)
    return f"the baseline's trial {trial_label(last.number)} failed ({why})"


def baseline_problem(study: optuna.Study, *, infeasible_ok: bool = False) -> str | None:
    """Why the study has no measured baseline to compare against, or None when it has one."""
    trials = study.get_trials(deepcopy=False)
    failed = baseline_failure(trials, infeasible_ok=infeasible_ok)
    if failed is not None:
        return failed
    measured = [t for t in trials if is_baseline(t) and t.state == TrialState.COMPLETE
                and not t.user_attrs.get("failure")]
    if not measured:
        return "the baseline's trial never completed (queued, running or interrupted)"
    return None


def stop_if_baseline_failed(study: optuna.Study | None, *, infeasible_ok: bool = False) -> None:
    """Between trials: raise NothingMeasured once the baseline's trial has failed."""
    if study is None:
        return
    failed = baseline_failure(study.get_trials(deepcopy=False), infeasible_ok=infeasible_ok)
    if failed is not None:
        raise NothingMeasured(failed)


def baseline_standing(
    measurements: Sequence[Measurement],
    baseline_trial: FrozenTrial | None,
    slos: Sequence[SLO],
    objective: Any,
) -> str:
    """The baseline's measured figures in one line: the held-out repeats when the gate ran
    them (and one did not fail), else its search trial."""
    runs = [m for m in measurements if m.candidate == BASELINE and m.ok]
    if runs:
        values = [m.value for m in runs]
        spread = f", {min(values):.3g}-{max(values):.3g}" if len(values) > 1 else ""
        figure = (f"{objective.format_score(statistics.median(values))} on the held-out window "
                  f"(median of {len(values)} repeat{'s' if len(values) > 1 else ''}{spread})")
        margins: dict[str, float | None] = {}
        for slo in slos:
            seen = [m.margins_ms.get(slo.spec()) for m in runs]
            margins[slo.spec()] = None if any(v is None for v in seen) or not seen else max(seen)  # type: ignore[type-var]
        return f"{figure}; {_slo_text(slos, margins)}"
    if baseline_trial is not None and baseline_trial.state == TrialState.COMPLETE:
        score = float(baseline_trial.user_attrs.get("score") or 0.0)
        figure = (f"{objective.format_score(score)} on the tuning window "
                  f"({trial_label(baseline_trial.number)})")
        return f"{figure}; {_slo_text(slos, baseline_trial.user_attrs.get('margins_ms') or {})}"
    return "not measured"


def _slo_text(slos: Sequence[SLO], margins: dict[str, float | None]) -> str:
    parts = []
    for slo in slos:
        margin = margins.get(slo.spec())
        if margin is None:
            parts.append(f"{slo.spec()} not measured")
        else:
            state = "met" if margin <= 0 else "missed"
            parts.append(f"{slo.spec()} {state} ({slo.threshold_ms + margin:.0f} ms)")
    return ", ".join(parts) if parts else "no SLOs"
