"""`autotune generate OUT.jsonl`: a synthetic trace, translation traffic or like a reference."""

from __future__ import annotations

import argparse
import warnings

from autotune.cli.traces import describe_trace_command, first_error
from workloads.errors import WorkloadError
from workloads.trace_io import TraceWarning, write_trace


def configure(parser: argparse.ArgumentParser) -> None:
    """`autotune generate`'s description and flags."""
    describe_trace_command(
        parser,
        "Without --like: bursty translation traffic (10-200 token inputs, "
        "per-language-pair output ratios, sessions). With --like: arrivals with the "
        "reference's rate and burstiness, (input, output) pairs resampled together.",
    )
    add = parser.add_argument
    add("output", metavar="OUT.jsonl", help="trace file to write")
    add("--like", metavar="REF", default=None, help="trace .jsonl or profile .json to imitate")
    add("--duration-s", type=float, default=600.0, help="trace length in seconds")
    add(
        "--rate",
        type=float,
        default=None,
        help="mean requests/s (default: 5 for translation, the reference's for --like)",
    )
    add(
        "--arrivals",
        choices=["gamma", "poisson"],
        default="gamma",
        help="--like: inter-arrival distribution",
    )
    add(
        "--cv",
        type=float,
        default=None,
        help="--like with gamma: inter-arrival CV (default: the reference's)",
    )
    add("--burst-multiplier", type=float, default=2.5, help="translation: burst rate / quiet rate")
    add("--burst-fraction", type=float, default=0.2, help="translation: share of time in bursts")
    add("--seed", type=int, default=0, help="random seed (same seed, same trace)")
    parser.set_defaults(func=generate_command)


def generate_command(args: argparse.Namespace) -> int:
    from workloads import synthetic

    if args.like is None:
        try:
            spec = synthetic.TranslationSpec(
                duration_s=args.duration_s,
                mean_rps=args.rate if args.rate is not None else 5.0,
                burst_multiplier=args.burst_multiplier,
                burst_time_fraction=args.burst_fraction,
            )
        except ValueError as error:
            raise WorkloadError(f"bad generator option: {first_error(error)}") from None
        trace = synthetic.translation(spec, seed=args.seed)
    else:
        from workloads.drift import load_reference

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TraceWarning)
            reference = load_reference(args.like)
        trace = synthetic.like(
            reference,
            duration_s=args.duration_s,
            rate_rps=args.rate,
            arrivals=args.arrivals,
            cv=args.cv,
            seed=args.seed,
        )
    write_trace(args.output, trace)
    rate = (len(trace) - 1) / trace.duration_s() if trace.duration_s() > 0 else 0.0
    print(
        f"{args.output}: {len(trace)} requests, {trace.duration_s():.1f} s, {rate:.2f} req/s (seed {args.seed})"
    )
    return 0
