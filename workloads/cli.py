"""`autotune convert | profile | generate | window | drift`: the traffic-side commands.

Each command raises WorkloadError on bad input; `autotune.cli.main` prints it and exits 2.
`drift` returns 3 when the traffic drifted (0 when it did not).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workloads.errors import WorkloadError
from workloads.files import write_text_atomic
from workloads.pipes import run_closing_quietly
from workloads.trace import Trace
from workloads.trace_io import TraceWarning, read_trace, write_trace

EXIT_DRIFT = 3
_Formatter = argparse.ArgumentDefaultsHelpFormatter


def _command(
    subparsers: argparse._SubParsersAction,
    name: str,
    func: Callable[[argparse.Namespace], int],
    help: str,
    description: str | None = None,
    *,
    trace: bool = False,
) -> argparse.ArgumentParser:
    """One subcommand running `func`; with `trace`, its first argument is the TRACE file."""
    parser = subparsers.add_parser(
        name, help=help, description=description, formatter_class=_Formatter
    )
    parser.set_defaults(func=func)
    if trace:
        parser.add_argument("trace", metavar="TRACE", help="JSONL trace file")
    return parser


def register(subparsers: argparse._SubParsersAction) -> None:
    convert = _command(
        subparsers,
        "convert",
        _convert,
        help="convert a public trace (Azure, BurstGPT, Mooncake) to our JSONL",
        description="Convert a public trace format to the JSONL trace format "
        "(timestamp ms from the first request, input_length, output_length).",
    )
    convert.add_argument(
        "--from",
        dest="fmt",
        required=True,
        choices=["azure", "burstgpt", "mooncake"],
        help="input format",
    )
    convert.add_argument("input", metavar="IN", help="input file (CSV or JSONL)")
    convert.add_argument("output", metavar="OUT.jsonl", help="trace file to write")
    convert.add_argument(
        "--model", default=None, help="BurstGPT only: keep rows of this Model (e.g. ChatGPT, GPT-4)"
    )
    convert.add_argument(
        "--skip-invalid",
        action="store_true",
        help="drop bad rows (counted) instead of stopping at the first",
    )

    profile = _command(
        subparsers,
        "profile",
        _profile,
        help="measure a trace: rates, burstiness, lengths, concurrency, fingerprint",
        trace=True,
    )
    profile.add_argument("--json", action="store_true", help="print the full TraceProfile as JSON")
    profile.add_argument("--plot", metavar="DIR", default=None, help="also write PNG plots to DIR")
    profile.add_argument(
        "--skip-invalid", action="store_true", help="drop bad lines (counted) instead of stopping"
    )

    generate = _command(
        subparsers,
        "generate",
        _generate,
        help="write a synthetic trace (translation traffic, or like a given trace/profile)",
        description="Without --like: bursty translation traffic (10-200 token inputs, "
        "per-language-pair output ratios, sessions). With --like: arrivals with the "
        "reference's rate and burstiness, (input, output) pairs resampled together.",
    )
    generate.add_argument("output", metavar="OUT.jsonl", help="trace file to write")
    generate.add_argument(
        "--like", metavar="REF", default=None, help="trace .jsonl or profile .json to imitate"
    )
    generate.add_argument("--duration-s", type=float, default=600.0, help="trace length in seconds")
    generate.add_argument(
        "--rate",
        type=float,
        default=None,
        help="mean requests/s (default: 5 for translation, the reference's for --like)",
    )
    generate.add_argument(
        "--arrivals",
        choices=["gamma", "poisson"],
        default="gamma",
        help="--like: inter-arrival distribution",
    )
    generate.add_argument(
        "--cv",
        type=float,
        default=None,
        help="--like with gamma: inter-arrival CV (default: the reference's)",
    )
    generate.add_argument(
        "--burst-multiplier", type=float, default=2.5, help="translation: burst rate / quiet rate"
    )
    generate.add_argument(
        "--burst-fraction", type=float, default=0.2, help="translation: share of time in bursts"
    )
    generate.add_argument("--seed", type=int, default=0, help="random seed (same seed, same trace)")

    window = _command(
        subparsers,
        "window",
        _window,
        help="cut a representative tuning window and a disjoint held-out window",
        trace=True,
    )
    window.add_argument("--tuning-s", type=float, required=True, help="tuning window length (s)")
    window.add_argument("--holdout-s", type=float, required=True, help="held-out window length (s)")
    window.add_argument(
        "--step-s",
        type=float,
        default=None,
        help="slide between candidate windows (default: a quarter window)",
    )
    window.add_argument(
        "--out-dir", default=None, help="write tuning.jsonl, holdout.jsonl, windows.json here"
    )

    drift = _command(
        subparsers,
        "drift",
        _drift,
        help="test whether current traffic drifted from a reference (exit 3 if it did)",
        description="Exit status: 0 no drift, 3 drift, 2 bad input.",
    )
    drift.add_argument(
        "--reference",
        required=True,
        metavar="REF",
        help="trace .jsonl, profile .json, or exported best.yaml",
    )
    drift.add_argument(
        "--current", required=True, metavar="TRACE", help="current traffic, JSONL trace"
    )
    drift.add_argument("--json", action="store_true", help="print the DriftReport as JSON")
    drift.add_argument(
        "--ks-threshold", type=float, default=0.1, help="KS statistic above which lengths drifted"
    )
    drift.add_argument(
        "--rate-threshold",
        type=float,
        default=0.25,
        help="relative change of mean rate that counts as drift",
    )
    drift.add_argument(
        "--burstiness-threshold",
        type=float,
        default=0.3,
        help="relative change of inter-arrival CV that counts as drift",
    )


def _note(message: str) -> None:
    print(f"autotune: {message}", file=sys.stderr)


def _load(path: str, skip_invalid: bool = False) -> Trace:
    loaded = read_trace(path, skip_invalid=skip_invalid)
    if loaded.invalid:
        _note(f"{path}: skipped {loaded.invalid} invalid line(s); first: {loaded.errors[0]}")
    if loaded.reordered:
        _note(f"{path}: timestamps were not ascending; requests sorted by timestamp")
    return loaded.trace


def _convert(args: argparse.Namespace) -> int:
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


def _profile(args: argparse.Namespace) -> int:
    from workloads.profile import format_profile, profile_trace, write_plots

    trace = _load(args.trace, args.skip_invalid)
    profile = profile_trace(trace)
    if args.json:
        print(profile.model_dump_json(indent=2))
    else:
        print(format_profile(profile))
    if args.plot:
        for path in write_plots(trace, profile, args.plot):
            _note(f"wrote {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
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
            raise WorkloadError(f"bad generator option: {_first_error(error)}") from None
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


def _first_error(error: ValueError) -> str:
    errors = getattr(error, "errors", None)
    if callable(errors):
        first = errors()[0]
        return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return str(error)


def _window(args: argparse.Namespace) -> int:
    from workloads.windows import select_windows

    trace = _load(args.trace)
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


def _drift(args: argparse.Namespace) -> int:
    from workloads.drift import DriftThresholds, compare, load_reference

    try:
        thresholds = DriftThresholds(
            ks_statistic=args.ks_threshold,
            rate_change=args.rate_threshold,
            burstiness_change=args.burstiness_threshold,
        )
    except ValueError as error:
        raise WorkloadError(f"bad drift threshold: {_first_error(error)}") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        reference = load_reference(args.reference)
    report = compare(reference, _load(args.current), thresholds)
    if args.json:
        print(json.dumps(report.model_dump(mode="json"), indent=2))
    else:
        print(report.format())
    return EXIT_DRIFT if report.drifted else 0


def main(argv: list[str] | None = None) -> int:
    """The traffic commands alone (`python -m workloads.cli ...`), same exit codes as
    `autotune`: for environments that install only `workloads`."""
    return run_closing_quietly(lambda: _run(argv))


def _run(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.cli")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except WorkloadError as error:
        print(f"autotune: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
