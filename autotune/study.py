"""The tuning study: Optuna drives the search, a TrialRunner measures, the gate validates.

Choices, and why:
- Sampler: TPE, multivariate (batch size, step budget and memory interact), `group=True`
  (the baseline is enqueued with only the parameters its values can be represented by, so
  trials do not all share one parameter set), seeded. TPE rather than NSGA-II also for the
  Pareto objective: NSGA-II needs a population of tens of trials before it learns anything,
  and a trial here costs a server start.
- A config that breaks a relation, or that a server cannot run (OOM, crash, start timeout,
  errors), is told as COMPLETE with objective 0 and a violated `ran` constraint rather than as
  FAIL: TPE ignores FAIL trials entirely (it would keep proposing the same region), while it
  ranks constraint-violating trials below every feasible one and samples away from them.
  Failures that say nothing about the config (a busy port, Ctrl-C, a killed tuner) are FAIL.
- SLOs are constraints (`Trial.set_constraint`, the Optuna 5 API), so a trial that misses
  one is known as infeasible and is never the "best".
- The baseline (vLLM's defaults, or `--baseline FILE`) is trial 0, labelled, never pruned.
- Several workers may share one study (`autotune worker`, `autotune.distributed`): with an
  RDB storage that has a heartbeat, each measured trial records heartbeats, a trial whose
  worker stopped beating is failed and retried by Optuna's retry callback, and a worker waits
  rather than over-shoot the trial count while others still measure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import socket
import sqlite3
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import AutotuneError
from autotune.first_moves import Move, first_moves, follow_up
from autotune.gate import (
    BASELINE,
    GateDecision,
    Measurement,
    decide,
    decide_min_memory,
    round_robin,
)
from autotune.kv_cache import KVCacheSize
from autotune.ladder import CapacityResult, recorded_rate
from autotune.objective import (
    CONFIG_FAILURES,
    MEMORY_KNOB,
    Evaluation,
    Objective,
    evaluate,
    invalid_config_evaluation,
)
from autotune.progress import format_duration, progress_line
from autotune.signals import stop_reason
from autotune.space import POW2_PREFIX, SearchSpace
from server.config import ServerConfig
from workloads.files import write_text_atomic
from workloads.slo import SLO
from workloads.trace import Trace

# Relation operands that are not usually search parameters but matter for the built-ins.
CONTEXT_KEYS = ("max_model_len", "enable_chunked_prefill", "max_num_seqs", "max_num_batched_tokens")


class Runner(Protocol):
    """What the study needs of `autotune.trial.TrialRunner` (tests pass a fake)."""

    def run(
        self,
        config: ServerConfig,
        window: Trace,
        trial_dir: Path,
        *,
        should_prune: Callable[[float, Any], bool] | None = None,
    ) -> Any: ...


@dataclasses.dataclass
class StudyOptions:
    study_name: str
    output_dir: Path
    # An Optuna RDB URL (default sqlite:///<output_dir>/study.db), or a storage object (the
    # search benchmark replays studies in Optuna's in-memory storage).
    storage: str | optuna.storages.BaseStorage | None = None
    resume: bool = False
    n_trials: int | None = 6  # total, the baseline included
    time_budget_s: float | None = None  # for the search; the gate comes after
    # Accelerator-seconds the search may spend holding engines (`--gpu-seconds`): each
    # trial's wall time x the devices its config's engine holds (`engine_devices`).
    gpu_seconds: float | None = None
    seed: int = 0
    top_k: int = 3
    repeats: int = 3
    prune: bool = True
    # `autotune run --resume`: runs an interrupted gate measured on this host are kept
    # (finalize --again and retune always measure the gate afresh).
    resume_gate: bool = False

    @property
    def storage_url(self) -> str:
        """The storage as text (messages, provenance)."""
        if self.storage is None:
            return f"sqlite:///{(self.output_dir / 'study.db').resolve()}"
        if isinstance(self.storage, str):
            return self.storage
        return f"{type(self.storage).__name__} (this process only)"

    @property
    def registry_path(self) -> Path:
        return self.output_dir / "servers.json"


@dataclasses.dataclass
class ValidationResult:
    measurements: list[Measurement]
    decision: GateDecision
    candidates: dict[str, ServerConfig]  # label -> config ("baseline" included)
    run_dirs: dict[str, list[Path]]  # label -> one folder per repeat
    wall_s: float
    server_s: float


def check_writable(directory: Path) -> None:
    """Fail before any trial when results could not be written."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise AutotuneError(
            f"{directory}: cannot write results there ({error.strerror or error}); "
            f"pass a writable --output-dir"
        ) from None


def check_sqlite_database(url: str) -> None:
    """Refuse a damaged SQLite study file in one line before anything reads or writes it.

    Unchecked, a damaged file fails at open with SQLAlchemy's several-line message, or (when the
    damage is in pages read later) mid-study with a traceback. Other storages are not checked.
    """
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        return
    path = Path(url[len(prefix) :].split("?", 1)[0])
    if not path.is_file():
        return
    try:
        uri = f"{path.resolve().as_uri()}?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=10)) as db:
            db.text_factory = bytes  # damaged text must not fail the check itself
            rows = db.execute("PRAGMA quick_check").fetchall()
            problems = [row[0].decode("utf-8", "replace") for row in rows]
            if problems == ["ok"]:
                problems = _damaged_json(db) or problems
    except sqlite3.OperationalError as error:
        if "locked" in str(error) or "busy" in str(error):
            return  # in use by another process, not damaged; opening it will tell
        problems = [str(error)]
    except (sqlite3.Error, ValueError) as error:
        problems = [str(error)]
    if problems != ["ok"]:
        raise AutotuneError(
            f"study database {path} is damaged ({' '.join(problems[0].split())}); move it aside "
            f"and start a new study (drop --resume), or pass another --output-dir / --storage"
        )


# Optuna's columns holding JSON: bytes overwritten inside them pass SQLite's page checks but
# fail Optuna mid-study (a decode error deep in SQLAlchemy), so they are checked up front.
_JSON_COLUMNS = (
    ("trial_user_attributes", "value_json"),
    ("trial_system_attributes", "value_json"),
    ("study_user_attributes", "value_json"),
    ("study_system_attributes", "value_json"),
    ("trial_params", "distribution_json"),
)


def _damaged_json(db: sqlite3.Connection) -> list[str]:
    """The first JSON value of the study's tables that does not decode, as a problem line."""
    tables = {row[0].decode() for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    for table, column in _JSON_COLUMNS:
        if table not in tables:
            continue
        for rowid, raw in db.execute(f"SELECT rowid, {column} FROM {table}"):  # noqa: S608 - fixed names
            if raw is None:
                continue
            try:
                json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
            except (UnicodeDecodeError, ValueError):
                return [f"{table}.{column} of row {rowid} is not valid JSON"]
    return []


def server_seconds(outcome: Any) -> float:
    """Seconds a server process existed for this trial (engine start to teardown)."""
    timing = getattr(outcome, "timing", None)
    if timing is None:
        return 0.0
    return float(timing.ready_s + timing.warmup_s + timing.measure_s + timing.teardown_s)


def engine_devices(engine: dict[str, Any]) -> int:
    """Accelerators one engine of this config holds: tensor x pipeline x data parallel size
    (1 unless the config sets them; on CPU, the engine's wall time is what is counted)."""
    devices = 1
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        devices *= max(1, int(engine.get(key) or 1))
    return devices


def trial_label(number: int) -> str:
    return f"trial-{number:04d}"


def is_baseline(trial: FrozenTrial) -> bool:
    return bool(trial.user_attrs.get("baseline"))


def lost_worker(trial: FrozenTrial) -> bool:
    """A trial failed from outside: its worker stopped heartbeating (killed, host lost).

    Every failure the tuner records itself sets `failure` or `interrupted` before telling;
    Optuna's stale-trial check sets only the state.
    """
    return (
        trial.state == TrialState.FAIL
        and not trial.user_attrs.get("failure")
        and not trial.user_attrs.get("interrupted")
    )


def counts_toward_budget(trial: FrozenTrial) -> bool:
    """Finished trials, minus those a Ctrl-C, a killed tuner or a lost worker cut short."""
    return (
        trial.state.is_finished()
        and not trial.user_attrs.get("interrupted")
        and not lost_worker(trial)
    )


def heartbeat_interval(storage: Any) -> int | None:
    """The storage's heartbeat interval in seconds; None when it records no heartbeats."""
    getter = getattr(storage, "get_heartbeat_interval", None)
    return getter() if getter is not None else None


class _Heartbeat:
    """Records a trial's heartbeat every interval while it is measured, so other workers can
    tell a dead worker's trial from a slow one (what `Study.optimize` does for its trials)."""

    def __init__(self, storage: Any, trial_id: int, interval_s: float) -> None:
        self.storage = storage
        self.trial_id = trial_id
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{trial_id}", daemon=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(Exception):  # a missed beat is retried next interval
                self.storage.record_heartbeat(self.trial_id)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join()


class TuningStudy:
    """Search, then validate. `run_search()` and `validate()` are the two phases."""

    def __init__(
        self,
        *,
        options: StudyOptions,
        space: SearchSpace,
        objective: Objective,
        slos: Sequence[SLO],
        baseline: ServerConfig,
        baseline_source: str,
        tuning_window: Trace,
        holdout_window: Trace,
        runner: Runner,
        comparisons: dict[str, ServerConfig] | None = None,
        effective_defaults: dict[str, Any] | None = None,
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
        self.space = space
        self.objective = objective
        self.slos = list(slos)
        # The baseline as the user runs it (serving settings included), and as measured:
        # exact token counts need the server's benchmark mode.
        self.baseline = baseline
        self.baseline_source = baseline_source
        self.tuning_window = tuning_window
        self.holdout_window = holdout_window
        self.runner = runner
        # Configs measured beside the baseline in validation (e.g. the user's hand-tuned one):
        # reported side by side, never eligible for export.
        self.comparisons = dict(comparisons or {})
        self.effective_defaults = dict(effective_defaults or {})
        self.study_attrs = dict(study_attrs or {})
        self.reap = reap
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

    # -- opening ---------------------------------------------------------------------------

    def settings_fingerprint(self) -> dict[str, Any]:
        """What must not change between a study and its --resume."""
        return {
            "objective": self.objective.spec(),
            "slos": [slo.spec() for slo in self.slos],
            "space": self.space.fingerprint(),
        }

    def open(self) -> optuna.Study:
        """Create the study, or load it with --resume; end servers and close trials a killed
        tuner left behind."""
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        options = self.options
        url = options.storage_url
        check_sqlite_database(url)
        try:
            # get_storage passes a storage object through and opens a URL.
            storage = optuna.storages.get_storage(url if isinstance(options.storage, str | None) else options.storage)
            existing = set(optuna.get_all_study_names(storage))
        except Exception as error:  # noqa: BLE001 - any backend error is a bad --storage for the user
            # SQLAlchemy appends the SQL and a link on further lines: the first one says why.
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise AutotuneError(f"--storage {url!r}: cannot open it: {reason}") from None
        exists = options.study_name in existing
        if exists and not options.resume:
            raise AutotuneError(
                f"study {options.study_name!r} already exists in {url}; pass --resume to continue "
                f"it or --study-name NEW for a fresh study"
            )
        if options.resume and not exists:
            raise AutotuneError(
                f"--resume: no study {options.study_name!r} in {url} (it has: "
                f"{', '.join(sorted(existing)) or 'none'}); drop --resume to start it"
            )
        if options.resume and self.reap is not None:
            ended = self.reap(options.registry_path)
            if ended:
                self.say(f"ended {len(ended)} server process(es) a previous run left behind: {ended}")
        previous = 0
        if exists:
            previous = len(optuna.load_study(study_name=options.study_name, storage=storage).trials)
        # On resume a fresh sampler seeded alike would re-propose the first run's random
        # points; offsetting by the trials so far keeps runs reproducible and distinct.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.TPESampler(
                seed=options.seed + previous,
                multivariate=True,
                group=True,
                n_startup_trials=self._startup_trials(),
            )
        pruner = self._pruner()
        if exists:
            study = optuna.load_study(
                study_name=options.study_name, storage=storage, sampler=sampler, pruner=pruner
            )
            self._check_same_settings(study)
            self._close_stale(study)
        else:
            study = optuna.create_study(
                study_name=options.study_name,
                storage=storage,
                sampler=sampler,
                pruner=pruner,
                directions=self.objective.directions,
            )
            study.set_user_attr("settings", self.settings_fingerprint())
            study.set_user_attr("baseline_source", self.baseline_source)
            study.set_user_attr("effective_defaults", self.effective_defaults)
            for key, value in self.study_attrs.items():
                study.set_user_attr(key, value)
        self.study = study
        return study

    def attach(self, storage: optuna.storages.BaseStorage, *, seed: int | None = None) -> optuna.Study:
        """Join a study another process created (a worker, or finalize): load it, never
        create it, never close trials that other workers are running (heartbeats do that).

        `seed` should differ per worker: two workers seeded alike would propose the same
        configs. TPE's constant liar keeps a worker away from configs others are measuring.
        """
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.TPESampler(
                seed=self.options.seed if seed is None else seed,
                multivariate=True,
                group=True,
                constant_liar=True,
                n_startup_trials=self._startup_trials(),
            )
        try:
            study = optuna.load_study(
                study_name=self.options.study_name, storage=storage, sampler=sampler, pruner=self._pruner()
            )
        except KeyError:
            raise AutotuneError(
                f"no study {self.options.study_name!r} in {self.options.storage_url}; create it with "
                f"`autotune run --workers-only --storage URL --study-name NAME ...`"
            ) from None
        self.study = study
        self.shared = True
        return study

    def _startup_trials(self) -> int:
        # Optuna's default of 10 random trials would make a 6-trial study pure random search.
        n = self.options.n_trials
        return 10 if n is None else max(3, min(10, n // 3))

    def _pruner(self) -> optuna.pruners.BasePruner:
        if not self.options.prune or self.objective.kind == "pareto" or self.objective.uses_ladder:
            # Optuna cannot prune multi-objective trials; a ladder abandons its own failing
            # steps and has no goodput-so-far to compare.
            return optuna.pruners.NopPruner()
        # Compare goodput-so-far only past 40% of the window: early seconds say little.
        warmup = int(0.4 * self.tuning_window.duration_s())
        return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=warmup)

    def _check_same_settings(self, study: optuna.Study) -> None:
        stored = study.user_attrs.get("settings")
        current = self.settings_fingerprint()
        if stored is None:
            return
        for key in ("objective", "slos", "space"):
            if stored.get(key) != current[key]:
                raise AutotuneError(
                    f"--resume: study {study.study_name!r} was created with {key} "
                    f"{json.dumps(stored.get(key))}, this run asks for {json.dumps(current[key])}; "
                    f"use the same options or a new --study-name"
                )

    def _close_stale(self, study: optuna.Study) -> None:
        """RUNNING trials in a study nobody is running belong to a killed tuner: FAIL them."""
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            study._storage.set_trial_user_attr(
                trial._trial_id, "interrupted", "the tuner stopped during this trial"
            )
            study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
            self.say(f"{trial_label(trial.number)}: was running when the tuner stopped; marked failed")

    # -- the search ------------------------------------------------------------------------

    def run_search(self) -> optuna.Study:
        study = self.study or self.open()
        options = self.options
        start = self.clock()
        if not self.shared:
            # A shared study was created with its baseline queued; a lost baseline is retried.
            self._enqueue_baseline(study)
        durations: list[float] = []
        device_costs: list[float] = []  # accelerator-seconds of each trial this run measured
        waiting_on: int | None = None
        while True:
            self.fail_stale(study)
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
                    self.sleep(self.poll_s(study))
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
            trial_start = self.clock()
            frozen = self.run_one(study)
            durations.append(self.clock() - trial_start)
            device_costs.append(self.device_seconds(frozen))
            self.say(self._progress(study, frozen, start, durations, device_costs))
        self.search_wall_s = self.clock() - start
        return study

    def device_seconds(self, trial: FrozenTrial) -> float:
        """Accelerator-seconds a trial held: its wall time (0 when never launched) x the
        devices its config's engine holds."""
        config = self.trial_config(trial.user_attrs.get("overrides") or {})
        return float(trial.user_attrs.get("wall_s") or 0.0) * engine_devices(config.engine)

    @staticmethod
    def poll_s(study: optuna.Study) -> float:
        return float(heartbeat_interval(study._storage) or 5)

    def fail_stale(self, study: optuna.Study) -> None:
        """Fail trials whose worker stopped heartbeating; the storage's callback retries them."""
        if heartbeat_interval(study._storage) is None:
            return
        before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        for trial in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
            if trial.number in before and lost_worker(trial):
                where = trial.user_attrs.get("worker") or trial.user_attrs.get("host") or "its worker"
                self.say(f"{trial_label(trial.number)}: {where} stopped heartbeating; failed it, "
                         f"queued a retry")

    def queue_first_moves(self, study: optuna.Study) -> None:
        """Once the baseline's capacity is known, plan the one-knob moves its measurement
        points to (autotune.first_moves), once per study. One move is queued at a time, so
        that a move that paid off is followed a step further before the next idea."""
        if not self.objective.measures_capacity:
            return
        if "first_moves" not in study.user_attrs:
            baseline = self.baseline_trial(study)
            if baseline is None or baseline.state != TrialState.COMPLETE:
                return
            capacity = None
            trial_dir = baseline.user_attrs.get("trial_dir")
            ladder_file = Path(trial_dir) / "ladder.json" if trial_dir else None
            if ladder_file is not None and ladder_file.is_file():
                capacity = CapacityResult.model_validate_json(ladder_file.read_text(encoding="utf-8"))
            values = baseline.user_attrs.get("engine_params") or {}
            moves = first_moves(capacity, self.slos, self.space, values)
            study.set_user_attr("first_moves", [move.name for move in moves])
            study.set_user_attr("pending_moves", [move.model_dump(mode="json") for move in moves])
            if moves:
                self.say("first moves from the baseline's measurement: " + "; ".join(
                    f"{move.name} ({move.why})" for move in moves))
        pending = [Move.model_validate(m) for m in study.user_attrs.get("pending_moves", [])]
        pending = self._follow_moves(study) + pending
        busy = study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING))
        if pending and not busy:
            self._queue_move(study, pending.pop(0))
        study.set_user_attr("pending_moves", [m.model_dump(mode="json") for m in pending])

    def _queue_move(self, study: optuna.Study, move: Move) -> None:
        study.enqueue_trial(
            self.space.fixed_params(move.values),
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
        baseline = self.baseline_trial(study)
        base = (baseline.user_attrs.get("engine_params") or {}) if baseline else {}
        mine = trial.user_attrs.get("engine_params") or {}
        changed = [k for k in self.space.params if k in mine and mine.get(k) != base.get(k)]
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
            score = float(trial.user_attrs.get("capacity_rps") or 0.0) if self.feasible(trial) else 0.0
            move = self._as_move(study, trial)
            if move is not None and trial.number not in followed and trial.state.is_finished():
                nxt = follow_up(move, self.space) if score > best_before * 1.02 else None
                if nxt is not None:
                    found.append(nxt)
                    self.say(f"{trial_label(trial.number)} ({move.name}) paid off: next {nxt.name}")
                followed.add(trial.number)
            best_before = max(best_before, score)
        study.set_user_attr("followed_moves", sorted(followed))
        return found

    def enqueue_baseline(self, study: optuna.Study) -> None:
        """Queue the baseline as the next trial unless it was measured or is queued/running."""
        self._enqueue_baseline(study)

    def _enqueue_baseline(self, study: optuna.Study) -> None:
        trials = study.get_trials(deepcopy=False)
        measured = (TrialState.COMPLETE, TrialState.WAITING, TrialState.RUNNING)
        # A baseline whose trial failed (crash, errors) is measured again: nothing is judged
        # without it (autotune.outcome).
        if any(is_baseline(t) and t.state in measured and not t.user_attrs.get("failure") for t in trials):
            return
        known = {**self.effective_defaults, **self._explicit(self.baseline)}
        fixed = self.space.fixed_params(known)
        names = [n for n in self.space.params if n in fixed or f"{POW2_PREFIX}{n}" in fixed]
        study.enqueue_trial(fixed, user_attrs={"baseline": True, "fixed": names})

    @staticmethod
    def _explicit(config: ServerConfig) -> dict[str, Any]:
        return {k: v for k, v in config.engine.items() if v is not None}

    def trial_dir(self, number: int) -> Path:
        """Where the search trial `number` writes its files."""
        return self.options.output_dir / "trials" / trial_label(number)

    def trial_config(self, params: dict[str, Any]) -> ServerConfig:
        """The baseline with `params` on top, in benchmark mode (exact output lengths)."""
        engine = {**self.baseline.engine, **params}
        serving = self.baseline.serving.model_copy(update={"benchmark_mode": True})
        return self.baseline.model_copy(update={"engine": engine, "serving": serving, "provenance": None})

    def run_one(self, study: optuna.Study) -> FrozenTrial:
        """Ask for a trial (a queued one first: the baseline, a retry), measure it, tell it."""
        with warnings.catch_warnings():
            # Optuna warns that heartbeats are meant for Study.optimize; we beat ourselves.
            warnings.filterwarnings("ignore", message="Heartbeat of storage")
            trial = study.ask()
        interval = heartbeat_interval(study._storage)
        if interval is None:
            return self._run_asked(study, trial)
        study._storage.record_heartbeat(trial._trial_id)
        with _Heartbeat(study._storage, trial._trial_id, interval).running():
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
            self.space.suggest(trial, only=set(trial.user_attrs.get("fixed", [])))
            params: dict[str, Any] = {}
        else:
            params = self.space.suggest(trial)
        config = self.trial_config(params)
        context = {**self.effective_defaults, **self._explicit(config)}
        trial.set_user_attr("engine_params", {k: context.get(k) for k in self.space.params})
        trial.set_user_attr("overrides", params)
        trial.set_user_attr("explicit", sorted(k for k in self._explicit(config) if k in self.space.params))
        trial.set_user_attr("trial_dir", str(trial_dir))
        broken = [] if baseline else self.space.broken_relations(context)
        if broken:
            reason = "breaks " + "; ".join(broken)
            trial_dir.mkdir(parents=True, exist_ok=True)
            config.write(trial_dir / "config.yaml", header=f"not launched: {reason}")
            evaluation = invalid_config_evaluation(self.objective, self.slos, reason)
            trial.set_user_attr("broken_relations", broken)
            return self._tell(study, trial, evaluation, wall_s=0.0, server_s=0.0)
        started = self.clock()
        try:
            outcome = self.runner.run(
                config,
                self.tuning_window,
                trial_dir,
                should_prune=None if baseline else self._prune_callback(trial),
                **self._ladder_start(study, self.tuning_window, None),
            )
        except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM / SIGHUP (autotune.signals)
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
            trial.set_user_attr("failure", "pruned")
            trial.set_user_attr("failure_detail", outcome.failure_detail)
            trial.set_user_attr("wall_s", wall)
            trial.set_user_attr("server_s", server_seconds(outcome))
            trial.set_constraint("ran", 0.0)
            study.tell(trial, state=TrialState.PRUNED)
            return study.trials[trial.number]
        if failure is not None and failure not in CONFIG_FAILURES:
            trial.set_user_attr("failure", failure)
            trial.set_user_attr("failure_detail", outcome.failure_detail)
            trial.set_user_attr("wall_s", wall)
            trial.set_user_attr("server_s", server_seconds(outcome))
            if failure == "interrupted":
                trial.set_user_attr("interrupted", outcome.failure_detail or "interrupted")
            study.tell(trial, state=TrialState.FAIL)
            return study.trials[trial.number]
        evaluation = evaluate(outcome, self.objective, self.slos, memory=self.memory_of(config))
        return self._tell(study, trial, evaluation, wall_s=wall, server_s=server_seconds(outcome))

    def _ladder_start(self, study: optuna.Study, window: Trace, rps: float | None) -> dict[str, Any]:
        """Where a capacity ladder starts: at `rps` (this config's capacity measured before),
        else at the best capacity of the study so far, as a speed-up of `window`; nothing
        for the other objectives (their runners take no such keyword, or, min-memory, their
        single step is always at the headroom)."""
        if not self.objective.measures_capacity:
            return {}
        if rps is None:
            best = self.best_trials(study, 1, include_baseline=True)
            rps = best[0].user_attrs.get("capacity_rps") if best else None
        recorded = recorded_rate(window)
        if not rps or recorded <= 0:
            return {"start_speedup": None}
        return {"start_speedup": float(rps) / recorded}

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
        if self.objective.kind == "pareto" or self.objective.uses_ladder or not self.options.prune:
            return None
        reported: set[int] = set()

        def should_prune(elapsed_s: float, summary: Any) -> bool:
            step = int(elapsed_s)
            if step in reported:
                return False
            reported.add(step)
            goodput = summary.request_goodput
            value = summary.request_throughput if goodput is None or self.objective.kind == "throughput" else goodput
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
        for name, value in evaluation.constraints.items():
            trial.set_constraint(name, value)
        trial.set_user_attr("score", evaluation.score)
        if evaluation.capacity_rps is not None:
            trial.set_user_attr("capacity_rps", evaluation.capacity_rps)
            trial.set_user_attr("headroom", evaluation.headroom)
        if evaluation.memory is not None:
            trial.set_user_attr("memory", evaluation.memory)
            trial.set_user_attr("kv_cache_gib", evaluation.kv_cache_gib)
            trial.set_user_attr("kv_cache_tokens", evaluation.kv_cache_tokens)
        trial.set_user_attr("slo_met", evaluation.slo_met)
        trial.set_user_attr("measured_ms", evaluation.measured_ms)
        trial.set_user_attr("margins_ms", evaluation.margins_ms)
        trial.set_user_attr("failure", evaluation.failure)
        trial.set_user_attr("failure_detail", evaluation.failure_detail)
        trial.set_user_attr("wall_s", wall_s)
        trial.set_user_attr("server_s", server_s)
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
        trials = study.get_trials(deepcopy=False)
        done = sum(counts_toward_budget(t) for t in trials)
        elapsed = self.clock() - start
        best = self.best_trials(study, 1, include_baseline=True)
        best_text = (
            f"{self.objective.format_score(best[0].user_attrs['score'])} ({trial_label(best[0].number)})"
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
        eta = None if remaining is None else remaining + self.estimated_gate_s(typical)
        return progress_line(
            done=done,
            total=self.options.n_trials,
            elapsed_s=elapsed,
            best=best_text,
            eta_s=eta,
            this=f"{trial_label(frozen.number)}: {describe_trial(frozen, self.objective)}",
        )

    def estimated_gate_s(self, typical_trial_s: float) -> float:
        runs = (self.options.top_k + 1) * self.options.repeats
        per_run = typical_trial_s - self.tuning_window.duration_s() + self.holdout_window.duration_s()
        return runs * max(per_run, 0.0)

    # -- results ---------------------------------------------------------------------------

    @staticmethod
    def feasible(trial: FrozenTrial) -> bool:
        return trial.state == TrialState.COMPLETE and all(v <= 0 for v in trial.constraints.values())

    def best_trials(
        self, study: optuna.Study, k: int, *, include_baseline: bool = False
    ) -> list[FrozenTrial]:
        """The top `k` feasible trials by objective score, one per distinct config."""
        candidates = [
            t
            for t in study.get_trials(deepcopy=False)
            if self.feasible(t) and (include_baseline or not is_baseline(t))
        ]
        if self.objective.kind == "pareto":
            # Only Pareto-optimal configs go to the gate; ranked there by throughput.
            front = {t.number for t in study.best_trials}
            candidates = [t for t in candidates if t.number in front]
        candidates.sort(key=lambda t: (self.objective.rank_key(t.user_attrs.get("score", 0.0)), t.number))
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

    def memory_of(self, config: ServerConfig) -> float | None:
        """The gpu_memory_utilization `config` runs with (vLLM's default when it sets none)."""
        value = {**self.effective_defaults, **self._explicit(config)}.get(MEMORY_KNOB)
        return None if value is None else float(value)

    def decide(self, measurements: Sequence[Measurement]) -> GateDecision:
        """The gate's rule for this study's objective (autotune.gate)."""
        if self.objective.kind == "min-memory":
            return decide_min_memory(measurements, headroom=float(self.objective.headroom or 1.0))
        return decide(measurements, seed=self.options.seed)

    def baseline_trial(self, study: optuna.Study) -> FrozenTrial | None:
        done = [t for t in study.get_trials(deepcopy=False) if is_baseline(t) and t.state.is_finished()]
        return done[-1] if done else None

    # -- the gate --------------------------------------------------------------------------

    @staticmethod
    def _gate_done(record: Path, order: list[tuple[int, str]], host: str) -> list[Measurement]:
        """The runs a gate cut short (killed tuner, machine taken back) already measured, in
        this gate's order and on this host; --resume goes on after them. Runs measured on
        another machine are not mixed in: the comparison must be on one machine."""
        if not record.is_file():
            return []
        try:
            stored = [Measurement.model_validate(m) for m in json.loads(record.read_text(encoding="utf-8"))]
        except (ValueError, TypeError):
            return []
        done: list[Measurement] = []
        for measurement, (repeat, name) in zip(stored, order, strict=False):
            if (measurement.candidate, measurement.repeat) != (name, repeat) or measurement.host != host:
                break
            done.append(measurement)
        return done

    def validate(self, study: optuna.Study | None = None) -> ValidationResult:
        """Re-run the top K and the baseline on the held-out window, R times, interleaved."""
        study = study or self.study
        assert study is not None
        options = self.options
        top = self.best_trials(study, options.top_k)
        candidates: dict[str, ServerConfig] = {BASELINE: self.trial_config({})}
        for trial in top:
            candidates[trial_label(trial.number)] = self.trial_config(trial.user_attrs.get("overrides", {}))
        candidates.update(self.comparisons)
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
        server_s = 0.0
        if not top:
            self.say("gate: no feasible candidate from the search; keeping the baseline")
            decision = self.decide([_baseline_placeholder(study, self)]).model_copy(
                update={"reason": "no searched config ran and met every SLO, so none was validated"}
            )
            return ValidationResult([], decision, candidates, run_dirs, 0.0, 0.0)
        order = round_robin(list(candidates), options.repeats)
        record = options.output_dir / "validation" / "measurements.json"
        host = socket.gethostname()
        done = self._gate_done(record, order, host) if options.resume_gate else []
        if done:
            self.say(f"gate: reusing {len(done)} of {len(order)} runs an interrupted gate measured "
                     f"on this host ({record})")
        measurements.extend(done)
        for index, (repeat, name) in enumerate(order, start=1):
            run_dir = options.output_dir / "validation" / name / f"repeat-{repeat + 1}"
            run_dirs[name].append(run_dir)
            if index <= len(done):
                continue
            hint = known_rps.get(name, known_rps[BASELINE])
            outcome = self.runner.run(
                candidates[name],
                self.holdout_window,
                run_dir,
                **self._ladder_start(study, self.holdout_window, hint),
            )
            server_s += server_seconds(outcome)
            evaluation = evaluate(outcome, self.objective, self.slos,
                                  memory=self.memory_of(candidates[name]))
            measurements.append(
                Measurement(
                    candidate=name,
                    repeat=repeat,
                    value=evaluation.score,
                    slo_met=evaluation.slo_met,
                    ok=evaluation.ok,
                    failure=evaluation.failure,
                    margins_ms=evaluation.margins_ms,
                    host=host,
                    kv_cache_gib=evaluation.kv_cache_gib,
                    kv_cache_tokens=evaluation.kv_cache_tokens,
                )
            )
            write_text_atomic(
                record, json.dumps([m.model_dump() for m in measurements], indent=2) + "\n"
            )
            status = "SLOs met" if evaluation.slo_met else _slo_text(evaluation)
            if evaluation.headroom is not None:
                status = f"{evaluation.headroom:.2f}x the recorded rate" + (
                    "" if evaluation.ok else f"; failed ({evaluation.failure}: {evaluation.failure_detail})"
                )
            if self.objective.kind == "min-memory":
                status = memory_status(evaluation, self.objective)
            self.say(
                f"gate {index}/{len(order)}  repeat {repeat + 1}  {name}: "
                f"{self.objective.format_score(evaluation.score)}, {status}"
            )
        searched = [m for m in measurements if m.candidate not in self.comparisons]
        decision = self.decide(searched)
        return ValidationResult(
            measurements, decision, candidates, run_dirs, self.clock() - start, server_s
        )


def _baseline_placeholder(study: optuna.Study, tuning: TuningStudy) -> Measurement:
    trial = tuning.baseline_trial(study)
    score = float(trial.user_attrs.get("score", 0.0)) if trial is not None else 0.0
    met = bool(trial.user_attrs.get("slo_met", False)) if trial is not None else False
    return Measurement(candidate=BASELINE, repeat=0, value=score, slo_met=met)


def memory_status(evaluation: Evaluation, objective: Objective) -> str:
    """A min-memory run's line: SLOs at H, and the KV cache."""
    at = f"at {objective.headroom:g}x the recorded rate"
    text = f"SLOs met {at}" if evaluation.slo_met else f"{_slo_text(evaluation)} {at}"
    kv = KVCacheSize(gib=evaluation.kv_cache_gib, tokens=evaluation.kv_cache_tokens)
    if kv.gib is not None or kv.tokens is not None:
        text += f", KV cache {kv.describe()}"
    return text


def _slo_text(evaluation: Evaluation) -> str:
    if not evaluation.ok:
        return f"failed ({evaluation.failure}: {evaluation.failure_detail})"
    missed = [spec for spec, margin in evaluation.margins_ms.items() if margin is None or margin > 0]
    return "missed " + ", ".join(missed) if missed else "SLOs met"


def describe_trial(trial: FrozenTrial, objective: Objective) -> str:
    """One line: the overrides, the score, SLO status or the failure."""
    overrides = trial.user_attrs.get("overrides") or {}
    params = ", ".join(f"{k}={_fmt(v)}" for k, v in overrides.items()) or "baseline (no overrides)"
    if trial.state == TrialState.PRUNED:
        return f"pruned ({params})"
    if trial.state == TrialState.FAIL:
        return f"failed: {trial.user_attrs.get('failure_detail') or trial.user_attrs.get('interrupted')} ({params})"
    failure = trial.user_attrs.get("failure")
    if failure:
        return f"{failure}: {trial.user_attrs.get('failure_detail')} ({params})"
    score = trial.user_attrs.get("score", 0.0)
    status = "SLOs met" if trial.user_attrs.get("slo_met") else "SLO missed"
    if objective.kind == "min-memory":
        status = ("SLOs met" if trial.user_attrs.get("slo_met") else "SLO missed") + f" at {objective.headroom:g}x the recorded rate"
        kv = KVCacheSize(gib=trial.user_attrs.get("kv_cache_gib"), tokens=trial.user_attrs.get("kv_cache_tokens"))
        if kv.gib is not None or kv.tokens is not None:
            status += f", KV cache {kv.describe()}"
    elif trial.user_attrs.get("headroom") is not None:
        status = f"{trial.user_attrs['headroom']:.2f}x the recorded rate"
    if trial.user_attrs.get("move"):
        params = f"first move {trial.user_attrs['move']}: {params}"
    return f"{objective.format_score(score)}, {status} ({params})"


def _fmt(value: Any) -> str:
    if isinstance(value, float) and not math.isnan(value):
        return f"{value:.3g}"
    return str(value)

