"""The gate: the search's top K configs and the baseline re-measured on the held-out window,
R times, interleaved (`validate`), and the rule that picks the winner (`decide`). Also the
ranking both phases use (`best_trials`) and where a capacity ladder starts (`ladder_start`).

A gate cut short (killed tuner, machine taken back) keeps its measured runs in
validation/measurements.json; `autotune run --resume` goes on after them (whole rounds only
from another machine: `_gate_done`).
"""

from __future__ import annotations

import dataclasses
import json
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import optuna
from optuna.trial import FrozenTrial

from autotune.errors import EnvironmentFailure
from autotune.measure.ladder import recorded_rate
from autotune.progress import format_duration
from autotune.search.gate import (
    BASELINE,
    GateDecision,
    Measurement,
    decide,
    decide_min_memory,
    round_robin,
)
from autotune.search.objective import STUDY_STOPPING_FAILURES, evaluate
from autotune.search.study_store import SearchInputs, StudyOptions
from autotune.search.trial_records import (
    capacity_interval,
    engine_devices,
    feasible,
    headroom_status,
    is_baseline,
    memory_of,
    memory_status,
    on_gpus,
    server_seconds,
    slo_text,
    trial_config,
    trial_label,
)
from server.config import ServerConfig
from workloads.files import write_text_atomic
from workloads.trace import Trace


class Runner(Protocol):
    """What the study needs of `autotune.measure.trial.TrialRunner` (tests pass a fake)."""

    def run(
        self,
        config: ServerConfig,
        window: Trace,
        trial_dir: Path,
        *,
        should_prune: Callable[[float, Any], bool] | None = None,
    ) -> Any: ...


@dataclasses.dataclass
class ValidationResult:
    measurements: list[Measurement]
    decision: GateDecision
    candidates: dict[str, ServerConfig]  # label -> config ("baseline" included)
    run_dirs: dict[str, list[Path]]  # label -> one folder per repeat
    wall_s: float
    server_s: float


@dataclasses.dataclass(eq=False, repr=False)
class GateRunner:
    """Ranks a study's trials and validates the best of them against the baseline."""

    options: StudyOptions
    inputs: SearchInputs
    _: dataclasses.KW_ONLY
    runner: Runner
    say: Callable[[str], None]
    clock: Callable[[], float]

    def best_trials(
        self, study: optuna.Study, k: int, *, include_baseline: bool = False
    ) -> list[FrozenTrial]:
        """The top `k` feasible trials by objective score, one per distinct config."""
        candidates = [
            t
            for t in study.get_trials(deepcopy=False)
            if feasible(t) and (include_baseline or not is_baseline(t))
        ]
        if self.inputs.objective.kind == "pareto":
            # Only Pareto-optimal configs go to the gate; ranked there by throughput.
            front = {t.number for t in study.best_trials}
            candidates = [t for t in candidates if t.number in front]
        candidates.sort(key=lambda t: (self.inputs.objective.rank_key(t.user_attrs.get("score", 0.0)), t.number))
        chosen: list[FrozenTrial] = []
        seen: list[dict[str, Any]] = []
        for trial in candidates:
            overrides = trial.user_attrs.get("overrides", {})
            if overrides in seen:
                continue
            seen.append(overrides)
            chosen.append(trial)
            if len(chosen) == k:
                break
        return chosen

    def numerics_free(self, study: optuna.Study, top: Sequence[FrozenTrial]) -> list[FrozenTrial]:
        """The best feasible trial that changes no numerics (autotune.search.numerics), when
        every one of `top` does: validated in the same gate, so that the report can show the
        user a config with the baseline's outputs beside the faster one. Else nothing."""
        if not top or not all(t.user_attrs.get("changes_numerics") for t in top):
            return []
        ranked = self.best_trials(study, len(study.trials))
        return [t for t in ranked if not t.user_attrs.get("changes_numerics")][:1]

    def decide(self, measurements: Sequence[Measurement]) -> GateDecision:
        """The gate's rule for this study's objective (autotune.search.gate)."""
        if self.inputs.objective.kind == "min-memory":
            return decide_min_memory(measurements, headroom=float(self.inputs.objective.headroom or 1.0))
        return decide(measurements, seed=self.options.seed)

    def baseline_trial(self, study: optuna.Study) -> FrozenTrial | None:
        done = [t for t in study.get_trials(deepcopy=False) if is_baseline(t) and t.state.is_finished()]
        return done[-1] if done else None

    def estimated_gate_s(self, typical_trial_s: float) -> float:
        runs = (self.options.top_k + 1) * self.options.repeats
        per_run = typical_trial_s - self.inputs.tuning_window.duration_s() + self.inputs.holdout_window.duration_s()
        return runs * max(per_run, 0.0)

    def ladder_start(self, study: optuna.Study, window: Trace, rps: float | None) -> dict[str, Any]:
        """Where a capacity ladder starts: at `rps` (this config's capacity measured before),
        else at the best capacity of the study so far, as a speed-up of `window`; nothing
        for the other objectives (their runners take no such keyword, or, min-memory, their
        single step is always at the headroom)."""
        if not self.inputs.objective.measures_capacity:
            return {}
        if rps is None:
            best = self.best_trials(study, 1, include_baseline=True)
            rps = best[0].user_attrs.get("capacity_rps") if best else None
        recorded = recorded_rate(window)
        if not rps or recorded <= 0:
            return {"start_speedup": None}
        return {"start_speedup": float(rps) / recorded}

    @staticmethod
    def _gate_done(record: Path, order: list[tuple[int, str]], host: str) -> list[Measurement]:
        """The runs a gate cut short (killed tuner, machine taken back) already measured, in
        this gate's order; --resume goes on after them. Every round (each config once) must be
        measured on one machine, so that a round's configs are compared on equal terms: whole
        rounds another machine measured are kept, and a part-measured round only if it was
        this machine (else it is measured again, wholly here)."""
        if not record.is_file():
            return []
        try:
            stored = [Measurement.model_validate(m) for m in json.loads(record.read_text(encoding="utf-8"))]
        except (ValueError, TypeError):
            return []
        matching: list[Measurement] = []
        for measurement, (repeat, name) in zip(stored, order, strict=False):
            if (measurement.candidate, measurement.repeat) != (name, repeat):
                break
            matching.append(measurement)
        per_round = len({name for _, name in order})  # each config once per round
        done: list[Measurement] = []
        for start in range(0, len(matching), per_round):
            round_runs = matching[start:start + per_round]
            hosts = {m.host for m in round_runs}
            if len(hosts) != 1 or (len(round_runs) < per_round and hosts != {host}):
                break
            done.extend(round_runs)
        return done

    def validate(self, study: optuna.Study) -> ValidationResult:
        """Re-run the top K and the baseline on the held-out window, R times, interleaved."""
        options = self.options
        top = self.best_trials(study, options.top_k)
        for trial in self.numerics_free(study, top):
            self.say(f"gate: every top config changes numerics; also validating {trial_label(trial.number)}, "
                     "the best that does not, so that the user can choose")
            top.append(trial)
        candidates: dict[str, ServerConfig] = {BASELINE: trial_config(self.inputs.baseline, {})}
        for trial in top:
            candidates[trial_label(trial.number)] = trial_config(self.inputs.baseline, trial.user_attrs.get("overrides", {}))
        candidates.update(self.inputs.comparisons)
        # Capacity ladders start where the search found each config's cliff (comparisons
        # and a baseline without a search trial start at the baseline's).
        baseline_trial = self.baseline_trial(study)
        known_rps: dict[str, float | None] = {
            BASELINE: baseline_trial.user_attrs.get("capacity_rps") if baseline_trial else None
        }
        for trial in top:
            known_rps[trial_label(trial.number)] = trial.user_attrs.get("capacity_rps")
        run_dirs: dict[str, list[Path]] = {name: [] for name in candidates}
        measurements: list[Measurement] = []
        start = self.clock()
        if not top:
            self.say("gate: no feasible candidate from the search; keeping the baseline")
            decision = self.decide([_baseline_placeholder(study, self)]).model_copy(
                update={"reason": "no searched config ran and met every SLO, so none was validated"}
            )
            return ValidationResult([], decision, candidates, run_dirs, 0.0, 0.0)
        order = round_robin(list(candidates), options.repeats)
        record = options.output_dir / "validation" / "measurements.json"
        host = machine_identity()
        done = self._gate_done(record, order, host) if options.resume_gate else []
        if done:
            self.say(f"gate: reusing {len(done)} of {len(order)} runs an interrupted gate measured "
                     f"({record})")
        measurements.extend(done)
        for index, (repeat, name) in enumerate(order, start=1):
            run_dir = options.output_dir / "validation" / name / f"repeat-{repeat + 1}"
            run_dirs[name].append(run_dir)
            if index <= len(done):
                continue
            hint = known_rps.get(name, known_rps[BASELINE])
            run_start = self.clock()
            outcome = self.runner.run(
                candidates[name],
                self.inputs.holdout_window,
                run_dir,
                **self.ladder_start(study, self.inputs.holdout_window, hint),
            )
            evaluation = evaluate(outcome, self.inputs.objective, self.inputs.slos,
                                  memory=memory_of(candidates[name], self.inputs.effective_defaults),
                                  devices=engine_devices(candidates[name].engine))
            measurements.append(Measurement(
                candidate=name, repeat=repeat, value=evaluation.score, host=host,
                wall_s=round(self.clock() - run_start, 1), server_s=round(server_seconds(outcome), 1),
                **evaluation.model_dump(include=KEPT_FROM_EVALUATION),
            ))
            write_text_atomic(
                record, json.dumps([m.model_dump() for m in measurements], indent=2) + "\n"
            )
            if outcome.failure in STUDY_STOPPING_FAILURES:
                # The install or the machine: every later run would die alike (the runs so far
                # are in `record`, which --resume reuses).
                raise EnvironmentFailure(f"gate run {name} repeat {repeat + 1}: {outcome.failure_detail}; "
                                         "the install or the machine, not the config: fix it, then "
                                         "rerun with --resume")
            status = "SLOs met" if evaluation.slo_met else slo_text(evaluation)
            if evaluation.headroom is not None:
                status = headroom_status(evaluation.headroom, evaluation.broke_first,
                                         capacity_interval(evaluation.capacity_rps, evaluation.first_fail_rps)) + (
                    "" if evaluation.ok else f"; failed ({evaluation.failure}: {evaluation.failure_detail})")
                if evaluation.capacity_note and evaluation.ok:
                    status = evaluation.capacity_note
                if self.inputs.objective.per_gpu and evaluation.devices:
                    status += "; " + on_gpus(evaluation.capacity_rps or 0.0, evaluation.devices)
            if self.inputs.objective.kind == "min-memory":
                status = memory_status(evaluation, self.inputs.objective)
            # The gate's own runs say what one costs: the search's trials climbed whole ladders
            # from 1x, a gate run starts at the config's capacity (on the H200 fp8 run of
            # results/h200-2026-12-02-fp8: trials 115-193 s, gate runs 66-81 s).
            walls = [m.wall_s or 0.0 for m in measurements[len(done):]]
            left = len(order) - index
            eta = f"ETA {format_duration(left * sum(walls) / len(walls))}  " if left and walls else ""
            self.say(
                f"gate {index}/{len(order)}  repeat {repeat + 1}  {eta}{name}: "
                f"{self.inputs.objective.format_score(evaluation.score)}, {status}"
            )
        searched = [m for m in measurements if m.candidate not in self.inputs.comparisons]
        decision = self.decide(searched)
        return ValidationResult(
            measurements, decision, candidates, run_dirs,
            # Reused runs (a resumed gate) count with the time they took when measured.
            (self.clock() - start) + sum(m.wall_s or 0.0 for m in done),
            sum(m.server_s or 0.0 for m in measurements)
        )


# The Evaluation fields a gate Measurement keeps as they are (same names).
KEPT_FROM_EVALUATION = {"slo_met", "ok", "failure", "margins_ms", "headroom", "broke_first",
                        "first_fail_rps", "resolution", "kv_cache_gib", "kv_cache_tokens",
                        "capacity_rps", "devices", "prefix_cache_hit_rate"}


def machine_identity() -> str:
    """Which machine measured a gate run: the host name and this boot of it. Lent machines
    may all be called the same (`vm`), so the name alone would mix two machines' runs."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="utf-8").strip()[:8]
    except OSError:  # not Linux
        return socket.gethostname()
    return f"{socket.gethostname()}/{boot}"


def _baseline_placeholder(study: optuna.Study, gate: GateRunner) -> Measurement:
    trial = gate.baseline_trial(study)
    score = float(trial.user_attrs.get("score", 0.0)) if trial is not None else 0.0
    met = bool(trial.user_attrs.get("slo_met", False)) if trial is not None else False
    return Measurement(candidate=BASELINE, repeat=0, value=score, slo_met=met)
