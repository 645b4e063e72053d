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
    .venv/bin/python benchmarks/search_efficiency.py replay [--table DIR ...] [--seeds 20]

TABLE defaults to benchmarks/data/search_grid_capacity (goodput: benchmarks/data/search_grid;
quick: /tmp/...). `replay` defaults to every committed table: those two and the GPU grids
(benchmarks/data/h100-DATE/SCENARIO/grid, h200-..., measured on the GPU host with --table RUN/grid and copied back). Results:
results/benchmarks/search_efficiency.{json,md} (quick: results/benchmarks/quick/).

One script over ~400 lines, as every benchmark here is one runnable file: measuring a table,
replaying it and writing its report share the table's model and are read together.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import itertools
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import (
    DATA,
    RESULTS,
    ROOT,
    EngineWatch,
    Goal,
    Recorder,
    fmt,
    md_table,
    say,
    spread,
    write_json_atomic,
)
from pydantic import BaseModel, ConfigDict, ValidationError

# The capacity grid: vLLM's default max_num_seqs (128) and max_num_batched_tokens (2048) on this
# CPU are a grid point, so the baseline is one of the points and the first moves from it (halve
# or quarter the prefill budget, halve or double the sequences) land on points of the grid.
CAPACITY_SEQS = (4, 8, 16, 32, 64, 128)
CAPACITY_BATCHED = (512, 1024, 2048)
GOODPUT_SEQS = (1, 2, 4, 8, 16, 32)
GOODPUT_BATCHED = (256, 512, 1024, 2048, 4096)
QUICK_SEQS = (16, 32)
QUICK_BATCHED = (1024, 2048)
TRACE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"
TARGETS = (0.95, 0.98)  # shares of the grid's best the searches are timed to
DONE_TARGET = 0.95
COST_GOAL = 0.25  # the issue: reach 0.95x within 25% of the grid's cost ...
SEEDS_GOAL = 0.9  # ... in the median and in 18 of 20 seeds
TELL_APART_Z = 1.2816  # one-sided 90%: how sure a search must be that one config beats another
BASELINE_LABEL = "baseline"
SEARCH_ONLY = " - the baseline's result not counted"


class Point(BaseModel):
    """One measured grid point (or the baseline) in TABLE/table.json."""

    label: str
    max_num_seqs: int | None  # None: vLLM's default (the baseline)
    max_num_batched_tokens: int | None
    effective: dict[str, Any]  # what the engine ran with (defaults resolved)
    baseline: bool
    ok: bool
    failure: str | None
    failure_detail: str | None
    score: float  # the table's objective: goodput or capacity, req/s (0 when the run failed)
    # What the study counts as feasible: goodput: ran and met every SLO; capacity: carried some
    # load with every SLO met (capacity > 0; the SLOs are inside the number).
    feasible: bool
    measured_ms: dict[str, float | None]
    throughput: float | None
    completed: int | None
    failed: int | None
    wall_s: float  # what the trial cost, start to stop, wall clock
    timing: dict[str, float] | None  # TrialTiming
    load_1min_before: float
    other_engine_share: float = 0.0  # share of the trial another user's vLLM engine ran
    measured_at: str
    trial_dir: str  # relative to the repository root, or absolute
    # capacity tables only
    capacity_rps: float | None = None
    headroom: float | None = None
    bracketed: bool | None = None
    ladder_steps: int | None = None
    start_speedup: float | None = None  # where the ladder started (None: at 1x, unhinted)
    limiting_slo: str | None = None  # the SLO that broke first above the capacity
    # A pooled point (a table with repeats.json): every launch of this config, the table's own
    # first; `score` is then their median (a failed launch counts 0), `wall_s` their mean cost.
    launches: list[Point] = []

    @property
    def key(self) -> tuple[int, int]:
        return int(self.effective["max_num_seqs"]), int(self.effective["max_num_batched_tokens"])

    def outcome_path(self) -> Path:
        folder = Path(self.trial_dir)
        return (folder if folder.is_absolute() else ROOT / folder) / "outcome.json"


class Table(BaseModel):
    settings: dict[str, Any]
    points: list[Point] = []

    @property
    def objective(self) -> str:
        return str(self.settings.get("objective", "goodput"))

    def by_key(self) -> dict[tuple[int, int], Point]:
        return {p.key: p for p in self.points}

    def grid_keys(self) -> list[tuple[int, int]]:
        """Every grid point, in auto_tune.sh's order: max_num_seqs outer, batched tokens inner."""
        grid = self.settings["grid"]
        return [(s, b) for s, b in itertools.product(sorted(grid["max_num_seqs"]),
                                                     sorted(grid["max_num_batched_tokens"]))
                if launchable(s, b)]

    def grid_points(self) -> list[Point]:
        """The grid's measured points (the baseline among them when it is a grid point)."""
        points = self.by_key()
        return [points[key] for key in self.grid_keys() if key in points]

    def baseline_point(self) -> Point | None:
        return next((p for p in self.points if p.baseline), None)

    def missing(self) -> list[tuple[int, int]]:
        points = self.by_key()
        return [key for key in self.grid_keys() if key not in points]


def load_table(table_dir: Path) -> Table:
    """The table; points measured on another host (a GPU's run folder) read their trial folders
    from beside the table, where the run folder was copied."""
    table = Table.model_validate_json((table_dir / "table.json").read_text())
    for point in table.points:
        if not point.outcome_path().exists() and (table_dir / "trials" / Path(point.trial_dir).name).is_dir():
            point.trial_dir = str(table_dir / "trials" / Path(point.trial_dir).name)
    return table


def table_trace(table: Table, table_dir: Path) -> Path:
    """The trace a table was measured on: where it recorded it (relative to the repository), else
    the copy `measure` keeps beside a table whose trace lived outside the repository (a GPU host's
    run folder), so a committed GPU grid replays anywhere."""
    recorded = ROOT / table.settings["trace"]
    if recorded.exists():
        return recorded
    copy = table_dir / Path(table.settings["trace"]).name
    if copy.exists():
        return copy
    raise SystemExit(f"{table_dir / 'table.json'}: trace {table.settings['trace']} not found, "
                     f"nor a copy at {copy}")


class RepeatsFile(BaseModel):
    """TABLE/repeats.json: tables whose points are more launches of this table's configs (the same
    model, trace, window, SLOs and ladder; e.g. a few points measured again on another day). The
    replay then draws one of a config's launches each time a strategy launches it, and judges a
    strategy by the median of its pick's launches: the noise a live tuner faces, and the truth it
    is after."""

    model_config = ConfigDict(extra="forbid")
    tables: list[str]  # folders, relative to the table's
    note: str = ""  # how the repeats were measured (e.g. that the trace copies are byte-identical)


def load_repeats(table: Table, table_dir: Path) -> list[Table]:
    """The tables TABLE/repeats.json names, each checked to measure this table's configs the same
    way: only the grid may differ (a repeat measures some of the points) and the trace's folder
    (a copy of the same trace per run on the GPU host)."""
    path = table_dir / "repeats.json"
    if not path.exists():
        return []
    try:
        spec = RepeatsFile.model_validate_json(path.read_text())
    except ValidationError as error:
        first = error.errors()[0]
        raise SystemExit(f"{path}: {'.'.join(str(x) for x in first['loc']) or 'file'}: {first['msg']}") from None
    repeats = []
    points = table.by_key()
    for folder in spec.tables:
        if not (table_dir / folder / "table.json").exists():
            raise SystemExit(f"{path}: tables: {folder}: no table.json there")
        other = load_table(table_dir / folder)
        conflicts = [key for key in settings_conflicts(table.settings, other.settings) if key not in ("grid", "trace")]
        if Path(other.settings["trace"]).name != Path(table.settings["trace"]).name:
            conflicts.append("trace")
        if conflicts:
            raise SystemExit(f"{path}: tables: {folder}: measured with another {conflicts[0]} "
                             f"({other.settings.get(conflicts[0])!r} against {table.settings.get(conflicts[0])!r})")
        stray = next((p for p in other.points if p.key not in points), None)
        if stray is not None:
            raise SystemExit(f"{path}: tables: {folder}: {stray.label} (max_num_seqs={stray.key[0]}, "
                             f"max_num_batched_tokens={stray.key[1]}) is not a point of this table")
        repeats.append(other)
    return repeats


def pooled(table: Table, repeats: Sequence[Table]) -> Table:
    """The table with every point's launches pooled (Point.launches). Without repeats, the table as
    it is: each point is its one launch."""
    if not repeats:
        return table
    launches: dict[tuple[int, int], list[Point]] = {p.key: [p] for p in table.points}
    for other in repeats:
        for point in other.points:
            launches[point.key].append(point)
    points = []
    for point in table.points:
        runs = launches[point.key]
        score = float(np.median([p.score if p.feasible else 0.0 for p in runs]))
        points.append(point.model_copy(update={
            "score": score, "feasible": score > 0, "wall_s": float(np.mean([p.wall_s for p in runs])),
            "launches": runs}))
    return table.model_copy(update={"points": points})


class SchedulerClass(BaseModel):
    """Grid points judged as one scheduler config (`one_scheduler_config`)."""

    labels: list[str]
    batched: int
    smallest_cap: int
    peak_running: float  # the most requests any ladder step of any of their launches ran at once
    launches: int
    score: float  # the median of every launch


def cap_idle(ladder: Any, seqs: int) -> bool:
    """Whether a `max_num_seqs` of `seqs` never limited this launch's ladder
    (autotune.measure.ladder.CapacityResult): in every step, scored or not, at most half the cap
    ran at once (the running gauge is sampled between scrapes: the margin covers what the samples
    missed), nothing was preempted and the KV cache stayed under 90% full. False where a step
    lacks the server's metrics."""
    steps = [*ladder.steps, *ladder.unscored]
    return bool(steps) and all(
        step.server is not None and step.server.num_running_max is not None
        and step.server.num_running_max <= 0.5 * seqs and not (step.server.preemptions or 0)
        and (step.server.kv_cache_usage_max or 0.0) < 0.9
        for step in steps)


def launch_capacity(point: Point):
    """A launch's capacity ladder (autotune.measure.ladder.CapacityResult), None when its
    outcome is not at hand."""
    from autotune.measure.trial import TrialOutcome

    path = point.outcome_path()
    return TrialOutcome.model_validate_json(path.read_text()).capacity if path.exists() else None


def one_scheduler_config(table: Table) -> tuple[Table, list[SchedulerClass]]:
    """The table with the points that ran as one scheduler config judged as one.

    Points with the same batched-token budget whose `max_num_seqs` never bound in any ladder
    step of any of their launches (`cap_idle` at each point's own cap: at most half the cap
    running, no preemption, the KV cache under 90% full) each made the
    decisions the scheduler makes with no cap at the loads they were offered, so their launches
    are draws of one config: each such point's value becomes the median of all their launches,
    and a launch of any of them draws from all of them. The cap also sizes vLLM's CUDA-graph
    capture list (batches up to twice it, at most 512) and the memory profile; the decode batches
    of such points (at most half the smallest cap) are captured under every cap, and the KV cache
    never filled. Points whose launches lack their ladders are left as they are."""
    groups: dict[int, list[Point]] = {}
    peaks: dict[tuple[int, int], float] = {}
    for point in table.points:
        ladders = [launch_capacity(run) for run in (point.launches or [point])]
        if not point.feasible or any(ladder is None or not cap_idle(ladder, point.key[0]) for ladder in ladders):
            continue
        peaks[point.key] = max(s.server.num_running_max for ladder in ladders for s in [*ladder.steps, *ladder.unscored])
        groups.setdefault(point.key[1], []).append(point)
    classes: list[SchedulerClass] = []
    merged: dict[tuple[int, int], Point] = {}
    for batched, members in sorted(groups.items()):
        if len(members) < 2:
            continue
        runs = [run for point in members for run in (point.launches or [point])]
        score = float(np.median([run.score if run.feasible else 0.0 for run in runs]))
        classes.append(SchedulerClass(
            labels=[p.label for p in members], batched=batched, smallest_cap=min(p.key[0] for p in members),
            peak_running=max(peaks[p.key] for p in members), launches=len(runs), score=score))
        for point in members:
            merged[point.key] = point.model_copy(update={"score": score, "feasible": score > 0, "launches": runs})
    points = [merged.get(p.key, p) for p in table.points]
    return table.model_copy(update={"points": points}), classes


def check_powers_of_two(settings: dict[str, Any]) -> None:
    """The replay's space is every power of two between a knob's lowest and highest value."""
    for name, values in settings["grid"].items():
        low, high = min(values), max(values)
        powers = [2**k for k in range(int(math.log2(low)), int(math.log2(high)) + 1)]
        if sorted(values) != powers:
            raise SystemExit(f"grid {name} {values}: the tuner's space is every power of two from "
                             f"{low} to {high}; measure a grid with all of them")


# -- the measurement -------------------------------------------------------------------------


def point_config(baseline, seqs: int | None, batched: int | None):
    """A grid point's config as TuningStudy.trial_config builds a trial's: the baseline with
    the knobs on top, in benchmark mode."""
    engine = dict(baseline.engine)
    if seqs is not None:
        engine["max_num_seqs"] = seqs
    if batched is not None:
        engine["max_num_batched_tokens"] = batched
    serving = baseline.serving.model_copy(update={"benchmark_mode": True})
    return baseline.model_copy(update={"engine": engine, "serving": serving, "provenance": None})


def launchable(seqs: int, batched: int) -> bool:
    """False for a point that breaks a built-in relation of the search space (vLLM refuses fewer
    batched tokens than sequences): `autotune run` never launches it, so a grid leaves it out."""
    from autotune.search.relations import BUILTIN_RELATIONS, parse_relation

    values = {"max_num_seqs": seqs, "max_num_batched_tokens": batched}
    return all(parse_relation(text).check(values) is not False for text in BUILTIN_RELATIONS)


def measurement_order(seqs: Sequence[int], batched: Sequence[int], defaults: tuple[int, int],
                      order_seed: int) -> list[tuple[str, int | None, int | None]]:
    """The baseline first, then every other grid point in a seeded random order (a slow
    period of the shared machine then does not line up with one corner of the grid). Points
    that break a built-in relation of the search space (vLLM refuses fewer batched tokens than
    sequences) are left out, as `autotune run` never launches them."""
    rest = [(f"s{s}-b{b}", s, b) for s, b in itertools.product(seqs, batched)
            if (s, b) != defaults and launchable(s, b)]
    rng = np.random.default_rng(order_seed)
    return [(BASELINE_LABEL, None, None)] + [rest[i] for i in rng.permutation(len(rest))]


def shard_points(order: Sequence[tuple[str, int | None, int | None]], shard: tuple[int, int]
                 ) -> list[tuple[str, int | None, int | None]]:
    """The points shard K of N measures: all of them for one shard; else every Nth point after
    the baseline, from the K-th (the same split in every process, whatever is already done)."""
    index, count = shard
    if count == 1:
        return list(order)
    return [point for point in order if point[0] != BASELINE_LABEL][index::count]


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


@contextlib.contextmanager
def table_lock(table_dir: Path):
    """Held while a process reads and rewrites table.json (shards measure one table at once)."""
    table_dir.mkdir(parents=True, exist_ok=True)
    with open(table_dir / ".table.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def read_table(table_path: Path, settings: dict[str, Any]) -> Table:
    """table.json as measured so far, or an empty table with these settings."""
    return Table.model_validate_json(table_path.read_text()) if table_path.exists() else Table(settings=settings)


def store_point(table_path: Path, settings: dict[str, Any], point: Point) -> Table:
    """Add (or replace) one point in table.json as it is on disk now, under the table's lock:
    points that other shards stored since this process read the table are kept."""
    with table_lock(table_path.parent):
        table = read_table(table_path, settings)
        table.points = [p for p in table.points if p.label != point.label] + [point]
        write_json_atomic(table_path, table.model_dump(mode="json"))
    return table


# Words about the measurement, not conditions of it: a table measured before they changed still
# takes points. "extended" is the table's record of its earlier, smaller grids.
DESCRIPTIVE_SETTINGS = ("measured_as", "hint", "extended")


def settings_conflicts(stored: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """The settings on which a table measured with `stored` cannot take points measured with
    `wanted`: every condition of the measurement must match, except that the grid may grow (every
    value it had is kept) and ladder fields added since the table was measured compare at their
    defaults."""
    from autotune.measure.ladder import LadderSettings

    conflicts = []
    for key in sorted({*stored, *wanted} - set(DESCRIPTIVE_SETTINGS)):
        old, new = stored.get(key), wanted.get(key)
        if key == "grid" and old is not None and new is not None:
            if not all(set(values) <= set(new.get(axis, ())) for axis, values in old.items()):
                conflicts.append(key)
        elif key == "ladder" and old is not None and new is not None:
            if LadderSettings.model_validate(old) != LadderSettings.model_validate(new):
                conflicts.append(key)
        elif old != new:
            conflicts.append(key)
    return conflicts


def extend_grid(table_path: Path, settings: dict[str, Any]) -> Table:
    """Grow a measured table's grid to `settings`' axes (a superset: settings_conflicts): the
    points measured are kept, the new settings are stored with a record of the smaller grid (its
    axes, its points and when the last was measured), so the report can say the table was measured
    in parts. Under the table's lock: the first of several shards extends it, the others find it
    extended."""
    with table_lock(table_path.parent):
        table = read_table(table_path, settings)
        if table.settings["grid"] != settings["grid"]:
            record = {"grid": table.settings["grid"], "points": len(table.points),
                      "last_measured_at": max((p.measured_at for p in table.points), default=None)}
            say(f"{table_path}: extending the grid from {table.settings['grid']} to {settings['grid']}; "
                f"its {len(table.points)} measured points are kept")
            table.settings = {**settings, "extended": [*table.settings.get("extended", []), record]}
            write_json_atomic(table_path, table.model_dump(mode="json"))
    return table


def keep_small(trial_dir: Path) -> None:
    """The table keeps what the replay and a reader need: outcome.json (the ladder's steps are
    in it), config.yaml, summary.json, server_metrics.json, server.log."""
    for name in ("requests.jsonl", "ladder.json"):
        (trial_dir / name).unlink(missing_ok=True)


def measure(args: argparse.Namespace) -> int:
    if args.objective == "capacity":
        return measure_capacity(args)
    return measure_goodput(args)


def measure_capacity(args: argparse.Namespace) -> int:
    from autotune.cli import build_parser
    from autotune.measure.ladder import recorded_rate
    from autotune.measure.limits import limiting_slo
    from autotune.pipeline import build_runner
    from autotune.prepare import prepare_plan
    from autotune.run_cli import run_request
    from autotune.search.objective import Objective, evaluate
    from server.engine import effective_settings, resolve_engine_config

    table_dir = Path(args.table)
    table_path = table_dir / "table.json"
    # `autotune run --workload TRACE` with every other flag at its default: the same window,
    # SLOs, ladder settings and baseline as the product's default run.
    # --run-arg adds `autotune run` flags (a GPU grid: --model, --slo, --max-model-len, ...).
    run_args = build_parser().parse_args(
        ["run", "--workload", str(args.trace), "--output-dir", str(table_dir), *args.run_args]
    )
    request = run_request(run_args).model_copy(update={"study_name": "search-grid", "output_dir": table_dir})
    plan = prepare_plan(request)
    tuning, slos, ladder, baseline = plan.tuning_window, plan.slos, plan.ladder, plan.baseline
    defaults = plan.effective_defaults
    window = plan.workload["tuning_window"]
    settings = {
        "trace": trace_name(Path(args.trace)),
        "objective": "capacity",
        # Only when given, so tables measured before the flag existed still resume.
        **({"run_args": list(args.run_args)} if args.run_args else {}),
        "measured_as": "autotune run --workload TRACE (every other flag at its default): one "
                       "trial = one engine launch + the capacity ladder (autotune.measure.trial.TrialRunner)",
        "window_start_s": window["start_s"],
        "window_recorded_s": window["end_s"] - window["start_s"],
        "window_requests": len(tuning),
        "recorded_rps": recorded_rate(tuning),
        "slos": [s.spec() for s in slos],
        "ladder": ladder.model_dump(),
        "mode": run_args.mode,
        "speedup": run_args.speedup,
        "defaults": defaults,
        "baseline_engine": stored_engine(baseline.engine),
        "grid": {"max_num_seqs": list(args.seqs), "max_num_batched_tokens": list(args.batched)},
        "hint": "the baseline's ladder starts at 1x (unhinted, as trial 0); every other point's "
                "starts at the baseline's capacity with finer steps (LadderSettings.hinted), as "
                "`autotune run` starts a trial at the best capacity found so far",
    }
    check_powers_of_two(settings)
    table = read_table(table_path, settings)
    if table.points:
        conflicts = settings_conflicts(table.settings, settings)
        if conflicts:
            raise SystemExit(f"{table_path} was measured with other settings ({', '.join(conflicts)}); "
                             f"use another --table")
        table = extend_grid(table_path, settings)  # nothing to do when the grid is the same
    default_key = (int(defaults["max_num_seqs"]), int(defaults["max_num_batched_tokens"]))
    order = measurement_order(args.seqs, args.batched, default_key, args.order_seed)
    shard_index, shards = args.shard
    if shards > 1 and table.baseline_point() is None:
        raise SystemExit(f"{table_path}: --shard {shard_index}/{shards} needs the baseline measured "
                         "first (every other point's ladder starts at its capacity): run once with "
                         "--max-points 1 and no --shard")
    done = {p.label for p in table.points}
    todo = [w for w in shard_points(order, args.shard) if w[0] not in done]
    if args.max_points is not None:
        todo = todo[: args.max_points]
    say(f"{len(done)} points measured, {len(todo)} to measure now"
        + (f" (shard {shard_index}/{shards})" if shards > 1 else "")
        + f"; window {len(tuning)} requests, "
        f"{settings['recorded_rps']:.2f} req/s recorded; SLOs {', '.join(settings['slos'])}; ladder "
        f"{ladder.step_requests} requests / >= {ladder.min_step_s:g} s a step")
    # A registry of its own per shard: a starting run ends the servers its registry names.
    registry = table_dir / ("servers.json" if shards == 1 else f"servers-shard{shard_index}.json")
    runner = build_runner(plan, registry=registry, say=say)
    objective = Objective(kind="capacity")
    for label, seqs, batched in todo:
        base = table.baseline_point()
        hint = None
        if label != BASELINE_LABEL and base is not None and base.score > 0:
            hint = base.score / settings["recorded_rps"]
        config = point_config(baseline, seqs, batched)
        effective = effective_settings(resolve_engine_config(config)).model_dump()
        trial_dir = table_dir / "trials" / label
        if trial_dir.exists():
            shutil.rmtree(trial_dir)  # a point cut short earlier is measured again
        load = os.getloadavg()[0]
        say(f"{label}: measuring (ladder from x{hint:.3g})" if hint else f"{label}: measuring")
        started = time.monotonic()
        with EngineWatch() as watch:
            outcome = runner.run(config, tuning, trial_dir, start_speedup=hint)
        wall = time.monotonic() - started
        evaluation = evaluate(outcome, objective, slos)
        capacity = outcome.capacity
        point = Point(
            label=label,
            max_num_seqs=seqs,
            max_num_batched_tokens=batched,
            effective={k: effective[k] for k in ("max_num_seqs", "max_num_batched_tokens",
                                                  "gpu_memory_utilization", "enforce_eager")},
            baseline=label == BASELINE_LABEL,
            ok=outcome.ok,
            failure=outcome.failure,
            failure_detail=outcome.failure_detail,
            score=evaluation.score,
            feasible=evaluation.feasible,
            measured_ms=evaluation.measured_ms,
            throughput=None if outcome.summary is None else outcome.summary.request_throughput,
            completed=None if outcome.summary is None else outcome.summary.completed,
            failed=None if outcome.summary is None else outcome.summary.failed,
            wall_s=wall,
            timing=None if outcome.timing is None else outcome.timing.model_dump(),
            load_1min_before=load,
            other_engine_share=watch.report()["share_with_foreign_engine"],
            measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
            trial_dir=relative_dir(trial_dir),
            capacity_rps=evaluation.capacity_rps,
            headroom=evaluation.headroom,
            bracketed=None if capacity is None else capacity.bracketed,
            ladder_steps=None if capacity is None else len(capacity.steps),
            start_speedup=hint,
            limiting_slo=None if capacity is None else limiting_slo(capacity, slos),
        )
        table = store_point(table_path, settings, point)
        keep_small(trial_dir)
        say(f"{label}: capacity {point.score:.3g} req/s ({fmt(point.headroom)}x the recorded rate, "
            f"{point.ladder_steps} steps, {'bracketed' if point.bracketed else 'not bracketed'}, "
            f"{point.limiting_slo or 'no SLO'} broke first), {'ok' if point.ok else point.failure}; "
            f"cost {wall:.1f} s (load {load:.1f}, another engine ran {point.other_engine_share:.0%} of it)")
    say(f"table: {len(table.points)} points, {len(order) - len(table.points)} still to measure -> {table_path}")
    return 0


def stored_engine(engine: dict[str, Any]) -> dict[str, Any]:
    """The baseline's engine arguments, a model folder inside the repository written relative
    to it (the table then reads the same from any checkout)."""
    model = Path(str(engine.get("model", "")))
    if engine.get("model") and model.is_dir():
        return {**engine, "model": relative_dir(model)}
    return dict(engine)


def relative_dir(folder: Path) -> str:
    resolved = folder.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(resolved)


def measure_goodput(args: argparse.Namespace) -> int:
    """The older table: one timed replay of a 15 s window per point, scored by goodput."""
    from autotune.measure.trial import TrialRunner
    from autotune.search.objective import Objective, default_slos, evaluate
    from server.config import ServerConfig, default_engine_settings
    from server.engine import effective_settings, resolve_engine_config
    from workloads.replay import ReplayOptions
    from workloads.trace_io import load_trace
    from workloads.windows import select_windows

    table_dir = Path(args.table)
    table_path = table_dir / "table.json"
    trace = load_trace(args.trace)
    tuning, _, info = select_windows(trace, args.window_s * args.speedup, 20.0)
    slos = default_slos("cpu")
    settings = {
        "trace": str(Path(args.trace).resolve().relative_to(ROOT)),
        "window_recorded_s": args.window_s * args.speedup,
        "window_start_s": info.tuning.start_s,
        "speedup": args.speedup,
        "window_wall_s": args.window_s,
        "window_requests": len(tuning),
        "window_rate_rps": len(tuning) / args.window_s,
        "slos": [s.spec() for s in slos],
        "objective": "goodput",
        "request_timeout_s": args.request_timeout,
        "grid": {"max_num_seqs": list(args.seqs), "max_num_batched_tokens": list(args.batched)},
        "measurement": "autotune.measure.trial.TrialRunner (timed replay, 4 warm-up requests), one run per point",
    }
    table = read_table(table_path, settings)
    if table.points and table.settings != settings:
        raise SystemExit(f"{table_path} was measured with other settings; use another --table")
    table.settings = settings
    baseline = ServerConfig(engine=default_engine_settings())
    order = measurement_order(args.seqs, args.batched, (0, 0), args.order_seed)
    done = {p.label for p in table.points}
    todo = [w for w in order if w[0] not in done]
    if args.max_points is not None:
        todo = todo[: args.max_points]
    replay_options = ReplayOptions(mode="timed", speedup=args.speedup, slos=slos,
                                   timeout_s=args.request_timeout)
    runner = TrialRunner(replay=replay_options, stale_registry=table_dir / "servers.json")
    objective = Objective(kind="goodput")
    for label, seqs, batched in todo:
        config = point_config(baseline, seqs, batched)
        effective = effective_settings(resolve_engine_config(config)).model_dump()
        trial_dir = table_dir / "trials" / label
        if trial_dir.exists():
            shutil.rmtree(trial_dir)
        load = os.getloadavg()[0]
        started = time.monotonic()
        with EngineWatch() as watch:
            outcome = runner.run(config, tuning, trial_dir)
        wall = time.monotonic() - started
        evaluation = evaluate(outcome, objective, slos)
        summary = outcome.summary
        point = Point(
            label=label, max_num_seqs=seqs, max_num_batched_tokens=batched,
            effective={k: effective[k] for k in ("max_num_seqs", "max_num_batched_tokens",
                                                  "gpu_memory_utilization", "enforce_eager")},
            baseline=seqs is None, ok=outcome.ok, failure=outcome.failure,
            failure_detail=outcome.failure_detail, score=evaluation.score,
            feasible=evaluation.ok and evaluation.feasible, measured_ms=evaluation.measured_ms,
            throughput=None if summary is None else summary.request_throughput,
            completed=None if summary is None else summary.completed,
            failed=None if summary is None else summary.failed, wall_s=wall,
            timing=None if outcome.timing is None else outcome.timing.model_dump(),
            load_1min_before=load, other_engine_share=watch.report()["share_with_foreign_engine"],
            measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"), trial_dir=relative_dir(trial_dir),
        )
        table.points = [p for p in table.points if p.label != label] + [point]
        write_json_atomic(table_path, table.model_dump(mode="json"))
        (trial_dir / "requests.jsonl").unlink(missing_ok=True)
        say(f"{label}: goodput {point.score:.2f} req/s, feasible {point.feasible}; cost {wall:.1f} s")
    say(f"table: {len(table.points)} points, {len(order) - len(table.points)} still to measure -> {table_path}")
    return 0


# -- the tabular replay -------------------------------------------------------------------------


class VirtualClock:
    """The study's clock: advances by each trial's measured cost, nothing else."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TableRunner:
    """Answers a trial with the measured outcome of its grid point (autotune.search.gate_runner.Runner).

    A capacity outcome's ladder is also written to the trial folder as `ladder.json`, where the
    study reads the baseline's to choose its first moves (as TrialRunner writes it live). A pooled
    point answers with one of its launches, drawn anew at every launch (seeded)."""

    def __init__(self, table: Table, clock: VirtualClock, defaults: dict[str, Any], *, seed: int = 0):
        self.points = table.by_key()
        self.clock = clock
        self.defaults = defaults
        self.rng = np.random.default_rng(seed)
        self.calls: list[Point] = []  # the launches answered, in order

    def run(self, config, window, trial_dir, *, should_prune=None, start_speedup=None):
        from autotune.measure.trial import TrialOutcome

        key = (
            int(config.engine.get("max_num_seqs") or self.defaults["max_num_seqs"]),
            int(config.engine.get("max_num_batched_tokens") or self.defaults["max_num_batched_tokens"]),
        )
        point = self.points.get(key)
        if point is None:
            raise KeyError(f"the table has no point max_num_seqs={key[0]}, "
                           f"max_num_batched_tokens={key[1]}; measure it first")
        point = draw(point, self.rng)
        self.calls.append(point)
        self.clock.now += point.wall_s
        outcome = TrialOutcome.model_validate_json(point.outcome_path().read_text())
        if outcome.capacity is not None:
            Path(trial_dir).mkdir(parents=True, exist_ok=True)
            (Path(trial_dir) / "ladder.json").write_text(outcome.capacity.model_dump_json())
        return outcome


@dataclasses.dataclass
class Replay:
    """What a replayed study needs besides the table: built once per table."""

    table: Table
    objective: Any  # autotune.search.objective.Objective
    slos: list[Any]
    window: Any  # the tuning window (Trace); the study reads it only for ladder hints and ETAs
    defaults: dict[str, Any]  # vLLM's resolved defaults for the baseline
    baseline: Any  # ServerConfig

    @classmethod
    def of(cls, table: Table, table_dir: Path) -> Replay:
        from autotune.search.objective import Objective
        from server.config import ServerConfig
        from workloads.slo import parse_slos
        from workloads.trace_io import load_trace

        base = table.baseline_point()
        if base is None:
            raise SystemExit("the table has no baseline; run `measure` first")
        engine = table.settings.get("baseline_engine")
        if engine is None:  # the goodput table predates the stored baseline
            from server.config import default_engine_settings

            engine = default_engine_settings()
        trace = load_trace(table_trace(table, table_dir))
        start_ms = float(trace.timestamps_ms[0]) + 1000.0 * float(table.settings["window_start_s"])
        window = trace.slice_time(start_ms, start_ms + 1000.0 * float(table.settings["window_recorded_s"]))
        return cls(
            table=table,
            objective=Objective(kind=table.objective),
            slos=parse_slos(table.settings["slos"]),
            window=window,
            defaults=dict(table.settings.get("defaults") or base.effective),
            baseline=ServerConfig(engine=engine),
        )


def draw(point: Point, rng: np.random.Generator) -> Point:
    """One launch of a config: a pooled point's launches at random, else the point itself. A
    launch recorded for another point of its scheduler config answers as this point's."""
    if not point.launches:
        return point
    launch = point.launches[int(rng.integers(len(point.launches)))]
    if launch.key == point.key:
        return launch
    return launch.model_copy(update={"label": point.label, "max_num_seqs": point.max_num_seqs,
                                     "max_num_batched_tokens": point.max_num_batched_tokens,
                                     "effective": point.effective, "baseline": point.baseline})


def replay_space(table: Table):
    from autotune.search.space import ParamSpec, SearchSpace

    check_powers_of_two(table.settings)
    grid = table.settings["grid"]
    return SearchSpace(
        {name: ParamSpec(type="pow2", low=min(values), high=max(values)) for name, values in grid.items()},
        source="the benchmark grid",
    )


def run_study(replay: Replay, seed: int, n_trials: int, *, first_moves: bool = True) -> list[Point]:
    """Our tuner over the table (TuningStudy as `autotune run` builds it, the space restricted
    to the grid); `first_moves=False`: plain TPE from the baseline on. The points it launched."""
    import optuna

    from autotune.search.study import SearchInputs, StudyOptions, TuningStudy

    class PlainTPEStudy(TuningStudy):
        """The same study without the first phase of one-knob moves."""

        def queue_first_moves(self, study: optuna.Study) -> None:
            return None

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    clock = VirtualClock()
    runner = TableRunner(replay.table, clock, replay.defaults, seed=seed)
    with tempfile.TemporaryDirectory(prefix="search-replay-") as scratch:
        options = StudyOptions(
            study_name=f"replay-{seed}",
            output_dir=Path(scratch),
            n_trials=n_trials,
            seed=seed,
            prune=False,  # a pruned goodput trial cannot be replayed (capacity never prunes)
            # Nothing to keep, and SQLite's writes would take most of the replay's time.
            storage=optuna.storages.InMemoryStorage(),
        )
        study_class = TuningStudy if first_moves else PlainTPEStudy
        study = study_class(
            options=options,
            inputs=SearchInputs(
                space=replay_space(replay.table),
                objective=replay.objective,
                slos=replay.slos,
                baseline=replay.baseline,
                baseline_source="vLLM's defaults",
                tuning_window=replay.window,
                holdout_window=replay.window,
                effective_defaults=replay.defaults,
            ),
            runner=runner,
            say=lambda _line: None,
            clock=clock,
        )
        study.open()
        study.run_search()
    return runner.calls


def run_random(table: Table, seed: int) -> list[Point]:
    """Plain random search: every grid point once, in a seeded random order."""
    grid = table.grid_points()
    rng = np.random.default_rng(seed)
    return [draw(grid[i], rng) for i in rng.permutation(len(grid))]


def run_grid_order(table: Table, seed: int = 0) -> list[Point]:
    """auto_tune.sh: nested loops, max_num_seqs outer, max_num_batched_tokens inner (the seed
    only draws a pooled point's launch)."""
    rng = np.random.default_rng(seed)
    return [draw(point, rng) for point in table.grid_points()]


class Run(BaseModel):
    """One strategy's launches for one seed: cumulative cost and best feasible score."""

    labels: list[str]
    cost_s: list[float]
    best: list[float]

    @classmethod
    def of(cls, points: Sequence[Point], *, count_baseline: bool = True,
           truth: dict[tuple[int, int], float] | None = None) -> Run:
        """`points`: the launches in order. The best after each is what the search would pick
        (its best launch so far, the first on ties) judged by `truth` (a pooled table's median
        per config; default: the launch's own score). `count_baseline=False`: the baseline's
        launches are charged but their result does not count, so the figures say what the search
        found beyond vLLM's defaults."""
        pick: Point | None = None
        cost = 0.0
        bests, costs = [], []
        for point in points:
            cost += point.wall_s
            if point.feasible and (count_baseline or not point.baseline) and (pick is None or point.score > pick.score):
                pick = point
            bests.append(0.0 if pick is None else (truth or {}).get(pick.key, pick.score))
            costs.append(cost)
        return cls(labels=[p.label for p in points], cost_s=costs, best=bests)

    def reached(self, goal: float) -> tuple[int, float] | None:
        """(launches, seconds) when the best first reached `goal`; None if it never did."""
        for index, (best, cost) in enumerate(zip(self.best, self.cost_s, strict=True), start=1):
            if best >= goal:
                return index, cost
        return None


def summarize(runs: Sequence[Run], grid_best: float, grid_cost: float) -> dict[str, Any]:
    """Per target: how many seeds reach it, launches and seconds to it, the share of the grid's
    cost (unreached counted as infinite, so the median says what half the seeds achieve)."""
    out: dict[str, Any] = {
        "seeds": len(runs),
        "launches": spread([len(r.labels) for r in runs]),
        # Launches of a point this run had already measured (TPE may propose one again).
        "repeated_launches": spread([len(r.labels) - len(set(r.labels)) for r in runs]),
        "cost_share": spread([r.cost_s[-1] / grid_cost if r.cost_s else 0.0 for r in runs]),
        "final_over_best": spread([(r.best[-1] if r.best else 0.0) / grid_best for r in runs]),
    }
    for target in TARGETS:
        hits = [r.reached(target * grid_best) for r in runs]
        got = [h for h in hits if h is not None]
        shares = [math.inf if h is None else h[1] / grid_cost for h in hits]
        median = float(np.median(shares)) if shares else math.inf
        out[f"{target:g}"] = {
            "seeds_reaching": len(got),
            "launches": spread([h[0] for h in got]),
            "seconds": spread([h[1] for h in got]),
            "share_of_grid_cost": spread([s for s in shares if math.isfinite(s)]),
            # None: more than half the seeds never reach the target.
            "median_share_all_seeds": median if math.isfinite(median) else None,
            "seeds_within_cost_goal": sum(1 for s in shares if s <= COST_GOAL),
            "shares": [s if math.isfinite(s) else None for s in shares],  # None: never reached
        }
    return out


def done_when(summary: dict[str, Any]) -> dict[str, Any]:
    """The issue's done-when on one grid: the median over seeds reaches 0.95x the grid's best
    within 25% of the grid's cost, and 18 of 20 seeds (90%) do."""
    at = summary[f"{DONE_TARGET:g}"]
    seeds = summary["seeds"]
    median = at["median_share_all_seeds"]
    needed = math.ceil(SEEDS_GOAL * seeds)
    within = at["seeds_within_cost_goal"]
    median_met = median is not None and median <= COST_GOAL
    return {"median_share": median, "median_met": median_met, "seeds_within": within,
            "seeds_needed": needed, "seeds_met": within >= needed, "met": median_met and within >= needed}


def replay_table(table: Table, table_dir: Path, seeds: Sequence[int], default_trials: int, *,
                 as_one: bool = False) -> dict[str, Any]:
    """Every strategy over one table for every seed; a table with repeats.json over its pooled
    launches. Where points ran as one scheduler config (`one_scheduler_config`), ours at its
    defaults is also judged the other way: with them judged as one, or (`as_one`: every strategy
    judged so) each on its own launches."""
    missing = table.missing()
    if missing:
        raise SystemExit(f"the table lacks {len(missing)} grid points (e.g. {missing[0]}); run `measure` first")
    table = pooled(table, load_repeats(table, table_dir))
    merged, classes = one_scheduler_config(table)
    table, other = (merged, table) if as_one else (table, merged)
    truth = {p.key: p.score for p in table.points}
    replay = Replay.of(table, table_dir)
    grid = table.grid_points()
    feasible = [p for p in grid if p.feasible]
    if not feasible:
        raise SystemExit("no grid point met the SLOs: there is no best to reach")
    best_point = max(feasible, key=lambda p: p.score)
    grid_best, grid_cost = best_point.score, sum(p.wall_s for p in grid)
    say(f"{table.objective} grid: {len(grid)} points, {len(feasible)} feasible, best {grid_best:.3g} req/s "
        f"({best_point.label}), cost {grid_cost:.0f} s")
    long = len(grid)
    strategies: dict[str, list[list[Point]]] = {
        f"ours (autotune run defaults: --trials {default_trials})":
            [run_study(replay, seed, default_trials) for seed in seeds],
        f"ours, --trials {long}": [run_study(replay, seed, long) for seed in seeds],
        f"plain TPE, --trials {default_trials}":
            [run_study(replay, seed, default_trials, first_moves=False) for seed in seeds],
        f"plain TPE, --trials {long}": [run_study(replay, seed, long, first_moves=False) for seed in seeds],
        "random (grid in random order)": [run_random(table, seed) for seed in seeds],
        "grid order (auto_tune.sh; the same every seed)": [run_grid_order(table, seed) for seed in seeds],
    }
    # The study strategies again with the baseline's own result not counted (its cost still
    # is): when vLLM's defaults are already near the best, this is what the search added.
    for name in [n for n in strategies if n.startswith(("ours", "plain TPE"))]:
        strategies[f"{name}{SEARCH_ONLY}"] = strategies[name]
    results: dict[str, Any] = {}
    for name, launched in strategies.items():
        runs = [Run.of(points, count_baseline=not name.endswith(SEARCH_ONLY), truth=truth) for points in launched]
        # Each seed's launches in order: the table's costs and scores give the rest.
        results[name] = {**summarize(runs, grid_best, grid_cost), "launched": [r.labels for r in runs]}
        say(f"  {name}: " + "; ".join(
            f"{t:g}x: {results[name][f'{t:g}']['seeds_reaching']}/{len(seeds)} seeds, median share "
            f"{fmt(results[name][f'{t:g}']['median_share_all_seeds'])}" for t in TARGETS))
    ours = next(iter(results))
    judged_otherwise = None
    if classes:
        other_best = max(p.score for p in other.grid_points() if p.feasible)
        other_replay = dataclasses.replace(replay, table=other)  # the same trace window, not read again
        launched = [run_study(other_replay, seed, default_trials) for seed in seeds]
        runs = [Run.of(points, truth={p.key: p.score for p in other.points}) for points in launched]
        judged_otherwise = {**done_when(summarize(runs, other_best, grid_cost)), "grid_best": other_best,
                            "judge": "per config" if as_one else "as one scheduler config"}
        say(f"  {ours}, judged {judged_otherwise['judge']}: median share {fmt(judged_otherwise['median_share'])}, "
            f"{judged_otherwise['seeds_within']}/{len(seeds)} seeds within {COST_GOAL:.0%}")
    base = table.baseline_point()
    return {
        "scheduler_classes": [c.model_dump() for c in classes],
        "judged_as_one": as_one,
        "done_when_judged_otherwise": judged_otherwise,
        "least_share_baseline_first": least_share_baseline_first(table, grid_best, grid_cost),
        "launches_to_tell_apart": launches_to_tell_apart(table, grid_best),
        "objective": table.objective,
        "settings": table.settings,
        "grid": {"points": len(grid), "feasible_points": len(feasible), "best_score": grid_best,
                 "best_point": best_point.label, "cost_s": grid_cost,
                 "baseline_in_grid": base is not None and base.key in {p.key for p in grid}},
        "baseline": None if base is None else base.model_dump(),
        "conditions": conditions(table),
        "table": [p.model_dump() for p in table.points],
        "ours": ours,
        "done_when": done_when(results[ours]),
        "strategies": results,
    }


def axes(grid: dict[str, list[int]]) -> str:
    """A grid's axes as the report names them: max_num_seqs 512-1024 x batched 1024-8192."""
    return " x ".join(f"{'batched' if k == 'max_num_batched_tokens' else k} {min(v)}-{max(v)}"
                      for k, v in grid.items())


def least_share_baseline_first(table: Table, grid_best: float, grid_cost: float) -> float | None:
    """The least share of the grid's cost in which any search that measures the baseline first
    can reach DONE_TARGET x the grid's best: the baseline, then straight to the cheapest point
    that reaches it (an oracle's path). Above COST_GOAL, no such search can meet the goal."""
    base = table.baseline_point()
    if base is None:
        return None
    goal = DONE_TARGET * grid_best
    if base.feasible and base.score >= goal:
        return base.wall_s / grid_cost
    reaching = [p.wall_s for p in table.grid_points() if p.feasible and p.score >= goal and not p.baseline]
    return (base.wall_s + min(reaching)) / grid_cost if reaching else None


def launches_to_tell_apart(table: Table, grid_best: float) -> dict[str, Any] | None:
    """How many launches of each a search needs to tell the grid's best from the best point below
    DONE_TARGET x it: n = 2 (z sd / gap)^2 (z = TELL_APART_Z) makes the better config's mean over n
    launches come out above the other's 9 times in 10, with sd the launches' spread within a
    config (pooled over the configs launched more than once, normal noise assumed). What one
    launch per config can resolve on this grid; None without repeated configs or such a point."""
    groups = [[run.score if run.feasible else 0.0 for run in p.launches]
              for p in table.points if len(p.launches) >= 2]
    below = [p.score for p in table.grid_points() if p.feasible and p.score < DONE_TARGET * grid_best]
    if not groups or not below:
        return None
    freedom = sum(len(g) - 1 for g in groups)
    sd = math.sqrt(sum(float(np.sum((np.array(g) - np.mean(g)) ** 2)) for g in groups) / freedom)
    gap = grid_best - max(below)
    return {"pooled_sd": sd, "configs": len(groups), "launches": sum(len(g) for g in groups),
            "gap": gap, "below": max(below), "z": TELL_APART_Z,
            "launches_per_config": math.ceil(2 * (TELL_APART_Z * sd / gap) ** 2)}


def conditions(table: Table) -> dict[str, Any]:
    """What the machine was doing while the grid was measured: the 1-minute load average before
    each point, and (capacity) the replayer's send-lag p99 over every ladder step."""
    lags = []
    for point in table.points:
        path = point.outcome_path()
        if table.objective == "capacity" and path.exists():
            from autotune.measure.trial import TrialOutcome

            outcome = TrialOutcome.model_validate_json(path.read_text())
            steps = outcome.capacity.steps if outcome.capacity is not None else []
            lags += [s.summary.send_lag_p99_ms for s in steps if s.summary.send_lag_p99_ms is not None]
    return {"load_1min_before": spread([p.load_1min_before for p in table.points]),
            "send_lag_p99_ms": spread(lags),
            "other_engine_share": spread([p.other_engine_share for p in table.points])}


def replay(args: argparse.Namespace) -> int:
    from autotune.plan import DEFAULT_TRIALS

    recorder = Recorder("search_efficiency", "Search efficiency: our tuner vs plain TPE, random search "
                        "and the grid, on measured grids (issue 18)", "quick" if args.quick else "full")
    seeds = list(range(args.seeds))
    grids: dict[str, Any] = {}
    for table_dir in args.tables:
        say(f"replaying {table_dir}")
        grids[relative_dir(Path(table_dir))] = replay_table(load_table(Path(table_dir)), Path(table_dir), seeds,
                                                               DEFAULT_TRIALS, as_one=args.as_one)
    goals = []
    for name, grid in grids.items():
        done = grid["done_when"]
        goals.append(Goal(
            name=f"{name} ({grid['objective']}): ours, share of the grid's cost spent until the best "
                 f"reaches {DONE_TARGET:g}x the grid's best (median over {len(seeds)} seeds)",
            target=f"<= {COST_GOAL:g}",
            measured=done["median_share"],
            met=done["median_met"],
            note="" if done["median_share"] is not None else "more than half the seeds never reach it",
        ))
        goals.append(Goal(
            name=f"{name} ({grid['objective']}): seeds of ours reaching {DONE_TARGET:g}x within "
                 f"{COST_GOAL:.0%} of the grid's cost",
            target=f">= {done['seeds_needed']}/{len(seeds)}",
            measured=done["seeds_within"],
            met=done["seeds_met"],
        ))
    notes = [
        "Tabular benchmark: every grid point was measured once for real (`measure`: the CPU "
        "tables on this machine's CPU engine, benchmarks/data/h100-*/*/grid and benchmarks/data/h200*/*/grid on lent H100s and H200s); the strategies were then REPLAYED over the measured table: each trial gets "
        "the measured outcome of its point (for capacity, the whole ladder: the first moves read "
        "the baseline's ladder as they would live) and is charged that point's measured wall-clock "
        "cost (engine start, warm-up, ladder or window, teardown) on a virtual clock. No engine ran "
        "during the replay. The 'GPU-seconds' of the issue are these engine wall-seconds (on CPU, "
        "the CPU engine's).",
        f"Ours = autotune.search.study.TuningStudy as `autotune run` builds it with its defaults: "
        f"--trials {DEFAULT_TRIALS} (the baseline included), the objective and SLOs the table was "
        f"measured with (capacity: the default objective; CPU SLOs, or the GPU table's own), seeds 0-{len(seeds) - 1} "
        f"(`--seed N`; 0 is the default). The search space is the grid itself (each knob every power "
        f"of two from its lowest to its highest grid value): `autotune run`'s default space is "
        f"wider than any measured grid. The gate is not replayed.",
        "First moves (autotune.search.first_moves) need a capacity ladder: on the goodput table they "
        "never fire, and ours is plain TPE there.",
        "Plain TPE = the same study without the first moves (baseline first, then TPE). Random = "
        "every grid point once in a seeded random order. Grid order = every point in auto_tune.sh's "
        "nested-loop order (max_num_seqs outer); it is the same every seed.",
        "A table without repeats: each point was measured once, a re-proposed point is charged again "
        "and returns the same measurement (a live run would measure it again, with noise), and the "
        "grid's best is the best single measurement. A table with repeats (TABLE/repeats.json: "
        "other tables measuring some of its configs again, same trace, window, SLOs and ladder) is "
        "replayed POOLED: every launch of a config answers with one of its recorded launches, drawn "
        "at random (seeded) each time, and is charged that launch's cost; a point's value is the "
        "median of its launches (its cost their mean), so the grid's best is the best median; a "
        "strategy's result after each launch is the median of the config it would pick then (its "
        "best launch so far). That is the noise a live tuner faces, judged by the best estimate "
        "of what each config carries.",
        "Capacity tables: the baseline's ladder started at 1x; every other point's at the baseline's "
        "capacity (finer steps), as `autotune run` starts a trial at the best capacity so far; a live "
        "trial started from a better best would take a few more or fewer steps than charged here.",
        "Grid cost = the sum of every grid point's measured cost (measuring every point once, as "
        "vLLM's benchmarks/auto_tune/auto_tune.sh does). When vLLM's defaults are a grid point, "
        "the baseline is that point.",
        "Median share over all seeds: a seed that never reaches the target counts as infinite.",
        "The H100 and H200 grids of the long-prompt scenario (results/h100-2026-11-23c/long-prompts, "
        "results/h200-2026-11-25/long-prompts) were measured first with 8 points (max_num_seqs "
        "512-1024 x batched 1024-8192), where the baseline's launch alone cost 0.17-0.18 of the grid "
        "and no strategy that measures vLLM's defaults first could meet the 0.25; both were then "
        "extended to 19 points (each section's 'Measured in parts'). On all three long-prompt grids "
        "no ladder step of any point ran more than 19 requests at once, so a max_num_seqs of 128 or "
        "more never bound: along that axis the points differ by launch-to-launch spread. Two repeats "
        "of the four sequence counts at 1024 batched tokens on an H100 "
        "(results/h100-2026-11-23c/long-prompts/seqs-repeats-2026-11-26) reshuffled their order "
        "(256 sequences, a best point of that grid at 14.0, measured 13.2 and 14.0; 512, at 13.2 in "
        "the grid, 14.0 and 14.8), and a second launch of 1024/1024 on 2026-11-23 (grid-repeat) "
        "measured 10.6 against the grid's 13.2. Two more repeats on another H100 on 2026-11-27 "
        "(results/h100-2026-11-23c/long-prompts/seqs-repeats-2026-11-27) measured the four counts at "
        "10.3-14.0: over their 21 launches every count spans at least 2.3 req/s (17%), wider than "
        "the one ladder step (6%) between the per-config medians the goal tells apart.",
        "Judged as one scheduler config (the line under each done-when): grid points at one batched "
        "budget whose max_num_seqs never bound (in every ladder step of every launch at most half the "
        "cap ran at once, nothing was preempted, the KV cache stayed under 90%) made the decisions "
        "vLLM's scheduler makes with no cap, so their launches are pooled into one value and a "
        "launch of any of them draws from all of them.",
        "The CPU capacity grid was measured on this shared 2-core machine, where the replayer and the "
        "engine share the cores with other work: every ladder step's client ran late (send-lag p99 in "
        "the grid's section) and TTFT broke first at every point. Launches of one config vary by far "
        "more than the 10% goal (results/benchmarks/capacity_repeats.md), so differences between the "
        "points with 8 or more sequences are mostly measurement noise, and the grid's best is a tie "
        "of single measurements at the same ladder step.",
        "The 19-point grid of the same scenario "
        "(results/h200-x4-2026-11-26/long-prompts, max_num_seqs 128-1024 x max_num_batched_tokens "
        "512-8192) was measured on the four H200s of one host at once (`measure --shard K/N`, "
        "scripts/gpu/grid-8b-gpus.sh): the baseline first on GPU 0 alone, then one shard per GPU, "
        "each point's engine with a GPU and 16 of the 64 CPUs to itself and a copy of the "
        "baseline's compile cache; the other shards' engines ran beside almost every point. Where "
        "it overlaps the one-GPU H200 grid of 2026-11-25 (7 points besides the baseline), 4 points "
        "came out one ladder step (about 5%) higher and 3 the same.",
    ]
    result = recorder.result(
        settings={"seeds": len(seeds), "targets": list(TARGETS), "cost_goal": COST_GOAL,
                  "default_trials": DEFAULT_TRIALS, "tables": list(grids)},
        goals=goals,
        results={"grids": grids},
        notes=notes,
    )
    recorder.write(result, tables(grids, len(seeds)))
    for name, grid in grids.items():
        done = grid["done_when"]
        say(f"{name}: done-when {'met' if done['met'] else 'NOT met'} (median share "
            f"{fmt(done['median_share'])}, {done['seeds_within']}/{len(seeds)} seeds within {COST_GOAL:.0%})")
    return 0


def tables(grids: dict[str, Any], seeds: int) -> str:
    lines: list[str] = []
    for name, grid in grids.items():
        settings = grid["settings"]
        objective = grid["objective"]
        lines += [f"## `{name}`: {objective} grid", ""]
        if objective == "capacity":
            ladder = settings["ladder"]
            lines += [
                f"Measured as {settings['measured_as']}. Tuning window: {settings['window_requests']} "
                f"requests of `{settings['trace']}` ({settings['window_recorded_s']:.0f} s recorded, "
                f"{settings['recorded_rps']:.2f} req/s); SLOs {', '.join(settings['slos'])}; ladder "
                f"{ladder['step_requests']} requests and >= {ladder['min_step_s']:g} s a step, growth "
                f"x{ladder['growth']:g}, resolution {ladder['resolution']:.0%}.", "",
                "Capacity req/s (cost s, ladder steps, the SLO that broke first):", ""]
        else:
            lines += [
                f"Window: {settings['window_requests']} requests of `{settings['trace']}` "
                f"({settings['window_recorded_s']:g} s, {settings['window_rate_rps']:.1f} req/s), goodput "
                f"under {', '.join(settings['slos'])}. Measured with the older goodput objective; "
                f"kept and replayed for comparison (vLLM's defaults are already 0.97x of its best, and "
                f"the first moves need a ladder).", "",
                "Goodput req/s (* = misses an SLO or failed; cost s):", ""]
        points = {(p["effective"]["max_num_seqs"], p["effective"]["max_num_batched_tokens"]): p
                  for p in grid["table"]}
        batched = sorted(settings["grid"]["max_num_batched_tokens"])
        rows = []
        for s in sorted(settings["grid"]["max_num_seqs"]):
            row = [f"max_num_seqs {s}"]
            for b in batched:
                p = points.get((s, b))
                row.append("-" if p is None else cell(p))
            rows.append(row)
        lines += md_table(["", *[f"batched {b}" for b in batched]], rows)
        base = grid["baseline"]
        g = grid["grid"]
        if base:
            where = "a grid point" if g["baseline_in_grid"] else "not a grid point"
            lines += ["", f"Baseline (vLLM's defaults: max_num_seqs {base['effective']['max_num_seqs']}, "
                          f"max_num_batched_tokens {base['effective']['max_num_batched_tokens']}; {where}): "
                          f"{cell(base)}, {base['score'] / g['best_score']:.2f}x the grid's best."]
        ties = [p["label"] for p in grid["table"] if p["feasible"] and p["score"] >= g["best_score"]]
        lines += ["", f"Grid: {g['points']} points, {g['feasible_points']} feasible, best {g['best_score']:.3g} "
                      f"req/s ({', '.join(ties)}), cost {g['cost_s']:.0f} s ({g['cost_s'] / 60:.1f} min)."]
        for group in grid.get("scheduler_classes") or []:
            lines += ["", f"**One scheduler config:** {', '.join(group['labels'])} (batched {group['batched']}): in "
                          f"every ladder step of their {group['launches']} launches at most half of the point's own "
                          f"cap ran at once (the most: {group['peak_running']:g}; the smallest cap "
                          f"{group['smallest_cap']}), nothing was preempted and the KV cache stayed under 90%; "
                          f"judged as one config, its value is the median of all {group['launches']} launches, "
                          f"{group['score']:.3g} req/s, and a launch of one of them draws from all of them"
                          + ("." if grid.get("judged_as_one") else
                             " (the line after the done-when; the tables judge each point on its own launches).")]
        for earlier in grid["settings"].get("extended", []):
            later = sorted(p["measured_at"] for p in grid["table"] if p["measured_at"] > earlier["last_measured_at"])
            lines += ["", f"Measured in parts: {earlier['points']} points on the grid {axes(earlier['grid'])} "
                          f"until {earlier['last_measured_at']}; the grid was then extended and "
                          f"{len(later)} points measured from {later[0] if later else '-'} (the table takes points "
                          "only with the same model, trace window, SLOs and ladder; the baseline was not "
                          "measured again: the new points' ladders start at its capacity)."]
        load, lag = grid["conditions"]["load_1min_before"], grid["conditions"]["send_lag_p99_ms"]
        others = grid["conditions"]["other_engine_share"]
        lines += ["", f"While it was measured: load average (1 min) before a point {span(load, '{:.1f}')} "
                      f"on the measuring host"
                  + (f"; the replayer's send-lag p99 per ladder step {span(lag, '{:.0f}')} ms" if lag["n"] else "")
                  + (f"; another vLLM engine ran on the host for {span(others, '{:.2f}')} of a point's time "
                     "(other work, or the other shards of a grid measured on several GPUs at once)"
                     if others["n"] and others["max"] > 0 else "")
                  + ".", ""]
        least = grid.get("least_share_baseline_first")
        if least is not None:
            lines += [f"The least any search that measures the baseline first can spend to reach {DONE_TARGET:g}x "
                      f"(the baseline, then straight to the cheapest point that reaches it): **{least:.3f}** of "
                      f"the grid's cost"
                      + (f", over the goal's {COST_GOAL:g}: no such search can meet the goal on this grid."
                         if least > COST_GOAL else "."), ""]
        apart = grid.get("launches_to_tell_apart")
        if apart is not None:
            lines += [f"Telling the grid's best ({g['best_score']:.3g} req/s) from the best point under "
                      f"{DONE_TARGET:g}x it ({apart['below']:.3g}, {apart['gap']:.2g} req/s apart) takes "
                      f"**{apart['launches_per_config']} launches of each** (for their means to order them right "
                      f"9 times in 10): one config's "
                      f"launches spread by {apart['pooled_sd']:.2g} req/s (SD within a config, pooled over "
                      f"the {apart['configs']} configs launched more than once, {apart['launches']} launches). "
                      "With one launch each, any search tells them apart only by chance.", ""]
        if base and base["feasible"] and base["score"] >= DONE_TARGET * g["best_score"]:
            lines += [f"**vLLM's defaults alone reach {DONE_TARGET:g}x the grid's best** "
                      f"({base['score'] / g['best_score']:.2f}x): every strategy that measures the baseline "
                      f"first meets the target on its first launch, so this grid does not tell the searches "
                      f"apart; the rows marked '{SEARCH_ONLY.strip(' -')}' show what each search found "
                      f"beyond the defaults.", ""]
        for target in TARGETS:
            lines += [f"### To reach {target:g}x the grid's best ({target * g['best_score']:.3g} req/s); "
                      f"median (min-max) over {seeds} seeds", ""]
            rows = []
            for strategy, data in grid["strategies"].items():
                at = data[f"{target:g}"]
                rows.append([
                    strategy,
                    f"{at['seeds_reaching']}/{seeds}",
                    span(at["launches"], "{:g}"),
                    span(at["seconds"], "{:.0f}"),
                    span(at["share_of_grid_cost"], "{:.2f}"),
                    "never" if at["median_share_all_seeds"] is None else f"{at['median_share_all_seeds']:.2f}",
                    f"{at['seeds_within_cost_goal']}/{seeds}",
                ])
            lines += md_table(["strategy", "seeds reaching it", "launches", "seconds", "share of grid cost",
                               "median share, all seeds", f"seeds within {COST_GOAL:.0%} of grid cost"], rows)
            lines.append("")
        lines += ["### Each strategy's whole run", ""]
        rows = [[strategy, span(data["launches"], "{:g}"), span(data["repeated_launches"], "{:g}"),
                 span(data["cost_share"], "{:.2f}"), span(data["final_over_best"], "{:.3f}")]
                for strategy, data in grid["strategies"].items()]
        lines += md_table(["strategy", "launches", "of them a point measured before", "cost / grid cost",
                           "final best / grid best"], rows)
        done = grid["done_when"]
        median = "never" if done["median_share"] is None else f"{done['median_share']:.2f}"
        lines += ["", f"Done-when ({grid['ours']}): median share of the grid's cost to reach {DONE_TARGET:g}x = "
                      f"{median} "
                      f"(goal <= {COST_GOAL:g}); {done['seeds_within']}/{seeds} seeds within {COST_GOAL:.0%} "
                      f"(goal >= {done['seeds_needed']}): **{'met' if done['met'] else 'not met'}**.", ""]
        other = grid.get("done_when_judged_otherwise")
        if other:
            median = "never" if other["median_share"] is None else f"{other['median_share']:.2f}"
            lines += [f"The same done-when for ours, judged {other['judge']} (the grid's best "
                      f"{other['grid_best']:.3g} req/s): median share {median}, {other['seeds_within']}/{seeds} "
                      f"seeds within {COST_GOAL:.0%}: **{'met' if other['met'] else 'not met'}**.", ""]
    return "\n".join(lines)


def cell(point: dict[str, Any]) -> str:
    if len(point.get("launches") or []) > 1:
        return (f"{point['score']:.3g}, median of {len(point['launches'])} launches "
                f"({', '.join(format(p['score'], '.3g') for p in point['launches'])}; mean {point['wall_s']:.0f} s)")
    if point.get("capacity_rps") is not None or point.get("ladder_steps") is not None:
        mark = "" if point["ok"] else f" {point['failure']}"
        return (f"{point['score']:.3g}{mark} ({point['wall_s']:.0f} s, {point['ladder_steps']} steps, "
                f"{point['limiting_slo'] or '-'})")
    return f"{point['score']:.2f}{'' if point['feasible'] else '*'} ({point['wall_s']:.0f})"


def span(stats: dict[str, Any], form: str) -> str:
    if stats["median"] is None:
        return "-"
    return f"{form.format(stats['median'])} ({form.format(stats['min'])}-{form.format(stats['max'])})"


def trace_name(trace: Path) -> str:
    """The trace as the table records it: relative to the repository where it lives in it."""
    resolved = trace.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(resolved)


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


def default_table(objective: str, quick: bool) -> Path:
    name = "search_grid_capacity" if objective == "capacity" else "search_grid"
    return Path(f"/tmp/{name}_quick") if quick else DATA / name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args.seeds = args.seeds or (5 if args.quick else 20)
    if args.tables is None:
        candidates = [default_table(o, args.quick) for o in ("capacity", "goodput")]
        if not args.quick:  # the GPU grids the headline runs measured (DATA/h100-DATE/SCENARIO/grid, h200-...)
            candidates += sorted(DATA.glob("h[0-9]*-*/*/grid"))
        args.tables = [str(c) for c in candidates if (c / "table.json").exists()]
        if not args.tables:
            raise SystemExit("no measured table: run `measure` first")
    return replay(args)


if __name__ == "__main__":
    sys.exit(main())
