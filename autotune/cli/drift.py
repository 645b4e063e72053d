"""`autotune drift`: whether the current traffic drifted from a reference; exit 3 when it did
(0 when it did not)."""

from __future__ import annotations

import argparse
import json
import warnings

from autotune.cli.traces import describe_trace_command, first_error, load
from workloads.errors import WorkloadError
from workloads.trace_io import TraceWarning

EXIT_DRIFT = 3


def configure(parser: argparse.ArgumentParser) -> None:
    """`autotune drift`'s description and flags."""
    describe_trace_command(parser, "Exit status: 0 no drift, 3 drift, 2 bad input.")
    add = parser.add_argument
    add(
        "--reference",
        required=True,
        metavar="REF",
        help="trace .jsonl, profile .json, or exported best.yaml",
    )
    add("--current", required=True, metavar="TRACE", help="current traffic, JSONL trace")
    add("--json", action="store_true", help="print the DriftReport as JSON")
    add("--ks-threshold", type=float, default=0.1, help="KS statistic above which lengths drifted")
    add(
        "--rate-threshold",
        type=float,
        default=0.25,
        help="relative change of mean rate that counts as drift",
    )
    add(
        "--burstiness-threshold",
        type=float,
        default=0.3,
        help="relative change of inter-arrival CV that counts as drift",
    )
    parser.set_defaults(func=drift_command)


def drift_command(args: argparse.Namespace) -> int:
    from workloads.drift import DriftThresholds, compare, load_reference

    try:
        thresholds = DriftThresholds(
            ks_statistic=args.ks_threshold,
            rate_change=args.rate_threshold,
            burstiness_change=args.burstiness_threshold,
        )
    except ValueError as error:
        raise WorkloadError(f"bad drift threshold: {first_error(error)}") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        reference = load_reference(args.reference)
    report = compare(reference, load(args.current), thresholds)
    if args.json:
        print(json.dumps(report.model_dump(mode="json"), indent=2))
    else:
        print(report.format())
    return EXIT_DRIFT if report.drifted else 0
