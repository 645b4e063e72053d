"""`autotune run`: search, validate, export `best.yaml` and write `report.md`.

The flags become a TuningRequest (`run_request`); autotune.prepare checks it and makes the
TuningPlan; autotune.pipeline runs it (or autotune.distributed stores it for workers).
"""

from __future__ import annotations

import argparse
import sys

from autotune.cli.flags import request_fields
from autotune.errors import EXIT_OK, describe_command
from autotune.measure.server_registry import reap_stale_servers
from autotune.options import add_flags
from autotune.progress import say
from autotune.request import RUN_GROUPS, TuningRequest


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
    add_flags(parser, TuningRequest, groups=RUN_GROUPS)  # every flag: a field of the request
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    # Imported here, not at the top: they load Optuna and the measuring stack, which
    # `autotune run --help` does not need.
    from autotune import pipeline
    from autotune.distributed import create_shared_study
    from autotune.prepare import prepare_plan

    request = run_request(args)
    plan = prepare_plan(request)
    if request.workers_only:
        create_shared_study(plan, say=say)
        return EXIT_OK
    runner = pipeline.build_runner(plan, registry=plan.output_dir / "servers.json", say=say)
    pipeline.execute(plan, runner=runner, reap=reap_stale_servers)
    return EXIT_OK


def run_request(args: argparse.Namespace) -> TuningRequest:
    """`autotune run`'s flags as the request the plan is built from (one-line errors)."""
    # The command as a user would retype it, whatever entry point ran it.
    return TuningRequest(command_line=["autotune", *sys.argv[1:]], **request_fields(args))
