"""`report.md`: what was tried, what won, by how much, at what cost.

Its plots, and `ReportInputs` (what both are made of), are in `autotune/decide/report_plots.py`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from autotune.decide.export import preflight_lines, trial_server_lines, vllm_serve_command
from autotune.decide.report_plots import ReportInputs, write_plots
from autotune.measure.kv_cache import KVCacheSize, kv_cache_note
from autotune.progress import format_duration
from autotune.search.gate import BASELINE, Measurement, candidate_stats, noise_text
from autotune.search.objective import Objective
from autotune.search.trial_records import is_baseline, lost_worker, trial_label
from server.config import SEARCHABLE_SERVING_SETTINGS
from workloads.files import write_text_atomic
from workloads.slo import SLO

VERDICT_HEADLINES = {
    "validated": "A better config was validated",
    "kept": "The baseline was kept",
    "nothing": "Nothing could be measured",
}


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


def hit_rate(value: float | None) -> str:
    """A prefix-cache hit rate: "62%"; "-" where the server exposed no counters."""
    return "-" if value is None else f"{value:.0%}"


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
    # The capacity ladder's view of what limited each config (studies before it: no column).
    broke = any(trial.user_attrs.get("broke_first") for trial in trials)
    # A topology search (or capacity-per-gpu): the GPUs each config's engine held, and under
    # capacity-per-gpu the whole capacity beside the per-GPU score.
    gpus = objective.per_gpu or any((trial.user_attrs.get("devices") or 1) > 1 for trial in trials)
    hits = any(trial.user_attrs.get("prefix_cache_hit_rate") is not None for trial in trials)
    header = ["trial", *(["host"] if hosts else []), *names, scored,
              *(["capacity (req/s)"] if objective.per_gpu else []), *(["GPUs"] if gpus else []),
              *(["prefix cache hits"] if hits else []), "SLOs",
              *(["broke first"] if broke else []), "failure", "wall"]
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
        notes = [trial.user_attrs["unscored"][:160]] if trial.user_attrs.get("unscored") else []
        if trial.system_attrs.get("failed_trial") is not None:
            notes.append(f"retry of {trial_label(int(trial.system_attrs['retry_history'][-1]))}")
        if trial.number in retried_as:
            notes.append(f"retried as {trial_label(retried_as[trial.number])}")
        failure = "; ".join(part for part in (failure[:120], *notes) if part)
        complete = trial.state == TrialState.COMPLETE
        cells += [score,
                  *([_fmt(trial.user_attrs.get("capacity_rps")) if complete else "-"] if objective.per_gpu else []),
                  *([_fmt(trial.user_attrs.get("devices")) if complete else "-"] if gpus else []),
                  *([hit_rate(trial.user_attrs.get("prefix_cache_hit_rate"))] if hits else []),
                  slo, *([trial.user_attrs.get("broke_first") or "-"] if broke else []),
                  failure, format_duration(trial.user_attrs.get("wall_s"))]
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
    lines += changed_lines(provenance["decision"]["overrides"],
                           provenance["baseline"].get("effective_defaults") or {})
    lines += numerics_lines(provenance.get("numerics"), objective)
    for line in provenance["study"].get("clamped", []):  # a --space file that excludes the baseline
        lines += ["", f"Space clamped: {line}."]
    if verdict != "nothing":
        lines += [
            "",
            f"Deploy: `python -m server --config {inputs.best_yaml.name}` or "
            f"`{vllm_serve_command(inputs.best_yaml.name, inputs.front_ends)}`.",
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
    lines += validation_section(inputs)

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


def changed_lines(overrides: Mapping[str, Any], baseline: Mapping[str, Any]) -> list[str]:
    """"Changed engine arguments: `quantization=fp8`" and the same for serving settings: the
    emitted config's values that differ from what the baseline ran with (`baseline`: vLLM's
    resolved defaults). A value equal to the baseline's, or None (left to vLLM's default), is
    no change; the values the config sets to the baseline's are named after the changes."""
    changed = {k: v for k, v in overrides.items() if v is not None and baseline.get(k, object()) != v}
    same = [k for k, v in overrides.items() if v is not None and k not in changed]
    lines: list[str] = []
    for what, names in (
        ("engine arguments", [k for k in changed if k not in SEARCHABLE_SERVING_SETTINGS]),
        ("serving settings", [k for k in changed if k in SEARCHABLE_SERVING_SETTINGS]),
    ):
        if names:
            lines += ["", f"Changed {what}: " + ", ".join(f"`{k}={changed[k]}`" for k in names)]
    if lines and same:
        lines[-1] += " (set as the baseline ran: " + ", ".join(f"`{k}`" for k in same) + ")"
    return lines


def numerics_lines(numerics: dict[str, Any] | None, objective: Objective) -> list[str]:
    """The emitted config changes numerics (fp8: autotune.search.numerics): the mark, and the
    best config of the same gate without such knobs, so the user can choose."""
    if not numerics:
        return []
    changes = ", ".join(f"`{k}={v}`" for k, v in numerics["changes"].items())
    lines = ["", f"**The emitted config {numerics['note']}** ({changes})."]
    free = numerics.get("numerics_free")
    if free is None:
        return lines + ["", "Without such knobs: no searched config was validated; the baseline is the choice."]
    settings = ", ".join(f"`{k}={v}`" for k, v in free["overrides"].items()) or "the baseline's settings"
    met = "every SLO in every repeat" if free["eligible"] else f"not eligible: {free['why_not']}"
    return lines + ["", f"Without such knobs, validated in the same gate: **{free['candidate']}** ({settings}): "
                    f"median {objective.format_score(free['median'])}, {_pct(free['vs_baseline'])} vs the "
                    f"baseline, {met}."]


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
    """The first line of a capacity report: how much of the user's traffic each config carries,
    as offered rates the ladder's steps really sent: the highest passing step's, and the first
    failing step's above it (the bracket the capacity is known within)."""
    recorded = capacity["recorded_rps"]
    base = capacity.get("baseline_rps")
    # Met every SLO at the ladder's highest rate (--max-speedup): the cliff is further up.
    base_least = "at least " if capacity.get("baseline_lower_bound") else ""
    win_least = "at least " if capacity.get("winner_lower_bound") else ""
    where = capacity.get("measured_on", "held-out median")
    noise = (f"; noise {capacity['noise']:.1%}: {capacity['noise_source']}"
             if capacity.get("noise") is not None else "")
    text = (
        f"**Headroom: the baseline carries {base_least}{_fmt(capacity.get('baseline_headroom'))}x your "
        f"recorded traffic** ({_offered(base, capacity.get('baseline_first_fail_rps'))} vs "
        f"{_fmt(recorded)} req/s recorded; {where}{noise})"
    )
    if not kept_baseline and capacity.get("winner_rps") is not None:
        text = (
            f"**Headroom: the exported config carries {win_least}{_fmt(capacity.get('winner_headroom'))}x your "
            f"recorded traffic** ({_offered(capacity['winner_rps'], capacity.get('winner_first_fail_rps'))} "
            f"vs {_fmt(recorded)} req/s recorded; {where}{noise}); the baseline carries "
            f"{base_least}{_fmt(capacity.get('baseline_headroom'))}x "
            f"({_offered(base, capacity.get('baseline_first_fail_rps'))})"
        )
    return text + per_gpu_text(capacity, kept_baseline) + "."


def per_gpu_text(capacity: dict[str, Any], kept_baseline: bool) -> str:
    """capacity-per-gpu: what each config carries per GPU its engine holds (what the gate
    compared), "; per GPU: the exported config 6.1 req/s (1 GPU), the baseline 4.6 req/s (2
    GPUs)"; "" under the other objectives."""
    if capacity.get("baseline_rps_per_gpu") is None:
        return ""

    def on(who: str) -> str:
        count = capacity.get(f"{who}_gpus") or 1
        return f"{_fmt(capacity[f'{who}_rps_per_gpu'])} req/s ({count} GPU{'' if count == 1 else 's'})"

    if not kept_baseline and capacity.get("winner_rps_per_gpu") is not None:
        return f"; per GPU: the exported config {on('winner')}, the baseline {on('baseline')}"
    return f"; per GPU: the baseline {on('baseline')}"


def _offered(rps: float | None, first_fail_rps: float | None) -> str:
    """"12.1 req/s offered with every SLO met, 13.4 failed": a capacity and its bracket."""
    text = f"{_fmt(rps)} req/s offered with every SLO met"
    return text + (f", {_fmt(first_fail_rps)} failed" if first_fail_rps is not None else "")


def _hardware(hardware: dict[str, Any]) -> str:
    if hardware.get("gpus"):
        return ", ".join(hardware["gpus"])
    return f"{hardware.get('cpu')} ({hardware.get('cpu_count')} cores)"


def _window(info: dict[str, Any] | None) -> str:
    if not info:
        return "-"
    return f"{info['start_s']:.0f}-{info['end_s']:.0f} s ({info['requests']} requests)"


def validation_section(inputs: ReportInputs) -> list[str]:
    """The held-out comparison: each config's repeats, median, change against the baseline,
    spread and eligibility (and, for capacity, what broke first in its repeats)."""
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
    capacity = objective.kind == "capacity"
    for stats in [*decision.stats, *extra]:
        change = None if not base or stats.candidate == BASELINE else (stats.median - base) / base
        runs = sorted((m for m in inputs.measurements if m.candidate == stats.candidate), key=lambda m: m.repeat)
        rows.append(
            [
                stats.candidate + (" (emitted)" if stats.candidate == decision.winner else ""),
                ", ".join(_bracket(m, per_gpu=objective.per_gpu) for m in runs) if capacity and runs
                else ", ".join(_fmt(v) for v in stats.values),
                _fmt(stats.median),
                _pct(change),
                "-" if stats.relative_spread is None else f"{stats.relative_spread:.1%}",
                "yes" if stats.eligible else f"no: {stats.why_not}",
            ]
        )
    # What broke first above each config's capacity on the held-out window, repeat by repeat.
    broke = {name: [m.broke_first or "-" for m in inputs.measurements if m.candidate == name]
             for name in dict.fromkeys(m.candidate for m in inputs.measurements)}
    broke_column = any(value != "-" for values in broke.values() for value in values)
    if broke_column:
        for row, stats in zip(rows, [*decision.stats, *extra], strict=True):
            row.append("; ".join(dict.fromkeys(broke.get(stats.candidate, []))) or "-")
    # The GPUs each config's engine held (capacity-per-gpu divides by them), and its prefix-cache
    # hit rate over every repeat's measured steps (a column only where vLLM exposed the counters).
    runs_of = {stats.candidate: [m for m in inputs.measurements if m.candidate == stats.candidate]
               for stats in [*decision.stats, *extra]}
    gpus_column = objective.per_gpu or any((m.devices or 1) > 1 for m in inputs.measurements)
    hits_column = any(m.prefix_cache_hit_rate is not None for m in inputs.measurements)
    for row, stats in zip(rows, [*decision.stats, *extra], strict=True):
        runs = runs_of[stats.candidate]
        if gpus_column:
            row.append(_fmt(next((m.devices for m in runs if m.devices), None)))
        if hits_column:
            rates = [m.prefix_cache_hit_rate for m in runs if m.prefix_cache_hit_rate is not None]
            row.append(hit_rate(statistics.median(rates) if rates else None))
    per_repeat = (f"{objective.label} per repeat, passed-failed step offered ({objective.unit})"
                  if capacity else f"{objective.label} per repeat ({objective.unit})")
    lines = _table(
        ["config", per_repeat, "median", "vs baseline",
         "spread", "every SLO every repeat", *(["broke first"] if broke_column else []),
         *(["GPUs"] if gpus_column else []), *(["prefix cache hits (median)"] if hits_column else [])],
        rows,
    )
    if decision.ci_low is not None:
        lines += [
            "",
            f"Best candidate {decision.best_candidate}: effect {_pct(decision.effect)}, "
            f"{decision.confidence:.0%} bootstrap CI of the median difference "
            f"[{_fmt(decision.ci_low)}, {_fmt(decision.ci_high)}] {objective.unit}; noise used "
            f"{noise_text(decision.noise, decision.noise_source)}. "
            "Rule: emit only if the CI lies above 0 and the effect exceeds the noise (the baseline's "
            "spread over its repeats, never less than the capacity's resolution: the gap between "
            "the last passing and first failing ladder step).",
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


def _bracket(run: Measurement, *, per_gpu: bool = False) -> str:
    """One repeat's capacity with its bracket: "12.1-13.4" (the offered rates of the last
    passing and the first failing step), ">=12.1" when none failed above it; per GPU, both
    ends over the GPUs the engine held."""
    if not run.ok and run.value <= 0:
        return "failed"
    if run.first_fail_rps is None:
        return f">={_fmt(run.value)}" if run.value > 0 else "0"
    fail = run.first_fail_rps / max(run.devices or 1, 1) if per_gpu else run.first_fail_rps
    return f"{_fmt(run.value)}-{_fmt(fail)}"


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
