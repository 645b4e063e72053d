"""`autotune profile TRACE`: a trace's rates, burstiness, lengths, concurrency, fingerprint."""

from __future__ import annotations

import argparse

from autotune.cli.traces import describe_trace_command, load, note


def configure(parser: argparse.ArgumentParser) -> None:
    """`autotune profile`'s flags."""
    describe_trace_command(parser, trace=True)
    parser.add_argument("--json", action="store_true", help="print the full TraceProfile as JSON")
    parser.add_argument("--plot", metavar="DIR", default=None, help="also write PNG plots to DIR")
    parser.add_argument(
        "--skip-invalid", action="store_true", help="drop bad lines (counted) instead of stopping"
    )
    parser.set_defaults(func=profile_command)


def profile_command(args: argparse.Namespace) -> int:
    from workloads.profile import format_profile, profile_trace, write_plots

    trace = load(args.trace, args.skip_invalid)
    profile = profile_trace(trace)
    if args.json:
        print(profile.model_dump_json(indent=2))
    else:
        print(format_profile(profile))
    if args.plot:
        for path in write_plots(trace, profile, args.plot):
            note(f"wrote {path}")
    return 0
