"""Several workers (one per GPU, any number of hosts) on one study, through Optuna's RDB storage.

    autotune run --workload T --storage URL --study-name N --workers-only   # create, store the plan
    autotune worker --storage URL --study N                                 # on every GPU
    autotune finalize --storage URL --study N                               # gate, best.yaml, report

There is no scheduler of ours: the database is the only thing workers share. Creating the
study stores everything a worker needs (settings, search space, baseline, the tuning and
held-out windows themselves) as the study's user attribute `shared_plan`, and queues the
baseline once. Each worker asks the study for trials (a queued one first) and measures them on
its own local server. A measured trial records heartbeats; a trial whose worker stopped beating
for `grace_period` seconds is failed by whichever process looks next and re-queued by Optuna's
retry callback (same parameters, `failed_trial`/`retry_history` in its system attributes), so
its configuration is measured once by another worker: never lost, never counted twice (a FAIL
does not count; a late tell from a worker that was presumed dead is refused and discarded).
Finalize claims the study atomically (it creates the study `NAME.finalize`; names are unique),
waits for running trials, then runs the same gate, export and report as `autotune run`.

One module because create, work and finalize are one protocol over one study and one output
folder: the shared plan that creating stores and workers and finalize load, the workers'
leases beside their server registries, the finalize claim.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import re
import socket
import time
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import psutil
from optuna.trial import FrozenTrial, TrialState
from pydantic import BaseModel, ValidationError

from autotune import pipeline
from autotune.decide.outcome import stop_if_baseline_failed
from autotune.errors import AutotuneError
from autotune.measure.server_registry import StaleServerRegistry, reap_stale_servers
from autotune.plan import TuningPlan
from autotune.redact import redact, redact_argv
from autotune.search.study import TuningStudy
from autotune.search.study_store import check_writable
from autotune.search.trial_records import counts_toward_budget, trial_label
from workloads.files import write_text_atomic

PLAN_ATTR = "shared_plan"
CLAIM_SUFFIX = ".finalize"


def _say(line: str) -> None:
    print(line, flush=True)


# ---------------------------------------------------------------------------------------------
# The plan every worker reads from the study


def load_shared(
    storage: optuna.storages.BaseStorage, study_name: str, url: str, output_dir: Path, *,
    fork_server_socket: Path | None = None,
) -> TuningPlan:
    """The plan stored in study `study_name`, for a process writing to `output_dir` (forking
    its trial servers from `fork_server_socket`'s fork server, if any); AutotuneError when there
    is none to join."""
    try:
        study_id = storage.get_study_id_from_name(study_name)
    except KeyError:
        names = sorted(n for n in optuna.get_all_study_names(storage) if not n.endswith(CLAIM_SUFFIX))
        raise AutotuneError(
            f"no study {study_name!r} in {redact(url)} (it has: {', '.join(names) or 'none'}); "
            f"create it with `autotune run --workload TRACE --storage URL --study-name "
            f"{study_name} --workers-only`"
        ) from None
    raw = storage.get_study_user_attrs(study_id).get(PLAN_ATTR)
    if raw is None:
        raise AutotuneError(
            f"study {study_name!r} in {redact(url)} was not created for workers (no stored plan); "
            f"create one with `autotune run ... --storage URL --study-name NEW --workers-only`"
        )
    try:
        plan = TuningPlan.from_shared(raw, study_name=study_name, storage_url=url, output_dir=output_dir)
    except ValidationError as error:
        first = error.errors()[0]
        raise AutotuneError(
            f"study {study_name!r}: its stored plan is unreadable here (field "
            f"'{'.'.join(map(str, first['loc']))}': {first['msg']}); was it created by another "
            f"version of vllm-autotune? use the same version on every worker"
        ) from None
    return plan.model_copy(update={"fork_server_socket": fork_server_socket})


# ---------------------------------------------------------------------------------------------
# The storage


def retry_callback(max_retry: int) -> Callable[[optuna.Study, FrozenTrial], None]:
    """Optuna's own: re-queues a lost trial with its parameters, at most `max_retry` times."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.simplefilter("ignore", FutureWarning)
        cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
        if cls is None:  # Optuna < 4.9 names it RetryFailedTrialCallback
            cls = optuna.storages.RetryFailedTrialCallback
        return cls(max_retry=max_retry)


def connect(
    url: str,
    *,
    heartbeat_interval_s: int,
    grace_period_s: int,
    max_retry: int,
) -> optuna.storages.RDBStorage:
    """An RDB storage (PostgreSQL, MySQL; SQLite for workers on one host) with heartbeats."""
    if heartbeat_interval_s < 1 or grace_period_s <= heartbeat_interval_s:
        raise AutotuneError(
            f"--heartbeat-interval {heartbeat_interval_s} / --grace-period {grace_period_s}: the "
            f"interval must be >= 1 s and the grace period longer than it (e.g. 10 and 60)"
        )
    if max_retry < 0:
        raise AutotuneError(f"--max-retry {max_retry}: must be 0 or more")
    callback = retry_callback(max_retry)
    settings = {"heartbeat_interval": heartbeat_interval_s, "grace_period": grace_period_s}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.simplefilter("ignore", FutureWarning)
        try:
            try:
                return optuna.storages.RDBStorage(
                    url, **settings, heartbeat_stale_trial_callback=callback
                )
            except TypeError:  # Optuna < 4.9
                return optuna.storages.RDBStorage(url, **settings, failed_trial_callback=callback)
        except Exception as error:  # noqa: BLE001 - any backend error is a bad --storage for the user
            detail = " ".join(str(error).split())[:200]
            raise AutotuneError(
                f"--storage {redact(url)!r}: cannot open it: {detail}; check the URL, that the "
                f"database is reachable from here and its driver installed "
                f"(pip install 'vllm-autotune[postgres]')"
            ) from None


# ---------------------------------------------------------------------------------------------
# Who measures


@dataclasses.dataclass(frozen=True)
class WorkerIdentity:
    """A host and a worker on it; recorded on every trial the worker measures."""

    host: str
    worker: str

    @classmethod
    def detect(cls, worker_id: str | None = None, env: dict[str, str] | None = None) -> WorkerIdentity:
        """`--worker-id`, else the GPUs it was given (`CUDA_VISIBLE_DEVICES`), else its pid."""
        env = dict(os.environ if env is None else env)
        if worker_id:
            worker = worker_id
        elif env.get("CUDA_VISIBLE_DEVICES"):
            worker = "gpu" + env["CUDA_VISIBLE_DEVICES"].replace(",", "+")
        else:
            worker = f"pid{os.getpid()}"
        return cls(host=socket.gethostname(), worker=worker)

    @property
    def label(self) -> str:
        return f"{self.host}/{self.worker}"

    def attrs(self) -> dict[str, str]:
        return {"host": self.host, "worker": self.worker}

    def file_stem(self) -> str:
        return re.sub(r"[^A-Za-z0-9._+-]", "_", f"{self.host}--{self.worker}")


class Lease(BaseModel):
    """`workers/<host>--<worker>.json`: this worker's process, while it runs."""

    host: str
    worker: str
    pid: int
    create_time: float
    started: str


def _process_alive(pid: int, create_time: float) -> bool:
    try:
        process = psutil.Process(pid)
        return (
            abs(process.create_time() - create_time) < 0.05
            and process.status() != psutil.STATUS_ZOMBIE
        )
    except psutil.NoSuchProcess:
        return False


class WorkerRoster:
    """Leases and server registries of the workers sharing one output folder.

    Each worker registers the servers it starts in its own registry beside its lease. A worker
    that dies (SIGKILL, OOM killer) leaves its server running; the next worker on the same host
    to look (another GPU's worker, or this one restarted) ends that server's process group.
    """

    def __init__(self, directory: Path, identity: WorkerIdentity, *, say: Callable[[str], None] = _say):
        self.directory = directory
        self.identity = identity
        self.say = say
        stem = identity.file_stem()
        self.lease_path = directory / f"{stem}.json"
        self.registry_path = directory / f"{stem}.servers.json"

    def join(self) -> None:
        lease = self._read(self.lease_path)
        if lease is not None and lease.host == self.identity.host and _process_alive(lease.pid, lease.create_time):
            raise AutotuneError(
                f"worker {self.identity.label} is already running here (pid {lease.pid}); give "
                f"each worker on a host its own --worker-id or CUDA_VISIBLE_DEVICES"
            )
        self.reap_departed()
        me = psutil.Process()
        write_text_atomic(
            self.lease_path,
            Lease(
                host=self.identity.host,
                worker=self.identity.worker,
                pid=me.pid,
                create_time=me.create_time(),
                started=dt.datetime.now().isoformat(timespec="seconds"),
            ).model_dump_json(indent=2),
        )

    def leave(self) -> None:
        self.lease_path.unlink(missing_ok=True)

    def reap_departed(self) -> list[int]:
        """End the servers of workers on this host whose process is gone; the pids ended."""
        ended: list[int] = []
        if not self.directory.is_dir():
            return ended
        for path in sorted(self.directory.glob("*.json")):
            if path.name.endswith(".servers.json"):
                continue
            lease = self._read(path)
            if lease is None or lease.host != self.identity.host:
                continue  # another host's worker (shared folder): only it can end its servers
            if path != self.lease_path and _process_alive(lease.pid, lease.create_time):
                continue
            if path == self.lease_path and lease.pid == os.getpid():
                continue
            registry = path.with_name(path.name[: -len(".json")] + ".servers.json")
            pids = reap_stale_servers(registry)
            if pids:
                self.say(f"ended server process(es) {pids} that worker {lease.host}/{lease.worker} "
                         f"(pid {lease.pid}, gone) left behind")
            ended += pids
            if path != self.lease_path and not StaleServerRegistry(registry).entries():
                path.unlink(missing_ok=True)
                registry.unlink(missing_ok=True)
        return ended

    @staticmethod
    def _read(path: Path) -> Lease | None:
        try:
            return Lease.model_validate_json(path.read_text())
        except (OSError, ValidationError):
            return None


# ---------------------------------------------------------------------------------------------
# The three commands' work


def create_shared_study(plan: TuningPlan, *, say: Callable[[str], None] = _say) -> optuna.Study:
    """Create the study with its plan stored and the baseline queued; measure nothing."""
    url = redact(plan.storage_url)
    try:
        exists = plan.study_name in optuna.get_all_study_names(plan.storage_url)
    except Exception:  # noqa: BLE001 - TuningStudy.open() reports a bad --storage in one line
        exists = False
    if exists:
        raise AutotuneError(
            f"study {plan.study_name!r} already exists in {url}; start workers on it "
            f"(`autotune worker --storage URL --study {plan.study_name}`) or pick a new "
            f"--study-name"
        )
    # Stored for every worker and finalize to read: the command line with passwords hidden.
    shared = plan.model_copy(update={"command_line": redact_argv(plan.command_line)}).shared_form()
    study = pipeline.create_study(
        plan,
        study_attrs={"workload_fingerprint": plan.workload["fingerprint"], PLAN_ATTR: shared},
        say=say,
    )
    target = f"{plan.n_trials} trials" if plan.n_trials else "no trial limit"
    budget = f", time budget {plan.time_budget_s:.0f} s per worker" if plan.time_budget_s else ""
    if plan.gpu_seconds:
        budget += f", {plan.gpu_seconds:.0f} GPU-seconds per worker"
    say(f"created study {plan.study_name} in {url} ({target}{budget}; objective "
        f"{plan.objective.spec()}; SLOs {', '.join(s.spec() for s in plan.slos)}); "
        f"the baseline is queued as trial-0000")
    say("start a worker per GPU, on any host that reaches the database:")
    say(f"  autotune worker --storage '{url}' --study {plan.study_name}")
    say("then validate and export once they are done:")
    say(f"  autotune finalize --storage '{url}' --study {plan.study_name}")
    return study


def worker_seed(seed: int, identity: WorkerIdentity, trials_so_far: int) -> int:
    """Distinct per worker (two workers seeded alike would propose the same configs)."""
    return zlib.crc32(f"{seed}/{identity.label}/{trials_so_far}".encode())


def run_worker(
    storage: optuna.storages.BaseStorage,
    study_name: str,
    *,
    url: str,
    identity: WorkerIdentity,
    output_dir: Path,
    max_retry: int,
    runner: Any = None,
    say: Callable[[str], None] = _say,
    sleep: Callable[[float], None] = time.sleep,
    fork_server_socket: Path | None = None,
) -> optuna.Study:
    """Measure trials of the shared study until it has its trials (or this worker's time
    budget is spent); trials go to OUTPUT_DIR/trials/trial-NNNN (numbers are study-wide)."""
    plan = load_shared(storage, study_name, url, output_dir, fork_server_socket=fork_server_socket)
    check_writable(output_dir)
    roster = WorkerRoster(output_dir / "workers", identity, say=say)
    roster.join()
    try:
        if runner is None:
            runner = pipeline.build_runner(plan, registry=roster.registry_path)
        tuning = pipeline.build_study(
            plan,
            runner=runner,
            trial_attrs=identity.attrs(),
            on_interrupted=retry_callback(max_retry),
            say=say,
            sleep=sleep,
        )

        def between_trials() -> None:
            roster.reap_departed()
            # Once the baseline's trial has failed no trial can be judged: every worker stops.
            stop_if_baseline_failed(tuning.study, infeasible_ok=plan.search_anyway)

        tuning.between_trials = between_trials
        previous = len(storage.get_all_trials(storage.get_study_id_from_name(study_name), deepcopy=False))
        study = tuning.attach(storage, seed=worker_seed(plan.seed, identity, previous))
        say(f"worker {identity.label} joined study {study_name} in {redact(url)}; trials go to "
            f"{output_dir / 'trials'}")
        tuning.run_search()
    finally:
        roster.leave()
    done = sum(counts_toward_budget(t) for t in study.get_trials(deepcopy=False))
    mine = sum(t.user_attrs.get("worker") == identity.worker and t.user_attrs.get("host") == identity.host
               and t.state.is_finished() for t in study.get_trials(deepcopy=False))
    say(f"worker {identity.label}: search over ({done} trials done in the study, {mine} here); "
        f"validate and export with `autotune finalize --storage URL --study {study_name}`")
    return study


class FinalizeClaim:
    """Exactly one finalize per study: claiming creates the study `NAME.finalize` (study
    names are unique in the storage, so a second claimant is refused by the database)."""

    def __init__(self, storage: optuna.storages.BaseStorage, study_name: str, url: str):
        self.storage = storage
        self.name = study_name + CLAIM_SUFFIX
        self.study_name = study_name
        self.url = url
        self.study: optuna.Study | None = None

    def take(self, identity: WorkerIdentity, *, again: bool = False) -> None:
        if again:
            self.release()
        try:
            self.study = optuna.create_study(study_name=self.name, storage=self.storage)
        except optuna.exceptions.DuplicatedStudyError:
            attrs = optuna.load_study(study_name=self.name, storage=self.storage).user_attrs
            state = f"finalised at {attrs['finished']}" if attrs.get("finished") else "being finalised"
            raise AutotuneError(
                f"study {self.study_name!r} is already {state} by {attrs.get('by', 'another process')} "
                f"(claimed {attrs.get('claimed', '?')}); pass --again to validate and export once more"
            ) from None
        self.study.set_user_attr("by", f"{identity.label} pid {os.getpid()}")
        self.study.set_user_attr("claimed", dt.datetime.now().isoformat(timespec="seconds"))

    def done(self, output_dir: Path) -> None:
        assert self.study is not None
        self.study.set_user_attr("finished", dt.datetime.now().isoformat(timespec="seconds"))
        self.study.set_user_attr("output_dir", str(output_dir.resolve()))

    def release(self) -> None:
        try:
            optuna.delete_study(study_name=self.name, storage=self.storage)
        except KeyError:
            pass
        self.study = None


def wait_for_search(
    tuning: TuningStudy,
    study: optuna.Study,
    *,
    partial: bool,
    wait_timeout_s: float | None,
    say: Callable[[str], None] = _say,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Return once no trial is running (failing stale ones), and the study has its trials."""
    options = tuning.options
    start = clock()
    told: tuple[int, int] | None = None
    while True:
        tuning.store.fail_stale(study)
        trials = study.get_trials(deepcopy=False)
        done = sum(counts_toward_budget(t) for t in trials)
        running = sum(t.state == TrialState.RUNNING for t in trials)
        queued = sum(t.state == TrialState.WAITING for t in trials)
        target = options.n_trials
        if running == 0:
            if target is None or done >= target or partial:
                return
            raise AutotuneError(
                f"study {options.study_name!r}: {done} of {target} trials measured, none running"
                f"{f' ({queued} queued)' if queued else ''}; start `autotune worker --storage URL "
                f"--study {options.study_name}` or pass --partial to validate what was measured"
            )
        if wait_timeout_s is not None and clock() - start > wait_timeout_s:
            raise AutotuneError(
                f"study {options.study_name!r}: {running} trial(s) still running after waiting "
                f"{wait_timeout_s:.0f} s; wait longer (--wait) or stop the workers"
            )
        if told != (done, running):
            say(f"waiting for {running} running trial(s) ({done}/{target or '-'} done)")
            told = (done, running)
        tuning.sleep(tuning.store.poll_s(study))


def search_span_s(study: optuna.Study) -> float:
    """Wall time from the first trial's start to the last one's end (all workers)."""
    trials = study.get_trials(deepcopy=False)
    starts = [t.datetime_start for t in trials if t.datetime_start is not None]
    ends = [t.datetime_complete for t in trials if t.datetime_complete is not None]
    if not starts or not ends:
        return 0.0
    return max(0.0, (max(ends) - min(starts)).total_seconds())


def finalize(
    storage: optuna.storages.BaseStorage,
    study_name: str,
    *,
    url: str,
    output_dir: Path,
    identity: WorkerIdentity,
    partial: bool = False,
    again: bool = False,
    wait_timeout_s: float | None = None,
    runner: Any = None,
    say: Callable[[str], None] = _say,
    sleep: Callable[[float], None] = time.sleep,
    fork_server_socket: Path | None = None,
) -> pipeline.RunOutcome:
    """Once the search is over: the gate, best.yaml and report.md, as `autotune run` makes."""
    plan = load_shared(storage, study_name, url, output_dir, fork_server_socket=fork_server_socket)
    check_writable(output_dir)
    claim = FinalizeClaim(storage, study_name, url)
    claim.take(identity, again=again)
    try:
        registry = output_dir / "servers.json"
        ended = reap_stale_servers(registry)
        if ended:
            say(f"ended {len(ended)} server process(es) an earlier finalize left behind: {ended}")
        if runner is None:
            runner = pipeline.build_runner(plan, registry=registry)
        tuning = pipeline.build_study(plan, runner=runner, say=say, sleep=sleep)
        study = tuning.attach(storage)
        wait_for_search(tuning, study, partial=partial, wait_timeout_s=wait_timeout_s, say=say)
        tuning.search_wall_s = search_span_s(study)
        trials = study.get_trials(deepcopy=False)
        workers = sorted({f"{t.user_attrs['host']}/{t.user_attrs.get('worker', '')}".rstrip("/")
                          for t in trials if t.user_attrs.get("host")})
        lost = [trial_label(t.number) for t in trials if t.system_attrs.get("failed_trial") is not None]
        say(f"finalising study {study_name}: {len(trials)} trials from {len(workers)} worker(s)"
            + (f", {len(lost)} of them retries of lost trials" if lost else "")
            + "; validating on the held-out window")
        outcome = pipeline.finish(
            plan,
            tuning,
            study,
            search_extra={"workers": workers, "finalized_by": identity.label},
        )
    except BaseException:
        claim.release()  # a finalize that did not finish must not block the next one
        raise
    claim.done(output_dir)
    return outcome
