"""What a tuning run runs on (`TuningPlan`).

A `TuningRequest` (autotune.request) holds the user's choices as `autotune run` takes them
(retune fills one in from its own flags). `autotune.prepare.prepare_plan` checks it and turns it into a
`TuningPlan`: the traces cut into windows, the search space, the baseline, the SLOs and the
objective, every setting the search and the gate need. The pipeline (autotune.pipeline) runs
a plan; nothing below the CLI reads flags.

A plan's JSON form (`shared_form()`) is what a study created for workers stores as its
user attribute `shared_plan`: a worker on another host rebuilds the same plan from it
(`TuningPlan.from_shared`) with no copy of the trace file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_serializer, model_validator

from autotune.measure.ladder import LadderSettings
from autotune.measure.servers import TrialServer
from autotune.search.objective import Objective, parse_objective
from autotune.search.relations import parse_relation
from autotune.search.space import ParamSpec, SearchSpace
from server.config import ServerConfig
from workloads.replay import ReplayOptions
from workloads.slo import SLO, parse_slos
from workloads.trace import Trace, TraceRequest

# The plan's fields that belong to one process (where it writes, which study it opens), not
# to the study: left out of the form stored for workers.
PROCESS_FIELDS = frozenset({"study_name", "output_dir", "storage", "resume", "resume_gate", "fork_server_socket"})


class StoredWindow(BaseModel):
    """A trace window as stored in the study (workers need no copy of the trace file)."""

    model_config = ConfigDict(extra="forbid")

    source: str
    requests: list[dict[str, Any]]

    @classmethod
    def from_trace(cls, trace: Trace) -> StoredWindow:
        requests = [trace.request(i).model_dump(exclude_none=True) for i in range(len(trace))]
        return cls(source=trace.source, requests=requests)

    def trace(self) -> Trace:
        return Trace.from_requests(
            (TraceRequest.model_validate(r) for r in self.requests), source=self.source
        )


class TuningPlan(BaseModel):
    """Everything checked and prepared before the first trial, typed.

    The field order and JSON form of the fields outside PROCESS_FIELDS are the stored
    `shared_plan` (version 1): studies created by earlier versions stay readable.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    version: Literal[1] = 1
    accelerator: str
    objective: Objective
    slos: list[SLO]
    space: SearchSpace
    baseline: ServerConfig
    baseline_source: str
    comparisons: dict[str, ServerConfig] = {}  # measured in the gate, never exported
    effective_defaults: dict[str, Any] = {}  # vLLM's defaults for the baseline, resolved
    # What the user chose, as --resume compares it (autotune.prepare.user_choices).
    choices: dict[str, Any] = {}
    workload: dict[str, Any]  # the provenance's workload section
    profile_text: str = ""
    tuning_window: Trace
    holdout_window: Trace
    n_trials: int | None
    time_budget_s: float | None
    gpu_seconds: float | None = None  # per worker, like the time budget
    seed: int
    top_k: int
    repeats: int
    prune: bool = True
    # Search on when the baseline's ladder found no load that meets the SLOs (else exit 12).
    search_anyway: bool = False
    ladder: LadderSettings | None = None  # the capacity ladder (min-memory: one step at H)
    mode: str
    speedup: float
    startup_timeout_s: float
    max_client_lag_ms: float | None = None  # runs lagging more are not scored (None: derived)
    # Resolved on each host that measures (a worker's CPUs are its own): CpuSplit.resolve.
    client_cpus: str = "auto"
    # Trial servers forked from a process that imported vLLM once (autotune.measure.forkserver).
    fork_servers: Literal["on", "off"] = "on"
    command_line: list[str]
    # What every trial runs on (workers too); studies stored before it existed ran ours.
    trial_server: TrialServer = TrialServer()
    # This process's (PROCESS_FIELDS):
    study_name: str
    output_dir: Path
    storage: str | None = None  # an Optuna RDB URL; None: sqlite:///OUTPUT_DIR/study.db
    resume: bool = False
    # `autotune run --resume`: the runs an interrupted gate measured are kept (whole rounds only
    # from another machine: autotune.search.gate_runner).
    resume_gate: bool = False
    # Trial servers forked from this host's shared fork server where it accepts our environment.
    fork_server_socket: Path | None = None

    def replay_options(self) -> ReplayOptions:
        """How a trial replays its window: the plan's mode, speed-up, SLOs and the client
        lag above which a run is not scored."""
        return ReplayOptions(mode=self.mode, speedup=self.speedup, slos=tuple(self.slos),
                             max_send_lag_ms=self.max_client_lag_ms)

    @property
    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{(self.output_dir / 'study.db').resolve()}"

    # -- the stored form --------------------------------------------------------------------

    def shared_form(self) -> dict[str, Any]:
        """The plan as a study created for workers stores it (JSON)."""
        return self.model_dump(mode="json", exclude=set(PROCESS_FIELDS))

    @classmethod
    def from_shared(cls, stored: dict[str, Any], *, study_name: str, storage_url: str,
                    output_dir: Path) -> TuningPlan:
        """The plan a study stores, for a process that joins it (a worker, finalize).
        Raises pydantic's ValidationError when the stored form is not this version's."""
        return cls.model_validate({**stored, "study_name": study_name, "storage": storage_url,
                                   "output_dir": output_dir, "resume": True})

    @model_validator(mode="before")
    @classmethod
    def _parse_stored(cls, data: Any) -> Any:
        """The stored form's text and JSON back into the objects a plan holds."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        slos = data.get("slos")
        if isinstance(slos, list) and all(isinstance(slo, str) for slo in slos):
            data["slos"] = parse_slos(slos)
        if isinstance(data.get("objective"), str):
            data["objective"] = parse_objective(data["objective"], data["slos"])
        if isinstance(data.get("space"), dict):
            data["space"] = SearchSpace(
                {name: ParamSpec.model_validate(spec) for name, spec in data["space"]["params"].items()},
                [parse_relation(text) for text in data["space"]["relations"]],
                source=f"study {data.get('study_name')}'s search space",
            )
        for key in ("tuning_window", "holdout_window"):
            if isinstance(data.get(key), dict):
                data[key] = StoredWindow.model_validate(data[key]).trace()
        return data

    @field_serializer("objective", when_used="json")
    def _objective_spec(self, objective: Objective) -> str:
        return objective.spec()

    @field_serializer("slos", when_used="json")
    def _slo_specs(self, slos: list[SLO]) -> list[str]:
        return [slo.spec() for slo in slos]

    @field_serializer("space", when_used="json")
    def _space_fingerprint(self, space: SearchSpace) -> dict[str, Any]:
        return space.fingerprint()

    @field_serializer("tuning_window", "holdout_window", when_used="json")
    def _stored_window(self, window: Trace) -> dict[str, Any]:
        return StoredWindow.from_trace(window).model_dump()
