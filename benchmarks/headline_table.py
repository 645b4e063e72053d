"""One headline scenario's table (issue 59): vLLM's defaults, the hand-tuned config, the tuned
configs (default space; `--allow fp8`) and the grid's best without and with fp8, side by side.

Inputs are what the runs wrote, nothing re-measured:
- a tuned run's `--output-dir` (its best.yaml provenance holds the gate's measurements on the
  held-out window, the emitted config and the search and gate wall times; trials/<trial>/
  outcome.json the emitted trial's capacity on the tuning window);
- the grid's table (benchmarks/search_table.py), measured with the same ladder on the same
  tuning window, its repeats.json pooling the defaults' extra launches.

Columns: capacity on the held-out window (req/s, median and [min, max] of the gate's
interleaved repeats) and its ratio to the defaults of the same gate; capacity on the tuning
window (one launch; the defaults' and a pooled point's: the median of their launches) and its
ratio to the grid's best on that window (the grid's best without fp8 for the default space,
with fp8 for `--allow fp8`); GPU seconds (one GPU: the run's search and gate wall time; the
grid: every point's launch).

Usage: python benchmarks/headline_table.py --grid RUN/grid --tuned RUN/tuned --fp8 RUN/fp8
       [--out RUN/table.md]   (any of the three may be left out; the out file gets a .json twin)
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

if not __package__:  # run as a file: its folder is on sys.path, the repository (benchmarks.*) is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.benchlib import write_json_atomic, write_text_atomic  # noqa: E402
from benchmarks.search_table import (  # noqa: E402
    Point,
    Table,
    load_repeats,
    load_table,
    one_scheduler_config,
    pooled,
    read_trial_outcome,
    table_trace,
    validation_line,
)
from server.config import ConfigError, ServerConfig  # noqa: E402
from workloads.errors import OneLineErrorParser, VllmAutotuneError  # noqa: E402
from workloads.profile import profile_trace  # noqa: E402
from workloads.trace_io import load_trace  # noqa: E402

HANDTUNED = "compare-handtuned"
DEFAULTS = "vLLM's defaults"


class Row(BaseModel):
    """One line of the table. Capacities in req/s; None: not measured that way."""

    config: str
    what: str  # the config's settings, e.g. "quantization=fp8"
    held_out: list[float] = []  # the gate's repeats
    held_out_defaults: list[float] = []  # the same gate's defaults
    tuning: list[float] = []  # launches on the tuning window
    grid_best: float | None = None  # the grid's best this row is judged against (tuning window)
    gpu_s: float | None = None


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class GateMeasurement(BaseModel):
    """One launch of the gate (best.yaml provenance `validation[*]`): capacity in req/s."""

    candidate: str
    repeat: int = Field(ge=0)
    value: float = Field(ge=0, allow_inf_nan=False)


class _Decision(BaseModel):
    emitted: str
    overrides: dict[str, Any] | None = None


class _Window(BaseModel):
    start_s: float


class _Workload(BaseModel):
    fingerprint: str
    tuning_window: _Window


class _StudyTimes(BaseModel):
    search_wall_s: float = Field(ge=0)
    validation_wall_s: float = Field(ge=0)


class RunProvenance(BaseModel):
    """The fields of best.yaml's `additional-config.vllm_autotune.provenance` the table reads
    (autotune writes more)."""

    decision: _Decision
    workload: _Workload
    slos: list[str]
    command_line: str
    validation: list[GateMeasurement] = Field(min_length=1)
    study: _StudyTimes


class TunedRun(BaseModel):
    """What one `autotune run` output dir says (best.yaml's provenance)."""

    source: str  # the best.yaml, for messages
    fingerprint: str  # the trace's (workloads.profile)
    slos: list[str]
    tuning_start_s: float
    allow_fp8: bool  # run with --allow fp8
    emitted: str
    overrides: dict[str, Any]
    measurements: list[GateMeasurement]
    search_wall_s: float
    gate_wall_s: float
    tuning_capacity: float | None  # the emitted trial's, on the tuning window

    def held_out(self, candidate: str) -> list[float]:
        return [m.value for m in sorted(self.measurements, key=lambda m: m.repeat) if m.candidate == candidate]


PROVENANCE = "additional-config.vllm_autotune.provenance"


def read_run(out_dir: Path) -> TunedRun:
    """The run's provenance; SystemExit (one line naming the file, the field and the value) when
    out_dir is not a finished `autotune run` output dir."""
    path = out_dir / "best.yaml"
    if not out_dir.is_dir():
        raise SystemExit(f"{out_dir}: no such folder (give an `autotune run --output-dir`)")
    if not path.is_file():
        raise SystemExit(f"{path}: not found (not an `autotune run` output dir, or the run has "
                         f"not finished its gate)")
    try:
        provenance = ServerConfig.load(path).provenance  # a bad file: ConfigError, one line
    except ConfigError as error:
        raise SystemExit(f"{path}: not a finished run's best.yaml ({error})") from None
    if provenance is None:
        raise SystemExit(f"{path}: not a finished run's best.yaml (no {PROVENANCE}); "
                         "give an `autotune run --output-dir`")
    objective = provenance.get("objective")
    if objective != "capacity":  # before the rest: a goodput run's gate has another shape
        raise SystemExit(f"{path}: {PROVENANCE}.objective: {objective!r}: the headline table compares "
                         "capacity (req/s); give a run with --objective capacity")
    try:
        run = RunProvenance.model_validate(provenance)
    except ValidationError as error:
        raise SystemExit(f"{path}: not a finished run's best.yaml: "
                         f"{PROVENANCE}.{validation_line(error, provenance)}") from None
    emitted = run.decision.emitted
    if emitted not in {m.candidate for m in run.validation}:
        raise SystemExit(f"{path}: {PROVENANCE}.decision.emitted: {emitted!r} is not a candidate the gate "
                         f"measured ({', '.join(sorted({m.candidate for m in run.validation}))})")
    trial = "trial-0000" if emitted == "baseline" else emitted
    outcome = out_dir / "trials" / trial / "outcome.json"
    capacity = read_trial_outcome(outcome, "the emitted trial's outcome: its capacity on the tuning window").capacity
    return TunedRun(
        source=str(path), fingerprint=run.workload.fingerprint, slos=run.slos,
        tuning_start_s=run.workload.tuning_window.start_s,
        allow_fp8=any(flag in run.command_line for flag in (" --allow fp8", " --allow=fp8")),
        emitted=emitted,
        overrides={k: v for k, v in (run.decision.overrides or {}).items() if v is not None},
        measurements=run.validation, search_wall_s=run.study.search_wall_s,
        gate_wall_s=run.study.validation_wall_s,
        tuning_capacity=capacity.capacity_rps if capacity is not None else None,
    )


def read_grid(folder: Path) -> tuple[Table, str]:
    """The grid's table with its repeats pooled, and its trace's fingerprint; SystemExit (one
    line naming the file) for a folder that holds no measured table."""
    table = load_table(folder)  # a missing or unreadable table.json: SystemExit, one line
    if not table.points:
        raise SystemExit(f"{folder / 'table.json'}: no measured point yet (run measure first)")
    if table.objective != "capacity":
        raise SystemExit(f"{folder / 'table.json'}: settings.objective: {table.objective!r}: the headline table "
                         "compares capacity (req/s); give a grid measured with --objective capacity")
    trace = table_trace(table, folder)
    return pooled(table, load_repeats(table, folder)), profile_trace(load_trace(trace)).fingerprint


def check_one_scenario(grid: tuple[Table, str] | None, tuned: TunedRun | None, fp8: TunedRun | None) -> None:
    """SystemExit (one line) where the inputs are not one scenario's: the runs and the grid
    must share the trace, the SLOs and the tuning window; --tuned must be a default-space run
    and --fp8 one with --allow fp8 (else the rows would be labelled wrongly)."""
    if tuned is not None and tuned.allow_fp8:
        raise SystemExit(f"--tuned {tuned.source}: that run used --allow fp8; give it as --fp8")
    if fp8 is not None and not fp8.allow_fp8:
        raise SystemExit(f"--fp8 {fp8.source}: that run did not use --allow fp8; give it as --tuned")
    runs = [run for run in (tuned, fp8) if run is not None]
    first = runs[0] if runs else None
    for run in runs[1:]:
        for what, mine, theirs in (("trace (fingerprint)", run.fingerprint, first.fingerprint),
                                   ("SLOs", sorted(run.slos), sorted(first.slos))):
            if mine != theirs:
                raise SystemExit(f"{run.source}: another {what} than {first.source}: {mine} against {theirs}")
    if grid is not None and first is not None:
        table, fingerprint = grid
        for what, mine, theirs in (
            ("trace (fingerprint)", fingerprint, first.fingerprint),
            ("SLOs", sorted(table.settings.get("slos", [])), sorted(first.slos)),
            ("tuning window start (s)", float(table.settings.get("window_start_s", -1)), first.tuning_start_s),
        ):
            if mine != theirs:
                raise SystemExit(f"--grid: measured with another {what} than {first.source}: {mine} against {theirs}")


def point_score(point: Point) -> list[float]:
    """A grid point's launches' capacities on the tuning window (a failed launch: 0)."""
    runs = point.launches or [point]
    return [p.score if p.feasible else 0.0 for p in runs]


def describe_point(point: Point) -> str:
    seqs, batched = point.effective.get("max_num_seqs"), point.effective.get("max_num_batched_tokens")
    quantization = point.quantization
    return f"max_num_seqs={seqs}, max_num_batched_tokens={batched}" + (
        f", quantization={quantization}" if quantization else "")


def grid_best(table: Table, *, fp8: bool | None) -> Point | None:
    """The grid's best point on the tuning window: among points without fp8 (fp8=False), with
    fp8 only (True), or all (None)."""
    points = [p for p in table.points
              if fp8 is None or (p.quantization == "fp8") == fp8]
    return max(points, key=lambda p: p.score, default=None)


def build_rows(grid: Table | None, tuned: TunedRun | None, fp8: TunedRun | None) -> list[Row]:
    rows: list[Row] = []
    gate = tuned or fp8
    defaults_tuning = point_score(grid.baseline_point()) if grid and grid.baseline_point() else []
    if gate is not None or defaults_tuning:
        base = gate.held_out("baseline") if gate else []
        rows.append(Row(config=DEFAULTS, what="no overrides", held_out=base, held_out_defaults=base,
                        tuning=defaults_tuning))
    if gate is not None and gate.held_out(HANDTUNED):
        rows.append(Row(config="hand-tuned", what="16 seqs / 8192 batched tokens / 0.3 memory",
                        held_out=gate.held_out(HANDTUNED), held_out_defaults=gate.held_out("baseline")))
    best_plain = grid_best(grid, fp8=False) if grid else None
    best_any = grid_best(grid, fp8=None) if grid else None
    for name, run, against in (("tuned (default space)", tuned, best_plain), ("tuned (--allow fp8)", fp8, best_any)):
        if run is None:
            continue
        what = ", ".join(f"{k}={v}" for k, v in run.overrides.items()) or "the baseline kept"
        rows.append(Row(config=name + (f": {run.emitted}" if run.emitted != "baseline" else ": baseline kept"),
                        what=what, held_out=run.held_out(run.emitted), held_out_defaults=run.held_out("baseline"),
                        tuning=[run.tuning_capacity] if run.tuning_capacity is not None else [],
                        grid_best=against.score if against else None, gpu_s=run.search_wall_s + run.gate_wall_s))
    if grid is not None:
        cost = sum(p.wall_s for p in grid.points)
        best_fp8 = grid_best(grid, fp8=True)
        for name, point in (("grid's best without fp8", best_plain), ("grid's best with fp8", best_fp8)):
            if point is not None:
                rows.append(Row(config=name + f": {point.label}", what=describe_point(point),
                                tuning=point_score(point), grid_best=best_any.score if best_any else None,
                                gpu_s=cost))
        rows += scheduler_config_rows(grid, cost)
    return rows


def scheduler_config_rows(grid: Table, cost: float) -> list[Row]:
    """The grid's best without and with fp8 again, judged with the points that ran as one
    scheduler config as one (benchmarks/search_table.py `one_scheduler_config`: max_num_seqs never
    bound, so their launches are draws of one config, valued at the median of all of them); only
    where that changes which launches the best stands on. A single launch's best can be the
    luck of one launch: this row says what the grid's launches support."""
    merged, classes = one_scheduler_config(grid)
    if not classes:
        return []
    members = {label: c.labels for c in classes for label in c.labels}
    best_any = grid_best(merged, fp8=None)
    rows = []
    for name, fp8 in (("grid's best without fp8", False), ("grid's best with fp8", True)):
        point, alone = grid_best(merged, fp8=fp8), grid_best(grid, fp8=fp8)
        if point is None or point.label not in members or point_score(point) == point_score(alone):
            continue
        rows.append(Row(config=f"{name}, as one scheduler config: {' = '.join(members[point.label])}",
                        what=describe_point(point).replace(
                            f"max_num_seqs={point.effective.get('max_num_seqs')}", "max_num_seqs never bound"),
                        tuning=point_score(point), grid_best=best_any.score if best_any else None, gpu_s=cost))
    return rows


def _rate(value: float) -> str:
    """req/s to 3 significant figures, at least one decimal: 36.2, 2.57, 0.715 (one decimal
    alone read a 5% step between 0.715 and 0.753 as 0.7 against 0.8)."""
    decimals = 1 if value <= 0 else max(1, 2 - math.floor(math.log10(value)))
    return f"{value:.{decimals}f}"


def _span(values: list[float]) -> str:
    if not values:
        return "-"
    middle = statistics.median(values)
    return _rate(middle) if len(values) == 1 else f"{_rate(middle)} [{_rate(min(values))}, {_rate(max(values))}]"


def _ratio(value: float | None, against: float | None) -> str:
    return "-" if value is None or not against else f"{value / against:.2f}x"


def markdown(rows: list[Row]) -> str:
    lines = ["| config | settings | held-out capacity, median [min, max] | vs defaults (same gate) "
             "| tuning-window capacity | vs grid's best | GPU seconds |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        versus = (_ratio(median(row.held_out), median(row.held_out_defaults))
                  if row.held_out is not row.held_out_defaults and row.config != DEFAULTS else "-")
        lines.append(
            f"| {row.config} | {row.what} | {_span(row.held_out)} | {versus} "
            f"| {_span(row.tuning)} | {_ratio(median(row.tuning), row.grid_best)} "
            f"| {'-' if row.gpu_s is None else f'{row.gpu_s:.0f}'} |")
    if any(row.grid_best for row in rows):
        lines += ["", "vs grid's best, on the tuning window: the default-space run against the grid's best "
                  "without fp8; every other row against the grid's best overall, single launches, or judged "
                  "as one scheduler config for the rows so named."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", type=Path, help="the grid's table folder (table.json)")
    parser.add_argument("--tuned", type=Path, help="the default-space run's --output-dir")
    parser.add_argument("--fp8", type=Path, help="the --allow fp8 run's --output-dir")
    parser.add_argument("--out", type=Path, help="write the table here (and a .json beside it)")
    args = parser.parse_args(argv)
    if not (args.grid or args.tuned or args.fp8):
        parser.error("give at least one of --grid, --tuned, --fp8")
    if args.out is not None and (args.out.suffix != ".md" or args.out.is_dir()
                                 or args.out.with_suffix(".json").is_dir() or not args.out.parent.is_dir()):
        raise SystemExit(f"--out {args.out}: give a .md file to write in an existing folder (its .json "
                         "twin goes beside it)")
    try:
        grid = read_grid(args.grid) if args.grid is not None else None
        tuned = read_run(args.tuned) if args.tuned else None
        fp8 = read_run(args.fp8) if args.fp8 else None
    except VllmAutotuneError as error:  # a damaged trace copy, a config that does not parse
        raise SystemExit(str(error)) from None
    check_one_scenario(grid, tuned, fp8)
    rows = build_rows(grid[0] if grid else None, tuned, fp8)
    text = markdown(rows)
    if args.out is not None:
        write_text_atomic(args.out, text)
        write_json_atomic(args.out.with_suffix(".json"), [r.model_dump() for r in rows])
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
