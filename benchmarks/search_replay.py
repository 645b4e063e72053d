"""The search benchmark's tabular replay (benchmarks/search_efficiency.py replay): the strategies
(ours, plain TPE, random search, grid order) run over a measured table, each trial answered with
its point's measured outcome and charged its measured cost on a virtual clock, and the figures
they are judged by (launches and cost until 0.95x and 0.98x the grid's best, the done-when)."""

from __future__ import annotations

import dataclasses
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from benchmarks.benchlib import fmt, say, spread
from benchmarks.search_table import (
    QUANTIZATION_AXIS,
    Key,
    Point,
    SchedulerClass,
    Table,
    check_powers_of_two,
    conditions,
    draw,
    load_repeats,
    one_scheduler_config,
    point_label,
    pooled,
    read_outcome,
    table_trace,
)

TARGETS = (0.95, 0.98)  # shares of the grid's best the searches are timed to
DONE_TARGET = 0.95
COST_GOAL = 0.25  # the issue: reach 0.95x within 25% of the grid's cost ...
SEEDS_GOAL = 0.9  # ... in the median and in 18 of 20 seeds
TELL_APART_Z = 1.2816  # one-sided 90%: how sure a search must be that one config beats another
SEARCH_ONLY = " - the baseline's result not counted"


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
        self.table = table
        self.clock = clock
        self.defaults = defaults
        self.rng = np.random.default_rng(seed)
        self.calls: list[Point] = []  # the launches answered, in order

    def run(self, config, window, trial_dir, *, should_prune=None, start_speedup=None):
        point = self.table.lookup(config.engine, self.defaults)
        point = draw(point, self.rng)
        self.calls.append(point)
        self.clock.now += point.wall_s
        outcome = read_outcome(point)
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


def replay_space(table: Table):
    """The grid as a search space: each scheduler knob every power of two from its lowest to its
    highest value; a grid with fp8 points adds `quantization` as `autotune run --allow fp8` does."""
    from autotune.search.numerics import numerics_params
    from autotune.search.space import ParamSpec, SearchSpace

    check_powers_of_two(table.settings)
    grid = table.settings["grid"]
    params = {name: ParamSpec(type="pow2", low=min(values), high=max(values))
              for name, values in grid.items() if name != QUANTIZATION_AXIS}
    if table.has_fp8():
        # `--allow fp8` also adds kv_cache_dtype, which no table measured: only the axes the table
        # has can be looked up, so the replay searches the weights' quantization alone. The
        # baseline is vLLM's defaults (no quantization), as in every table.
        params |= {name: spec for name, spec in numerics_params(("fp8",), {}).items() if name == QUANTIZATION_AXIS}
    return SearchSpace(params, source="the benchmark grid")


def run_study(replay: Replay, seed: int, n_trials: int, *, first_moves: bool = True) -> list[Point]:
    """Our tuner over the table (TuningStudy as `autotune run` builds it, the space restricted
    to the grid); `first_moves=False`: plain TPE from the baseline on. The points it launched."""
    import optuna

    from autotune.request import DEFAULT_REPEATS, DEFAULT_TOP_K
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
            top_k=DEFAULT_TOP_K,  # no gate is replayed; the study's settings as `autotune run`'s
            repeats=DEFAULT_REPEATS,
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
           truth: dict[Key, float] | None = None) -> Run:
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
    check_powers_of_two(table.settings)  # before the missing points: a grid off the space lacks none of its own
    missing = table.missing()
    if missing:
        raise SystemExit(f"{table_dir / 'table.json'}: the table lacks {len(missing)} of its grid's points "
                         f"(e.g. {point_label(*missing[0])}); run `measure` first")
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
        # Only fp8 classes name their weights: a table without fp8 replays to the same JSON as before.
        "scheduler_classes": [c.model_dump(exclude_none=True) for c in classes],
        "judged_as_one": as_one,
        "done_when_judged_otherwise": judged_otherwise,
        "least_share_baseline_first": least_share_baseline_first(table, grid_best, grid_cost),
        "launches_to_tell_apart": launches_to_tell_apart(other if as_one else table, grid_best, classes, judged=table),
        "objective": table.objective,
        "settings": table.settings,
        "grid": {"points": len(grid), "feasible_points": len(feasible), "best_score": grid_best,
                 "best_point": best_point.label, "cost_s": grid_cost,
                 "baseline_in_grid": base is not None and base.key in {p.key for p in grid},
                 # Only a grid that measured fp8: the done-when is against the best of either.
                 **({"best_by_quantization": best_by_quantization(feasible)} if table.has_fp8() else {})},
        "baseline": None if base is None else base.model_dump(),
        "conditions": conditions(table),
        "table": [p.model_dump() for p in table.points],
        "ours": ours,
        "done_when": done_when(results[ours]),
        "strategies": results,
    }


def best_by_quantization(feasible: Sequence[Point]) -> dict[str, dict[str, Any] | None]:
    """The best feasible point without fp8 ("none") and with it ("fp8"): its label and score
    (req/s); None where no point of that kind met the SLOs."""
    out: dict[str, dict[str, Any] | None] = {}
    for name, quantization in (("none", None), ("fp8", "fp8")):
        kind = [p for p in feasible if p.quantization == quantization]
        best = max(kind, key=lambda p: p.score) if kind else None
        out[name] = None if best is None else {"point": best.label, "score": best.score}
    return out


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


def launches_to_tell_apart(table: Table, grid_best: float, classes: Sequence[SchedulerClass] = (),
                           judged: Table | None = None) -> dict[str, Any] | None:
    """How many launches of each a search needs to tell the grid's best from the best point below
    DONE_TARGET x it: n = 2 (z sd / gap)^2 (z = TELL_APART_Z) makes the better config's mean over n
    launches come out above the other's 9 times in 10, with sd the launches' spread within a
    config (normal noise assumed), pooled over every config launched more than once: a point
    measured again (repeats), and each of `classes` (points of `table`, judged per point, that
    ran as one scheduler config: `one_scheduler_config`) with all its members' launches. What
    one launch per config can resolve on this grid; None without repeated configs or such a point.
    `judged` (default `table`): the table whose scores the grid's best and the point below come from."""
    by_label = {p.label: p for p in table.points}
    grouped = {label for c in classes for label in c.labels}
    launch_sets = [[run for label in c.labels for run in (by_label[label].launches or [by_label[label]])]
                   for c in classes]
    launch_sets += [p.launches for p in table.points if len(p.launches) >= 2 and p.label not in grouped]
    groups = [[run.score if run.feasible else 0.0 for run in runs] for runs in launch_sets]
    below = [p.score for p in (judged or table).grid_points() if p.feasible and p.score < DONE_TARGET * grid_best]
    if not groups or not below:
        return None
    freedom = sum(len(g) - 1 for g in groups)
    sd = math.sqrt(sum(float(np.sum((np.array(g) - np.mean(g)) ** 2)) for g in groups) / freedom)
    gap = grid_best - max(below)
    return {"pooled_sd": sd, "configs": len(groups), "launches": sum(len(g) for g in groups),
            "scheduler_configs": len(classes), "gap": gap, "below": max(below), "z": TELL_APART_Z,
            "launches_per_config": math.ceil(2 * (TELL_APART_Z * sd / gap) ** 2)}
