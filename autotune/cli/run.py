"""`autotune run`: search, validate, export `best.yaml` and write `report.md`.

The flags become a TuningRequest (`run_request`); autotune.prepare checks it and makes the
TuningPlan; autotune.pipeline runs it (or autotune.distributed stores it for workers).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

from autotune.cli.flags import add_measurement_flags, measurement_fields
from autotune.errors import AutotuneError, describe_command
from autotune.measure.server_registry import reap_stale_servers
from autotune.measure.servers import add_server_flags, trial_server
from autotune.plan import (
    DEFAULT_HEADROOM,
    DEFAULT_TRIALS,
    TuningRequest,
)
from autotune.progress import parse_duration, say
from autotune.search.numerics import ALLOW_CHOICES
from server.config import NO_MODEL_RULE


def configure(parser: argparse.ArgumentParser) -> None:
    """`autotune run`'s description and flags."""
    describe_command(
        parser,
        (
            "Search engine settings on a window of your trace, re-check the best few and the "
            "baseline on a held-out window, and write RESULTS/best.yaml (a `vllm serve --config` "
            "file) and RESULTS/report.md. The baseline is kept unless a config beats it beyond "
            "the measured noise while meeting every SLO in every repeat. Before any engine "
            "starts, the trace is checked against the model's context and the windows against "
            "the SLO percentiles (see --over-context); a baseline that cannot be measured stops "
            "the run (exit 12) and nothing is exported."
        ),
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
        help="where trials, best.yaml and report.md go (default: runs/STUDY_NAME/, which git ignores)")
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
    add("--baseline", type=Path, default=None, metavar="FILE.yaml",
        help="the config you run today (a server/vllm serve config; without --model, "
             f"{NO_MODEL_RULE}); default: vLLM's defaults")
    add("--compare", type=Path, action="append", default=None, metavar="FILE.yaml",
        help="another config to measure beside the baseline and the top K on the held-out "
             "window (repeatable; e.g. your hand-tuned config; no model: as --baseline); "
             "reported, never exported")
    add("--space", type=Path, default=None, metavar="FILE.yaml",
        help="widen/narrow/add searched engine arguments and relations (see autotune/search/space.py)")
    add("--allow", action="append", choices=ALLOW_CHOICES, default=None, metavar="fp8",
        help="also search knobs that change the model's outputs: fp8 = vLLM's `quantization: fp8` "
             "(FP8 weights, quantized at load) and `kv_cache_dtype: fp8`; needs a GPU of compute "
             "capability 8.9+ (refused otherwise). Configs using them are marked \"changes "
             "numerics: check output quality before deploying\", and the best config without "
             "them is validated beside them (default: off)")
    add("--slo", action="append", default=None, metavar="METRIC_pPCT_ms=MS",
        help="an SLO, repeatable, e.g. --slo ttft_p95_ms=500 (default on CPU: "
             "ttft_p95_ms=1000 and tpot_p95_ms=100; on GPU: ttft_p95_ms=500 and tpot_p95_ms=50)")
    add("--objective", default="capacity",
        help="capacity (the highest req/s at which every SLO holds, found by a load ladder in "
             "one launch per config), goodput (req/s meeting every SLO at the recorded rate), "
             "throughput, pareto[:METRIC_pPCT] (throughput vs a latency percentile), or "
             "min-memory (the smallest gpu_memory_utilization that meets every SLO at the "
             "recorded rate x --headroom; for several models on one GPU) (default: %(default)s)")
    add("--headroom", type=float, default=DEFAULT_HEADROOM, metavar="H",
        help="min-memory objective: every SLO must hold at H x the traffic's recorded rate "
             "(one load step at speed-up H per trial and per gate run) (default: %(default)s)")
    add("--search-anyway", action="store_true",
        help="search even when the baseline meets the SLOs at no load the ladder tries (by "
             "default the run then ends with exit 12 and the SLO that cannot be met)")
    add_measurement_flags(add)
    add_server_flags(add)
    add("--workers-only", action="store_true",
        help="create the study in --storage with every setting above stored in it, measure "
             "nothing and exit: `autotune worker --storage URL --study NAME` processes (one per "
             "GPU, any number of hosts) measure its trials, `autotune finalize` validates and exports")
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    # Imported here, not at the top: they load Optuna and the measuring stack, which
    # `autotune run --help` does not need.
    from autotune import pipeline
    from autotune.distributed import create_shared_study
    from autotune.prepare import prepare_plan

    request = run_request(args)
    plan = prepare_plan(request)
    if args.workers_only:
        create_shared_study(plan, say=say)
        return 0
    runner = pipeline.build_runner(plan, registry=plan.output_dir / "servers.json", say=say)
    return pipeline.execute(plan, runner=runner, reap=reap_stale_servers)


def run_request(args: argparse.Namespace) -> TuningRequest:
    """`autotune run`'s flags checked and turned into the request the plan is built from."""
    if args.trials is not None and args.trials < 1:
        raise AutotuneError(f"--trials {args.trials}: must be at least 1 (the baseline)")
    if args.top_k < 1 or args.repeats < 1:
        raise AutotuneError("--top-k and --repeats must be at least 1")
    if not args.headroom > 0:
        raise AutotuneError(f"--headroom {args.headroom:g}: must be above 0 (1.5 = 50% more than "
                            "the recorded rate)")
    budget = parse_duration(args.time_budget) if args.time_budget else None
    gpu_seconds = parse_duration(args.gpu_seconds, option="--gpu-seconds") if args.gpu_seconds else None
    trials = args.trials
    if trials is None and budget is None and gpu_seconds is None:
        trials = DEFAULT_TRIALS
    if args.workers_only and args.resume:
        raise AutotuneError("--workers-only creates a study; to add measurements to it start "
                            "`autotune worker --storage URL --study NAME` instead of --resume")
    study_name = args.study_name or f"{Path(args.workload).stem}-{dt.date.today():%Y%m%d}"
    return TuningRequest(
        workload=args.workload,
        study_name=study_name,
        output_dir=args.output_dir or Path("runs") / study_name,
        # The command as a user would retype it, whatever entry point ran it.
        command_line=["autotune", *sys.argv[1:]],
        trials=trials,
        time_budget_s=budget,
        gpu_seconds=gpu_seconds,
        storage=args.storage,
        resume=args.resume,
        model=args.model,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        baseline=args.baseline,
        compare=args.compare or [],
        space=args.space,
        allow=sorted(set(args.allow or [])),
        slos=args.slo,
        objective=args.objective,
        headroom=args.headroom,
        search_anyway=args.search_anyway,
        trial_server=trial_server(args.server, args.api_server_count),
        **measurement_fields(args),
    )
