"""The plots of `report.md`, and `ReportInputs`, what the report and its plots are made of.

Plots are PNGs next to the report (matplotlib, Agg backend, no display needed):
history.png, importances.png (>= 2 varied parameters and enough trials), pareto.png
(two-objective studies), latency_cdf.png (validation runs, winner vs baseline),
kv_cache.png (server metrics timelines of the same runs).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState
from pydantic import BaseModel, ConfigDict

from autotune.measure.ladder import CapacityResult, step_rate
from autotune.search.gate import BASELINE, GateDecision, Measurement
from autotune.search.objective import Objective
from workloads.slo import SLO

MIN_TRIALS_FOR_IMPORTANCE = 4


class ReportInputs(BaseModel):
    """What the report is made of (all of it already measured and stored)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    study: Any  # optuna.Study
    objective: Objective
    slos: list[SLO]
    decision: GateDecision
    measurements: list[Measurement]
    run_dirs: dict[str, list[Path]]
    provenance: dict[str, Any]
    best_yaml: Path
    front_ends: int = 1  # best.yaml's serving.api_processes (`vllm serve` takes it as a flag)
    search_wall_s: float
    gate_wall_s: float
    gate_server_s: float
    workload_profile: str = ""
    # "validated": a better config won the gate; "kept": the baseline stays (measured);
    # "nothing": the baseline could not be measured, nothing was exported.
    verdict: Literal["validated", "kept", "nothing"] | None = None
    baseline_standing: str = ""  # the baseline's measured figures, one line


def write_plots(output_dir: Path, inputs: ReportInputs) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[tuple[str, str]] = []

    def save(fig: Any, name: str, title: str) -> None:
        fig.tight_layout()
        fig.savefig(output_dir / name, dpi=110)
        plt.close(fig)
        written.append((title, name))

    study = inputs.study
    objective = inputs.objective
    trials = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    if trials:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        xs = [t.number for t in trials]
        ys = [float(t.user_attrs.get("score", 0.0)) for t in trials]
        feasible = [all(v <= 0 for v in t.constraints.values()) for t in trials]
        ax.scatter([x for x, f in zip(xs, feasible, strict=True) if f], [y for y, f in zip(ys, feasible, strict=True) if f],
                   label="feasible", color="tab:blue")
        ax.scatter([x for x, f in zip(xs, feasible, strict=True) if not f], [y for y, f in zip(ys, feasible, strict=True) if not f],
                   label="infeasible (SLO missed / failed)", color="tab:red", marker="x")
        best: list[float] = []
        running: float | None = None
        for y, f in zip(ys, feasible, strict=True):
            if f and (running is None or objective.rank_key(y) < objective.rank_key(running)):
                running = y
            best.append(running if running is not None else np.nan)
        ax.step(xs, best, where="post", color="tab:green", label="best feasible so far")
        ax.set_xlabel("trial")
        ax.set_ylabel(f"{objective.label} ({objective.unit})")
        ax.legend(fontsize=8)
        save(fig, "history.png", "Optimisation history")

    importances = _importances(study, trials, objective)
    if importances:
        fig, ax = plt.subplots(figsize=(6, 0.5 + 0.4 * len(importances)))
        names = list(importances)[::-1]
        ax.barh(names, [importances[n] for n in names])
        ax.set_xlabel("importance (PED-ANOVA, for a high objective)")
        save(fig, "importances.png", "Parameter importances")

    if objective.kind == "pareto" and trials:
        feasible_trials = [t for t in trials if all(v <= 0 for v in t.constraints.values())]
        if feasible_trials:
            front = {t.number for t in study.best_trials}
            fig, ax = plt.subplots(figsize=(6, 4))
            for trial in feasible_trials:
                on = trial.number in front
                ax.scatter(trial.values[1], trial.values[0], color="tab:red" if on else "tab:gray")
            ax.set_xlabel(objective.latency_name())
            ax.set_ylabel(f"throughput ({objective.unit})")
            ax.set_title("Pareto front (red), feasible trials")
            save(fig, "pareto.png", "Pareto front")

    shown = _shown_runs(inputs)
    curves = {name: _ladders(dirs) for name, dirs in shown.items()}
    if any(curves.values()) and inputs.slos:
        per_request = [slo for slo in inputs.slos if slo.metric != "itl"][:2] or list(inputs.slos[:1])
        fig, axes = plt.subplots(1, len(per_request), figsize=(4.8 * len(per_request), 3.6), squeeze=False)
        colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for ax, slo in zip(axes[0], per_request, strict=True):
            for k, (name, ladders) in enumerate(curves.items()):
                colour = colours[k % len(colours)]
                for index, ladder in enumerate(ladders):
                    points = sorted(
                        (step_rate(step), step.measured_ms.get(slo.spec()), step.passed)
                        for step in ladder.steps
                        if step.measured_ms.get(slo.spec()) is not None
                    )
                    if not points:
                        continue
                    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                            color=colour, alpha=0.8, label=name if index == 0 else None)
                    if ladder.capacity_rps > 0:
                        ax.axvline(ladder.capacity_rps, color=colour, linestyle=":", alpha=0.6)
            ax.axhline(slo.threshold_ms, color="black", linestyle="--", label=f"SLO {slo.threshold_ms:g} ms")
            ax.set_xlabel("offered load (req/s)")
            ax.set_ylabel(f"{slo.metric.upper()} p{slo.percentile:g} (ms)")
            ax.set_yscale("log")
            ax.legend(fontsize=7)
        save(fig, "capacity.png", "Latency against offered load, held-out ladders (dotted: capacity)")
    cdf_runs = {name: _latencies(dirs) for name, dirs in shown.items()}
    if any(values["ttft"] for values in cdf_runs.values()):
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for name, values in cdf_runs.items():
            for ax, metric in zip(axes, ("ttft", "e2el"), strict=True):
                data = np.sort(np.asarray(values[metric]))
                if data.size:
                    ax.plot(data, np.arange(1, data.size + 1) / data.size, label=name)
        for ax, metric in zip(axes, ("TTFT (ms)", "end-to-end latency (ms)"), strict=True):
            ax.set_xlabel(metric)
            ax.set_ylabel("fraction of requests")
            ax.legend(fontsize=8)
        save(fig, "latency_cdf.png", "Latency CDFs on the held-out window (all repeats)")

    timelines = {name: _timelines(dirs) for name, dirs in shown.items()}
    if any(timelines.values()):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for name, series in timelines.items():
            for index, (ts, usage) in enumerate(series):
                ax.plot(ts, usage, label=name if index == 0 else None,
                        color="tab:blue" if name == BASELINE else "tab:orange", alpha=0.8)
        ax.set_xlabel("seconds into the window")
        ax.set_ylabel("KV-cache usage (0-1)")
        ax.legend(fontsize=8)
        save(fig, "kv_cache.png", "KV-cache usage over time (held-out runs)")
    return written


def _ladders(dirs: Sequence[Path]) -> list[CapacityResult]:
    found = []
    for directory in dirs:
        path = Path(directory) / "ladder.json"
        if path.is_file():
            found.append(CapacityResult.model_validate_json(path.read_text(encoding="utf-8")))
    return found


def _importances(study: optuna.Study, trials: list[FrozenTrial], objective: Objective) -> dict[str, float]:
    if objective.kind == "min-memory":
        # The score is the memory knob itself: its "importance" would be a tautology.
        return {}
    varied = {
        name
        for name in (trials[0].params if trials else {})
        if len({t.params.get(name) for t in trials}) > 1
    }
    if len(varied) < 2 or len(trials) < MIN_TRIALS_FOR_IMPORTANCE:
        return {}
    try:
        # Importances need one shared parameter set; the baseline may lack some.
        # Optuna's default evaluator (PED-ANOVA; fANOVA would need scikit-learn) scores what
        # it takes to reach *low* targets, so the maximised score is negated.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "computes ... low target values": we know
            return optuna.importance.get_param_importances(
                study,
                params=sorted(varied),
                target=lambda t: objective.rank_key(float(t.user_attrs.get("score", 0.0))),
            )
    except (RuntimeError, ValueError):
        return {}


def _shown_runs(inputs: ReportInputs) -> dict[str, list[Path]]:
    decision = inputs.decision
    names = [BASELINE]
    other = decision.winner if not decision.keep_baseline else decision.best_candidate
    if other and other != BASELINE:
        names.append(other)
    return {name: inputs.run_dirs.get(name, []) for name in names}


def _latencies(dirs: Sequence[Path]) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {"ttft": [], "e2el": []}
    for directory in dirs:
        path = directory / "requests.jsonl"
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if record.get("error") is None and record.get("ttft_ms") is not None:
                values["ttft"].append(record["ttft_ms"])
                if record.get("e2e_ms") is not None:
                    values["e2el"].append(record["e2e_ms"])
    return values


def _timelines(dirs: Sequence[Path]) -> list[tuple[list[float], list[float]]]:
    series = []
    for directory in dirs:
        path = directory / "server_metrics.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        points = [p for p in data.get("timeline", []) if p.get("kv_cache_usage") is not None]
        if points:
            series.append(([p["t_s"] for p in points], [p["kv_cache_usage"] for p in points]))
    return series
