"""The search: Optuna proposes, a TrialRunner measures, the objective scores; trial by trial
until the trial, time or GPU-seconds budget is spent. The storage is `autotune.search.study_store`'s,
the gate `autotune.search.gate_runner`'s, a trial's stored attributes `autotune.search.trial_records`'.

Longer than ~400 lines, and `TuningStudy` longer than ~250, on purpose: what is left is one
loop (ask, measure, tell; the budgets; waiting on other workers; the first phase's one-knob
moves), whose steps share the study and the run's budgets and are read in order.

Choices, and why:
- A config that breaks a relation, or that a server cannot run (OOM, crash, start timeout,
  errors), is told as COMPLETE with objective 0 and a violated `ran` constraint rather than as
  FAIL: TPE ignores FAIL trials entirely (it would keep proposing the same region), while it
  ranks constraint-violating trials below every feasible one and samples away from them.
  Failures that say nothing about the config (a busy port, Ctrl-C, a killed tuner) are FAIL.
- SLOs are constraints (`Trial.set_constraint`, the Optuna 5 API), so a trial that misses
  one is known as infeasible and is never the "best".
- The baseline (vLLM's defaults, or `--baseline FILE`) is trial 0, labelled, never pruned.
- Several workers may share one study: a trial failed as stale is retried by whichever worker
  asks next, and a worker waits rather than over-shoot the trial count while others still
  measure.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import EnvironmentFailure
from autotune.measure.ladder import CapacityResult
from autotune.measure.signals import stop_reason
from autotune.progress import format_duration, progress_line
from autotune.search.first_moves import (
    BATCHED,
    MEMORY,
    Move,
    first_moves,
    follow_up,
    memory_descent,
    rebase,
)
from autotune.search.gate_runner import GateRunner, Runner, ValidationResult
from autotune.search.numerics import numerics_changes
from autotune.search.objective import (
    CONFIG_FAILURES,
    STUDY_STOPPING_FAILURES,
    Evaluation,
    evaluate,
    invalid_config_evaluation,
)
from autotune.search.space import POW2_PREFIX
from autotune.search.study_store import SearchInputs, StudyOptions, StudyStore
from autotune.search.trial_records import (
    counts_toward_budget,
    describe_trial,
    engine_devices,
    explicit_engine,
    feasible,
    is_baseline,
    memory_of,
    record_evaluation,
    record_failure,
    server_seconds,
    trial_config,
    trial_label,
)
from server.config import SEARCHABLE_SERVING_SETTINGS, ServerConfig

# A move pays off (and is followed a step further) when it carries this much more than every
# config measured before it; within this margin either way it ties (followed once, if a first move).
PAID_OFF_MARGIN = 0.02
# Relation operands that are not usually search parameters but matter for the built-ins.
CONTEXT_KEYS = ("max_model_len", "enable_chunked_prefill", "max_num_seqs", "max_num_batched_tokens")


class TuningStudy:
    """Search, then validate. `run_search()` and `validate()` are the two phases; the study's
    storage is `self.store`'s, the gate and the ranking of trials `self.gate`'s. Over ~250
    lines: the search loop and its steps (see the module's docstring)."""

    def __init__(
        self,
        *,
        options: StudyOptions,
        inputs: SearchInputs,
        runner: Runner,
        study_attrs: dict[str, Any] | None = None,
        reap: Callable[[Path], list[int]] | None = None,
        say: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        trial_attrs: dict[str, Any] | None = None,
        on_interrupted: Callable[[optuna.Study, FrozenTrial], None] | None = None,
        between_trials: Callable[[], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.options = options
        self.inputs = inputs
        self.runner = runner
        self.study_attrs = dict(study_attrs or {})
        self.say = say or (lambda line: print(line, flush=True))
        self.clock = clock
        # Stamped on every trial this process measures (host, worker id): the report's host.
        self.trial_attrs = dict(trial_attrs or {})
        # Called with a trial a Ctrl-C / SIGTERM cut short (a leaving worker re-queues it).
        self.on_interrupted = on_interrupted
        # Called before each trial and while waiting on other workers (e.g. reaping servers).
        self.between_trials = between_trials
        self.sleep = sleep
        self.study: optuna.Study | None = None
        self.search_wall_s = 0.0
        self.shared = False  # set by attach(): other processes run trials of this study too
        # The storage and the gate work on the same options and inputs as the search.
        self.store = StudyStore(options, inputs, study_attrs=self.study_attrs, reap=reap, say=self.say)
        self.gate = GateRunner(options, inputs, runner=runner, say=self.say, clock=clock)

    def open(self) -> optuna.Study:
        """Create the study, or load it with --resume (`StudyStore.open`)."""
        self.study = self.store.open()
        return self.study

    def attach(self, storage: optuna.storages.BaseStorage, *, seed: int | None = None) -> optuna.Study:
        """Join a study another process created (`StudyStore.attach`)."""
        self.study = self.store.attach(storage, seed=seed)
        self.shared = True
        return self.study

    def validate(self, study: optuna.Study | None = None) -> ValidationResult:
        """The gate (`GateRunner.validate`) on this study."""
        study = study or self.study
        assert study is not None
        return self.gate.validate(study)

    # -- the search ------------------------------------------------------------------------

    def run_search(self) -> optuna.Study:
        study = self.study or self.open()
        options = self.options
        start = self.clock()
        # A resumed study's search time includes the trials earlier processes measured.
        earlier_s = sum(float(t.user_attrs.get("wall_s") or 0.0)
                        for t in study.get_trials(deepcopy=False) if t.state.is_finished())
        if not self.shared:
            # A shared study was created with its baseline queued; a lost baseline is retried.
            self.enqueue_baseline(study)
        durations: list[float] = []
        # Trials whose ladder started at a known capacity. The first climbs from 1x, cold: on
        # the CPU demo it took 137 s, the hinted trials 36 and 57 s and each gate run about 40;
        # priced at the first, the ETA after it read 13m42s where 4.5 minutes were left.
        hinted_durations: list[float] = []
        device_costs: list[float] = []  # accelerator-seconds of each trial this run measured
        waiting_on: int | None = None
        while True:
            self.store.fail_stale(study)
            if self.between_trials is not None:
                self.between_trials()
            trials = study.get_trials(deepcopy=False)
            done = sum(counts_toward_budget(t) for t in trials)
            elapsed = self.clock() - start
            if options.n_trials is not None and done >= options.n_trials:
                break
            if self.shared and options.n_trials is not None:
                # Others are measuring the last trials: wait for them to finish (then stop)
                # or to be found dead (then their trials come back WAITING: run them).
                running = sum(t.state == TrialState.RUNNING for t in trials)
                queued = any(t.state == TrialState.WAITING for t in trials)
                if done + running >= options.n_trials and not queued:
                    if waiting_on != running:
                        self.say(f"{done}/{options.n_trials} trials done; waiting on {running} "
                                 f"running on other workers")
                        waiting_on = running
                    self.sleep(self.store.poll_s(study))
                    continue
            waiting_on = None
            if options.time_budget_s is not None and done > 0:
                typical = sum(durations) / len(durations) if durations else 0.0
                if elapsed + typical > options.time_budget_s:
                    self.say(
                        f"time budget {format_duration(options.time_budget_s)} reached after "
                        f"{done} trials"
                    )
                    break
            if options.gpu_seconds is not None and done > 0:
                # Like the time budget: a trial that would overrun is not started.
                spent = sum(device_costs)
                typical = spent / len(device_costs) if device_costs else 0.0
                if spent + typical > options.gpu_seconds:
                    self.say(
                        f"GPU-seconds budget {options.gpu_seconds:.0f} reached after {done} "
                        f"trials ({spent:.0f} spent)"
                    )
                    break
            self.queue_first_moves(study)
            # Whether this trial's ladder starts at a capacity measured before (every trial
            # after the first, and every gate run): the ETA prices what is left at such runs.
            hinted = self.gate.ladder_start(study, self.inputs.tuning_window, None).get("start_speedup") is not None
            trial_start = self.clock()
            frozen = self.run_one(study)
            durations.append(self.clock() - trial_start)
            if hinted:
                hinted_durations.append(durations[-1])
            device_costs.append(self.device_seconds(frozen))
            self.say(self._progress(study, frozen, start, hinted_durations or durations, device_costs))
            self._stop_on_environment(frozen, start, earlier_s)
        self.search_wall_s = (self.clock() - start) + earlier_s
        return study

    def _stop_on_environment(self, trial: FrozenTrial, start: float, earlier_s: float) -> None:
        """Raise EnvironmentFailure after a trial whose server died of the install or the
        machine (STUDY_STOPPING_FAILURES): every later config would die alike. The trial is
        told FAIL (TPE learns nothing from it) and every trial before it stays measured."""
        failure = trial.user_attrs.get("failure")
        if failure not in STUDY_STOPPING_FAILURES:
            return
        self.search_wall_s = (self.clock() - start) + earlier_s
        detail = trial.user_attrs.get("failure_detail") or failure
        study = self.study
        kept = 0 if study is None else sum(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False))
        self.say(f"{trial_label(trial.number)}: {failure} failure, not the config's: stopping the study")
        raise EnvironmentFailure(
            f"{trial_label(trial.number)}: {detail}; this is the install or the machine, not the "
            f"config: fix it (e.g. install the missing module), then rerun with --resume "
            f"({kept} measured trial{'' if kept == 1 else 's'} kept)"
        )

    def device_seconds(self, trial: FrozenTrial) -> float:
        """Accelerator-seconds a trial held: its wall time (0 when never launched) x the
        devices its config's engine holds."""
        config = self.trial_config(trial.user_attrs.get("overrides") or {})
        return float(trial.user_attrs.get("wall_s") or 0.0) * engine_devices(config.engine)

    def queue_first_moves(self, study: optuna.Study) -> None:
        """Once the baseline's capacity is known, plan the one-knob moves its measurement
        points to (autotune.search.first_moves), once per study. One move is queued at a time, so
        that a move that paid off is followed a step further before the next idea.
        min-memory bisects memory instead (`_queue_memory_descent`)."""
        if self.inputs.objective.kind == "min-memory":
            self._queue_memory_descent(study)
            return
        if not self.inputs.objective.measures_capacity:
            return
        if "first_moves" not in study.user_attrs:
            baseline = self.gate.baseline_trial(study)
            if baseline is None or baseline.state != TrialState.COMPLETE:
                return
            capacity = None
            trial_dir = baseline.user_attrs.get("trial_dir")
            ladder_file = Path(trial_dir) / "ladder.json" if trial_dir else None
            if ladder_file is not None and ladder_file.is_file():
                capacity = CapacityResult.model_validate_json(ladder_file.read_text(encoding="utf-8"))
            values = baseline.user_attrs.get("engine_params") or {}
            moves = first_moves(capacity, self.inputs.slos, self.inputs.space, values)
            study.set_user_attr("first_moves", [move.name for move in moves])
            study.set_user_attr("pending_moves", [move.model_dump(mode="json") for move in moves])
            if moves:
                self.say("first moves from the baseline's measurement: " + "; ".join(
                    f"{move.name} ({move.why})" for move in moves))
        pending = [Move.model_validate(m) for m in study.user_attrs.get("pending_moves", [])]
        pending = self._follow_moves(study) + pending
        busy = study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING))
        while pending and not busy:
            move = self._next_move(study, pending.pop(0))
            if move is not None:
                self._queue_move(study, move)
                break
        study.set_user_attr("pending_moves", [m.model_dump(mode="json") for m in pending])

    def _next_move(self, study: optuna.Study, planned: Move) -> Move | None:
        """The planned move as it is launched now: from the best config so far; None (said, not
        launched) along a direction that already paid off, or onto a config measured already or
        one that breaks a relation of the space."""
        if not planned.follow and planned.direction in study.user_attrs.get("paid_off", []):
            self.say(f"skipping move {planned.name}: {planned.direction} already paid off and was followed")
            return None
        # A follow-up goes on from its own move's config (`follow_up`), the best one or tied
        # with it; the other moves start from the best config so far.
        best = [] if planned.follow else self.gate.best_trials(study, 1, include_baseline=True)
        move = planned if not best else rebase(planned, self.inputs.space, best[0].user_attrs.get("engine_params") or {})
        if move is None:
            return None
        # None waits (the caller queues only when nothing is busy): every trial has its params.
        tried = [t.user_attrs.get("engine_params") or {} for t in study.get_trials(deepcopy=False)]
        if any(all(params.get(k) == v for k, v in move.values.items()) for params in tried):
            self.say(f"skipping move {move.name}: that config was measured already")
            return None
        broken = self.inputs.space.broken_relations(move.values)
        if broken:
            self.say(f"skipping move {move.name}: it breaks {'; '.join(broken)}")
            return None
        return move

    def _queue_memory_descent(self, study: optuna.Study) -> None:
        """min-memory: queue the next memory of the bisection (autotune.search.first_moves.
        memory_descent) from the finished trials that changed memory alone."""
        trials = study.get_trials(deepcopy=False)
        if any(t.state in (TrialState.WAITING, TrialState.RUNNING) for t in trials):
            return
        baseline = self.gate.baseline_trial(study)
        if baseline is None or not baseline.state.is_finished():
            return
        base = baseline.user_attrs.get("engine_params") or {}
        points: list[tuple[float, bool]] = []
        for trial in trials:
            params = trial.user_attrs.get("engine_params") or {}
            if not trial.state.is_finished() or params.get(MEMORY) is None:
                continue
            if trial.number == baseline.number or (trial.user_attrs.get("move_detail") or {}).get("knob") == MEMORY:
                points.append((float(params[MEMORY]), feasible(trial)))
        move = memory_descent(points, self.inputs.space, base)
        if move is not None:
            if "first_moves" not in study.user_attrs:
                study.set_user_attr("first_moves", [move.name])
            self.say(f"next memory: {move.name} ({move.why})")
            self._queue_move(study, move)

    def _queue_move(self, study: optuna.Study, move: Move) -> None:
        study.enqueue_trial(
            self.inputs.space.fixed_params(move.values),
            user_attrs={"move": move.name, "move_why": move.why,
                        "move_detail": move.model_dump(mode="json")},
            skip_if_exists=True,
        )

    def _as_move(self, study: optuna.Study, trial: FrozenTrial) -> Move | None:
        """The move a first-phase trial made: the one knob its values differ in from the
        baseline's (None for a sampled trial)."""
        if not trial.user_attrs.get("move"):
            return None
        detail = trial.user_attrs.get("move_detail")
        if detail:
            return Move.model_validate(detail)
        baseline = self.gate.baseline_trial(study)
        base = (baseline.user_attrs.get("engine_params") or {}) if baseline else {}
        mine = trial.user_attrs.get("engine_params") or {}
        changed = [k for k in self.inputs.space.params if k in mine and mine.get(k) != base.get(k)]
        if len(changed) != 1 or not base.get(changed[0]):
            return None
        knob = changed[0]
        return Move(name=str(trial.user_attrs["move"]), why="", values=dict(mine), knob=knob,
                    factor=float(mine[knob]) / float(base[knob]))

    def _follow_moves(self, study: optuna.Study) -> list[Move]:
        """For each finished move not looked at yet: its next step when it carries more than
        everything measured before it."""
        followed = set(study.user_attrs.get("followed_moves", []))
        trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
        found: list[Move] = []
        best_before = 0.0
        for trial in trials:
            # The objective's score: the capacity, or per GPU under capacity-per-gpu.
            score = float(trial.user_attrs.get("score") or 0.0) if feasible(trial) else 0.0
            move = self._as_move(study, trial)
            if move is not None and trial.number not in followed and trial.state.is_finished():
                paid_off = score > best_before * (1 + PAID_OFF_MARGIN)
                # A first move of the chunk budget that tied the best (within the margin either
                # way) is followed once too: the ladder's steps are ~10% apart, so a tie says its
                # effect was below that, not that the line is flat. On the H200 conversation grid
                # with fp8, 8192 -> 4096 and -> 2048 batched tokens tied at 32 req/s and 1024
                # carried 36.2. Not max_num_seqs: a cap the batch never reached ties for real
                # (following those ties on the H100 long-prompt grid spent the launches TPE used better).
                tied = (not paid_off and not move.follow and move.knob == BATCHED and score > 0
                        and score * (1 + PAID_OFF_MARGIN) >= best_before)
                if paid_off:
                    study.set_user_attr("paid_off", sorted({*study.user_attrs.get("paid_off", []), move.direction}))
                nxt = follow_up(move, self.inputs.space) if paid_off or tied else None
                if nxt is not None:
                    found.append(nxt)
                    verdict = "paid off" if paid_off else "tied with the best"
                    self.say(f"{trial_label(trial.number)} ({move.name}) {verdict}: next {nxt.name}")
                followed.add(trial.number)
            best_before = max(best_before, score)
        study.set_user_attr("followed_moves", sorted(followed))
        return found

    def enqueue_baseline(self, study: optuna.Study) -> None:
        """Queue the baseline as the next trial unless it was measured or is queued/running."""
        trials = study.get_trials(deepcopy=False)
        measured = (TrialState.COMPLETE, TrialState.WAITING, TrialState.RUNNING)
        # A baseline whose trial failed (crash, errors) is measured again: nothing is judged
        # without it (autotune.decide.outcome).
        if any(is_baseline(t) and t.state in measured and not t.user_attrs.get("failure") for t in trials):
            return
        known = self.inputs.baseline.searchable_values(self.inputs.effective_defaults)
        fixed = self.inputs.space.fixed_params(known)
        names = [n for n in self.inputs.space.params if n in fixed or f"{POW2_PREFIX}{n}" in fixed]
        study.enqueue_trial(fixed, user_attrs={"baseline": True, "fixed": names})

    def trial_dir(self, number: int) -> Path:
        """Where the search trial `number` writes its files."""
        return self.options.output_dir / "trials" / trial_label(number)

    def trial_config(self, params: dict[str, Any]) -> ServerConfig:
        """The baseline with `params` on top, in benchmark mode (exact output lengths)."""
        return trial_config(self.inputs.baseline, params)

    def run_one(self, study: optuna.Study) -> FrozenTrial:
        """Ask for a trial (a queued one first: the baseline, a retry), measure it, tell it."""
        with warnings.catch_warnings():
            # Optuna warns that heartbeats are meant for Study.optimize; we beat ourselves.
            warnings.filterwarnings("ignore", message="Heartbeat of storage")
            trial = study.ask()
        heartbeat = self.store.heartbeat(study, trial)
        if heartbeat is None:
            return self._run_asked(study, trial)
        with heartbeat:
            try:
                return self._run_asked(study, trial)
            except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
                frozen = study._storage.get_trial(trial._trial_id)
                if not frozen.state.is_finished():
                    raise
                # Declared dead (no heartbeat within the grace period) while still measuring,
                # and retried elsewhere: the retry's measurement is the one that counts.
                self.say(f"{trial_label(trial.number)}: was failed as stale by another worker "
                         f"and retried there; this measurement is discarded")
                return frozen

    def _run_asked(self, study: optuna.Study, trial: optuna.Trial) -> FrozenTrial:
        baseline = bool(trial.user_attrs.get("baseline"))
        label = trial_label(trial.number)
        trial_dir = self.trial_dir(trial.number)
        for key, value in self.trial_attrs.items():
            trial.set_user_attr(key, value)
        retry_of = study._storage.get_trial_system_attrs(trial._trial_id).get("failed_trial")
        if retry_of is not None:
            # A retry carries the lost trial's attributes; keep its identity, not its fate.
            for key in ("interrupted", "failure", "failure_detail"):
                if trial.user_attrs.get(key) is not None:
                    trial.set_user_attr(key, None)
            self.say(f"{label}: retrying {trial_label(int(retry_of))}, which its worker did not finish")
        if baseline:
            # Only the enqueued values are "suggested"; the rest stays vLLM's (or the file's).
            self.inputs.space.suggest(trial, only=set(trial.user_attrs.get("fixed", [])))
            params: dict[str, Any] = {}
        else:
            params = self.inputs.space.suggest(trial)
        config = self.trial_config(params)
        context = config.searchable_values(self.inputs.effective_defaults)
        trial.set_user_attr("engine_params", {k: context.get(k) for k in self.inputs.space.params})
        changes = numerics_changes(context, self.inputs.baseline.searchable_values(self.inputs.effective_defaults))
        if changes:  # marked wherever the trial is shown; the gate validates a config without them
            trial.set_user_attr("changes_numerics", changes)
        trial.set_user_attr("overrides", params)
        # vLLM's defaults are marked as such in the report; our server's settings are always set.
        set_here = {*explicit_engine(config), *SEARCHABLE_SERVING_SETTINGS}
        trial.set_user_attr("explicit", sorted(k for k in self.inputs.space.params if k in set_here))
        trial.set_user_attr("trial_dir", str(trial_dir))
        broken = [] if baseline else self.inputs.space.broken_relations(context)
        if broken:
            reason = "breaks " + "; ".join(broken)
            trial_dir.mkdir(parents=True, exist_ok=True)
            config.write(trial_dir / "config.yaml", header=f"not launched: {reason}")
            evaluation = invalid_config_evaluation(self.inputs.objective, self.inputs.slos, reason)
            trial.set_user_attr("broken_relations", broken)
            return self._tell(study, trial, evaluation, wall_s=0.0, server_s=0.0)
        started = self.clock()
        try:
            outcome = self.runner.run(
                config,
                self.inputs.tuning_window,
                trial_dir,
                should_prune=None if baseline else self._prune_callback(trial),
                **self.gate.ladder_start(study, self.inputs.tuning_window, None),
            )
        except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM / SIGHUP (autotune.measure.signals)
            closed = self._close_failed(study, trial, f"{stop_reason(stop)} during the trial; its server was stopped")
            if closed and self.on_interrupted is not None:
                self.on_interrupted(study, study._storage.get_trial(trial._trial_id))
                self.say(f"{label}: interrupted; queued again for another worker")
            else:
                self.say(f"{label}: interrupted; resume with --resume")
            raise
        except BaseException as error:
            # A bug or a user error mid-trial: close the trial rather than leave it RUNNING.
            self._close_failed(study, trial, f"tuner error: {type(error).__name__}: {error}")
            raise
        wall = self.clock() - started
        failure = outcome.failure
        if failure == "pruned":
            record_failure(trial, "pruned", outcome.failure_detail, wall_s=wall, server_s=server_seconds(outcome))
            trial.set_constraint("ran", 0.0)
            study.tell(trial, state=TrialState.PRUNED)
            return study.trials[trial.number]
        if failure is not None and failure not in CONFIG_FAILURES:
            record_failure(trial, failure, outcome.failure_detail, wall_s=wall, server_s=server_seconds(outcome))
            if failure == "interrupted":
                trial.set_user_attr("interrupted", outcome.failure_detail or "interrupted")
            study.tell(trial, state=TrialState.FAIL)
            return study.trials[trial.number]
        evaluation = evaluate(outcome, self.inputs.objective, self.inputs.slos,
                              memory=memory_of(config, self.inputs.effective_defaults),
                              devices=engine_devices(config.engine))
        return self._tell(study, trial, evaluation, wall_s=wall, server_s=server_seconds(outcome))

    @staticmethod
    def _close_failed(study: optuna.Study, trial: optuna.Trial, reason: str) -> bool:
        """FAIL a trial the tuner itself cut short; False if another worker closed it first."""
        try:
            trial.set_user_attr("interrupted", reason)
            study.tell(trial, state=TrialState.FAIL)
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
            return False
        return True

    def _prune_callback(self, trial: optuna.Trial) -> Callable[[float, Any], bool] | None:
        if self.inputs.objective.kind == "pareto" or self.inputs.objective.uses_ladder or not self.options.prune:
            return None
        reported: set[int] = set()

        def should_prune(elapsed_s: float, summary: Any) -> bool:
            step = int(elapsed_s)
            if step in reported:
                return False
            reported.add(step)
            goodput = summary.request_goodput
            value = summary.request_throughput if goodput is None or self.inputs.objective.kind == "throughput" else goodput
            try:
                trial.report(float(value), step)
            except optuna.exceptions.UpdateFinishedTrialError:
                return True  # another worker failed it as stale and retried it: stop measuring
            return trial.should_prune()

        return should_prune

    def _tell(
        self,
        study: optuna.Study,
        trial: optuna.Trial,
        evaluation: Evaluation,
        *,
        wall_s: float,
        server_s: float,
    ) -> FrozenTrial:
        record_evaluation(trial, evaluation, wall_s=wall_s, server_s=server_s)
        study.tell(trial, evaluation.values)
        return study.trials[trial.number]

    def _progress(
        self,
        study: optuna.Study,
        frozen: FrozenTrial,
        start: float,
        durations: list[float],
        device_costs: list[float] | None = None,
    ) -> str:
        """The trial line; `durations`: the walls of the trials a remaining trial or gate run is
        priced at (the hinted ones once there are any)."""
        trials = study.get_trials(deepcopy=False)
        done = sum(counts_toward_budget(t) for t in trials)
        elapsed = self.clock() - start
        best = self.gate.best_trials(study, 1, include_baseline=True)
        best_text = (
            f"{self.inputs.objective.format_score(best[0].user_attrs['score'])} ({trial_label(best[0].number)})"
            if best
            else "none feasible yet"
        )
        typical = sum(durations) / len(durations)
        remaining = None
        if self.options.n_trials is not None:
            remaining = max(0, self.options.n_trials - done) * typical
        if self.options.time_budget_s is not None:
            left = max(0.0, self.options.time_budget_s - elapsed)
            remaining = left if remaining is None else min(remaining, left)
        spent = sum(device_costs or [])
        if self.options.gpu_seconds is not None and spent > 0:
            per_trial = spent / len(device_costs or [1])
            fit = math.floor(max(0.0, self.options.gpu_seconds - spent) / per_trial)
            remaining = fit * typical if remaining is None else min(remaining, fit * typical)
        eta = None if remaining is None else remaining + self.gate.estimated_gate_s(typical)
        return progress_line(
            done=done,
            total=self.options.n_trials,
            elapsed_s=elapsed,
            best=best_text,
            eta_s=eta,
            this=f"{trial_label(frozen.number)}: {describe_trial(frozen, self.inputs.objective)}",
        )
