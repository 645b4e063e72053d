"""The search benchmark's measured table (benchmarks/search_efficiency.py): its points
(TABLE/table.json), loading a table and the repeats that measured its configs again, pooling
those launches, judging points that ran as one scheduler config as one, and the conditions the
table was measured under. `measure` writes tables, `replay` reads them."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from benchmarks.benchlib import DATA, ROOT, spread

QUANTIZATIONS = ("none", "fp8")  # the grid's quantization axis: "none" is vLLM's default weights
QUANTIZATION_AXIS = "quantization"
# A point's key: (max_num_seqs, max_num_batched_tokens) at vLLM's default weights, as every table
# measured before the quantization axis keys its points; (seqs, batched, "fp8") with fp8 weights.
Key = tuple[int, int] | tuple[int, int, str]


def point_key(seqs: int, batched: int, quantization: str | None = None) -> Key:
    """A point's key; `quantization` None (or "none") is vLLM's default."""
    return (seqs, batched) if quantization in (None, "none") else (seqs, batched, str(quantization))


def point_label(seqs: int, batched: int, quantization: str | None = None) -> str:
    """A grid point's label: s256-b1024, and s256-b1024-fp8 with fp8 weights."""
    return f"s{seqs}-b{batched}" + ("" if quantization in (None, "none") else f"-{quantization}")


def grid_quantizations(grid: dict[str, Any]) -> list[str | None]:
    """The grid's quantization axis as engine values (None: vLLM's default), none first; a grid
    that does not record the axis measured vLLM's default weights only."""
    values = grid.get(QUANTIZATION_AXIS, ["none"])
    return [None if q == "none" else q for q in QUANTIZATIONS if q in values]


NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]  # a measured rate or cost


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
    score: NonNegative  # the table's objective: goodput or capacity, req/s (0 when the run failed)
    # What the study counts as feasible: goodput: ran and met every SLO; capacity: carried some
    # load with every SLO met (capacity > 0; the SLOs are inside the number).
    feasible: bool
    measured_ms: dict[str, float | None]
    throughput: float | None
    completed: int | None
    failed: int | None
    wall_s: NonNegative  # what the trial cost, start to stop, wall clock
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
    quantization: Literal["fp8"] | None = None  # the `quantization` engine argument; None: vLLM's default

    @model_validator(mode="after")
    def _effective_knobs(self) -> Point:
        for knob in ("max_num_seqs", "max_num_batched_tokens"):
            value = self.effective.get(knob)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"effective.{knob} is {value!r}: a positive integer (what the engine ran with)")
        return self

    @model_serializer(mode="wrap")
    def _leave_out_default_weights(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A point at vLLM's default weights is written as before the axis existed: a table
        # measured without fp8 has the same shape whenever it was measured.
        data = handler(self)
        if data.get("quantization") is None:
            data.pop("quantization", None)
        return data

    @property
    def key(self) -> Key:
        return point_key(int(self.effective["max_num_seqs"]), int(self.effective["max_num_batched_tokens"]),
                         self.quantization)

    def outcome_path(self) -> Path:
        folder = Path(self.trial_dir)
        return (folder if folder.is_absolute() else ROOT / folder) / "outcome.json"


class GridAxes(BaseModel):
    """settings.grid: the axes a table's points span."""

    model_config = ConfigDict(extra="forbid")
    max_num_seqs: list[PositiveInt] = Field(min_length=1)
    max_num_batched_tokens: list[PositiveInt] = Field(min_length=1)
    quantization: list[Literal["none", "fp8"]] = Field(default=["none"], min_length=1)


class TableSettings(BaseModel):
    """The conditions in TABLE/table.json's settings every reader relies on (the rest are
    descriptive or checked where used): checked once, when the table is loaded."""

    model_config = ConfigDict(extra="allow")
    trace: str
    grid: GridAxes
    objective: Literal["capacity", "goodput"]
    slos: list[str]
    window_start_s: float
    ladder: dict[str, Any] | None = None  # capacity tables: the ladder's settings

    @model_validator(mode="after")
    def _capacity_has_its_ladder(self) -> TableSettings:
        if self.objective == "capacity" and self.ladder is None:
            raise ValueError("ladder: missing: a capacity table records its ladder's settings")
        if self.objective == "goodput" and not isinstance(getattr(self, "window_rate_rps", None), (int, float)):
            raise ValueError("window_rate_rps: missing: a goodput table records its window's rate")
        return self


class Table(BaseModel):
    settings: dict[str, Any]
    points: list[Point] = []

    @property
    def objective(self) -> str:
        return str(self.settings.get("objective", "goodput"))

    def by_key(self) -> dict[Key, Point]:
        return {p.key: p for p in self.points}

    def grid_keys(self) -> list[Key]:
        """Every grid point, in auto_tune.sh's order: max_num_seqs outer, batched tokens inner;
        with a quantization axis, every point at vLLM's default weights, then every fp8 point
        (one more loop around the two)."""
        grid = self.settings["grid"]
        return [point_key(s, b, q) for q, s, b in itertools.product(grid_quantizations(grid),
                                                                    sorted(grid["max_num_seqs"]),
                                                                    sorted(grid["max_num_batched_tokens"]))
                if launchable(s, b)]

    def grid_points(self) -> list[Point]:
        """The grid's measured points (the baseline among them when it is a grid point)."""
        points = self.by_key()
        return [points[key] for key in self.grid_keys() if key in points]

    def baseline_point(self) -> Point | None:
        return next((p for p in self.points if p.baseline), None)

    def has_fp8(self) -> bool:
        """Whether the grid measured fp8 weights (its quantization axis)."""
        return "fp8" in grid_quantizations(self.settings["grid"])

    def lookup(self, engine: dict[str, Any], defaults: dict[str, Any]) -> Point:
        """The point a config's engine arguments land on (vLLM's `defaults` for a knob left
        unset); KeyError naming it when the table has none."""
        seqs = int(engine.get("max_num_seqs") or defaults["max_num_seqs"])
        batched = int(engine.get("max_num_batched_tokens") or defaults["max_num_batched_tokens"])
        quantization = engine.get("quantization")
        point = self.by_key().get(point_key(seqs, batched, quantization))
        if point is None:
            raise KeyError(f"the table has no point max_num_seqs={seqs}, max_num_batched_tokens={batched}"
                           + (f", quantization={quantization}" if quantization else "") + "; measure it first")
        return point

    def missing(self) -> list[Key]:
        points = self.by_key()
        return [key for key in self.grid_keys() if key not in points]


def load_table(table_dir: Path) -> Table:
    """The table; points measured on another host (a GPU's run folder) read their trial folders
    from beside the table, where the run folder was copied. SystemExit (one line naming the
    file, the field, the value and the rule) where the folder holds no table or a damaged one."""
    path = table_dir / "table.json"
    if not path.is_file():
        raise SystemExit(f"{path}: not found (give a `search_efficiency.py measure --table` folder)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise SystemExit(f"{path}: unreadable: {error}") from None
    except json.JSONDecodeError as error:
        raise SystemExit(f"{path}: file: Invalid JSON: {error.msg} at line {error.lineno} column {error.colno}") from None
    try:
        table = Table.model_validate(raw)
    except ValidationError as error:
        raise SystemExit(f"{path}: {validation_line(error, raw)}") from None
    try:
        TableSettings.model_validate(table.settings)
    except ValidationError as error:
        line = validation_line(error, table.settings)
        raise SystemExit(f"{path}: settings" + (line.removeprefix("file") if line.startswith("file:") else f".{line}")) from None
    seen: dict[Key, str] = {}
    for point in table.points:
        if point.key in seen:
            raise SystemExit(f"{path}: points: {seen[point.key]} and {point.label} are the same config "
                             f"({point.key}): a table holds one launch of each (more go in repeats.json)")
        seen[point.key] = point.label
    baselines = [p.label for p in table.points if p.baseline]
    if len(baselines) > 1:
        raise SystemExit(f"{path}: points: {len(baselines)} marked baseline ({', '.join(baselines)}): one at most")
    for point in table.points:
        beside = table_dir.resolve() / "trials" / Path(point.trial_dir).name
        if not point.outcome_path().exists() and beside.is_dir():
            # Relative to the repository where it lies inside it: reports stay the same on any clone.
            point.trial_dir = str(beside.relative_to(ROOT) if beside.is_relative_to(ROOT) else beside)
    return table


def validation_line(error: ValidationError, raw: Any) -> str:
    """A pydantic error as one line: the field's path (a point named by its label), the rule and
    the value given."""
    first = error.errors()[0]
    parts, node = [], raw
    for part in first["loc"]:
        node = node[part] if isinstance(node, (dict, list)) and _has(node, part) else None
        label = node.get("label") if isinstance(node, dict) and isinstance(part, int) else None
        parts.append(f"{part} ({label})" if isinstance(label, str) else str(part))
    where = ".".join(parts) or "file"
    given = first.get("input")
    quiet = isinstance(given, (dict, list)) or first["type"] in ("missing", "json_invalid", "value_error")
    message = first["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" + ("" if quiet else f" (got {given!r})")


def _has(node: dict | list, part: Any) -> bool:
    return part in node if isinstance(node, dict) else isinstance(part, int) and 0 <= part < len(node)


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
    except (OSError, UnicodeDecodeError) as error:
        raise SystemExit(f"{path}: unreadable: {error}") from None
    except ValidationError as error:
        raise SystemExit(f"{path}: {validation_line(error, None)}") from None
    repeats = []
    points = table.by_key()
    if len(set(spec.tables)) < len(spec.tables):
        raise SystemExit(f"{path}: tables: a table named twice: each repeat's launches count once")
    for folder in spec.tables:
        if (table_dir / folder).resolve() == table_dir.resolve():
            raise SystemExit(f"{path}: tables: {folder} is this table itself: name the tables that measured it again")
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
    launches: dict[Key, list[Point]] = {p.key: [p] for p in table.points}
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
                                     "quantization": point.quantization,
                                     "effective": point.effective, "baseline": point.baseline})


class SchedulerClass(BaseModel):
    """Grid points judged as one scheduler config (`one_scheduler_config`)."""

    labels: list[str]
    batched: int
    quantization: str | None = None  # the weights they ran with (None: vLLM's default)
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
    return read_outcome(point).capacity if point.outcome_path().exists() else None


def read_outcome(point: Point):
    """A point's trial outcome (autotune.measure.trial.TrialOutcome); SystemExit (one line) where
    it is missing or damaged (`read_trial_outcome`)."""
    return read_trial_outcome(point.outcome_path(), f"{point.label}'s trial outcome")


def read_trial_outcome(path: Path, what: str):
    """The trial outcome at `path` (autotune.measure.trial.TrialOutcome); SystemExit (one line
    naming the file, the field, the value and `what` the file is) where it is missing or damaged."""
    from autotune.measure.trial import TrialOutcome

    try:
        return TrialOutcome.model_validate_json(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"{path}: not found ({what})") from None
    except (OSError, UnicodeDecodeError) as error:
        raise SystemExit(f"{path}: unreadable: {error}") from None
    except ValidationError as error:
        raise SystemExit(f"{path}: {validation_line(error, None)} ({what})") from None


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
    # By batched budget and weights: fp8 weights are another model's numerics, never one config
    # with vLLM's default weights.
    groups: dict[tuple[int, str], list[Point]] = {}
    peaks: dict[Key, float] = {}
    for point in table.points:
        ladders = [launch_capacity(run) for run in (point.launches or [point])]
        if not point.feasible or any(ladder is None or not cap_idle(ladder, point.key[0]) for ladder in ladders):
            continue
        peaks[point.key] = max(s.server.num_running_max for ladder in ladders for s in [*ladder.steps, *ladder.unscored])
        groups.setdefault((point.key[1], point.quantization or ""), []).append(point)
    classes: list[SchedulerClass] = []
    merged: dict[Key, Point] = {}
    for (batched, quantization), members in sorted(groups.items()):
        if len(members) < 2:
            continue
        runs = [run for point in members for run in (point.launches or [point])]
        score = float(np.median([run.score if run.feasible else 0.0 for run in runs]))
        classes.append(SchedulerClass(
            labels=[p.label for p in members], batched=batched, quantization=quantization or None,
            smallest_cap=min(p.key[0] for p in members),
            peak_running=max(peaks[p.key] for p in members), launches=len(runs), score=score))
        for point in members:
            merged[point.key] = point.model_copy(update={"score": score, "feasible": score > 0, "launches": runs})
    points = [merged.get(p.key, p) for p in table.points]
    return table.model_copy(update={"points": points}), classes


def check_powers_of_two(settings: dict[str, Any]) -> None:
    """The replay's space is every power of two between a knob's lowest and highest value (the
    quantization axis is a set of choices: QUANTIZATIONS)."""
    for name, values in settings["grid"].items():
        if name == QUANTIZATION_AXIS:
            continue
        low, high = min(values), max(values)
        powers = [2**k for k in range(int(math.log2(low)), int(math.log2(high)) + 1)]
        if sorted(values) != powers:
            raise SystemExit(f"grid {name} {values}: the tuner's space is every power of two from "
                             f"{low} to {high}; measure a grid with all of them")


def launchable(seqs: int, batched: int) -> bool:
    """False for a point that breaks a built-in relation of the search space (vLLM refuses fewer
    batched tokens than sequences): `autotune run` never launches it, so a grid leaves it out."""
    from autotune.search.relations import BUILTIN_RELATIONS, parse_relation

    values = {"max_num_seqs": seqs, "max_num_batched_tokens": batched}
    return all(parse_relation(text).check(values) is not False for text in BUILTIN_RELATIONS)


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


def relative_dir(folder: Path) -> str:
    resolved = folder.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(resolved)


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


def default_table(objective: str, quick: bool) -> Path:
    name = "search_grid_capacity" if objective == "capacity" else "search_grid"
    return Path(f"/tmp/{name}_quick") if quick else DATA / name
