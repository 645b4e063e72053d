"""`autotune retune`: re-tune the deployed config when the traffic has drifted.

    autotune retune --current TRAFFIC --config deployed.yaml [--force] [--dry-run]

1. Drift check: the current traffic (a trace, or the server recorder's folder) against the
   profile stored in the deployed config's provenance (or `--reference`). No drift and no
   `--force`: exit 0, nothing launched.
2. Capacity check (capacity objective, drift, no `--force`): the deployed config is launched
   once and its capacity measured on the current traffic's tuning window by the load ladder
   (autotune.decide.capacity_check), into `deployed-capacity.json` in the re-tune's folder. While it
   carries at least `--headroom` H times the current recorded rate it stays: exit 11, no study.
   Below H the study runs, with that measurement as its trial 0 (the baseline is not launched
   again). Under the other objectives (goodput, throughput, pareto) every drift re-tunes.
3. A study warm-started from the previous one: the deployed config is the baseline (trial 0,
   and what the gate compares against); then the previous study's best trials and the
   deployed config's neighbours (one step along each searched parameter) are enqueued before
   the sampler proposes anything. `autotune run`'s own plan and pipeline run it.
4. Only a config that beats the deployed one in the gate is written: `best-v{N}.yaml` and,
   atomically, `best.yaml` beside it (the deployment reads `best.yaml`). Its provenance holds
   the profile of the traffic it was tuned on, which the next `retune` compares against.

Exit status, for a scheduler: 0 no drift (nothing done), 10 a new config was written (restart
the servers), 11 drift but the deployed config stays (it still carries H x the current traffic,
or the study found no winner; deployed-capacity.json and the report say which), 3 drift found
in --dry-run, 2 bad input (refused before any server started), 12 the deployed config could not
be measured on the current traffic (the capacity check's launch or the study's baseline failed;
nothing written beside the study's report), 1 failure, 143 / 129 / 130 stopped by SIGTERM /
SIGHUP / Ctrl-C (the trial's server stopped; nothing published).

Why 11 for both ways of keeping the deployed config: what a scheduler does with it is the same
(leave the servers as they are; deploy/ treats 11 as a normal night), and scripts written for
11 keep working. Which of the two it was is in the printed line and in deployed-capacity.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.cli.flags import request_fields
from autotune.decide.publish import next_version, publish
from autotune.drift_inputs import drift_thresholds, load_current, load_drift_reference
from autotune.errors import describe_command
from autotune.measure.server_registry import reap_stale_servers
from autotune.measure.servers import deployed_server
from autotune.options import add_flags
from autotune.plan import TuningPlan
from autotune.progress import say
from autotune.request import RETUNE_GROUPS, RetuneRequest, TuningRequest
from autotune.search.warm_start import WarmStart, warm_start_trials
from server.config import ServerConfig
from workloads.trace_io import TraceWarning, write_trace

# Optuna, SciPy (drift, profiles) and the measuring stack are imported inside the functions
# that use them: `autotune retune --help` needs none of them.
if TYPE_CHECKING:
    from autotune.decide.capacity_check import CapacityCheck, PremeasuredRunner

EXIT_NO_DRIFT = 0
EXIT_DRY_RUN_DRIFT = 3  # as `autotune drift`
EXIT_NEW_CONFIG = 10
EXIT_KEPT_DEPLOYED = 11


def configure(parser: argparse.ArgumentParser) -> None:
    """`autotune retune`'s description and flags."""
    describe_command(
        parser,
        (
            "Check the current traffic for drift against the deployed config's tuning traffic; "
            "if it drifted (or with --force), run a study warm-started from the deployed config "
            "and write best-v{N}.yaml + best.yaml only if a config beats the deployed one. "
            "Under the capacity objective a drift first re-measures the deployed config's "
            "capacity on the current traffic (one launch) and keeps it while it carries "
            "--headroom times the current rate. "
            "Exit status: 0 no drift, 10 new config written, 11 drift but the deployed config "
            "stays (enough headroom, or no winner), 3 drift found (--dry-run), 2 bad input, "
            "12 the deployed config could not be measured (nothing published), 1 failure."
        ),
    )
    # Every flag a RetuneRequest field; how each config is measured: `autotune run`'s fields.
    add_flags(parser, RetuneRequest, groups=RETUNE_GROUPS,
              default_help={"server": "the server the deployed config's trials ran on, from its "
                                      "provenance; autotune when it does not say"})
    parser.set_defaults(func=retune_command)


# -- inputs ---------------------------------------------------------------------------------


# -- the command ----------------------------------------------------------------------------


def retune_command(args: argparse.Namespace, *, runner: Any = None) -> int:
    """The CLI entry; `runner` replaces the TrialRunner (tests)."""
    from autotune import pipeline
    from autotune.decide.capacity_check import CHECK_FILE
    from autotune.search.study_store import check_writable
    from workloads.drift import compare

    options = RetuneRequest(**request_fields(args, model=RetuneRequest))
    deployed = ServerConfig.load(options.config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)  # a recording may be re-sorted; fine
        current = load_current(options.current)
    reference, reference_source = load_drift_reference(options.reference, options.config, deployed)
    thresholds = drift_thresholds(ks_statistic=options.ks_threshold, rate_change=options.rate_threshold,
                                  burstiness_change=options.burstiness_threshold,
                                  concurrency_change=options.concurrency_threshold)
    report = compare(reference, current, thresholds)
    say(f"drift check against {reference_source}:")
    say(report.format())
    if not report.drifted and not options.force:
        say(f"no drift: {options.config} stays deployed; nothing launched")
        return EXIT_NO_DRIFT
    why = "drift" if report.drifted else "no drift, but --force"

    out_dir: Path = options.output_dir or options.config.resolve().parent
    check_writable(out_dir)  # before any trial: a result that cannot be written is wasted
    version = next_version(out_dir)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    study_name = options.study_name or f"retune-v{version}-{stamp}"
    if options.dry_run:
        with tempfile.TemporaryDirectory(prefix="retune-dry-run-") as scratch:
            plan, warm = prepare(options, deployed, current, Path(scratch), study_name)
        checks = plan.objective.measures_capacity and not options.force
        print_plan(plan, warm, out_dir / study_name, out_dir / f"best-v{version}.yaml", why,
                   headroom=options.headroom if checks else None)
        return EXIT_DRY_RUN_DRIFT if report.drifted else EXIT_NO_DRIFT

    work_dir = out_dir / study_name
    plan, warm = prepare(options, deployed, current, work_dir, study_name)
    if runner is None:
        runner = pipeline.build_runner(plan, registry=work_dir / "servers.json", say=say)
    if plan.objective.measures_capacity and not options.force:
        check, runner = measure_deployed(options, plan, runner)
        say(check.line())
        if check.keep:
            say(f"measurement: {plan.output_dir / CHECK_FILE}; nothing published")
            return EXIT_KEPT_DEPLOYED
    say(f"{why}: re-tuning in {work_dir} (baseline: the deployed {options.config})")
    run_study(plan, warm, runner=runner)
    published = publish(options.config, deployed, current, report, plan, warm, out_dir, version)
    return EXIT_NEW_CONFIG if published else EXIT_KEPT_DEPLOYED


def prepare(
    options: RetuneRequest,
    deployed: ServerConfig,
    current: Any,
    work_dir: Path,
    study_name: str,
) -> tuple[TuningPlan, list[WarmStart]]:
    """`autotune run`'s plan for the current traffic with the deployed config as baseline,
    and the warm-start trials. Writes the trace and the baseline into `work_dir`."""
    from autotune.prepare import prepare_plan

    work_dir.mkdir(parents=True, exist_ok=True)
    trace_path = options.current
    if options.current.is_dir():
        trace_path = work_dir / "current.jsonl"
        write_trace(trace_path, current)
    # Trial servers must not record into the production recorder's folder; the recorder
    # setting is put back into the config that gets published.
    baseline_path = work_dir / "deployed-baseline.yaml"
    deployed.model_copy(
        update={
            "serving": deployed.serving.model_copy(update={"recorder": None}),
            "provenance": None,
        }
    ).write(baseline_path, header=f"baseline for re-tuning: {options.config} (recorder off)")
    provenance = deployed.provenance or {}
    request = TuningRequest(
        workload=str(trace_path),
        study_name=study_name,
        output_dir=work_dir,
        command_line=["autotune", *sys.argv[1:]],
        trials=options.trials,
        time_budget_s=options.time_budget_s,
        storage=options.storage,
        baseline=baseline_path,
        space=options.space,
        slos=options.slos or provenance.get("slos") or None,
        objective=options.objective or provenance.get("objective") or "goodput",
        headroom=options.headroom,
        **options.measurement(),
        default_server=deployed_server(provenance),
    )
    plan = prepare_plan(request)
    limit = min(options.warm_start, max(0, options.trials - 1))
    warm = warm_start_trials(deployed, plan.space, plan.effective_defaults, limit)
    return plan, warm


def measure_deployed(
    options: RetuneRequest, plan: TuningPlan, runner: Any
) -> tuple[CapacityCheck, PremeasuredRunner]:
    """The capacity check: the deployed config launched once on the current tuning window,
    exactly as the study's baseline trial would be (same config, window and trial folder).
    Returns the check (also written to deployed-capacity.json) and the runner for the study,
    which answers the baseline trial with this measurement instead of a second launch."""
    from autotune import pipeline
    from autotune.decide.capacity_check import CHECK_FILE, DeployedCapacityCheck, PremeasuredRunner

    tuning = pipeline.build_study(plan, runner=runner)  # measures nothing: names and config
    config, trial_dir = tuning.trial_config({}), tuning.trial_dir(0)
    check, outcome = DeployedCapacityCheck(runner, needed_headroom=options.headroom, say=say).run(
        config, plan.tuning_window, trial_dir, source=str(options.config)
    )
    check.write(plan.output_dir / CHECK_FILE)
    return check, PremeasuredRunner(runner, config=config, trial_dir=trial_dir, outcome=outcome)


def run_study(plan: TuningPlan, warm: list[WarmStart], *, runner: Any) -> None:
    """Creates the study with the baseline and the warm starts queued, then lets the
    pipeline resume it as `autotune run` would (search, gate, export into the study folder)."""
    from autotune import pipeline

    # Queue order is trial order: the deployed config first (trial 0), then the warm starts.
    pipeline.create_study(
        plan,
        study_attrs={"workload_fingerprint": plan.workload["fingerprint"], "retune": True},
        warm_starts=[(start.params, {"warm_start": start.why}) for start in warm],
        say=say,
    )
    resumed = plan.model_copy(update={"resume": True})  # opens the study just created, queue included
    pipeline.execute(resumed, runner=runner, reap=reap_stale_servers)


def print_plan(
    plan: TuningPlan,
    warm: list[WarmStart],
    work_dir: Path,
    versioned: Path,
    why: str,
    *,
    headroom: float | None = None,
) -> None:
    """`headroom`: the capacity check's H, None when no check would run."""
    from autotune.measure.ladder import recorded_rate

    tuning, holdout = plan.tuning_window, plan.holdout_window
    say(f"dry run ({why}): no server started. The re-tune would:")
    if headroom is not None:
        say(
            f"  first launch the deployed config once and measure its capacity on the tuning "
            f"window; keep it (exit 11, no study) if it carries >= {headroom:g}x the recorded "
            f"{recorded_rate(tuning):.3g} req/s, else re-tune with that launch as the baseline"
        )
    say(f"  study {plan.study_name} in {work_dir}")
    say(
        f"  baseline: {plan.baseline_source} (the deployed config; the gate compares against it)"
    )
    say(f"  objective {plan.objective.spec()}, SLOs {', '.join(s.spec() for s in plan.slos)}")
    say("  search: " + ", ".join(f"{k} ({v})" for k, v in plan.space.describe().items()))
    say(f"  {plan.n_trials} trials: the baseline, {len(warm)} warm start(s), then the sampler")
    for start in warm:
        say(f"    - {start.why}")
    say(
        f"  windows: tuning {tuning.duration_s():.0f} s ({len(tuning)} requests), "
        f"held-out {holdout.duration_s():.0f} s ({len(holdout)} requests)"
    )
    say(f"  gate: top {plan.top_k} x {plan.repeats} repeats against the baseline")
    say(
        f"  on a win: write {versioned} and {versioned.parent / 'best.yaml'} (exit 10); "
        "else exit 11"
    )
