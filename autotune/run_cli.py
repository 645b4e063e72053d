"""`autotune run`: search, validate, export `best.yaml` and write `report.md`."""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path
from typing import Any

from autotune.errors import EXIT_CODES_HELP, AutotuneError, HelpFormatter, NothingMeasured
from autotune.preflight import OVER_CONTEXT_CHOICES
from autotune.progress import format_duration, parse_duration

# 6 trials (baseline included) on a 30 s window, then the gate the product promises: the top 3
# and the baseline, 3 times each, interleaved, on a 20 s held-out window. Windows are lengthened
# until each holds what the SLO percentiles need (autotune.preflight): on the sample trace with
# the default p95 SLOs, to ~47 and ~48 s (200+ requests each). On the embedded tiny model and a
# 2-core CPU each run costs ~40 s of engine start plus its window: ~28 minutes.
DEFAULT_TRIALS = 6
DEFAULT_TUNING_S = 30.0
DEFAULT_HOLDOUT_S = 20.0
DEFAULT_TOP_K = 3
DEFAULT_REPEATS = 3


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="tune a vLLM config on a traffic trace and export best.yaml + report.md",
        description=(
            "Search engine settings on a window of your trace, re-check the best few and the "
            "baseline on a held-out window, and write RESULTS/best.yaml (a `vllm serve --config` "
            "file) and RESULTS/report.md. The baseline is kept unless a config beats it beyond "
            "the measured noise while meeting every SLO in every repeat. Before any engine "
            "starts, the trace is checked against the model's context and the windows against "
            "the SLO percentiles (see --over-context); a baseline that cannot be measured stops "
            "the run (exit 12) and nothing is exported."
        ),
        epilog=EXIT_CODES_HELP,
        formatter_class=HelpFormatter,
    )
    add = parser.add_argument
    add("--workload", required=True, metavar="TRACE.jsonl", help="the traffic trace to tune on")
    add("--trials", type=int, default=None, metavar="N",
        help="trials in the search, the baseline included (with --resume: the study's total) "
             f"(default: {DEFAULT_TRIALS}, or no limit when --time-budget or --gpu-seconds is given)")
    add("--time-budget", default=None, metavar="DURATION",
        help="stop starting search trials after this long, e.g. 900, 30m, 1.5h; the gate runs after "
             "(default: no limit, --trials decides)")
    add("--gpu-seconds", default=None, metavar="DURATION",
        help="stop starting search trials once their engines have held this many accelerator-"
             "seconds (each trial's wall time x the GPUs its config uses: tensor x pipeline x data "
             "parallel size; on CPU, its wall time), e.g. 3600 or 8h; the gate runs after "
             "(default: no limit, --trials decides)")
    add("--study-name", default=None,
        help="Optuna study name (default: the workload's file name and today's date)")
    add("--output-dir", type=Path, default=None, metavar="DIR",
        help="where trials, best.yaml and report.md go (default: results/STUDY_NAME/)")
    add("--storage", default=None, metavar="URL",
        help="Optuna storage URL, any RDB (default: sqlite:///OUTPUT_DIR/study.db)")
    add("--resume", action="store_true",
        help="continue the study of this name: keeps its trials, closes ones a killed run left open")
    add("--model", default=None, metavar="PATH",
        help="model to serve (default: the embedded tiny model, dummy weights)")
    add("--load-format", default=None,
        help="vLLM load format, e.g. dummy for random weights of the real shape "
             "(default: vLLM's auto; dummy for the embedded model)")
    add("--max-model-len", type=int, default=None, metavar="TOKENS", help="vLLM max_model_len (default: the model's; 2048 for the embedded model)")
    add("--over-context", choices=OVER_CONTEXT_CHOICES, default="refuse",
        help="requests whose input + output exceed the model's context: refuse the run (default), "
             "drop them from the trace, or cap them (prompts cut to fit); dropped or capped "
             "requests are counted in the log, report.md and best.yaml")
    add("--baseline", type=Path, default=None, metavar="FILE.yaml",
        help="the config you run today (a server/vllm serve config); default: vLLM's defaults")
    add("--compare", type=Path, action="append", default=None, metavar="FILE.yaml",
        help="another config to measure beside the baseline and the top K on the held-out "
             "window (repeatable; e.g. your hand-tuned config); reported, never exported")
    add("--space", type=Path, default=None, metavar="FILE.yaml",
        help="widen/narrow/add searched engine arguments and relations (see autotune/space.py)")
    add("--slo", action="append", default=None, metavar="METRIC_pPCT_ms=MS",
        help="an SLO, repeatable, e.g. --slo ttft_p95_ms=500 (default on CPU: "
             "ttft_p95_ms=1000 and tpot_p95_ms=100; on GPU: ttft_p95_ms=500 and tpot_p95_ms=50)")
    add("--objective", default="capacity",
        help="capacity (the highest req/s at which every SLO holds, found by a load ladder in "
             "one launch per config), goodput (req/s meeting every SLO at the recorded rate), "
             "throughput, or pareto[:METRIC_pPCT] (throughput vs a latency percentile) "
             "(default: %(default)s)")
    add("--step-requests", type=int, default=None, metavar="N",
        help="capacity ladder: requests per load step, at least (default: 200 on GPU, 60 on CPU)")
    add("--ladder-resolution", type=float, default=0.1, metavar="R",
        help="capacity ladder: stop bisecting when the failing rate is within this fraction "
             "of the passing one (default: %(default)s)")
    add("--seed", type=int, default=0, help="sampler seed (default: %(default)s)")
    add("--tuning-window", type=float, default=DEFAULT_TUNING_S, metavar="S",
        help="seconds of trace replayed per search trial; lengthened when too few requests for "
             "the SLO percentiles (p95: 200, p99: 1,000) (default: %(default)s)")
    add("--holdout-window", type=float, default=DEFAULT_HOLDOUT_S, metavar="S",
        help="seconds of (disjoint) trace replayed per validation run; lengthened likewise "
             "(default: %(default)s)")
    add("--speedup", type=float, default=1.0,
        help="replay arrivals this many times faster than recorded (timed mode) (default: %(default)s)")
    add("--top-k", type=int, default=DEFAULT_TOP_K, metavar="K",
        help="configs from the search re-run in validation (default: %(default)s)")
    add("--repeats", type=int, default=DEFAULT_REPEATS, metavar="R",
        help="validation repeats per config (interleaved) (default: %(default)s)")
    add("--mode", default="timed", metavar="timed|concurrency=N",
        help="replay at recorded arrival times, or closed loop with N requests in flight (default: %(default)s)")
    add("--startup-timeout", type=float, default=300.0, metavar="S",
        help="seconds a server may take to become ready before the trial fails (default: %(default)s)")
    add("--workers-only", action="store_true",
        help="create the study in --storage with every setting above stored in it, measure "
             "nothing and exit: `autotune worker --storage URL --study NAME` processes (one per "
             "GPU, any number of hosts) measure its trials, `autotune finalize` validates and exports")
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    from autotune.launcher import reap_stale_servers
    from autotune.trial import TrialRunner

    if args.trials is not None and args.trials < 1:
        raise AutotuneError(f"--trials {args.trials}: must be at least 1 (the baseline)")
    if args.top_k < 1 or args.repeats < 1:
        raise AutotuneError("--top-k and --repeats must be at least 1")
    budget = parse_duration(args.time_budget) if args.time_budget else None
    gpu_seconds = parse_duration(args.gpu_seconds, option="--gpu-seconds") if args.gpu_seconds else None
    if args.trials is None and budget is None and gpu_seconds is None:
        args.trials = DEFAULT_TRIALS
    if args.workers_only and args.resume:
        raise AutotuneError("--workers-only creates a study; to add measurements to it start "
                            "`autotune worker --storage URL --study NAME` instead of --resume")
    study_name = args.study_name or f"{Path(args.workload).stem}-{dt.date.today():%Y%m%d}"
    output_dir: Path = args.output_dir or Path("results") / study_name
    plan = plan_study(args, study_name=study_name, output_dir=output_dir, time_budget_s=budget,
                      gpu_seconds=gpu_seconds)
    # The command as a user would retype it, whatever entry point ran it.
    argv = ["autotune", *sys.argv[1:]]
    if args.workers_only:
        from autotune.distributed import create_shared_study

        create_shared_study(
            plan,
            effective_defaults=plan_defaults(plan),
            startup_timeout_s=args.startup_timeout,
            command_line=argv,
            say=_say,
        )
        return 0
    runner = TrialRunner(
        mode=args.mode,
        speedup=args.speedup,
        slos=plan["slos"],
        startup_timeout_s=args.startup_timeout,
        stale_registry=output_dir / "servers.json",
        ladder=plan["ladder"],
        say=_say,
    )
    return execute(plan, runner=runner, reap=reap_stale_servers, argv=argv)


def plan_study(
    args: argparse.Namespace,
    *,
    study_name: str,
    output_dir: Path,
    time_budget_s: float | None,
    gpu_seconds: float | None = None,
) -> dict[str, Any]:
    """Everything checked and prepared before the first trial (no server started).

    The pre-flight checks (autotune.preflight) come first and write nothing: a trace the
    model cannot serve, or windows too short for the SLO percentiles, cost seconds.
    """
    from autotune import preflight
    from autotune.objective import default_slos, parse_objective
    from autotune.space import SearchSpace, engine_argument_names
    from autotune.study import StudyOptions, check_writable
    from server.config import ServerConfig
    from workloads.profile import format_profile, profile_trace
    from workloads.slo import parse_slos
    from workloads.trace import load_trace

    slos = parse_slos(args.slo) if args.slo else None
    trace = load_trace(args.workload)
    # The context first, where it is known without importing vLLM (the embedded model, or
    # --max-model-len): a trace the model cannot serve is refused in about a second.
    early = explicit_context(args)
    served, fit = trace, None
    if early is not None:
        served, fit = preflight.fit_context(trace, early[0], source=early[1],
                                            policy=args.over_context, model_limit=early[2])
    baseline, baseline_source = load_baseline(args)
    accelerator = detect_accelerator()
    slos = slos or default_slos(accelerator)
    objective = parse_objective(args.objective, slos)
    needs = preflight.requirements(slos, objective)
    effective: dict[str, Any] | None = None
    if fit is None:
        context = baseline.engine.get("max_model_len")  # here only a --baseline file sets it
        context_source = f"max_model_len={context} from {args.baseline}"
        if context is None:  # the model's own: what vLLM derives from its config
            effective = resolve_defaults(baseline)
            context = effective.get("max_model_len")
            context_source = f"max_model_len={context}, vLLM's default for this model"
        if context is not None:
            served, fit = preflight.fit_context(
                trace,
                int(context),
                source=context_source,
                policy=args.over_context,
                model_limit=preflight.model_position_limit(baseline.engine.get("model")),
            )
        else:
            _say("autotune: note: the model's context length is unknown here; requests are not "
                 "checked against it")
    label = trace.source
    if fit is not None and fit.dropped:
        label += f" ({len(served):,} of {len(trace):,} requests left by --over-context drop)"
    tuning, holdout, windows, window_fit = preflight.fit_windows(
        served, args.tuning_window, args.holdout_window, needs, label=label
    )
    for line in (fit.describe() if fit else "", window_fit.describe()):
        if line:
            _say(f"pre-flight: {line}")

    check_writable(output_dir)  # before any trial: an unwritable folder must not cost one
    known = engine_argument_names()
    if args.space is not None:
        space = SearchSpace.load(args.space, accelerator, known_names=known)
    else:
        space = SearchSpace.default(accelerator)
        space.check_names(known)
    comparisons = {
        f"compare-{path.stem}": apply_model_flags(ServerConfig.load(path), args)
        for path in (args.compare or [])
    }
    profile = profile_trace(trace)
    ladder = None
    if objective.uses_ladder:
        from autotune.ladder import LadderSettings

        overrides: dict[str, Any] = {"resolution": args.ladder_resolution}
        if args.step_requests is not None:
            overrides["step_requests"] = args.step_requests
        try:
            ladder = LadderSettings.for_accelerator(accelerator, **overrides)
        except ValueError as error:
            raise AutotuneError(
                f"--step-requests {args.step_requests} / --ladder-resolution "
                f"{args.ladder_resolution}: {error.errors()[0]['msg']}"  # type: ignore[attr-defined]
            ) from None
    options = StudyOptions(
        study_name=study_name,
        output_dir=output_dir,
        storage=args.storage,
        resume=args.resume,
        resume_gate=args.resume,
        n_trials=args.trials,
        time_budget_s=time_budget_s,
        gpu_seconds=gpu_seconds,
        seed=args.seed,
        top_k=args.top_k,
        repeats=args.repeats,
    )
    workload = {
        "source": str(args.workload),
        "fingerprint": profile.fingerprint,
        "profile": profile.model_dump(mode="json", exclude={"length_sample"}),
        "tuning_window": windows.tuning.model_dump(mode="json"),
        "holdout_window": windows.holdout.model_dump(mode="json"),
        "mode": args.mode,
        "speedup": args.speedup,
        "preflight": {
            "context": fit.model_dump(mode="json") if fit else None,
            "windows": window_fit.model_dump(mode="json"),
        },
    }
    plan = {
        "options": options,
        "accelerator": accelerator,
        "slos": slos,
        "objective": objective,
        "space": space,
        "baseline": baseline,
        "baseline_source": baseline_source,
        "comparisons": comparisons,
        "tuning": tuning,
        "holdout": holdout,
        "workload": workload,
        "profile_text": format_profile(profile),
        "ladder": ladder,
    }
    if effective is not None:
        plan["effective_defaults"] = effective
    return plan


def explicit_context(args: argparse.Namespace) -> tuple[int, str, int | None] | None:
    """(max_model_len, where it came from, the model's own limit) when known from the flags
    alone: --max-model-len, or the embedded model (no --model, no --baseline); else None."""
    from autotune.preflight import model_position_limit
    from server.config import DEFAULT_MAX_MODEL_LEN, DEFAULT_MODEL_DIR

    model = args.model if args.model is not None else str(DEFAULT_MODEL_DIR)
    if args.max_model_len is not None:
        return args.max_model_len, f"max_model_len={args.max_model_len} from --max-model-len", model_position_limit(model)
    if args.model is None and args.baseline is None:
        return (DEFAULT_MAX_MODEL_LEN, f"max_model_len={DEFAULT_MAX_MODEL_LEN} from the embedded "
                f"model's settings", model_position_limit(model))
    return None


def plan_defaults(plan: dict[str, Any]) -> dict[str, Any]:
    """vLLM's resolved defaults for the plan's baseline (resolved once, kept in the plan)."""
    if "effective_defaults" not in plan:
        plan["effective_defaults"] = resolve_defaults(plan["baseline"])
    return plan["effective_defaults"]


def detect_accelerator() -> str:
    try:
        import torch
    except ImportError:
        return "cpu"
    return "gpu" if torch.cuda.is_available() else "cpu"


def load_baseline(args: argparse.Namespace) -> tuple[Any, str]:
    """The config the user runs today, or vLLM's defaults for the chosen model."""
    from server.config import ServerConfig, default_engine_settings

    if args.baseline is not None:
        baseline = ServerConfig.load(args.baseline)
        source = f"{args.baseline}"
    else:
        engine = default_engine_settings()
        if args.model is not None:
            # The embedded model's own settings do not apply to another model; keep only
            # what this machine needs (eager mode / CPU memory share on CPU).
            for key in ("model", "load_format", "dtype", "max_model_len"):
                engine.pop(key, None)
        baseline = ServerConfig(engine=engine)
        source = "vLLM's defaults (no engine overrides)"
    return apply_model_flags(baseline, args), source


def apply_model_flags(config: Any, args: argparse.Namespace) -> Any:
    """--model / --load-format / --max-model-len apply to every config measured."""
    engine = dict(config.engine)
    if args.model is not None:
        engine["model"] = args.model
    if args.load_format is not None:
        engine["load_format"] = args.load_format
    if args.max_model_len is not None:
        engine["max_model_len"] = args.max_model_len
    model_dir = Path(str(engine.get("model", "")))
    if model_dir.is_dir() and not has_tokenizer(model_dir):
        # Shape-only model folders (config.json alone) run without a tokenizer: token-id
        # prompts only, which is all the replayer sends.
        engine["skip_tokenizer_init"] = True
    return config.model_copy(update={"engine": engine, "provenance": None})


def has_tokenizer(model_dir: Path) -> bool:
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    return any((model_dir / name).exists() for name in names)


def resolve_defaults(baseline: Any) -> dict[str, Any]:
    """What vLLM will actually use for the baseline (defaults resolved), or {} if it cannot
    tell without starting an engine; reported as "which defaults the baseline used"."""
    try:
        # The server owns the usage context it builds the engine with; ask it, not guess.
        from server.engine import effective_settings, resolve_engine_config

        settings = effective_settings(resolve_engine_config(baseline))
    except Exception as error:  # noqa: BLE001 - an unresolvable default only costs a report line
        print(f"autotune: note: could not resolve vLLM's defaults ({error}); continuing", file=sys.stderr)
        return {}
    keep = ("usage_context", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
            "max_model_len", "block_size", "enforce_eager")
    data = settings.model_dump()
    return {key: data[key] for key in keep if data.get(key) is not None}


def build_tuning(plan: dict[str, Any], *, runner: Any, effective: dict[str, Any], **extra: Any) -> Any:
    """The TuningStudy a plan describes (`extra`: further TuningStudy keywords)."""
    from autotune.study import TuningStudy

    extra.setdefault("say", _say)
    return TuningStudy(
        options=plan["options"],
        space=plan["space"],
        objective=plan["objective"],
        slos=plan["slos"],
        baseline=plan["baseline"],
        baseline_source=plan["baseline_source"],
        tuning_window=plan["tuning"],
        holdout_window=plan["holdout"],
        runner=runner,
        comparisons=plan["comparisons"],
        effective_defaults=effective,
        **extra,
    )


def execute(plan: dict[str, Any], *, runner: Any, reap: Any, argv: list[str]) -> int:
    import socket

    from autotune.outcome import stop_if_baseline_failed

    options = plan["options"]
    say = _say
    effective = plan_defaults(plan)
    tuning = build_tuning(
        plan,
        runner=runner,
        effective=effective,
        study_attrs={"workload_fingerprint": plan["workload"]["fingerprint"]},
        reap=reap,
        trial_attrs={"host": socket.gethostname()},
    )
    # Without a measured baseline nothing the search finds can be judged: stop at once.
    tuning.between_trials = lambda: stop_if_baseline_failed(tuning.study)
    study = tuning.open()
    say(
        f"study {options.study_name} in {redact(options.storage_url)}: objective "
        f"{plan['objective'].spec()}, SLOs {', '.join(s.spec() for s in plan['slos'])}; searching "
        + ", ".join(f"{k} ({v})" for k, v in plan["space"].describe().items())
    )
    try:
        study = tuning.run_search()
    except NothingMeasured:
        return finish(plan, tuning, study, effective=effective, argv=argv)  # reports, raises
    say(f"search done in {format_duration(tuning.search_wall_s)}; validating on the held-out window")
    return finish(plan, tuning, study, effective=effective, argv=argv)


def redact(url: str) -> str:
    """A storage URL fit for logs and reports: the password hidden."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a SQLAlchemy URL: nothing to hide in it
        return url


def redact_argv(argv: list[str]) -> list[str]:
    """A command line fit for best.yaml and the report: --storage passwords hidden."""
    shown: list[str] = []
    for index, arg in enumerate(argv):
        if index > 0 and argv[index - 1] == "--storage":
            arg = redact(arg)
        elif arg.startswith("--storage="):
            arg = "--storage=" + redact(arg.removeprefix("--storage="))
        shown.append(arg)
    return shown


def finish(
    plan: dict[str, Any],
    tuning: Any,
    study: Any,
    *,
    effective: dict[str, Any],
    argv: list[str],
    search_extra: dict[str, Any] | None = None,
) -> int:
    """The gate, best.yaml and report.md for a study whose search is over.

    Only a study with a measured baseline gets a gate and a best.yaml; without one, report.md
    says what failed and NothingMeasured (exit 12) is raised.
    """
    from autotune.export import build_provenance, export_best, final_config
    from autotune.gate import BASELINE, Measurement, decide
    from autotune.outcome import baseline_problem, baseline_standing
    from autotune.report import ReportInputs, capacity_line, write_report
    from autotune.study import ValidationResult

    options = plan["options"]
    say = _say
    problem = baseline_problem(study)
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
    standing = baseline_standing(result.measurements, tuning.baseline_trial(study), plan["slos"],
                                 plan["objective"])
    validation = [m.model_dump() for m in result.measurements]
    provenance = build_provenance(
        decision=decision,
        winner_overrides=overrides,
        objective=plan["objective"],
        slos=plan["slos"],
        study_name=options.study_name,
        storage_url=redact(options.storage_url),
        command_line=redact_argv(argv),
        model=str(plan["baseline"].engine.get("model")),
        workload=plan["workload"],
        baseline_source=plan["baseline_source"],
        effective_defaults=effective,
        validation=validation,
        search={"trials": len(study.trials), "search_wall_s": round(tuning.search_wall_s, 1),
                "validation_wall_s": round(result.wall_s, 1), **(search_extra or {})},
        baseline_standing=standing,
    )
    capacity = capacity_figures(plan, decision, gated=bool(result.measurements),
                                baseline_trial=tuning.baseline_trial(study))
    if capacity is not None:
        provenance["capacity"] = capacity
    best_path = options.output_dir / "best.yaml"
    if verdict != "nothing":
        export_best(best_path, final_config(plan["baseline"], overrides), provenance)
    report = write_report(
        options.output_dir,
        ReportInputs(
            study=study,
            objective=plan["objective"],
            slos=plan["slos"],
            decision=decision,
            measurements=result.measurements,
            run_dirs=result.run_dirs,
            provenance=provenance,
            best_yaml=best_path,
            search_wall_s=tuning.search_wall_s,
            gate_wall_s=result.wall_s,
            gate_server_s=result.server_s,
            workload_profile=plan["profile_text"],
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
    if decision.keep_baseline:
        say("")
        say("*** KEPT THE BASELINE: no config beat it beyond the noise. ***")
        say(f"*** {decision.reason} ***")
        say(f"*** baseline measured: {standing} ***")
        say(f"*** {best_path} holds the baseline config. ***")
    else:
        say(f"winner {decision.winner}: {decision.reason}")
        say("changed: " + ", ".join(f"{k}={v}" for k, v in overrides.items()))
    say(f"wrote {best_path} and {report}")
    return 0


def capacity_figures(
    plan: dict[str, Any], decision: Any, *, gated: bool, baseline_trial: Any
) -> dict[str, Any] | None:
    """Capacity and headroom of the baseline and the winner for best.yaml's provenance, the
    report and the last lines: medians of the gate's held-out repeats, or, when no gate ran,
    the baseline's search measurement on the tuning window (and the figures say which)."""
    from autotune.ladder import recorded_rate

    if not plan["objective"].uses_ladder:
        return None
    if gated and decision.baseline_median is not None:
        recorded = recorded_rate(plan["holdout"])
        base = float(decision.baseline_median)
        source = "held-out window, median of the gate's repeats"
    elif baseline_trial is not None and baseline_trial.user_attrs.get("capacity_rps") is not None:
        recorded = recorded_rate(plan["tuning"])
        base = float(baseline_trial.user_attrs["capacity_rps"])
        source = "tuning window, the baseline's search trial (no gate ran)"
    else:
        return None
    figures: dict[str, Any] = {
        "measured_on": source,
        "recorded_rps": round(recorded, 3),
        "baseline_rps": round(base, 3),
        "baseline_headroom": round(base / recorded, 3) if recorded > 0 else None,
    }
    if gated and not decision.keep_baseline and decision.candidate_median is not None:
        win = float(decision.candidate_median)
        figures["winner_rps"] = round(win, 3)
        figures["winner_headroom"] = round(win / recorded, 3) if recorded > 0 else None
    return figures


def _say(line: str) -> None:
    print(line, flush=True)
