"""Search efficiency (issue 18): what it costs to find a good config by our tuner, by plain TPE,
by random search and by an exhaustive grid, on tabular benchmarks measured on the real CPU engine.

1. `measure`: every point of a fixed grid (max_num_seqs x max_num_batched_tokens, powers of
   two, plus the baseline, vLLM's defaults) is measured once for real and stored in
   TABLE/table.json, each point's trial folder (outcome.json: the whole measured outcome, the
   capacity ladder's steps included) beside it. Resumable: measured points are kept.
   - `--objective capacity` (the default, as `autotune run`'s): each point is one trial exactly
     as `autotune run --workload TRACE` with its defaults measures one (its tuning window, CPU
     SLOs and CPU ladder settings, built by autotune.prepare.prepare_plan; one engine launch, a
     load ladder, the highest req/s meeting every SLO). The baseline is measured first, with
     an unhinted ladder (as trial 0); every other point's ladder starts at the baseline's
     capacity, as `autotune run` starts a trial's ladder at the best capacity so far.
   - `--shard K/N` (capacity): one of N processes measuring one table at once, each on its own
     GPU of a multi-GPU host (CUDA_VISIBLE_DEVICES, its own CPUs): shard K takes every Nth point
     of the measurement order after the baseline, which must be measured first (the other points'
     ladders start at its capacity). Each shard adds its points to table.json under a file lock,
     re-reading it first, so no shard's point is lost; each has its own server registry.
   - A measured table takes a larger grid (`--seqs`/`--batched` keeping every value it had,
     every other setting the same): its points are kept, the missing ones measured, and the
     report says the table was measured in parts (settings.extended).
   - `--quantization none,fp8` (capacity; issue 59): every scheduler point also with fp8 weights
     (`quantization: fp8`, as `autotune run --allow fp8`; labels s256-b1024-fp8). The baseline
     stays vLLM's defaults; the replay then searches `quantization` too, and the report gives the
     grid's best without and with fp8. The default, none, measures the tables measured before.
   - `--objective goodput`: the older table (benchmarks/data/search_grid): one timed replay
     of a 15 s window per point, goodput under the default CPU SLOs.
2. `replay`: the strategies are run over each measured table for 20 seeds; a trial is answered
   with the measured outcome of its point (the baseline's ladder included, so our first moves
   read what they would read live) and charged that point's measured wall-clock cost on a
   virtual clock. Strategies: ours (autotune.search.study.TuningStudy as `autotune run` builds it,
   with its default --trials: baseline, first moves, TPE), the same with as many trials as the
   grid has points, plain TPE (the same study without the first moves), random search (the grid
   in a seeded random order) and grid order (every point in auto_tune.sh's nested-loop order).
   Reported: launches and seconds until the best found reaches 0.95x and 0.98x of the grid's
   best, as a share of the grid's cost, and the issue's done-when.
   A table with TABLE/repeats.json (other tables that measured some of its configs again) is
   replayed pooled: a launch draws one of the config's recorded launches, and a config's value
   is the median of its launches (`pooled`, `RepeatsFile`). Points whose `max_num_seqs` never
   bound in any ladder step are one scheduler config at that traffic: ours is also judged with
   them pooled (`one_scheduler_config`; `--as-one` judges every strategy so).

    .venv/bin/python benchmarks/search_efficiency.py measure [--objective capacity|goodput] [--table DIR]
    .venv/bin/python benchmarks/search_efficiency.py replay [--table DIR ... --out DIR] [--seeds 20]

TABLE defaults to benchmarks/data/search_grid_capacity (goodput: benchmarks/data/search_grid;
quick: /tmp/...). `replay` defaults to every committed table: those two and the GPU grids
(benchmarks/data/h100-DATE/SCENARIO/grid, h200-..., measured on the GPU host with --table RUN/grid and copied back). Results:
results/benchmarks/search_efficiency.{json,md} (quick: results/benchmarks/quick/).

The command line only; each job lives in a module of its own beside it: search_table.py (the
measured table's model, loading and repeats), search_measure.py (`measure`), search_replay.py
(the strategies replayed over a table) and search_report.py (`replay`'s results and report).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # run as a file: its folder is on sys.path, the repository (benchmarks.*) is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.benchlib import DATA
from benchmarks.search_measure import (
    CAPACITY_BATCHED,
    CAPACITY_SEQS,
    GOODPUT_BATCHED,
    GOODPUT_SEQS,
    QUICK_BATCHED,
    QUICK_SEQS,
    TRACE,
    measure,
)
from benchmarks.search_report import replay
from benchmarks.search_table import QUANTIZATIONS, default_table, load_table, relative_dir
from workloads.errors import OneLineErrorParser, VllmAutotuneError


def parse_shard(text: str) -> tuple[int, int]:
    """`--shard K/N` (argparse type): K in 0..N-1."""
    index, sep, count = text.partition("/")
    try:
        k, n = int(index), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected K/N, e.g. 0/4") from None
    if not sep or n < 1 or not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"{text!r}: expected K/N with 0 <= K < N, e.g. 0/4")
    return k, n


def powers_list(text: str) -> tuple[int, ...]:
    """`--seqs 64,128,256`: comma-separated powers of two (argparse type)."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 512,1024") from None
    bad = [v for v in values if v < 1 or v & (v - 1)]
    if bad:
        raise argparse.ArgumentTypeError(f"{text!r}: {bad[0]} is not a power of two")
    return values


def quantization_list(text: str) -> tuple[str, ...]:
    """`--quantization none,fp8` (argparse type): values of QUANTIZATIONS, "none" among them (the
    baseline, vLLM's defaults, runs its default weights), in that order, each once."""
    values = [part.strip() for part in text.split(",")]
    bad = [v for v in values if v not in QUANTIZATIONS]
    if bad:
        raise argparse.ArgumentTypeError(f"{text!r}: {bad[0]!r} is not one of {', '.join(QUANTIZATIONS)}")
    if "none" not in values:
        raise argparse.ArgumentTypeError(f"{text!r}: include none (vLLM's default weights), e.g. none,fp8: "
                                         "the grid compares fp8 with the defaults' weights")
    return tuple(q for q in QUANTIZATIONS if q in values)


def main() -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    measure_parser = sub.add_parser("measure", help="measure every point of a grid on the engine")
    measure_parser.add_argument("--objective", choices=("capacity", "goodput"), default="capacity")
    measure_parser.add_argument("--quick", action="store_true",
                                help=f"grid {QUICK_SEQS} x {QUICK_BATCHED}, table in /tmp")
    measure_parser.add_argument("--table", default=None, help="default: benchmarks/data/search_grid_capacity "
                                "(goodput: benchmarks/data/search_grid)")
    measure_parser.add_argument("--trace", default=str(TRACE))
    measure_parser.add_argument("--seqs", type=powers_list, default=None,
                                help=f"capacity grid's max_num_seqs values (default {CAPACITY_SEQS})")
    measure_parser.add_argument("--batched", type=powers_list, default=None,
                                help=f"capacity grid's max_num_batched_tokens values (default {CAPACITY_BATCHED})")
    measure_parser.add_argument("--quantization", type=quantization_list, default=("none",),
                                help="capacity: the weights' quantization axis, a comma list of "
                                     f"{', '.join(QUANTIZATIONS)} (none: vLLM's default weights; fp8: "
                                     "`quantization: fp8`, as `autotune run --allow fp8`); default none")
    measure_parser.add_argument("--run-arg", action="append", default=[], dest="run_args", metavar="FLAG",
                                help="capacity: an `autotune run` flag for every point, repeatable, "
                                     "e.g. --run-arg=--model=DIR --run-arg=--slo=ttft_p95_ms=500")
    measure_parser.add_argument("--max-points", type=int, default=None,
                                help="measure at most N more points, then stop (resume later)")
    measure_parser.add_argument("--order-seed", type=int, default=0)
    measure_parser.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="K/N",
                                help="capacity: measure only shard K of N (every Nth point after the "
                                     "baseline), beside N-1 other processes on other GPUs")
    measure_parser.add_argument("--window-s", type=float, default=15.0, help="goodput only: wall seconds replayed")
    measure_parser.add_argument("--speedup", type=float, default=1.0, help="goodput only")
    measure_parser.add_argument("--request-timeout", type=float, default=20.0, help="goodput only")
    replay_parser = sub.add_parser("replay", help="replay the strategies over measured tables")
    replay_parser.add_argument("--table", action="append", default=None, dest="tables",
                               help="a measured table folder, repeatable (default: every committed one)")
    replay_parser.add_argument("--quick", action="store_true", help="the quick tables in /tmp, 5 seeds")
    replay_parser.add_argument("--seeds", type=int, default=None, help="default 20 (quick 5)")
    replay_parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                               help="write search_efficiency.{md,json} here (default results/benchmarks/, "
                                    "which holds every committed table's report: required with --table)")
    replay_parser.add_argument("--as-one", action="store_true",
                               help="judge every strategy with the points that ran as one scheduler config "
                                    "judged as one (default: each point on its own launches)")
    args = parser.parse_args()
    if args.command == "measure":
        quick_or_full = (QUICK_SEQS, QUICK_BATCHED) if args.quick else (
            (CAPACITY_SEQS, CAPACITY_BATCHED) if args.objective == "capacity" else (GOODPUT_SEQS, GOODPUT_BATCHED))
        args.seqs, args.batched = args.seqs or quick_or_full[0], args.batched or quick_or_full[1]
        args.table = args.table or str(default_table(args.objective, args.quick))
        return measure(args)
    if args.seeds is not None and args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: at least 1")
    args.seeds = args.seeds or (5 if args.quick else 20)
    if args.tables is not None and len(set(args.tables)) < len(args.tables):
        parser.error("--table: a table given twice (each is replayed once)")
    if args.tables is not None and args.out is None and not args.quick:
        parser.error("--table replays only the tables given: give --out DIR for their report "
                     "(results/benchmarks/search_efficiency.* is every committed table's)")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: not a folder")
    if args.tables is None:
        candidates = [default_table(o, args.quick) for o in ("capacity", "goodput")]
        if not args.quick:  # the GPU grids the headline runs measured (DATA/h100-DATE/SCENARIO/grid, h200-...)
            candidates += [grid for grid in sorted(DATA.glob("h[0-9]*-*/*/grid")) if measured_whole(grid)]
        args.tables = [str(c) for c in candidates if (c / "table.json").exists()]
        if not args.tables:
            raise SystemExit("no measured table: run `measure` first")
    try:
        return replay(args)
    except VllmAutotuneError as error:  # a damaged trace copy beside a table
        raise SystemExit(str(error)) from None


def measured_whole(grid: Path) -> bool:
    """A committed GPU grid the default replay takes: every point of its grid measured. One
    measured in parts across device sessions is left out, with a line saying so, until done
    (`--table` on it still names what it lacks)."""
    table = load_table(grid)
    missing = table.missing()
    if missing:
        print(f"skipping {relative_dir(grid)}: {len(table.grid_keys()) - len(missing)} of "
              f"{len(table.grid_keys())} points measured so far", file=sys.stderr)
    return not missing


if __name__ == "__main__":
    sys.exit(main())
