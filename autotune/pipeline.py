"""One tuning from plan to verdict: build the runner and the study, search, gate, export, report.

    plan (autotune.prepare) -> build_runner + build_study -> search -> finish: the gate,
    best.yaml, report.md

`autotune run` goes through `execute` (search, then `finish`). `autotune retune` creates its
study with `create_study` (the deployed config and warm starts queued) and then `execute`s it.
`autotune run --workers-only` creates a study with `create_study` too; each `autotune worker`
searches it with `build_runner` + `build_study`, and `autotune finalize` ends it with `finish`
(autotune.distributed). The TrialRunner and the TuningStudy are built here only.
"""

from __future__ import annotations

import dataclasses
import socket
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import optuna

from autotune.decide.export import build_provenance, export_best, final_config
from autotune.decide.outcome import baseline_problem, baseline_standing, stop_if_baseline_failed
from autotune.decide.report import capacity_line, kept_summary, memory_line, write_report
from autotune.decide.report_plots import ReportInputs
from autotune.errors import NothingMeasured
from autotune.measure.cpu_split import CpuSplit
from autotune.measure.ladder import recorded_rate
from autotune.measure.trial import TrialRunner
from autotune.plan import TuningPlan
from autotune.progress import format_duration, say
from autotune.redact import redact, redact_argv
from autotune.search.gate import BASELINE, GateDecision, Measurement, decide
from autotune.search.gate_runner import ValidationResult
from autotune.search.numerics import describe_changes, numerics_changes, numerics_record
from autotune.search.study import TuningStudy
from autotune.search.study_store import SearchInputs, StudyOptions


def study_options(plan: TuningPlan) -> StudyOptions:
    """The plan's study settings: every StudyOptions field is the plan's field of that name."""
    return StudyOptions(**{field.name: getattr(plan, field.name)
                           for field in dataclasses.fields(StudyOptions)})


def search_inputs(plan: TuningPlan) -> SearchInputs:
    """What the plan's study searches and judges: every SearchInputs field is the plan's
    field of that name."""
    return SearchInputs(**{field.name: getattr(plan, field.name)
                           for field in dataclasses.fields(SearchInputs)})


def build_runner(
    plan: TuningPlan, *, registry: Path, say: Callable[[str], None] | None = None
) -> TrialRunner:
    """The runner that measures the plan's trials; `registry` records the servers it starts
    (so that the next run ends them if this process is killed)."""
    plan.trial_server.check(())  # a worker's host must have the server too
    cpu_split = CpuSplit.resolve(plan.client_cpus, accelerator=plan.accelerator)
    if cpu_split is not None and say is not None:
        say(f"load client and server on separate CPUs: {cpu_split.describe()}")
    return TrialRunner(
        replay=plan.replay_options(),
        startup_timeout_s=plan.startup_timeout_s,
        stale_registry=registry,
        ladder=plan.ladder,
        say=say,
        server=plan.trial_server,
        cpu_split=cpu_split,
        # Measured on vLLM's CPU platform and on an H200 (benchmarks/server_start.py): ready in
        # 0.3x and 0.5x the time, serving as fast. TrialRunner forks our server only.
        preload_server=plan.fork_servers == "on",
        shared_fork_server=plan.fork_server_socket,
    )


def build_study(plan: TuningPlan, *, runner: Any, **extra: Any) -> TuningStudy:
    """The TuningStudy a plan describes (`extra`: further TuningStudy keywords)."""
    extra.setdefault("say", say)
    return TuningStudy(options=study_options(plan), inputs=search_inputs(plan), runner=runner, **extra)


class _NotMeasuredHere:
    """`create_study` measures nothing."""

    def run(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a study being created measures no trial")


def create_study(
    plan: TuningPlan,
    *,
    study_attrs: dict[str, Any],
    warm_starts: Sequence[tuple[dict[str, Any], dict[str, Any]]] = (),
    say: Callable[[str], None] = say,
) -> optuna.Study:
    """Create the plan's study with the baseline queued as trial 0, then `warm_starts`
    (Optuna params, user attributes) in order; measure nothing."""
    tuning = build_study(plan, runner=_NotMeasuredHere(), study_attrs=study_attrs, say=say)
    study = tuning.open()
    tuning.enqueue_baseline(study)
    for params, user_attrs in warm_starts:
        study.enqueue_trial(params, user_attrs=user_attrs)
    return study


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """What a finished run produced: `verdict` "validated" (a config beat the baseline beyond
    the noise) or "kept" (the baseline stays, its measured standing in the report), and the
    paths of best.yaml and report.md. A run that measured nothing raises NothingMeasured."""

    verdict: Literal["validated", "kept"]
    best_yaml: Path
    report: Path


def execute(plan: TuningPlan, *, runner: Any, reap: Callable[[Path], list[int]] | None) -> RunOutcome:
    """Search, then `finish`: `autotune run` (and `retune`, on the study it created).
    `reap` ends the servers a killed earlier run left behind (None: nothing to end)."""
    tuning = build_study(
        plan,
        runner=runner,
        study_attrs={"workload_fingerprint": plan.workload["fingerprint"]},
        reap=reap,
        trial_attrs={"host": socket.gethostname()},
    )
    # Without a measured baseline nothing the search finds can be judged: stop at once.
    tuning.between_trials = lambda: stop_if_baseline_failed(tuning.study, infeasible_ok=plan.search_anyway)
    study = tuning.open()
    say(
        f"study {plan.study_name} in {redact(plan.storage_url)}: objective "
        f"{plan.objective.spec()}, SLOs {', '.join(s.spec() for s in plan.slos)}; searching "
        + ", ".join(f"{k} ({v})" for k, v in plan.space.describe().items())
    )
    for line in plan.space.describe_clamps(plan.baseline.searchable_values(plan.effective_defaults)):
        say(f"note: {line}")
    try:
        study = tuning.run_search()
    except NothingMeasured:
        return finish(plan, tuning, study)  # reports, raises
    say(f"search done in {format_duration(tuning.search_wall_s)}; validating on the held-out window")
    return finish(plan, tuning, study)


def finish(
    plan: TuningPlan,
    tuning: TuningStudy,
    study: optuna.Study,
    *,
    search_extra: dict[str, Any] | None = None,
) -> RunOutcome:
    """The gate, best.yaml and report.md for a study whose search is over.

    Only a study with a measured baseline gets a gate and a best.yaml; without one, report.md
    says what failed and NothingMeasured (exit 12) is raised.
    """
    problem = baseline_problem(study, infeasible_ok=plan.search_anyway)
    if problem is None:
        result = tuning.validate(study)
    else:
        unmeasured = Measurement(candidate=BASELINE, repeat=0, value=0.0, slo_met=False, ok=False,
                                 failure="not measured")
        decision = decide([unmeasured]).model_copy(update={"reason": problem})
        result = ValidationResult([], decision, {}, {}, 0.0, 0.0)
    decision = result.decision
    overrides: dict[str, Any] = {}
    if not decision.keep_baseline:
        number = int(decision.winner.split("-")[1])
        overrides = study.trials[number].user_attrs.get("overrides", {})
    verdict = "nothing" if problem is not None else "kept" if decision.keep_baseline else "validated"
    standing = baseline_standing(result.measurements, tuning.gate.baseline_trial(study), plan.slos,
                                 plan.objective)
    validation = [m.model_dump() for m in result.measurements]
    verdict_config = plan.trial_server.served(final_config(plan.baseline, overrides))
    provenance = build_provenance(
        decision=decision,
        winner_overrides=overrides,
        objective=plan.objective,
        slos=plan.slos,
        study_name=plan.study_name,
        storage_url=redact(plan.storage_url),
        command_line=redact_argv(plan.command_line),
        model=str(plan.baseline.engine.get("model")),
        workload=plan.workload,
        baseline_source=plan.baseline_source,
        effective_defaults=plan.effective_defaults,
        validation=validation,
        search={"trials": len(study.trials), "search_wall_s": round(tuning.search_wall_s, 1),
                "validation_wall_s": round(result.wall_s, 1), **clamped(plan), **(search_extra or {})},
        baseline_standing=standing,
        trial_server=plan.trial_server,
        deployed=verdict_config,
    )
    capacity = capacity_figures(plan, decision, result.measurements,
                                baseline_trial=tuning.gate.baseline_trial(study))
    numerics = numerics_figures(plan, study, decision, verdict_config)
    if numerics is not None:
        provenance["numerics"] = numerics
    if capacity is not None:
        provenance["capacity"] = capacity
    memory = None if problem is not None else memory_figures(
        plan, decision, result.measurements, baseline_trial=tuning.gate.baseline_trial(study))
    if memory is not None:
        provenance["memory"] = memory
    best_path = plan.output_dir / "best.yaml"
    if verdict != "nothing":
        export_best(best_path, verdict_config, provenance)
    report = write_report(
        plan.output_dir,
        ReportInputs(
            study=study,
            objective=plan.objective,
            slos=plan.slos,
            decision=decision,
            measurements=result.measurements,
            run_dirs=result.run_dirs,
            provenance=provenance,
            best_yaml=best_path,
            front_ends=verdict_config.serving.api_processes,
            search_wall_s=tuning.search_wall_s,
            gate_wall_s=result.wall_s,
            gate_server_s=result.server_s,
            workload_profile=plan.profile_text,
            verdict=verdict,
            baseline_standing=standing,
        ),
    )
    if verdict == "nothing":
        say("")
        say("*** NOTHING COULD BE MEASURED: the baseline failed, so no config can be judged. ***")
        say(f"*** {problem} ***")
        say(f"*** no best.yaml was written; {report} has the trials. ***")
        raise NothingMeasured(f"{problem}; no best.yaml written, see {report}")
    if capacity is not None:
        say(capacity_line(capacity, decision.keep_baseline).replace("**", ""))
    if memory is not None:
        say(memory_line(memory, decision.keep_baseline).replace("**", ""))
    if decision.keep_baseline:
        say("")
        say(f"*** KEPT THE BASELINE: {kept_summary(plan.objective)}. ***")
        say(f"*** {decision.reason} ***")
        say(f"*** baseline measured: {standing} ***")
        say(f"*** {best_path} holds the baseline config. ***")
    else:
        say(f"winner {decision.winner}: {decision.reason}")
        say("changed: " + ", ".join(f"{k}={v}" for k, v in overrides.items()))
        if numerics is not None:
            say(f"*** the winner {describe_changes(numerics['changes'])} ***")
            free = numerics["numerics_free"]
            say("without such knobs: " + (f"{free['candidate']} ({plan.objective.format_score(free['median'])} "
                                          f"median in the gate, {'every' if free['eligible'] else 'not every'} "
                                          "SLO in every repeat)" if free else "no config but the baseline"))
    say(f"wrote {best_path} and {report}")
    return RunOutcome(verdict="kept" if decision.keep_baseline else "validated", best_yaml=best_path,
                      report=report)


def clamped(plan: TuningPlan) -> dict[str, Any]:
    """The knobs whose baseline value the space excludes (SearchSpace.describe_clamps), for
    best.yaml's provenance and the report; {} when the space contains the baseline."""
    lines = plan.space.describe_clamps(plan.baseline.searchable_values(plan.effective_defaults))
    return {"clamped": lines} if lines else {}


def numerics_figures(
    plan: TuningPlan, study: optuna.Study, decision: GateDecision, deployed: Any
) -> dict[str, Any] | None:
    """The emitted config's numerics changes and the best gate candidate without them
    (autotune.search.numerics.numerics_record); None when it changes none."""
    if decision.keep_baseline:
        return None
    changes = numerics_changes(deployed.searchable_values(plan.effective_defaults),
                               plan.baseline.searchable_values(plan.effective_defaults))

    def overrides_of(label: str) -> dict[str, Any] | None:
        if label == BASELINE:
            return {}
        trial = study.trials[int(label.split("-")[1])]
        return None if trial.user_attrs.get("changes_numerics") else dict(trial.user_attrs.get("overrides") or {})

    return numerics_record(changes, decision.stats, decision.winner, overrides_of,
                           plan.objective.rank_key)


def capacity_figures(
    plan: TuningPlan, decision: GateDecision, measurements: Sequence[Measurement], *, baseline_trial: Any
) -> dict[str, Any] | None:
    """Capacity and headroom of the baseline and the winner for best.yaml's provenance, the
    report and the last lines: medians of the gate's held-out repeats, or, when no gate ran,
    the baseline's search measurement on the tuning window (and the figures say which).

    Each capacity is the offered rate (as sent) of the highest passing ladder step; beside it
    the first failing step's offered rate (median over the repeats), the bracket the capacity
    is known within. A config with no failing step above its capacity is a lower bound. Under
    capacity-per-gpu the gate's medians are per GPU: the capacities here are whole (headroom is
    the traffic one engine carries), and the per-GPU medians and GPUs held are added."""
    if not plan.objective.measures_capacity:
        return None
    per_gpu = plan.objective.per_gpu
    gpus: dict[str, int | None] = {}
    if measurements and decision.baseline_median is not None:
        recorded = recorded_rate(plan.holdout_window)
        base = whole_capacity(measurements, BASELINE) if per_gpu else float(decision.baseline_median)
        source = "held-out window, median of the gate's repeats"
        runs = {name: [m for m in measurements if m.candidate == name and m.ok]
                for name in (BASELINE, decision.winner)}
        fails = {name: [m.first_fail_rps for m in found] for name, found in runs.items()}
        gpus = {name: next((m.devices for m in measurements if m.candidate == name and m.devices), None)
                for name in (BASELINE, decision.winner)}
    elif baseline_trial is not None and baseline_trial.user_attrs.get("capacity_rps") is not None:
        recorded = recorded_rate(plan.tuning_window)
        base = float(baseline_trial.user_attrs["capacity_rps"])
        source = "tuning window, the baseline's search trial (no gate ran)"
        fails = {BASELINE: [baseline_trial.user_attrs.get("first_fail_rps")]}
        gpus = {BASELINE: baseline_trial.user_attrs.get("devices")}
    else:
        return None

    def first_fail(name: str) -> float | None:
        found = [f for f in fails.get(name, []) if f is not None]
        return round(float(statistics.median(found)), 3) if found else None

    def lower_bound(name: str) -> bool:
        """No step failed above the capacity (the ladder reached --max-speedup): a lower bound."""
        return bool(fails.get(name)) and all(f is None for f in fails[name])

    figures: dict[str, Any] = {
        "measured_on": source,
        "recorded_rps": round(recorded, 3),
        "baseline_rps": round(base, 3),
        "baseline_first_fail_rps": first_fail(BASELINE),
        "baseline_headroom": round(base / recorded, 3) if recorded > 0 else None,
        "baseline_lower_bound": base > 0 and lower_bound(BASELINE),
    }
    if per_gpu:
        figures["baseline_gpus"] = gpus.get(BASELINE) or 1
        figures["baseline_rps_per_gpu"] = round(base / figures["baseline_gpus"], 3)
    if measurements and not decision.keep_baseline and decision.candidate_median is not None:
        win = whole_capacity(measurements, decision.winner) if per_gpu else float(decision.candidate_median)
        if per_gpu:
            figures["winner_gpus"] = gpus.get(decision.winner) or 1
            figures["winner_rps_per_gpu"] = round(float(decision.candidate_median), 3)
        figures["winner_rps"] = round(win, 3)
        figures["winner_first_fail_rps"] = first_fail(decision.winner)
        figures["winner_headroom"] = round(win / recorded, 3) if recorded > 0 else None
        figures["winner_lower_bound"] = lower_bound(decision.winner)
    if decision.noise is not None:
        figures["noise"] = round(decision.noise, 4)
        figures["noise_source"] = decision.noise_source
    return figures


def whole_capacity(measurements: Sequence[Measurement], name: str) -> float:
    """The median whole capacity (req/s) of `name`'s gate runs (0 for a run that measured none),
    where the gate compared them per GPU."""
    values = [float(m.capacity_rps or 0.0) for m in measurements if m.candidate == name]
    return float(statistics.median(values)) if values else 0.0


def memory_figures(
    plan: TuningPlan, decision: GateDecision, measurements: Sequence[Measurement], *,
    baseline_trial: Any,
) -> dict[str, Any] | None:
    """min-memory: the baseline's and the winner's gpu_memory_utilization, whether they met
    every SLO at H x the recorded rate, and their KV cache (GiB, tokens) as vLLM logged it;
    from the gate's held-out repeats, else the baseline's search trial."""
    objective = plan.objective
    if objective.kind != "min-memory" or decision.baseline_median is None:
        return None
    headroom = float(objective.headroom or 1.0)
    if measurements:
        window, source = plan.holdout_window, "held-out window, every repeat of the gate"
        base_met = next((s.eligible for s in decision.stats if s.candidate == BASELINE), False)
    else:
        window, source = plan.tuning_window, "tuning window, the baseline's search trial (no gate ran)"
        base_met = bool(baseline_trial.user_attrs.get("slo_met")) if baseline_trial else False
    recorded = recorded_rate(window)

    def kv(name: str) -> dict[str, Any]:
        runs = [m for m in measurements if m.candidate == name
                and (m.kv_cache_gib is not None or m.kv_cache_tokens is not None)]
        if runs:
            return {"kv_cache_gib": runs[0].kv_cache_gib, "kv_cache_tokens": runs[0].kv_cache_tokens}
        if name == BASELINE and baseline_trial is not None:
            return {"kv_cache_gib": baseline_trial.user_attrs.get("kv_cache_gib"),
                    "kv_cache_tokens": baseline_trial.user_attrs.get("kv_cache_tokens")}
        return {"kv_cache_gib": None, "kv_cache_tokens": None}

    base_kv = kv(BASELINE)
    figures: dict[str, Any] = {
        "headroom": headroom,
        "measured_on": source,
        "recorded_rps": round(recorded, 3),
        "target_rps": round(recorded * headroom, 3),
        "baseline_gpu_memory_utilization": decision.baseline_median,
        "baseline_meets_slos": base_met,
        "baseline_kv_cache_gib": base_kv["kv_cache_gib"],
        "baseline_kv_cache_tokens": base_kv["kv_cache_tokens"],
    }
    if not decision.keep_baseline and decision.candidate_median is not None:
        win_kv = kv(decision.winner)
        figures["winner_gpu_memory_utilization"] = decision.candidate_median
        figures["winner_kv_cache_gib"] = win_kv["kv_cache_gib"]
        figures["winner_kv_cache_tokens"] = win_kv["kv_cache_tokens"]
    return figures
