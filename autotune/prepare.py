"""A `TuningRequest` checked and turned into a `TuningPlan`, before any server starts.

The pre-flight checks (autotune.preflight) come first and write nothing: a trace the model
cannot serve, or windows too short for the SLO percentiles, cost seconds. The module runs a
little over 400 lines because `prepare_plan` keeps the checks in one order, cheapest first, so
that it reads top to bottom as the order a user's mistakes are caught in.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from autotune import preflight
from autotune.errors import AutotuneError
from autotune.measure.cpu_split import CpuSplit
from autotune.measure.ladder import LadderSettings, requests_for_percentile, requests_for_slos
from autotune.measure.servers import TrialServer, labelled
from autotune.plan import TuningPlan
from autotune.progress import say
from autotune.redact import redact
from autotune.request import TuningRequest
from autotune.search.numerics import (
    check_allowed_in_space,
    check_fp8_config,
    check_fp8_space,
    check_supported,
    numerics_params,
)
from autotune.search.objective import MEMORY_KNOB, Objective, default_slos, parse_objective
from autotune.search.relations import BUILTIN_RELATIONS, parse_relation
from autotune.search.space import ParamSpec, SearchSpace
from autotune.search.study_store import (
    CHOICES_ATTR,
    RESOLVED_ATTR,
    check_writable,
    refuse_changed_choices,
    stored_attrs,
)
from server.config import (
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MODEL_DIR,
    SEARCHABLE_SERVING_SETTINGS,
    ConfigError,
    EngineSettingsRefused,
    ServerConfig,
    check_model_available,
    default_engine_settings,
    refused_by_vllm,
    vllm_reason,
)
from server.vllm_facts import FactsCache
from workloads.profile import format_profile, profile_trace
from workloads.slo import SLO, parse_slos
from workloads.trace_io import read_trace

# The request's settings a plan keeps as they are (same names, same values).
CARRIED = ("time_budget_s", "gpu_seconds", "seed", "top_k", "repeats", "mode", "speedup",
           "startup_timeout_s", "max_client_lag_ms", "client_cpus", "fork_servers", "fork_server_socket", "command_line", "trial_server", "study_name", "output_dir",
           "storage", "resume", "search_anyway")


def prepare_plan(request: TuningRequest) -> TuningPlan:
    """Everything checked and prepared before the first trial (no server started)."""
    slos = parse_slos(request.slos) if request.slos else None
    loaded = read_trace(request.workload)
    for line in loaded.repairs(request.workload):  # as `autotune profile` says them, not as warnings
        print(f"autotune: {line}", file=sys.stderr)
    trace = loaded.trace
    # The context first, where it is known without importing vLLM (the embedded model, or
    # --max-model-len): a trace the model cannot serve is refused in about a second.
    early = explicit_context(request)
    served, fit = trace, None
    if early is not None:
        served, fit = preflight.fit_context(trace, early[0], source=early[1],
                                            policy=request.over_context, model_limit=early[2])
    baseline, baseline_source = load_baseline(request)
    accelerator = detect_accelerator()
    check_supported(request.allow, accelerator)  # --allow fp8 on a CPU or an older GPU: refused now
    # FP8 asked for in a file (a deployed fp8 config, a space naming it): the same hardware rule.
    if request.baseline is not None:
        check_fp8_config(f"--baseline {request.baseline}", baseline.engine, accelerator)
    CpuSplit.resolve(request.client_cpus, accelerator=accelerator)  # a bad list: refused now
    slos = slos or default_slos(accelerator)
    objective = parse_objective(request.objective, slos, headroom=request.headroom)
    needs = preflight.requirements(slos, objective)
    effective: dict[str, Any] | None = None  # vLLM asked once (seconds), where first needed
    if fit is None:
        context = baseline.engine.get("max_model_len")  # here only a --baseline file sets it
        context_source = f"max_model_len={context} from {request.baseline}"
        if context is None:  # the model's own: what vLLM derives from its config
            effective = check_deployable(baseline, baseline_source)
            context = effective.get("max_model_len")
            context_source = f"max_model_len={context}, vLLM's default for this model"
        if context is not None:
            served, fit = preflight.fit_context(
                trace,
                int(context),
                source=context_source,
                policy=request.over_context,
                model_limit=preflight.model_position_limit(baseline.engine.get("model")),
            )
        else:
            say("autotune: note: the model's context length is unknown here; requests are not "
                "checked against it")
    label = trace.source
    if fit is not None and fit.dropped:
        label += f" ({len(served):,} of {len(trace):,} requests left by --over-context drop)"
    tuning, holdout, windows, window_fit = preflight.fit_windows(
        served, request.tuning_window_s, request.holdout_window_s, needs, label=label
    )
    for line in (fit.describe() if fit else "", window_fit.describe()):
        if line:
            say(f"pre-flight: {line}")

    check_writable(request.output_dir)  # before any trial: an unwritable folder must not cost one
    known = FactsCache().engine_arg_names()
    wide = objective.kind == "min-memory"  # memory from 0.05 up: the knob being minimised
    if request.space is not None:
        # A bad space file is refused before vLLM is asked anything (that takes seconds); it is
        # read again below, with the baseline's resolved values.
        early_space = SearchSpace.load(request.space, accelerator, known_names=known, wide_memory=wide)
        check_fp8_space(early_space, accelerator)
    # The built-in ranges contain what the baseline resolves to (1024 sequences on an H200).
    # Checked as a searched config is (vLLM's checks, the relations) before any server starts.
    effective = effective if effective is not None else check_deployable(baseline, baseline_source)
    resolved = baseline.searchable_values(effective)
    if request.space is not None:
        space = SearchSpace.load(request.space, accelerator, known_names=known, wide_memory=wide,
                                 baseline=resolved)
    else:
        space = SearchSpace.default(accelerator, wide_memory=wide, baseline=resolved)
    space = space.extended(numerics_params(request.allow, resolved))
    check_allowed_in_space(request.allow, space)
    space.check_names(known)
    if request.space is not None:
        check_space_ends(space, baseline, str(request.space))
    if wide and MEMORY_KNOB not in space.params:
        raise AutotuneError(
            f"--objective min-memory searches {MEMORY_KNOB}, but the space ({space.source}) does "
            f"not vary it; add it under 'params:' or drop '{MEMORY_KNOB}: null'"
        )
    comparisons = {}
    for path in request.compare:
        comparison = apply_model_flags(with_default_model(ServerConfig.load(path), request), request)
        check_fp8_config(f"--compare {path}", comparison.engine, accelerator)
        check_deployable(comparison, str(path))
        comparisons[f"compare-{path.stem}"] = comparison
    request.trial_server.check(labelled(baseline, comparisons, baseline_source))
    check_searched_serving(space, request.trial_server, baseline, baseline_source)
    profile = profile_trace(trace)
    ladder = ladder_settings(request, accelerator, slos) if objective.uses_ladder else None
    if ladder is not None and objective.kind == "min-memory":
        ladder = ladder.single(float(objective.headroom or 1.0))
    workload = {
        "source": request.workload,
        "fingerprint": profile.fingerprint,
        "profile": profile.model_dump(mode="json", exclude={"length_sample"}),
        "tuning_window": windows.tuning.model_dump(mode="json"),
        "holdout_window": windows.holdout.model_dump(mode="json"),
        "mode": request.mode,
        "speedup": request.speedup,
        "preflight": {
            "context": fit.model_dump(mode="json") if fit else None,
            "windows": window_fit.model_dump(mode="json"),
        },
    }
    if wide and {**effective, **baseline.engine}.get(MEMORY_KNOB) is None:
        raise AutotuneError(
            f"--objective min-memory: the baseline's {MEMORY_KNOB} is unknown (vLLM's default "
            f"could not be resolved); set it in the --baseline file"
        )
    plan = TuningPlan(
        accelerator=accelerator,
        objective=objective,
        slos=slos,
        space=space,
        baseline=baseline,
        baseline_source=baseline_source,
        comparisons=comparisons,
        # Resolved once here (it may start importing vLLM): reported as the baseline's defaults.
        effective_defaults=effective,
        choices=user_choices(request, fingerprint=profile.fingerprint, baseline=baseline,
                             slos=slos, objective=objective),
        workload=workload,
        profile_text=format_profile(profile),
        tuning_window=tuning,
        holdout_window=holdout,
        n_trials=request.trials,
        ladder=ladder,
        resume_gate=request.resume,
        **{name: getattr(request, name) for name in CARRIED},
    )
    return resumed_plan(plan) if request.resume else plan


def user_choices(
    request: TuningRequest, *, fingerprint: str, baseline: ServerConfig, slos: list[SLO],
    objective: Objective,
) -> dict[str, Any]:
    """What the user chose for a study, as --resume compares it (JSON): the trace's fingerprint,
    the model, the --baseline and --compare files as written, the model flags, the SLOs, the
    objective, the --space file and the --allow knobs. Never a value this machine derived from them (the baseline's
    CPU memory share, vLLM's resolved defaults, the space's bands): a resumed study keeps the
    ones it was created with (`resumed_plan`)."""
    return {
        "trace": fingerprint,
        "model": baseline.engine.get("model"),
        "baseline": None if request.baseline is None else as_written(request.baseline),
        "model_flags": {"load_format": request.load_format, "max_model_len": request.max_model_len},
        "compare": {str(path): as_written(path) for path in request.compare},
        "slos": [slo.spec() for slo in slos],
        "objective": objective.spec(),
        "space": None if request.space is None else yaml.safe_load(request.space.read_text(encoding="utf-8")),
        "allow": sorted(request.allow),
    }


def as_written(path: Path) -> dict[str, Any]:
    """A config file's settings as the user wrote them (provenance aside), as JSON."""
    return ServerConfig.load(path).model_dump(mode="json", exclude={"provenance"})


def resumed_plan(plan: TuningPlan) -> TuningPlan:
    """With --resume: AutotuneError (one line naming each change) when the user's choices
    differ from the study's; else the plan on the study's stored space, baseline, comparisons and
    vLLM defaults. Those are derived from the machine at each start (on CPU the memory band and
    the baseline's share follow the node's memory: server.config.cpu_memory_share), so a study
    resumed with nothing changed goes on as it was created. A study with no stored choices (an
    older version's), or none yet: the plan as it is (StudyStore.open compares its space)."""
    stored = stored_attrs(plan.storage_url, plan.study_name)
    if stored is None or CHOICES_ATTR not in stored:
        return plan
    refuse_changed_choices(plan.study_name, redact(plan.storage_url), stored[CHOICES_ATTR], plan.choices)
    update: dict[str, Any] = {}
    space = (stored.get("settings") or {}).get("space")
    if space is not None:
        update["space"] = SearchSpace(
            {name: ParamSpec.model_validate(spec) for name, spec in space["params"].items()},
            [parse_relation(text) for text in space["relations"]],
            source=plan.space.source,
        )
    if "effective_defaults" in stored:
        update["effective_defaults"] = stored["effective_defaults"]
    resolved = stored.get(RESOLVED_ATTR) or {}
    if "baseline" in resolved:
        update["baseline"] = ServerConfig.model_validate(resolved["baseline"])
    if "comparisons" in resolved:
        update["comparisons"] = {name: ServerConfig.model_validate(config)
                                 for name, config in resolved["comparisons"].items()}
    resumed = plan.model_copy(update=update)
    stored_space, machine_space = resumed.space.describe(), plan.space.describe()
    differ = [name for name in stored_space if stored_space[name] != machine_space.get(name)]
    if differ:
        say("autotune: note: --resume: the study's space as created: "
            + "; ".join(f"{name} {stored_space[name]} (this machine's: "
                        f"{machine_space.get(name, 'not searched')})" for name in differ))
    return resumed


def check_searched_serving(
    space: SearchSpace, server: TrialServer, baseline: ServerConfig, baseline_source: str
) -> None:
    """Refuse, in one line, a searched front-end count (`api_processes`) that the trials could
    not vary: beside a fixed --api-server-count, or with a baseline that records traffic (one
    front end only). On `vllm serve` each trial's count is its `--api-server-count`."""
    param = space.params.get("api_processes")
    if param is None:
        return
    where = f"{space.source}: params.api_processes"
    if server.api_server_count is not None:
        raise AutotuneError(f"{where}: --api-server-count {server.api_server_count} fixes the count "
                            "the space searches; drop one of the two")
    high = max(param.choices or []) if param.type == "categorical" else param.high
    if baseline.serving.recorder is not None and (high or 1) > 1:
        raise AutotuneError(f"{where}: {baseline_source} records traffic (serving.recorder), which "
                            "needs one front-end process; drop the recorder from the baseline for "
                            "tuning, or the parameter")


def ladder_settings(request: TuningRequest, accelerator: str, slos: Sequence[SLO]) -> LadderSettings:
    """The ladder's settings from the flags. Every step holds the requests its SLOs'
    percentiles need (`requests_for_slos`: p95 200, p99 1000): the accelerator's default step
    is raised to that, and a smaller --step-requests is refused."""
    overrides: dict[str, Any] = {"resolution": request.ladder_resolution}
    needed = requests_for_slos(slos)
    if request.step_requests is not None:
        if request.step_requests < needed:
            worst = max((s for s in slos if requests_for_percentile(s.percentile) == needed),
                        key=lambda s: s.percentile)
            raise AutotuneError(
                f"--step-requests {request.step_requests}: a p{worst.percentile:g} verdict "
                f"({worst.spec()}) needs at least {needed} requests a step (10 / (1 - "
                f"{worst.percentile:g}/100): about ten requests above the percentile); raise it "
                f"or use a lower percentile")
        overrides["step_requests"] = request.step_requests
    if request.step_seconds is not None:
        overrides["min_step_s"] = request.step_seconds
    if request.max_speedup is not None:
        overrides["max_speedup"] = request.max_speedup
    if request.max_silence_s is not None:
        overrides["max_silence_s"] = request.max_silence_s or None  # 0: silences kept whole
    try:
        settings = LadderSettings.for_accelerator(accelerator, **overrides)
    except ValueError as error:
        first = error.errors()[0]  # type: ignore[attr-defined]
        flag = {"step_requests": "--step-requests", "resolution": "--ladder-resolution",
                "max_speedup": "--max-speedup", "min_step_s": "--step-seconds"}.get(str(first["loc"][0]), str(first["loc"][0]))
        raise AutotuneError(f"{flag} {first['input']}: {first['msg']}") from None
    if settings.step_requests < needed:
        settings = settings.model_copy(update={"step_requests": needed})
    return settings


def explicit_context(request: TuningRequest) -> tuple[int, str, int | None] | None:
    """(max_model_len, where it came from, the model's own limit) when known from the flags
    alone: --max-model-len, or the embedded model (no --model, no --baseline); else None."""
    model = request.model if request.model is not None else str(DEFAULT_MODEL_DIR)
    if request.max_model_len is not None:
        return (request.max_model_len, f"max_model_len={request.max_model_len} from --max-model-len",
                preflight.model_position_limit(model))
    if request.model is None and request.baseline is None:
        return (DEFAULT_MAX_MODEL_LEN, f"max_model_len={DEFAULT_MAX_MODEL_LEN} from the embedded "
                f"model's settings", preflight.model_position_limit(model))
    return None


def detect_accelerator() -> str:
    """"cpu" where vLLM runs on the CPU here, else "gpu" (CUDA, ROCm ...): vLLM's own platform,
    from the facts cache (server.vllm_facts); without vLLM, or where it found no platform,
    whether torch sees a GPU."""
    try:
        device = FactsCache().device_type()
    except ImportError:
        device = ""
    if device:
        return "cpu" if device == "cpu" else "gpu"
    try:
        import torch  # here, not at the top: importing torch costs seconds and may be absent
    except ImportError:
        return "cpu"
    return "gpu" if torch.cuda.is_available() else "cpu"


def load_baseline(request: TuningRequest) -> tuple[ServerConfig, str]:
    """The config the user runs today, or vLLM's defaults for the chosen model."""
    if request.baseline is not None:
        baseline = with_default_model(ServerConfig.load(request.baseline), request)
        source = f"{request.baseline}"
    else:
        engine = default_engine_settings()
        if request.model is not None:
            # The embedded model's own settings do not apply to another model; keep only
            # what this machine needs (eager mode / CPU memory share on CPU).
            for key in ("model", "load_format", "dtype", "max_model_len"):
                engine.pop(key, None)
        baseline = ServerConfig(engine=engine)
        source = "vLLM's defaults (no engine overrides)"
    return apply_model_flags(baseline, request), source


def with_default_model(config: ServerConfig, request: TuningRequest) -> ServerConfig:
    """A config file that names no model serves the run's model: --model, else the embedded
    one with its own settings (server.config.NO_MODEL_RULE, as `python -m server --config`
    reads the file), never vLLM's built-in default model, which would be downloaded."""
    if request.model is not None:
        return config
    return config.with_default_model()


def apply_model_flags(config: ServerConfig, request: TuningRequest) -> ServerConfig:
    """--model / --load-format / --max-model-len apply to every config measured."""
    engine = dict(config.engine)
    if request.model is not None:
        engine["model"] = request.model
    if request.load_format is not None:
        engine["load_format"] = request.load_format
    if request.max_model_len is not None:
        engine["max_model_len"] = request.max_model_len
    model_dir = Path(str(engine.get("model", "")))
    if model_dir.is_dir() and not has_tokenizer(model_dir):
        # Shape-only model folders (config.json alone) run without a tokenizer: token-id
        # prompts only, which is all the replayer sends.
        engine["skip_tokenizer_init"] = True
    return config.model_copy(update={"engine": engine, "provenance": None})


def has_tokenizer(model_dir: Path) -> bool:
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    return any((model_dir / name).exists() for name in names)


def check_deployable(config: ServerConfig, where: str) -> dict[str, Any]:
    """`config`'s vLLM defaults resolved (`resolve_defaults`), once it passed the checks a
    searched config gets before any server starts: vLLM's own (EngineSettingsRefused: `where`,
    the settings, vLLM's whole reason) and the built-in relations (ConfigError naming the relation
    and the values that break it). For the baseline and every --compare file."""
    check_model_available(str(config.engine.get("model")), where)
    effective = resolve_defaults(config, where)
    values = config.searchable_values(effective)
    for relation in (parse_relation(text) for text in BUILTIN_RELATIONS):
        if relation.check(values) is False:
            shown = ", ".join(f"{name}={values.get(name)!r}" for name in sorted(relation.names()))
            raise ConfigError(where, None, None, f"breaks {relation.text} ({shown}); vLLM "
                              "refuses such a config: change one of these settings")
    return effective


@contextlib.contextmanager
def quiet_vllm() -> Iterator[None]:
    """vLLM's INFO lines off while it only checks configs (each check logs a dozen)."""
    logger = logging.getLogger("vllm")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_space_ends(space: SearchSpace, baseline: ServerConfig, where: str) -> None:
    """Each searched engine argument of a space file at its ends (low and high, or each choice),
    one at a time on the baseline, through vLLM's own field checks, before any server starts: a
    range vLLM refuses at an end (max_num_seqs from -5, gpu_memory_utilization up to 3.0) would
    spend launches on configs that cannot start. ConfigError naming the file, the parameter,
    the value and vLLM's reason. vLLM's checks across fields (batched tokens >= sequences) are
    not asked here: the space's relations skip such configs."""
    from pydantic import ValidationError

    from server.engine import resolve_engine_config

    for name, param in space.params.items():
        if name in SEARCHABLE_SERVING_SETTINGS:
            continue
        ends = param.choices if param.type == "categorical" else [param.low, param.high]
        for value in ends or []:
            if value is None:
                continue  # vLLM's default
            if param.type in ("int", "pow2") and isinstance(value, float):
                value = int(value)
            try:  # our own type checks first (ServerConfig), then vLLM's
                trial = ServerConfig.model_validate(
                    {**baseline.model_dump(), "engine": {**baseline.engine, name: value}})
            except ValidationError as error:
                reason = str(error.errors()[0]["msg"])
                reason = reason[reason.find("expected"):] if "expected" in reason else reason
                raise ConfigError(where, f"params.{name}", value, f"not a value vLLM takes: {reason}") from None
            try:
                with quiet_vllm():
                    resolve_engine_config(trial)
            except ValidationError as error:
                mine = [e for e in error.errors() if tuple(e.get("loc", ())) == (name,)]
                if mine:
                    reason = str(mine[0]["msg"]).removeprefix("Value error, ")
                    raise ConfigError(where, f"params.{name}", value,
                                      f"vLLM refuses this end of the range ({reason})") from None
            except Exception:  # noqa: BLE001 - anything else is not about this one value
                continue


def resolve_defaults(baseline: ServerConfig, where: str) -> dict[str, Any]:
    """What vLLM will actually use for the baseline (defaults resolved), or {} if it cannot
    tell without starting an engine (the install or the host: a note); reported as "which
    defaults the baseline used". EngineSettingsRefused (naming `where`) when vLLM refuses the
    values themselves."""
    def ask_vllm() -> dict[str, Any]:
        try:
            # The server owns the usage context it builds the engine with; ask it, not guess.
            # Imported here: server.engine imports vLLM (seconds), needed only at this point.
            from server.engine import effective_settings, resolve_engine_config

            settings = effective_settings(resolve_engine_config(baseline))
        except Exception as error:  # noqa: BLE001 - an unresolvable default only costs a report line
            if refused_by_vllm(error):
                raise EngineSettingsRefused(where, baseline.engine_settings(), error) from None
            print(f"autotune: note: could not resolve vLLM's defaults ({vllm_reason(error)}); "
                  "continuing", file=sys.stderr)
            return {}
        keep = ("usage_context", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
                "max_model_len", "block_size", "enforce_eager")
        data = settings.model_dump()
        return {key: data[key] for key in keep if data.get(key) is not None}

    return FactsCache().resolved_defaults(baseline.engine_settings(), ask_vllm)
