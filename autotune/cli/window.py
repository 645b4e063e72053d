"""`autotune window TRACE`: a representative tuning window and a disjoint held-out window."""

from __future__ import annotations

import argparse
from pathlib import Path

from autotune.cli.traces import describe_trace_command, load
from workloads.files import write_text_atomic
from workloads.trace_io import write_trace


def configure(parser: argparse.ArgumentParser) -> None:
    """`autotune window`'s flags."""
    describe_trace_command(parser, trace=True)
    parser.add_argument("--tuning-s", type=float, required=True, help="tuning window length (s)")
    parser.add_argument("--holdout-s", type=float, required=True, help="held-out window length (s)")
    parser.add_argument(
        "--step-s",
        type=float,
        default=None,
        help="slide between candidate windows (default: a quarter window)",
    )
    parser.add_argument(
        "--out-dir", default=None, help="write tuning.jsonl, holdout.jsonl, windows.json here"
    )
    parser.set_defaults(func=window_command)


def window_command(args: argparse.Namespace) -> int:
    from workloads.windows import select_windows

    trace = load(args.trace)
    tuning, holdout, info = select_windows(trace, args.tuning_s, args.holdout_s, step_s=args.step_s)
    for label, choice, part in (
        ("tuning", info.tuning, tuning),
        ("held-out", info.holdout, holdout),
    ):
        print(
            f"{label:<8}  {choice.start_s:9.1f} - {choice.end_s:9.1f} s  {len(part):6d} requests  "
            f"distance {choice.distance:.3f}"
        )
    if args.out_dir:
        out = Path(args.out_dir)
        write_trace(out / "tuning.jsonl", tuning)
        write_trace(out / "holdout.jsonl", holdout)
        write_text_atomic(out / "windows.json", info.model_dump_json(indent=2) + "\n")
        print(f"wrote {out / 'tuning.jsonl'}, {out / 'holdout.jsonl'}, {out / 'windows.json'}")
    return 0
