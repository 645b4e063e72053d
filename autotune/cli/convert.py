"""`autotune convert`: a public trace (Azure, BurstGPT, Mooncake) as our JSONL trace."""

from __future__ import annotations

import argparse
from typing import Any

from autotune.cli.traces import describe_trace_command
from workloads.errors import WorkloadError
from workloads.trace_io import write_trace


def configure(parser: argparse.ArgumentParser) -> None:
    """`autotune convert`'s description and flags."""
    describe_trace_command(
        parser,
        "Convert a public trace format to the JSONL trace format "
        "(timestamp ms from the first request, input_length, output_length).",
    )
    parser.add_argument(
        "--from",
        dest="fmt",
        required=True,
        choices=["azure", "burstgpt", "mooncake"],
        help="input format",
    )
    parser.add_argument("input", metavar="IN", help="input file (CSV or JSONL)")
    parser.add_argument("output", metavar="OUT.jsonl", help="trace file to write")
    parser.add_argument(
        "--model", default=None, help="BurstGPT only: keep rows of this Model (e.g. ChatGPT, GPT-4)"
    )
    parser.add_argument(
        "--skip-invalid",
        action="store_true",
        help="drop bad rows (counted) instead of stopping at the first",
    )
    parser.set_defaults(func=convert_command)


def convert_command(args: argparse.Namespace) -> int:
    from workloads.importers import importer

    if args.model is not None and args.fmt != "burstgpt":
        raise WorkloadError(f"--model filters BurstGPT rows only, not {args.fmt}")
    kwargs: dict[str, Any] = {"skip_invalid": args.skip_invalid}
    if args.fmt == "burstgpt":
        kwargs["model"] = args.model
    result = importer(args.fmt)(args.input, **kwargs)
    write_trace(args.output, result.trace)
    print(f"{args.output}: {result.summary()}; {result.trace.duration_s():.1f} s")
    return 0
