"""What a tuning run is asked for: `TuningRequest`, the one declaration of `autotune run`'s
options.

Each field is a setting: its type and default here, its flag, help text and help group in
its `Flag` (autotune.options), from which `autotune run`'s parser is generated (and
`retune`'s measurement flags, the same fields). Benchmarks and tests build a request
directly; autotune.prepare checks it against the trace, the model and the host and turns it
into a TuningPlan. The values a flag alone can check (counts, the headroom, durations) are
checked here, in one line each (AutotuneError).

Over 400 lines of help would be a smell; this module is long because every option's help
text lives beside its field, which is the point.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from autotune.errors import AutotuneError
from autotune.measure.servers import ServerKind, TrialServer, trial_server
from autotune.options import Flag
from autotune.progress import parse_duration
from server.config import NO_MODEL_RULE

# 6 trials (baseline included) on a 30 s window, then the gate the product promises: the top 3
# and the baseline, 3 times each, interleaved, on a 20 s held-out window. Windows are lengthened
# until each holds what the SLO percentiles need (autotune.preflight): on the sample trace with
# the default p95 SLOs, to ~47 and ~48 s (200+ requests each). On the embedded tiny model and a
# 2-core CPU that is 18 launches, ~20 minutes (`make demo` asks for fewer: the Makefile).
DEFAULT_TRIALS = 6
DEFAULT_TUNING_S = 30.0
DEFAULT_HOLDOUT_S = 20.0
DEFAULT_TOP_K = 3
DEFAULT_REPEATS = 3
DEFAULT_LADDER_RESOLUTION = 0.1
DEFAULT_STARTUP_TIMEOUT_S = 300.0
# Capacity over the recorded rate a config must keep (retune: the deployed config stays while
# it carries this many times the current traffic; min-memory: the rate its SLOs must hold at).
DEFAULT_HEADROOM = 1.5

CLIENT_LAG_ENV = "AUTOTUNE_MAX_CLIENT_LAG_MS"
FORK_SERVER_SOCKET_ENV = "AUTOTUNE_FORK_SERVER_SOCKET"

# `autotune run --help`'s sections, in this order; `retune --help`'s.
RUN_GROUPS = ("workload and model", "objective", "search", "ladder", "windows", "gate", "server", "output")
RETUNE_GROUPS = ("drift", *RUN_GROUPS)
# Trials retune enqueues after the deployed baseline (the previous best, the neighbours).
DEFAULT_WARM_START = 4

_gpu_seconds = functools.partial(parse_duration, option="--gpu-seconds")


def _seconds(text: str, *, option: str, rule: str, zero_ok: bool = False, most: float = math.inf) -> float:
    """A flag's seconds: a finite number above 0 (or 0 too, `zero_ok`), at most `most`;
    AutotuneError "OPTION 'TEXT': expected RULE" otherwise."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and (seconds >= 0 if zero_ok else seconds > 0) and seconds <= most):
        raise AutotuneError(f"{option} {text!r}: expected {rule}")
    return seconds


# `--max-silence S`: 0 or more (0: silences replayed whole).
_max_silence = functools.partial(_seconds, option="--max-silence", zero_ok=True,
                                 rule="seconds >= 0 (0: replay silences whole)")


def _step_seconds(text: str) -> float:
    """`--step-seconds S`: more than 0, at most `MAX_STEP_S`."""
    from autotune.measure.ladder import MAX_STEP_S  # the flag's own module stays light to import

    return _seconds(text, option="--step-seconds", most=MAX_STEP_S,
                    rule=f"seconds > 0 and at most {MAX_STEP_S:.0f} (an hour a step)")


def _window_seconds(option: str) -> functools.partial[float]:
    """`--tuning-window S` / `--holdout-window S`: more than 0."""
    return functools.partial(_seconds, option=option, rule="seconds > 0")


class MeasurementOptions(BaseModel):
    """How each config is measured and re-checked: the options `autotune run` and `retune`
    share (the replay, the capacity ladder, the windows, the gate's size, the trial server),
    declared once. `TuningRequest` is these and `run`'s own."""

    model_config = ConfigDict(extra="forbid")

    over_context: Annotated[Literal["refuse", "drop", "cap"], Flag(
        "workload and model", "requests whose input + output exceed the model's context: refuse "
        "the run, drop them from the trace, or cap them (prompts cut to fit); dropped or capped "
        "requests are counted in the log, report.md and best.yaml")] = "refuse"
    seed: Annotated[int, Flag("search", "sampler seed")] = 0

    step_requests: Annotated[int | None, Flag(
        "ladder", "capacity ladder: requests per load step, at least (default: what the SLO "
        "percentiles need: 200 for a p95, 1,000 for a p99)", metavar="N")] = None
    step_seconds: Annotated[float | None, Flag(
        "ladder", "capacity ladder: seconds of load per step, at least, at the step's rate; "
        "with --step-requests, the longer of the two (default: 10; 6 on a CPU)",
        metavar="S", parse=_step_seconds)] = None
    ladder_resolution: Annotated[float, Flag(
        "ladder", "capacity ladder: stop bisecting when the failing rate is within this "
        "fraction of the passing one", metavar="R")] = DEFAULT_LADDER_RESOLUTION
    max_silence_s: Annotated[float | None, Flag(
        "ladder", "capacity ladder: a silence between arrivals longer than S seconds (at the "
        "step's speed) is cut to S, the step still credited at its uncut rate; a failing step "
        "whose cut silence ended with requests in flight is run again uncut; 0: replay "
        "silences whole (default: 5)", name="--max-silence", metavar="S", parse=_max_silence)] = None
    max_speedup: Annotated[float | None, Flag(
        "ladder", "capacity ladder: the highest rate tried, as a multiple of the recorded rate; "
        "a config that meets every SLO there is reported as carrying at least X (default: 256)",
        metavar="X")] = None  # None: LadderSettings' own
    max_client_lag_ms: Annotated[float | None, Flag(
        "ladder", "a measured run (ladder step or window) whose replayer send-lag p99 exceeds "
        f"this is not scored: the client, not only the server, shaped it (default: ${CLIENT_LAG_ENV} "
        "if set, else a tenth of the tightest TTFT or E2E SLO threshold, at least 50)",
        metavar="MS")] = None
    speedup: Annotated[float, Flag(
        "ladder", "replay arrivals this many times faster than recorded (timed mode)")] = 1.0
    mode: Annotated[str, Flag(
        "ladder", "replay at recorded arrival times, or closed loop with N requests in flight",
        metavar="timed|concurrency=N")] = "timed"

    tuning_window_s: Annotated[float, Flag(
        "windows", "seconds of trace replayed per search trial; lengthened when too few "
        "requests for the SLO percentiles (p95: 200, p99: 1,000)", name="--tuning-window",
        metavar="S", parse=_window_seconds("--tuning-window"))] = DEFAULT_TUNING_S
    holdout_window_s: Annotated[float, Flag(
        "windows", "seconds of (disjoint) trace replayed per validation run; lengthened "
        "likewise", name="--holdout-window", metavar="S",
        parse=_window_seconds("--holdout-window"))] = DEFAULT_HOLDOUT_S

    top_k: Annotated[int, Flag(
        "gate", "configs from the search re-run in validation beside the baseline",
        metavar="K")] = DEFAULT_TOP_K
    repeats: Annotated[int, Flag(
        "gate", "validation repeats per config (interleaved)", metavar="R")] = DEFAULT_REPEATS
    server: Annotated[ServerKind | None, Flag(
        "server", "what runs each trial: autotune (our server, `python -m server`) or vllm "
        "(stock `vllm serve` from this Python's vLLM, for deployments that run it); best.yaml is "
        "the same file either way", shown_default="autotune")] = None
    api_server_count: Annotated[int | None, Flag(
        "server", "front-end processes sharing one engine core, for every trial: `vllm serve "
        "--api-server-count N` with --server vllm, `python -m server --api-processes N` with "
        "ours (best.yaml keeps it as serving.api_processes) (default: vLLM's; ours: the "
        "baseline's serving.api_processes)", metavar="N")] = None
    startup_timeout_s: Annotated[float, Flag(
        "server", "seconds a server may take to become ready before the trial fails",
        name="--startup-timeout", metavar="S")] = DEFAULT_STARTUP_TIMEOUT_S
    client_cpus: Annotated[str, Flag(
        "server", "CPUs of the load client (the replayer); the server gets the others: auto = "
        "the last half of the host's CPUs on hosts of 8 or more with a GPU engine, off = "
        "shared, or a list such as 12-15", metavar="auto|off|LIST")] = "auto"
    fork_servers: Annotated[Literal["on", "off"], Flag(
        "server", "start each trial's server (ours, not --server vllm) by forking a process "
        "that imported vLLM once, instead of a fresh `python -m server`: ready in 0.3x the time "
        "on a 2-core CPU, 0.5x on an H200 with a 1.5B model")] = "on"
    fork_server_socket: Annotated[Path | None, Flag(
        "server", "fork trial servers from the shared fork server listening here (`autotune "
        "fork-server --socket PATH`) where it imported vLLM in this environment, else from one "
        f"of our own, where fork servers are on (default: ${FORK_SERVER_SOCKET_ENV})",
        metavar="PATH")] = None

    @model_validator(mode="after")
    def _measurement_checked(self) -> MeasurementOptions:
        if self.top_k < 1 or self.repeats < 1:
            raise AutotuneError("--top-k and --repeats must be at least 1")
        if self.max_client_lag_ms is not None and not self.max_client_lag_ms > 0:
            raise AutotuneError(f"--max-client-lag-ms {self.max_client_lag_ms:g}: must be above 0 "
                                "(e.g. 50)")
        return self


class TuningRequest(MeasurementOptions):
    """`autotune run`'s options, typed; defaults are the command's defaults."""

    model_config = ConfigDict(extra="forbid")

    # -- workload and model ---------------------------------------------------------------
    workload: Annotated[str, Flag(
        "workload and model", "the traffic trace to tune on", metavar="TRACE.jsonl", required=True)]
    model: Annotated[str | None, Flag(
        "workload and model", "model to serve (default: the embedded tiny model, dummy weights)",
        metavar="PATH")] = None
    load_format: Annotated[str | None, Flag(
        "workload and model", "vLLM load format, e.g. dummy for random weights of the real shape "
        "(default: vLLM's auto; dummy for the embedded model)")] = None
    max_model_len: Annotated[int | None, Flag(
        "workload and model", "vLLM max_model_len (default: the model's; 2048 for the embedded "
        "model)", metavar="TOKENS")] = None
    baseline: Annotated[Path | None, Flag(
        "workload and model", "the config you run today (a server/vllm serve config; without "
        f"--model, {NO_MODEL_RULE}) (default: vLLM's defaults)", metavar="FILE.yaml")] = None

    # -- objective ------------------------------------------------------------------------
    slos: Annotated[list[str] | None, Flag(
        "objective", "an SLO, repeatable, e.g. --slo ttft_p95_ms=500 (default on CPU: "
        "ttft_p95_ms=1000 and tpot_p95_ms=100; on GPU: ttft_p95_ms=500 and tpot_p95_ms=50)",
        name="--slo", metavar="METRIC_pPCT_ms=MS")] = None
    objective: Annotated[str, Flag(
        "objective", "capacity (the highest req/s at which every SLO holds, found by a load "
        "ladder in one launch per config), goodput (req/s meeting every SLO at the recorded "
        "rate), capacity-per-gpu (capacity over the GPUs one engine of the config holds, TP x PP "
        "x DP: which topology serves the most per GPU; the gate compares it), throughput, "
        "pareto[:METRIC_pPCT] (throughput vs a latency percentile), or min-memory (the smallest gpu_memory_utilization that meets every SLO at the recorded "
        "rate x --headroom; for several models on one GPU)")] = "capacity"
    headroom: Annotated[float, Flag(
        "objective", "min-memory objective: every SLO must hold at H x the traffic's recorded "
        "rate (one load step at speed-up H per trial and per gate run)",
        metavar="H")] = DEFAULT_HEADROOM
    search_anyway: Annotated[bool, Flag(
        "objective", "search even when the baseline meets the SLOs at no load the ladder tries "
        "(by default the run then ends with exit 12 and the SLO that cannot be met)")] = False

    # -- search ---------------------------------------------------------------------------
    trials: Annotated[int | None, Flag(
        "search", "trials in the search, the baseline included (with --resume: the study's "
        f"total) (default: {DEFAULT_TRIALS}, or no limit when --time-budget or --gpu-seconds is "
        "given)", metavar="N")] = None
    time_budget_s: Annotated[float | None, Flag(
        "search", "stop starting search trials after this long, e.g. 900, 30m, 1.5h; the gate "
        "runs after (default: no limit, --trials decides)", name="--time-budget",
        metavar="DURATION", parse=parse_duration)] = None
    gpu_seconds: Annotated[float | None, Flag(
        "search", "stop starting search trials once their engines have held this many "
        "accelerator-seconds (each trial's wall time x the GPUs its config uses: tensor x "
        "pipeline x data parallel size; on CPU, its wall time), e.g. 3600 or 8h; the gate runs "
        "after (default: no limit, --trials decides)", metavar="DURATION",
        parse=_gpu_seconds)] = None
    space: Annotated[Path | None, Flag(
        "search", "widen/narrow/add searched engine arguments and relations (see "
        "docs/reference/config.md, search space file); on a host of 2+ GPUs "
        "(CUDA_VISIBLE_DEVICES, else nvidia-smi -L) the built-in space also searches "
        "tensor_parallel_size and data_parallel_size, only as topologies that fit "
        "(TP*PP*DP <= host_gpus)", metavar="FILE.yaml")] = None
    # Knobs that change the model's numerics, added to the space (autotune.search.numerics).
    allow: Annotated[list[Literal["fp8"]], Flag(
        "search", "also search knobs that change the model's outputs: fp8 = vLLM's "
        "`quantization: fp8` (FP8 weights, quantized at load) and `kv_cache_dtype: fp8`; needs a "
        "GPU of compute capability 8.9+ (refused otherwise). Configs using them are marked "
        "\"changes numerics: check output quality before deploying\", and the best config "
        "without them is validated beside them (default: off)", metavar="fp8")] = []
    # -- gate (top_k, repeats: MeasurementOptions) ------------------------------------------
    compare: Annotated[list[Path], Flag(
        "gate", "another config to measure beside the baseline and the top K on the held-out "
        "window (repeatable; e.g. your hand-tuned config; no model: as --baseline); reported, "
        "never exported", metavar="FILE.yaml")] = []

    # -- output ---------------------------------------------------------------------------
    study_name: Annotated[str | None, Flag(
        "output", "Optuna study name (default: the workload's file name and today's date)")] = None
    output_dir: Annotated[Path | None, Flag(
        "output", "where trials, best.yaml and report.md go (default: runs/STUDY_NAME/, which "
        "git ignores)", metavar="DIR")] = None
    storage: Annotated[str | None, Flag(
        "output", "Optuna storage URL, any RDB (default: sqlite:///OUTPUT_DIR/study.db)",
        metavar="URL")] = None
    resume: Annotated[bool, Flag(
        "output", "continue the study of this name: keeps its trials, closes ones a killed run "
        "left open")] = False
    workers_only: Annotated[bool, Flag(
        "output", "create the study in --storage with every setting above stored in it, measure "
        "nothing and exit: `autotune worker --storage URL --study NAME` processes (one per GPU, "
        "any number of hosts) measure its trials, `autotune finalize` validates and exports")] = False

    # Not a flag: the command as the user would retype it (passwords hidden on export).
    command_line: list[str] = []
    # Not a flag: the server kind when --server is not given (retune: the deployed one's).
    default_server: ServerKind = "autotune"

    @field_validator("allow")
    @classmethod
    def _allow_once_each(cls, allow: list[str]) -> list[str]:
        return sorted(set(allow))

    @model_validator(mode="after")
    def _checked_and_completed(self) -> TuningRequest:
        if self.trials is not None and self.trials < 1:
            raise AutotuneError(f"--trials {self.trials}: must be at least 1 (the baseline)")
        if not self.headroom > 0:
            raise AutotuneError(f"--headroom {self.headroom:g}: must be above 0 (1.5 = 50% more "
                                "than the recorded rate)")
        if self.workers_only and self.resume:
            raise AutotuneError("--workers-only creates a study; to add measurements to it start "
                                "`autotune worker --storage URL --study NAME` instead of --resume")
        if self.trials is None and self.time_budget_s is None and self.gpu_seconds is None:
            self.trials = DEFAULT_TRIALS
        if self.study_name is None:
            self.study_name = f"{Path(self.workload).stem}-{dt.date.today():%Y%m%d}"
        if self.output_dir is None:
            self.output_dir = Path("runs") / self.study_name
        self.trial_server  # noqa: B018  (its refusals now, before any trace is read)
        return self

    @property
    def trial_server(self) -> TrialServer:
        """What runs each trial (--server, --api-server-count), checked now: a count below 1
        or a server this Python cannot start is refused before any trace is read."""
        return trial_server(self.server, self.api_server_count, default=self.default_server)


# The fields `retune` takes as `run` does: how each config is measured and re-checked.
MEASUREMENT_FIELDS = tuple(MeasurementOptions.model_fields)


class RetuneRequest(MeasurementOptions):
    """`autotune retune`'s options, typed: the drift check's, the re-tune's own, and how each
    config is measured (MeasurementOptions, as `autotune run` takes them)."""

    # -- drift ----------------------------------------------------------------------------
    current: Annotated[Path, Flag(
        "drift", "current traffic: a JSONL trace, or the server recorder's folder",
        metavar="TRACE|DIR", required=True)]
    config: Annotated[Path, Flag(
        "drift", "the config the servers run now (an exported best.yaml)", metavar="DEPLOYED.yaml",
        required=True)]
    reference: Annotated[Path | None, Flag(
        "drift", "drift reference (trace, profile .json or best.yaml) (default: the profile in "
        "--config's provenance, else the trace it was tuned on)", metavar="REF")] = None
    force: Annotated[bool, Flag(
        "drift", "re-tune even without drift, and without the capacity check")] = False
    dry_run: Annotated[bool, Flag("drift", "check drift and print the plan; start no server")] = False
    ks_threshold: Annotated[float | None, Flag("drift", "drift: KS statistic threshold")] = None
    rate_threshold: Annotated[float | None, Flag("drift", "drift: relative rate change")] = None
    burstiness_threshold: Annotated[float | None, Flag(
        "drift", "drift: relative change of the inter-arrival CV")] = None
    concurrency_threshold: Annotated[float | None, Flag(
        "drift", "drift: relative change of mean concurrency")] = None

    # -- objective ------------------------------------------------------------------------
    slos: Annotated[list[str] | None, Flag(
        "objective", "an SLO, repeatable (default: the SLOs the deployed config was tuned under)",
        name="--slo", metavar="METRIC_pPCT_ms=MS")] = None
    objective: Annotated[str | None, Flag(
        "objective", "capacity, capacity-per-gpu, goodput, throughput, min-memory or "
        "pareto[:METRIC_pPCT] (default: the deployed config's, else goodput). Only capacity "
        "measures the deployed config first and keeps it while it has --headroom; the others "
        "re-tune on every drift")] = None
    headroom: Annotated[float, Flag(
        "objective", "capacity objective: the deployed config stays while its capacity on the "
        "current traffic is at least H x the traffic's recorded rate (exit 11, no study); "
        "min-memory (when the deployed config's objective does not name its own H): every SLO "
        "must hold at H x the recorded rate", metavar="H")] = DEFAULT_HEADROOM

    # -- search ---------------------------------------------------------------------------
    trials: Annotated[int, Flag(
        "search", "trials in the search, the deployed baseline and warm starts included",
        metavar="N")] = DEFAULT_TRIALS
    warm_start: Annotated[int, Flag(
        "search", "trials enqueued after the baseline: the previous study's best and the "
        "deployed config's neighbours", metavar="N")] = DEFAULT_WARM_START
    time_budget_s: Annotated[float | None, Flag(
        "search", "stop starting search trials after this long, e.g. 30m (default: --trials "
        "decides)", name="--time-budget", metavar="DURATION", parse=parse_duration)] = None
    space: Annotated[Path | None, Flag("search", "search space file", metavar="FILE.yaml")] = None

    # -- output ---------------------------------------------------------------------------
    output_dir: Annotated[Path | None, Flag(
        "output", "where best-v{N}.yaml, best.yaml and the study folder go (default: --config's "
        "folder)", metavar="DIR")] = None
    storage: Annotated[str | None, Flag(
        "output", "Optuna storage URL (default: sqlite in the study folder)", metavar="URL")] = None
    study_name: Annotated[str | None, Flag(
        "output", "Optuna study name (default: retune-v{N}-<UTC time>)")] = None

    @model_validator(mode="after")
    def _retune_checked(self) -> RetuneRequest:
        if self.trials < 1:
            raise AutotuneError(f"--trials {self.trials}: must be at least 1 (the deployed config)")
        if self.warm_start < 0:
            raise AutotuneError(f"--warm-start {self.warm_start}: must be 0 or more")
        if not self.headroom >= 1:
            raise AutotuneError(f"--headroom {self.headroom}: must be at least 1 (1 = the "
                                "deployed config just carries the current traffic), e.g. 1.5")
        if not self.current.exists():
            raise AutotuneError(f"--current {self.current}: no such trace file or recorder folder")
        return self

    def measurement(self) -> dict[str, object]:
        """The MeasurementOptions fields, by name, for the TuningRequest the re-tune runs."""
        return {name: getattr(self, name) for name in MEASUREMENT_FIELDS}
