"""`report.md` and its plots: what was tried, what won, by how much, at what cost.

Plots are PNGs next to the report (matplotlib, Agg backend, no display needed):
history.png, importances.png (>= 2 varied parameters and enough trials), pareto.png
(two-objective studies), latency_cdf.png (validation runs, winner vs baseline),
kv_cache.png (server metrics timelines of the same runs).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState
from pydantic import BaseModel, ConfigDict

from autotune.export import preflight_lines, trial_server_lines
from autotune.gate import BASELINE, GateDecision, Measurement, candidate_stats
from autotune.kv_cache import KVCacheSize, kv_cache_note
from autotune.ladder import CapacityResult
from autotune.objective import Objective
from autotune.progress import format_duration
from autotune.trial_records import is_baseline, lost_worker, trial_label
from workloads.files import write_text_atomic
from workloads.slo import SLO

MIN_TRIALS_FOR_IMPORTANCE = 4
VERDICT_HEADLINES = {
    "validated": "A better config was validated",
    "kept": "The baseline was kept",
    "nothing": "Nothing could be measured",
}


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
    search_wall_s: float
    gate_wall_s: float
    gate_server_s: float
    workload_profile: str = ""
    # "validated": a better config won the gate; "kept": the baseline stays (measured);
    # "nothing": the baseline could not be measured, nothing was exported.
    verdict: Literal["validated", "kept", "nothing"] | None = None
    baseline_standing: str = ""  # the baseline's measured figures, one line


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return "-"
        return f"{value:.{digits}g}"
    return str(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


def trial_rows(study: optuna.Study, objective: Objective) -> tuple[list[str], list[list[str]]]:
    trials = study.get_trials(deepcopy=False)
    names: list[str] = []
    for trial in trials:
        for name in trial.user_attrs.get("engine_params", {}):
            if name not in names:
                names.append(name)
    # Where each trial ran: shown once any trial recorded its host (every `autotune run` and
    # `autotune worker` does); older studies keep their columns.
    hosts = any(trial.user_attrs.get("host") for trial in trials)
    retried_as = {
        int(trial.system_attrs["retry_history"][-1]): trial.number
        for trial in trials
        if trial.system_attrs.get("retry_history")
    }
    # min-memory's score is the memory column itself: the KV cache vLLM made of it instead.
    scored = "KV cache" if objective.kind == "min-memory" else objective.label
    header = ["trial", *(["host"] if hosts else []), *names, scored, "SLOs", "failure", "wall"]
    rows = []
    for trial in trials:
        params = trial.user_attrs.get("engine_params", {})
        explicit = trial.user_attrs.get("explicit", [])
        label = trial_label(trial.number) + (
            " (baseline)" if is_baseline(trial) else " (warm start)" if trial.user_attrs.get("warm_start") else ""
        )
        cells = [label]
        if hosts:
            host, worker = trial.user_attrs.get("host"), trial.user_attrs.get("worker")
            cells.append("-" if not host else f"{host}/{worker}" if worker else str(host))
        for name in names:
            value = _fmt(params.get(name))
            # Values the baseline did not set are vLLM's defaults: marked so nobody reads them
            # as tuned.
            cells.append(value if name in explicit or value == "-" else f"{value}*")
        if trial.state == TrialState.COMPLETE:
            score = _fmt(trial.user_attrs.get("score"))
            if objective.kind == "min-memory":
                score = KVCacheSize(gib=trial.user_attrs.get("kv_cache_gib"),
                                    tokens=trial.user_attrs.get("kv_cache_tokens")).describe()
            slo = "met" if trial.user_attrs.get("slo_met") else "missed"
        else:
            score, slo = "-", trial.state.name.lower()
        failure = trial.user_attrs.get("failure") or ""
        detail = trial.user_attrs.get("failure_detail") or trial.user_attrs.get("interrupted") or ""
        if detail:
            failure = f"{failure}: {detail}" if failure else str(detail)
        if lost_worker(trial):
            failure = "worker lost (no heartbeat)"
        notes = []
        if trial.system_attrs.get("failed_trial") is not None:
            notes.append(f"retry of {trial_label(int(trial.system_attrs['retry_history'][-1]))}")
        if trial.number in retried_as:
            notes.append(f"retried as {trial_label(retried_as[trial.number])}")
        failure = "; ".join(part for part in (failure[:120], *notes) if part)
        cells += [score, slo, failure, format_duration(trial.user_attrs.get("wall_s"))]
        rows.append(cells)
    return header, rows


def write_report(output_dir: Path, inputs: ReportInputs) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    study = inputs.study
    objective = inputs.objective
    decision = inputs.decision
    provenance = inputs.provenance
    plots = write_plots(output_dir, inputs)
    verdict = inputs.verdict or ("kept" if decision.keep_baseline else "validated")
    # The first line says which of the three outcomes this is; scripts and people read it first.
    lines: list[str] = [f"# {VERDICT_HEADLINES[verdict]}: vllm-autotune study {provenance['study']['name']}", ""]
    # Then, for the capacity objective, how much of the user's traffic the result carries.
    capacity = provenance.get("capacity")
    if capacity and verdict != "nothing":
        lines += [capacity_line(capacity, decision.keep_baseline), ""]
    memory = provenance.get("memory")
    if memory and verdict != "nothing":
        lines += [memory_line(memory, decision.keep_baseline), ""]
    if verdict == "nothing":
        lines += [
            "**RESULT: NOTHING COULD BE MEASURED.** The baseline, which every figure of the study "
            "is compared against, failed, so no config can be judged and none was exported "
            f"(no `{inputs.best_yaml.name}`).",
            "",
            f"Why: {decision.reason}. Its trial folder (below) holds `server.log` and "
            "`requests.jsonl`.",
        ]
    elif decision.keep_baseline:
        lines += [
            f"**RESULT: THE BASELINE WAS KEPT.** {kept_summary(objective, capital=True)}. "
            f"`{inputs.best_yaml.name}` holds the baseline.",
            "",
            f"Baseline measured: {inputs.baseline_standing or 'see the tables below'}.",
            "",
            f"Why: {decision.reason}.",
        ]
    else:
        lines += [
            f"**RESULT: {decision.winner} is better than the baseline** "
            f"({_pct(decision.effect)} {objective.label}). `{inputs.best_yaml.name}` holds it.",
            "",
            f"Why: {decision.reason}.",
        ]
    overrides = provenance["decision"]["overrides"]
    if overrides:
        lines += ["", "Changed engine arguments: " + ", ".join(f"`{k}={v}`" for k, v in overrides.items())]
    if verdict != "nothing":
        lines += [
            "",
            f"Deploy: `python -m server --config {inputs.best_yaml.name}` or "
            f"`vllm serve --config {inputs.best_yaml.name}`.",
        ]
    lines += [
        "",
        f"Command: `{provenance['command_line']}`  ",
        f"Date: {provenance['date']}; vLLM {provenance['vllm_version']}; model `{provenance['model']}`; "
        f"hardware: {_hardware(provenance['hardware'])}.",
        *[f"Trials {line}." for line in trial_server_lines(provenance)],
        "",
        "## Objective and SLOs",
        "",
        f"Objective: **{objective.spec()}** ({objective.unit}). SLOs (p-th percentile of the run "
        f"must be at most the threshold; a request is *good* when its own values meet every "
        f"threshold): {', '.join(f'`{s.spec()}`' for s in inputs.slos) or 'none'}.",
        "",
        "## Workload",
        "",
        f"Trace `{provenance['workload'].get('source')}`, fingerprint "
        f"`{provenance['workload'].get('fingerprint')}`. Tuning window "
        f"{_window(provenance['workload'].get('tuning_window'))}, held-out window "
        f"{_window(provenance['workload'].get('holdout_window'))}; replay mode "
        f"`{provenance['workload'].get('mode')}`, speedup {provenance['workload'].get('speedup')}.",
    ]
    adjusted = preflight_lines(provenance["workload"])
    if adjusted:
        lines += ["", "Pre-flight changes to the traffic (before any engine started):", ""]
        lines += [f"- {line}" for line in adjusted]
    if inputs.workload_profile:
        lines += ["", "```", inputs.workload_profile.rstrip(), "```"]

    lines += ["", "## Baseline", "", f"Source: {provenance['baseline']['source']}."]
    defaults = provenance["baseline"].get("effective_defaults") or {}
    if defaults:
        usage = defaults.get("usage_context")
        lines += [
            "",
            "Engine settings the baseline ran with (vLLM's defaults resolved"
            + (f" for usage context `{usage}`" if usage else "")
            + "): "
            + ", ".join(f"`{k}={v}`" for k, v in defaults.items() if k != "usage_context")
            + ".",
        ]
    else:
        lines += ["", "vLLM's resolved defaults could not be determined (see the tuner's log)."]

    lines += ["", "## Validation on the held-out window", ""]
    lines += _validation_section(inputs)

    lines += ["", "## Trials", ""]
    header, rows = trial_rows(study, objective)
    lines += _table(header, rows)
    lines += ["", "`*` = not set by the config: vLLM's default, as resolved before the run."]

    trials = study.get_trials(deepcopy=False)
    search_server_s = sum(float(t.user_attrs.get("server_s") or 0.0) for t in trials)
    launched = sum(1 for t in trials if t.user_attrs.get("server_s"))
    lines += [
        "",
        "## Search cost",
        "",
        f"- trials: {len(trials)} ({sum(t.state == TrialState.COMPLETE for t in trials)} complete, "
        f"{sum(t.state == TrialState.PRUNED for t in trials)} pruned, "
        f"{sum(t.state == TrialState.FAIL for t in trials)} failed; {launched} started a server)",
        f"- search wall time: {format_duration(inputs.search_wall_s)} ({inputs.search_wall_s:.0f} s)",
        f"- validation wall time: {format_duration(inputs.gate_wall_s)} ({inputs.gate_wall_s:.0f} s), "
        f"{len(inputs.measurements)} runs",
        f"- accelerator time (a server process up, start to teardown): "
        f"{search_server_s + inputs.gate_server_s:.0f} s",
    ]
    workers = provenance["study"].get("workers")
    if workers:
        lost = sum(lost_worker(t) for t in trials)
        lines += [
            f"- workers: {len(workers)} ({', '.join(f'`{w}`' for w in workers)}), search wall time "
            f"from the first trial's start to the last one's end; validation on "
            f"`{provenance['study'].get('finalized_by', '-')}`",
            f"- trials lost with their worker (no heartbeat) and retried: {lost}",
        ]
    if plots:
        lines += ["", "## Plots", ""]
        for title, name in plots:
            lines += [f"### {title}", "", f"![{title}]({name})", ""]
    path = output_dir / "report.md"
    write_text_atomic(path, "\n".join(lines).rstrip() + "\n")
    return path


def kept_summary(objective: Objective, *, capital: bool = False) -> str:
    """Why a kept baseline was kept, in the objective's terms."""
    if objective.kind == "min-memory":
        text = (f"no searched config met every SLO at {objective.headroom:g}x the recorded rate "
                f"with less memory, in every repeat")
    else:
        text = "no searched config beat it beyond the measured noise and every SLO in every repeat"
    return text[0].upper() + text[1:] if capital else text


def memory_line(memory: dict[str, Any], kept_baseline: bool) -> str:
    """The first line of a min-memory report: the memory the exported config needs to meet
    every SLO at H x the user's traffic, against the baseline's."""
    at = f"at {memory['headroom']:g}x your recorded traffic"
    base = memory["baseline_gpu_memory_utilization"]
    where = f" ({memory['target_rps']:.3g} req/s; {memory.get('measured_on', 'held-out window')})"
    if not kept_baseline and memory.get("winner_gpu_memory_utilization") is not None:
        missed = "" if memory.get("baseline_meets_slos") else ", which misses an SLO there"
        return (f"**Memory: the exported config meets every SLO {at} with gpu_memory_utilization "
                f"{memory['winner_gpu_memory_utilization']:g}{kv_cache_note(memory, 'winner')} vs the "
                f"baseline's {base:g}{missed}**{where}")
    if memory.get("baseline_meets_slos"):
        return (f"**Memory: the baseline meets every SLO {at} with gpu_memory_utilization "
                f"{base:g}{kv_cache_note(memory, 'baseline')}; no config with less memory did in every "
                f"repeat**{where}")
    return (f"**Memory: the baseline, gpu_memory_utilization {base:g}{kv_cache_note(memory, 'baseline')}, "
            f"misses an SLO {at}, and no searched config met them all in every repeat**{where}")


def capacity_line(capacity: dict[str, Any], kept_baseline: bool) -> str:
    """The first line of a capacity report: how much of the user's traffic each config carries."""
    recorded = capacity["recorded_rps"]
    base = capacity.get("baseline_rps")
    text = (
        f"**Headroom: the baseline carries {_fmt(capacity.get('baseline_headroom'))}x your "
        f"recorded traffic** ({_fmt(base)} req/s with every SLO met vs {_fmt(recorded)} req/s "
        f"recorded; {capacity.get('measured_on', 'held-out median')})"
    )
    if not kept_baseline and capacity.get("winner_rps") is not None:
        text = (
            f"**Headroom: the exported config carries {_fmt(capacity.get('winner_headroom'))}x your "
            f"recorded traffic** ({_fmt(capacity['winner_rps'])} req/s with every SLO met vs "
            f"{_fmt(recorded)} req/s recorded; {capacity.get('measured_on', 'held-out median')}); "
            f"the baseline carries "
            f"{_fmt(capacity.get('baseline_headroom'))}x ({_fmt(base)} req/s)"
        )
    return text + "."


def _hardware(hardware: dict[str, Any]) -> str:
    if hardware.get("gpus"):
        return ", ".join(hardware["gpus"])
    return f"{hardware.get('cpu')} ({hardware.get('cpu_count')} cores)"


def _window(info: dict[str, Any] | None) -> str:
    if not info:
        return "-"
    return f"{info['start_s']:.0f}-{info['end_s']:.0f} s ({info['requests']} requests)"


def _validation_section(inputs: ReportInputs) -> list[str]:
    decision = inputs.decision
    if not inputs.measurements:
        return [f"Not run: {decision.reason}."]
    objective = inputs.objective
    base = decision.baseline_median
    rows = []
    measured = {s.candidate for s in decision.stats}
    # Side-by-side comparisons (--compare) are measured with the rest but never decided on.
    others = list(dict.fromkeys(m.candidate for m in inputs.measurements if m.candidate not in measured))
    extra = [candidate_stats(name, [m for m in inputs.measurements if m.candidate == name]) for name in others]
    for stats in [*decision.stats, *extra]:
        change = None if not base or stats.candidate == BASELINE else (stats.median - base) / base
        rows.append(
            [
                stats.candidate + (" (emitted)" if stats.candidate == decision.winner else ""),
                ", ".join(_fmt(v) for v in stats.values),
                _fmt(stats.median),
                _pct(change),
                "-" if stats.relative_spread is None else f"{stats.relative_spread:.1%}",
                "yes" if stats.eligible else f"no: {stats.why_not}",
            ]
        )
    lines = _table(
        ["config", f"{objective.label} per repeat ({objective.unit})", "median", "vs baseline",
         "spread", "every SLO every repeat"],
        rows,
    )
    if decision.ci_low is not None:
        lines += [
            "",
            f"Best candidate {decision.best_candidate}: effect {_pct(decision.effect)}, "
            f"{decision.confidence:.0%} bootstrap CI of the median difference "
            f"[{_fmt(decision.ci_low)}, {_fmt(decision.ci_high)}] {objective.unit}; baseline noise "
            f"(relative spread) {'-' if decision.noise is None else f'{decision.noise:.1%}'}. "
            "Rule: emit only if the CI lies above 0 and the effect exceeds the baseline's spread.",
        ]
    if objective.kind == "min-memory":
        lines += [
            "",
            f"Each run is one load step at {objective.headroom:g}x the window's recorded rate. Rule: "
            "emit the config with the least gpu_memory_utilization that met every SLO in every "
            "repeat, if it uses less than the baseline (or the baseline missed an SLO).",
        ]
    headroom = _headroom(inputs.measurements, inputs.slos)
    if headroom:
        lines += ["", "SLO headroom (threshold minus the worst repeat's percentile; negative = missed):", ""]
        lines += _table(["config", *[s.spec() for s in inputs.slos]], headroom)
    return lines


def _headroom(measurements: Sequence[Measurement], slos: Sequence[SLO]) -> list[list[str]]:
    rows = []
    names = list(dict.fromkeys(m.candidate for m in measurements))
    for name in names:
        runs = [m for m in measurements if m.candidate == name]
        cells = [name]
        for slo in slos:
            margins = [m.margins_ms.get(slo.spec()) for m in runs]
            if any(v is None for v in margins) or not margins:
                cells.append("-")
            else:
                cells.append(f"{-max(margins):.0f} ms")  # type: ignore[type-var]
        rows.append(cells)
    return rows


# ---------------------------------------------------------------------------------------------
# Plots


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
                        (step.offered_rps, step.measured_ms.get(slo.spec()), step.passed)
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
