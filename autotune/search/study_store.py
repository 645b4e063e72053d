"""The study's Optuna storage: opened or created once per run (`open`), joined by workers and
finalize (`attach`), checked before use and repaired after a killed tuner.

Choices, and why:
- Sampler: TPE, multivariate (batch size, step budget and memory interact), `group=True`
  (the baseline is enqueued with only the parameters its values can be represented by, so
  trials do not all share one parameter set), seeded. TPE rather than NSGA-II also for the
  Pareto objective: NSGA-II needs a population of tens of trials before it learns anything,
  and a trial here costs a server start.
- Several workers may share one study (`autotune worker`, `autotune.distributed`): with an
  RDB storage that has a heartbeat, each measured trial records heartbeats, and a trial whose
  worker stopped beating is failed and retried by Optuna's retry callback.

Over 400 lines in one module because opening, checking and repairing a study all work on the
one storage URL before Optuna may touch it: the SQLite damage checks (one line naming the
database and what is wrong) sit beside the open that runs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import sqlite3
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from autotune.errors import AutotuneError
from autotune.search.objective import Objective
from autotune.search.sampler import FreshConfigSampler
from autotune.search.space import SearchSpace
from autotune.search.trial_records import lost_worker, trial_label
from server.config import ServerConfig
from workloads.slo import SLO
from workloads.trace import Trace


@dataclasses.dataclass(kw_only=True)
class StudyOptions:
    study_name: str
    output_dir: Path
    # An Optuna RDB URL (default sqlite:///<output_dir>/study.db), or a storage object (the
    # search benchmark replays studies in Optuna's in-memory storage).
    storage: str | optuna.storages.BaseStorage | None = None
    resume: bool = False
    # The study's size and gate, always given (autotune.request holds the command's defaults).
    n_trials: int | None  # total, the baseline included
    time_budget_s: float | None = None  # for the search; the gate comes after
    # Accelerator-seconds the search may spend holding engines (`--gpu-seconds`): each
    # trial's wall time x the devices its config's engine holds (`engine_devices`).
    gpu_seconds: float | None = None
    seed: int = 0
    top_k: int
    repeats: int
    prune: bool = True
    # `autotune run --resume`: the runs an interrupted gate measured are kept (whole rounds only
    # from another machine: autotune.search.gate_runner)
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


@dataclasses.dataclass(frozen=True)
class SearchInputs:
    """What a study searches and judges, shared by the search (`TuningStudy`), its storage
    (`StudyStore`) and the gate (`GateRunner`). Each field is the `TuningPlan` field of that
    name (`autotune.pipeline.search_inputs`)."""

    space: SearchSpace
    objective: Objective
    slos: list[SLO]
    # The baseline as the user runs it (serving settings included), and where it came from.
    baseline: ServerConfig
    baseline_source: str
    tuning_window: Trace
    holdout_window: Trace
    # Configs measured beside the baseline in validation (e.g. the user's hand-tuned one):
    # reported side by side, never eligible for export.
    comparisons: dict[str, ServerConfig] = dataclasses.field(default_factory=dict)
    effective_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)  # vLLM's, resolved
    # What the user chose (`autotune.prepare.user_choices`): --resume refuses a change of any.
    choices: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "slos", list(self.slos))
        object.__setattr__(self, "comparisons", dict(self.comparisons))
        object.__setattr__(self, "effective_defaults", dict(self.effective_defaults))
        object.__setattr__(self, "choices", dict(self.choices))


# The study's user attributes that hold what it was created from: the user's choices, and what
# was derived from them on the machine that created it (a resumed study keeps the latter).
CHOICES_ATTR = "choices"
RESOLVED_ATTR = "resolved"
# How the refusal names each choice (`changed_choices`).
_CHOICE_NAMES = {
    "trace": "trace",
    "model": "model",
    "baseline": "baseline",
    "model_flags": "--load-format/--max-model-len",
    "compare": "--compare files",
    "slos": "SLOs",
    "objective": "objective",
    "space": "--space file",
    "allow": "--allow",
}


def changed_choices(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One phrase per choice that differs between a study's stored choices and this run's,
    in `_CHOICE_NAMES` order: `trace (fingerprint 1a2b3c4d5e6f, now 0f9e8d7c6b5a)`."""
    changes = []
    for key, name in _CHOICE_NAMES.items():
        if key not in stored:  # a study created before this choice was stored
            continue
        old, new = stored.get(key), current.get(key)
        if old == new:
            continue
        if key == "trace":
            detail = f"fingerprint {str(old)[:12]}, now {str(new)[:12]}"
        elif isinstance(old, dict) and isinstance(new, dict):
            keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            detail = "; ".join(f"{k}: {_shown(old.get(k))}, now {_shown(new.get(k))}" for k in keys)
        else:
            detail = f"{_shown(old)}, now {_shown(new)}"
        changes.append(f"{name} ({detail})")
    return changes


def _shown(value: Any) -> str:
    """A stored choice as the refusal shows it: JSON, `none` for an absent one."""
    return "none" if value is None else json.dumps(value, sort_keys=True)


def refuse_changed_choices(
    study_name: str, url: str, stored: dict[str, Any], current: dict[str, Any]
) -> None:
    """AutotuneError, one line naming every choice that changed, unless none did."""
    changes = changed_choices(stored, current)
    if changes:
        raise AutotuneError(
            f"--resume: study {study_name!r} in {url} was created with other inputs: "
            f"{'; '.join(changes)}; resume with the inputs it was created with, or pass a new "
            f"--study-name for these"
        )


def stored_attrs(url: str, study_name: str) -> dict[str, Any] | None:
    """The user attributes of study `study_name` in the RDB storage `url`, or None when there
    is no such study (or the storage cannot be read: `StudyStore.open` then says why)."""
    check_sqlite_database(url)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        storage = optuna.storages.get_storage(url)
        study_id = storage.get_study_id_from_name(study_name)
        return dict(storage.get_study_user_attrs(study_id))
    except Exception:  # noqa: BLE001 - no study, or a storage StudyStore.open reports in one line
        return None


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
            # integrity_check, not quick_check: it also compares each index with its table. One
            # byte overwritten in an index's copy of an attribute key passed quick_check and the
            # text check below (the table's copy was intact), and Optuna's load, which reads the
            # key through the index, raised a traceback (hypothesis found it).
            rows = db.execute("PRAGMA integrity_check").fetchall()
            problems = [row[0].decode("utf-8", "replace") for row in rows]
            if problems == ["ok"]:
                problems = _undecodable_text(db) or _damaged_json(db) or _damaged_datetimes(db) or problems
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


def _columns(db: sqlite3.Connection) -> list[tuple[str, str, str]]:
    """Every (table, column, declared type in capitals) of the database's own tables."""
    tables = [row[0].decode() for row in db.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
    return [(table, row[1].decode(), row[2].decode().upper())
            for table in tables for row in db.execute(f"PRAGMA table_info(\"{table}\")")]


def _first_line(error: BaseException) -> str:
    """An error's first line (SQLAlchemy appends the SQL and a link on further lines)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _undecodable_text(db: sqlite3.Connection) -> list[str]:
    """The first text value of any table that is not UTF-8, as a problem line: a byte
    overwritten inside an attribute's key passes SQLite's page checks, and Optuna's load then
    failed with SQLAlchemy's "Could not decode to UTF-8" (a traceback, found by hypothesis)."""
    for table, column, _ in _columns(db):
        query = f'SELECT rowid, "{column}" FROM "{table}" WHERE typeof("{column}") = \'text\''  # noqa: S608 - names from the schema
        for rowid, raw in db.execute(query):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return [f"{table}.{column} of row {rowid} is not UTF-8 text"]
    return []


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


def _damaged_datetimes(db: sqlite3.Connection) -> list[str]:
    """The first value of a DATETIME column that is not a date and time, as a problem line: one
    byte overwritten in a trial's start time passed the checks above, and Optuna's load failed in
    SQLAlchemy with "Invalid isoformat string" (a traceback, found by hypothesis)."""
    for table, column, declared in _columns(db):
        if declared != "DATETIME":
            continue
        query = f'SELECT rowid, "{column}" FROM "{table}" WHERE "{column}" IS NOT NULL'  # noqa: S608 - names from the schema
        for rowid, raw in db.execute(query):
            try:
                dt.datetime.fromisoformat(raw.decode("utf-8") if isinstance(raw, bytes) else str(raw))
            except (UnicodeDecodeError, ValueError):
                return [f"{table}.{column} of row {rowid} is not a date and time"]
    return []


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


@dataclasses.dataclass(eq=False, repr=False)
class StudyStore:
    """Opens, creates or joins the Optuna study of one set of options, with the sampler and
    pruner the search runs under, and closes the trials nobody is running any more."""

    options: StudyOptions
    inputs: SearchInputs
    _: dataclasses.KW_ONLY
    study_attrs: dict[str, Any]
    reap: Callable[[Path], list[int]] | None
    say: Callable[[str], None]

    def settings_fingerprint(self) -> dict[str, Any]:
        """What a study stores of its settings, and before `choices` were stored, what must
        not change between a study and its --resume (the space was compared too)."""
        return {
            "objective": self.inputs.objective.spec(),
            "slos": [slo.spec() for slo in self.inputs.slos],
            "space": self.inputs.space.fingerprint(),
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
            reason = _first_line(error)
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
            try:
                previous = len(optuna.load_study(study_name=options.study_name, storage=storage).trials)
            except Exception as error:  # noqa: BLE001 - damage the checks above did not name
                reason = _first_line(error)
                raise AutotuneError(
                    f"study {options.study_name!r} in {url} cannot be read ({reason}); if the file "
                    f"is damaged, move it aside and start a new study (drop --resume), or pass "
                    f"another --output-dir / --storage"
                ) from None
        # On resume a fresh sampler seeded alike would re-propose the first run's random
        # points; offsetting by the trials so far keeps runs reproducible and distinct.
        sampler = self._sampler(options.seed + previous)
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
                directions=self.inputs.objective.directions,
            )
            study.set_user_attr("settings", self.settings_fingerprint())
            study.set_user_attr("baseline_source", self.inputs.baseline_source)
            study.set_user_attr("effective_defaults", self.inputs.effective_defaults)
            if self.inputs.choices:
                study.set_user_attr(CHOICES_ATTR, self.inputs.choices)
                study.set_user_attr(RESOLVED_ATTR, {
                    "baseline": self.inputs.baseline.model_dump(mode="json"),
                    "comparisons": {name: config.model_dump(mode="json")
                                    for name, config in self.inputs.comparisons.items()},
                })
            for key, value in self.study_attrs.items():
                study.set_user_attr(key, value)
        return study

    def attach(self, storage: optuna.storages.BaseStorage, *, seed: int | None = None) -> optuna.Study:
        """Join a study another process created (a worker, or finalize): load it, never
        create it, never close trials that other workers are running (heartbeats do that).

        `seed` should differ per worker: two workers seeded alike would propose the same
        configs. TPE's constant liar keeps a worker away from configs others are measuring.
        """
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = self._sampler(self.options.seed if seed is None else seed, constant_liar=True)
        try:
            study = optuna.load_study(
                study_name=self.options.study_name, storage=storage, sampler=sampler, pruner=self._pruner()
            )
        except KeyError:
            raise AutotuneError(
                f"no study {self.options.study_name!r} in {self.options.storage_url}; create it with "
                f"`autotune run --workers-only --storage URL --study-name NAME ...`"
            ) from None
        return study

    def _sampler(self, seed: int, *, constant_liar: bool = False) -> FreshConfigSampler:
        """Multivariate TPE that draws again rather than launch a config measured before or
        one the host cannot hold (autotune.search.sampler)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            tpe = optuna.samplers.TPESampler(
                seed=seed,
                multivariate=True,
                group=True,
                constant_liar=constant_liar,
                n_startup_trials=self._startup_trials(),
            )
        # The host's fit is judged with the baseline's values under the proposal's: a parallel
        # size the space does not search (or that is not drawn yet) stays the baseline's.
        space = self.inputs.space
        known = self.inputs.baseline.searchable_values(self.inputs.effective_defaults)
        return FreshConfigSampler(tpe, space.engine_values,
                                  admits=lambda params: space.fits_host({**known, **space.drawn_values(params)}))

    def _startup_trials(self) -> int:
        # Optuna's default of 10 random trials would make a 6-trial study pure random search.
        n = self.options.n_trials
        return 10 if n is None else max(3, min(10, n // 3))

    def _pruner(self) -> optuna.pruners.BasePruner:
        if not self.options.prune or self.inputs.objective.kind == "pareto" or self.inputs.objective.uses_ladder:
            # Optuna cannot prune multi-objective trials; a ladder abandons its own failing
            # steps and has no goodput-so-far to compare.
            return optuna.pruners.NopPruner()
        # Compare goodput-so-far only past 40% of the window: early seconds say little.
        warmup = int(0.4 * self.inputs.tuning_window.duration_s())
        return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=warmup)

    def _check_same_settings(self, study: optuna.Study) -> None:
        """Refuse a resume that changed what the user chose. A study that stored its choices
        is compared on them first; its space, derived from the machine it was created on, is
        the resumed plan's (`autotune.prepare.resumed_plan`), so the comparison of objective,
        SLOs and space that follows (all an older study can be compared on) then holds."""
        choices = study.user_attrs.get(CHOICES_ATTR)
        if choices is not None and self.inputs.choices:
            refuse_changed_choices(study.study_name, self.options.storage_url, choices, self.inputs.choices)
        stored = study.user_attrs.get("settings")
        current = self.settings_fingerprint()
        if stored is None:
            return
        for key in ("objective", "slos", "space"):
            if stored.get(key) != current[key]:
                raise AutotuneError(
                    f"--resume: study {study.study_name!r} in {self.options.storage_url} was created with {key} "
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

    @staticmethod
    def heartbeat(study: optuna.Study, trial: optuna.Trial) -> contextlib.AbstractContextManager[None] | None:
        """Beats for `trial` while the context is open (a first beat now); None when the
        storage records no heartbeats."""
        interval = heartbeat_interval(study._storage)
        if interval is None:
            return None
        study._storage.record_heartbeat(trial._trial_id)
        return _Heartbeat(study._storage, trial._trial_id, interval).running()
