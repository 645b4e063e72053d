"""`search_efficiency.py measure`: every point of a grid measured once for real into
TABLE/table.json (benchmarks/search_table.py), each point's trial folder beside it: by capacity
as `autotune run` measures a trial (sharded over the GPUs of one host with `--shard K/N`), or by
goodput (the older table). Resumable: measured points are kept, and a table takes a larger grid."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import itertools
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.benchlib import ROOT, EngineWatch, fmt, say, write_json_atomic
from benchmarks.search_table import (
    QUANTIZATION_AXIS,
    Point,
    Table,
    check_powers_of_two,
    launchable,
    point_label,
    relative_dir,
    settings_conflicts,
)

CAPACITY_SEQS = (4, 8, 16, 32, 64, 128)
CAPACITY_BATCHED = (512, 1024, 2048)
GOODPUT_SEQS = (1, 2, 4, 8, 16, 32)
GOODPUT_BATCHED = (256, 512, 1024, 2048, 4096)
QUICK_SEQS = (16, 32)
QUICK_BATCHED = (1024, 2048)
TRACE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"
BASELINE_LABEL = "baseline"
# One point to measure: (label, max_num_seqs, max_num_batched_tokens, quantization); the knobs
# None for the baseline (vLLM's defaults), quantization None for vLLM's default weights.
Planned = tuple[str, int | None, int | None, str | None]


def point_config(baseline, seqs: int | None, batched: int | None, quantization: str | None = None):
    """A grid point's config as TuningStudy.trial_config builds a trial's: the baseline with
    the knobs on top, in benchmark mode; `quantization: fp8` as `autotune run --allow fp8` sets it."""
    engine = dict(baseline.engine)
    if seqs is not None:
        engine["max_num_seqs"] = seqs
    if batched is not None:
        engine["max_num_batched_tokens"] = batched
    if quantization is not None:
        engine["quantization"] = quantization
    serving = baseline.serving.model_copy(update={"benchmark_mode": True})
    return baseline.model_copy(update={"engine": engine, "serving": serving, "provenance": None})


def measurement_order(seqs: Sequence[int], batched: Sequence[int], defaults: tuple[int, int],
                      order_seed: int, quantizations: Sequence[str | None] = (None,)) -> list[Planned]:
    """The baseline first, then every other grid point in a seeded random order (a slow
    period of the shared machine then does not line up with one corner of the grid). Points
    that break a built-in relation of the search space (vLLM refuses fewer batched tokens than
    sequences) are left out, as `autotune run` never launches them. `quantizations`: the
    weights each scheduler point is measured with (None: vLLM's default; "fp8": one more point
    each, the defaults' knobs with fp8 included); at (None,) the order is the one measured before
    the axis existed."""
    rest = [(point_label(s, b, q), s, b, q) for q, s, b in itertools.product(quantizations, seqs, batched)
            if ((s, b) != defaults or q is not None) and launchable(s, b)]
    rng = np.random.default_rng(order_seed)
    return [(BASELINE_LABEL, None, None, None)] + [rest[i] for i in rng.permutation(len(rest))]


def grid_settings(seqs: Sequence[int], batched: Sequence[int], quantizations: Sequence[str]) -> dict[str, Any]:
    """The table's `grid` setting: the axes and their values. The quantization axis only where
    it holds more than vLLM's default weights, so a table measured without it (before the axis
    existed, or with `--quantization none`) has the same settings and resumes."""
    grid: dict[str, Any] = {"max_num_seqs": list(seqs), "max_num_batched_tokens": list(batched)}
    if list(quantizations) != ["none"]:
        grid[QUANTIZATION_AXIS] = list(quantizations)
    return grid


def shard_points(order: Sequence[Planned], shard: tuple[int, int]) -> list[Planned]:
    """The points shard K of N measures: all of them for one shard; else every Nth point after
    the baseline, from the K-th (the same split in every process, whatever is already done)."""
    index, count = shard
    if count == 1:
        return list(order)
    return [point for point in order if point[0] != BASELINE_LABEL][index::count]


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


def run_flags(argv: Sequence[str]) -> dict[str, Any]:
    """`autotune run` flags (--run-arg) as TuningRequest field values, read as that command
    reads them; {} for none."""
    if not argv:
        return {}
    from autotune.cli import build_parser
    from autotune.cli.flags import request_fields

    return request_fields(build_parser().parse_args(["run", "--workload", "-", *argv]))


def measure_capacity(args: argparse.Namespace) -> int:
    from autotune.errors import AutotuneError
    from autotune.measure.ladder import recorded_rate
    from autotune.measure.limits import limiting_slo
    from autotune.pipeline import build_runner
    from autotune.prepare import prepare_plan
    from autotune.request import TuningRequest
    from autotune.search.objective import Objective, evaluate
    from server.engine import effective_settings, resolve_engine_config

    table_dir = Path(args.table)
    table_path = table_dir / "table.json"
    # `autotune run --workload TRACE` with every other setting at its default: the same window,
    # SLOs, ladder settings and baseline as the product's default run.
    # --run-arg adds `autotune run` flags (a GPU grid: --model, --slo, --max-model-len, ...).
    flags = run_flags(args.run_args)
    if "fp8" in args.quantization:
        # As `autotune run --allow fp8`: a CPU or a GPU without FP8 is refused before any engine starts.
        flags["allow"] = sorted({*flags.get("allow", []), "fp8"})
    request = TuningRequest(**{**flags, "workload": str(args.trace),
                               "study_name": "search-grid", "output_dir": table_dir})
    try:
        plan = prepare_plan(request)
    except AutotuneError as error:  # e.g. fp8 on a CPU: refused in one line, before any engine starts
        if "fp8" in args.quantization:  # the user gave --quantization, not --allow: name that fix
            raise SystemExit(f"measure --quantization fp8: {str(error).replace('drop --allow fp8', 'take fp8 out of --quantization')}") from None
        raise SystemExit(f"measure: {error}") from None
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
        "mode": request.mode,
        "speedup": request.speedup,
        "defaults": defaults,
        "baseline_engine": stored_engine(baseline.engine),
        "grid": grid_settings(args.seqs, args.batched, args.quantization),
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
    quantizations = [None if q == "none" else q for q in args.quantization]
    order = measurement_order(args.seqs, args.batched, default_key, args.order_seed, quantizations)
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
    for label, seqs, batched, quantization in todo:
        base = table.baseline_point()
        hint = None
        if label != BASELINE_LABEL and base is not None and base.score > 0:
            hint = base.score / settings["recorded_rps"]
        config = point_config(baseline, seqs, batched, quantization)
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
            quantization=quantization,
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


def measure_goodput(args: argparse.Namespace) -> int:
    """The older table: one timed replay of a 15 s window per point, scored by goodput."""
    from autotune.measure.trial import TrialRunner
    from autotune.search.objective import Objective, default_slos, evaluate
    from server.config import ServerConfig, default_engine_settings
    from server.engine import effective_settings, resolve_engine_config
    from workloads.replay import ReplayOptions
    from workloads.trace_io import load_trace
    from workloads.windows import select_windows

    if list(args.quantization) != ["none"]:
        raise SystemExit("--quantization: the goodput table measures vLLM's default weights only (a CPU engine)")
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
    for label, seqs, batched, _ in todo:
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


def trace_name(trace: Path) -> str:
    """The trace as the table records it: relative to the repository where it lives in it."""
    resolved = trace.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(resolved)
