"""The search benchmark (benchmarks/search_efficiency.py; its table, measure, replay and report
modules beside it) on a small synthetic capacity table: each strategy launches what it should, the figures are computed as the issue defines
them, and the committed goodput table still replays. No engine runs here."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from autotune.measure.ladder import CapacityResult, LadderSettings
from autotune.measure.scraper import ServerMetrics
from benchmarks import search_efficiency, search_measure, search_replay, search_report, search_table
from tests.factories import ladder_step, trial_outcome

ROOT = Path(__file__).resolve().parents[2]
GRID = {"max_num_seqs": [4, 8, 16], "max_num_batched_tokens": [512, 1024, 2048]}
DEFAULTS = {"max_num_seqs": 16, "max_num_batched_tokens": 2048}  # vLLM's, here a grid point
SLOS = ["ttft_p95_ms=1000", "tpot_p95_ms=100"]
POINT_S = 100.0  # every point costs this much: the grid's cost is 900 s


def capacity_of(seqs: int, batched: int) -> float:
    """Peaks at 16 sequences and 512 batched tokens (10 req/s); the defaults carry 6."""
    return max(0.0, 10.0 - 2.0 * abs(math.log2(batched / 512)) - 3.0 * abs(math.log2(seqs / 16)))


def ladder(rps: float) -> CapacityResult:
    """A ladder whose TPOT breaks first above the capacity (as with big prefill chunks)."""
    steps = [
        ladder_step(speedup=rps, offered_rps=rps, requests=60, measured_ms={SLOS[0]: 400.0, SLOS[1]: 80.0},
                    seconds=6, server=ServerMetrics(num_waiting_max=0, num_running_max=4)),
        ladder_step(index=1, speedup=rps * 1.1, offered_rps=rps * 1.1, requests=60, passed=False,
                    measured_ms={SLOS[0]: 500.0, SLOS[1]: 150.0}, seconds=6),
    ]
    if rps <= 0:
        steps = steps[1:]
    return CapacityResult(capacity_rps=rps, capacity_speedup=rps or None, recorded_rps=1.0,
                          first_fail_rps=rps * 1.1, bracketed=rps > 0, steps=steps)


def write_table(folder: Path) -> Path:
    """A measured capacity table as `measure` writes it, every point costing POINT_S."""
    points = []
    for seqs in GRID["max_num_seqs"]:
        for batched in GRID["max_num_batched_tokens"]:
            baseline = (seqs, batched) == (DEFAULTS["max_num_seqs"], DEFAULTS["max_num_batched_tokens"])
            label = "baseline" if baseline else f"s{seqs}-b{batched}"
            trial_dir = folder / "trials" / label
            trial_dir.mkdir(parents=True)
            rps = capacity_of(seqs, batched)
            outcome = trial_outcome(trial_dir, capacity=ladder(rps))
            (trial_dir / "outcome.json").write_text(outcome.model_dump_json())
            points.append(point(label, seqs, batched, rps, trial_dir, baseline=baseline))
    settings: dict[str, Any] = {
        "trace": "workloads/samples/translation_trace.jsonl", "objective": "capacity",
        "measured_as": "a synthetic table", "window_start_s": 300.0, "window_recorded_s": 30.0,
        "window_requests": 140, "recorded_rps": 4.7, "slos": SLOS,
        "ladder": LadderSettings.for_accelerator("cpu").model_dump(), "defaults": DEFAULTS,
        "baseline_engine": {"model": "tiny"}, "grid": GRID,
    }
    table = search_table.Table(settings=settings, points=points)
    (folder / "table.json").write_text(table.model_dump_json())
    return folder


def point(label: str, seqs: int, batched: int, rps: float, trial_dir: Path, *, baseline: bool = False) -> Any:
    return search_table.Point(
        label=label, max_num_seqs=None if baseline else seqs, max_num_batched_tokens=None if baseline else batched,
        effective={"max_num_seqs": seqs, "max_num_batched_tokens": batched}, baseline=baseline, ok=True,
        failure=None, failure_detail=None, score=rps, feasible=rps > 0, measured_ms={}, throughput=None,
        completed=None, failed=None, wall_s=POINT_S, timing=None, load_1min_before=0.0,
        measured_at="2026-11-23T00:00:00", trial_dir=str(trial_dir), capacity_rps=rps, ladder_steps=2,
    )


@pytest.fixture()
def table(tmp_path: Path) -> Any:
    return search_table.load_table(write_table(tmp_path / "grid"))


def test_ours_moves_from_the_baseline_ladder_and_finds_the_peak_on_the_second_launch(table, tmp_path) -> None:
    launched = search_replay.run_study(search_replay.Replay.of(table, tmp_path / "grid"), seed=0, n_trials=6)
    # TPOT broke first in the baseline's ladder: a quarter of the prefill budget first.
    assert [p.label for p in launched[:2]] == ["baseline", "s16-b512"]
    assert len(launched) == 6
    run = search_replay.Run.of(launched)
    assert run.reached(0.95 * 10.0) == (2, 2 * POINT_S)
    assert run.reached(11.0) is None


def test_plain_tpe_starts_from_the_baseline_without_the_moves(table, tmp_path) -> None:
    replay = search_replay.Replay.of(table, tmp_path / "grid")
    for seed in range(3):
        launched = search_replay.run_study(replay, seed=seed, n_trials=6, first_moves=False)
        assert launched[0].label == "baseline" and len(launched) == 6
    # Seeded: the same seed replays the same launches.
    again = [p.label for p in search_replay.run_study(replay, seed=1, n_trials=6, first_moves=False)]
    assert again == [p.label for p in search_replay.run_study(replay, seed=1, n_trials=6, first_moves=False)]


def test_random_visits_every_grid_point_once_and_grid_order_is_auto_tune_sh_nesting(table) -> None:
    labels = {p.label for p in table.grid_points()}
    first, second = search_replay.run_random(table, 0), search_replay.run_random(table, 1)
    assert sorted(p.label for p in first) == sorted(labels) and len(first) == 9
    assert [p.label for p in first] != [p.label for p in second]
    keys = [p.key for p in search_replay.run_grid_order(table)]
    assert keys[:4] == [(4, 512), (4, 1024), (4, 2048), (8, 512)] and keys[-1] == (16, 2048)


def test_the_table_answers_with_the_ladder_where_the_study_reads_it(table, tmp_path) -> None:
    from server.config import ServerConfig

    clock = search_replay.VirtualClock()
    runner = search_replay.TableRunner(table, clock, DEFAULTS)
    outcome = runner.run(ServerConfig(engine={"model": "tiny", "max_num_seqs": 8}), None, tmp_path / "t")
    assert outcome.capacity.capacity_rps == capacity_of(8, 2048)
    assert CapacityResult.model_validate_json((tmp_path / "t" / "ladder.json").read_text()) == outcome.capacity
    assert clock.now == POINT_S
    with pytest.raises(KeyError, match="max_num_seqs=32"):
        runner.run(ServerConfig(engine={"model": "tiny", "max_num_seqs": 32}), None, tmp_path / "u")


def runs_reaching(shares: list[float | None]) -> list[Any]:
    """One run per seed reaching the best (1.0) after spending `share` of a 100 s grid (None: never)."""
    return [search_replay.Run(labels=["a", "b"], cost_s=[share * 100 if share else 10.0, 100.0],
                              best=[1.0 if share else 0.5, 1.0 if share else 0.5]) for share in shares]


def test_done_when_needs_the_median_and_18_of_20_seeds_within_a_quarter_of_the_grid_cost() -> None:
    held = search_replay.done_when(search_replay.summarize(runs_reaching([0.2] * 18 + [None] * 2), 1.0, 100.0))
    assert held == {"median_share": pytest.approx(0.2), "median_met": True, "seeds_within": 18,
                    "seeds_needed": 18, "seeds_met": True, "met": True}
    short = search_replay.done_when(search_replay.summarize(runs_reaching([0.2] * 17 + [0.5] * 3), 1.0, 100.0))
    assert short["median_met"] and not short["seeds_met"] and not short["met"]
    # More than half the seeds never get there: no median share at all.
    never = search_replay.summarize(runs_reaching([0.1] * 9 + [None] * 11), 1.0, 100.0)
    assert never["0.95"]["median_share_all_seeds"] is None and never["0.95"]["seeds_reaching"] == 9
    assert not search_replay.done_when(never)["met"]
    assert never["0.95"]["launches"]["median"] == 1


def test_a_table_measured_on_another_host_replays_from_the_trace_copy_beside_it(tmp_path) -> None:
    measured = write_table(tmp_path / "host" / "grid")
    window = search_replay.Replay.of(search_table.load_table(measured), measured).window
    # Copied off the host: the trial folders the table names are gone; the copies beside it are read.
    folder = tmp_path / "grid"
    shutil.copytree(measured, folder)
    shutil.rmtree(measured)
    table = search_table.load_table(folder)
    assert all(p.outcome_path().is_relative_to(folder) for p in table.points)
    # A GPU host's run folder: the recorded path does not exist here.
    table.settings["trace"] = "/root/run/traffic.jsonl"
    with pytest.raises(SystemExit, match=r"grid/table.json: trace /root/run/traffic.jsonl not found"):
        search_replay.Replay.of(table, folder)
    shutil.copy(ROOT / "workloads/samples/translation_trace.jsonl", folder / "traffic.jsonl")
    assert search_replay.Replay.of(table, folder).window.timestamps_ms.tolist() == window.timestamps_ms.tolist()


def test_replaying_a_table_reports_every_strategy_and_the_done_when(table, tmp_path) -> None:
    result = search_replay.replay_table(table, tmp_path / "grid", seeds=[0, 1, 2], default_trials=6)
    assert result["grid"]["best_score"] == 10.0 and result["grid"]["cost_s"] == 9 * POINT_S
    assert result["grid"]["baseline_in_grid"]
    strategies = result["strategies"]
    assert result["ours"] == "ours (autotune run defaults: --trials 6)"
    assert {"random (grid in random order)", "plain TPE, --trials 6", "ours, --trials 9"} <= set(strategies)
    ours = strategies[result["ours"]]["0.95"]
    assert ours["seeds_reaching"] == 3 and ours["median_share_all_seeds"] == pytest.approx(2 / 9)
    assert result["done_when"]["met"]
    grid = strategies["grid order (auto_tune.sh; the same every seed)"]["0.95"]
    assert grid["launches"]["median"] == 7  # (16, 512) comes after the six 4- and 8-sequence points
    json.dumps(result, allow_nan=False)  # the JSON the benchmark writes holds no Infinity
    markdown = search_report.tables({"grid": result}, 3)
    assert "Done-when" in markdown and "**met**" in markdown


def test_a_grid_with_a_gap_in_its_powers_of_two_is_refused() -> None:
    with pytest.raises(SystemExit, match="every power of two"):
        search_table.check_powers_of_two({"grid": {"max_num_seqs": [4, 16], "max_num_batched_tokens": [512]}})


def test_the_baseline_is_measured_first_and_once() -> None:
    order = search_measure.measurement_order([4, 8], [512, 1024], (8, 1024), order_seed=0)
    assert order[0] == ("baseline", None, None, None)
    assert sorted(label for label, *_ in order[1:]) == ["s4-b1024", "s4-b512", "s8-b512"]


def test_the_committed_goodput_table_still_loads_complete() -> None:
    table = search_table.load_table(ROOT / "benchmarks" / "data" / "search_grid")
    assert table.objective == "goodput" and table.missing() == []
    assert len(table.grid_points()) == 30
    base = table.baseline_point()
    assert base is not None and base.key not in {p.key for p in table.grid_points()}


def test_a_grid_axis_is_powers_of_two_and_anything_else_is_named() -> None:
    assert search_efficiency.powers_list("512,1024,2048") == (512, 1024, 2048)
    with pytest.raises(Exception, match="24 is not a power of two"):
        search_efficiency.powers_list("16,24")
    with pytest.raises(Exception, match="comma-separated integers"):
        search_efficiency.powers_list("16;32")


def test_a_trace_outside_the_repository_is_recorded_by_its_full_path(tmp_path: Path) -> None:
    inside = ROOT / "workloads" / "samples" / "translation_trace.jsonl"
    assert search_measure.trace_name(inside) == "workloads/samples/translation_trace.jsonl"
    outside = tmp_path / "traffic.jsonl"
    assert search_measure.trace_name(outside) == str(outside.resolve())


def test_a_grid_leaves_out_the_points_vllm_would_refuse() -> None:
    # 1024 sequences with a 512-token step budget: vLLM refuses to start such an engine, and
    # `autotune run` never launches it; the grid must neither measure it nor wait for it.
    order = search_measure.measurement_order([512, 1024], [512, 1024], (1024, 1024), order_seed=0)
    assert sorted(label for label, *_ in order[1:]) == ["s512-b1024", "s512-b512"]
    table = search_table.Table(settings={"grid": {"max_num_seqs": [512, 1024], "max_num_batched_tokens": [512, 1024]}})
    assert (1024, 512) not in table.grid_keys() and len(table.grid_keys()) == 3


def test_shards_split_the_points_after_the_baseline_without_overlap() -> None:
    order = search_measure.measurement_order([128, 256, 512, 1024], [512, 1024, 2048, 4096, 8192], (1024, 8192),
                                             order_seed=0)
    shards = [search_measure.shard_points(order, (k, 4)) for k in range(4)]
    labels = [label for shard in shards for label, *_ in shard]
    assert sorted(labels) == sorted(label for label, *_ in order[1:])  # each point once
    assert "baseline" not in labels
    assert [len(shard) for shard in shards] == [5, 5, 4, 4]
    assert search_measure.shard_points(order, (0, 1)) == order  # one process: the baseline first, then all


def test_a_shard_is_written_k_slash_n_and_anything_else_is_named() -> None:
    assert search_efficiency.parse_shard("2/4") == (2, 4)
    for text, message in (("4/4", "0 <= K < N"), ("1", "expected K/N"), ("a/4", "expected K/N")):
        with pytest.raises(Exception, match=message):
            search_efficiency.parse_shard(text)


def test_shards_storing_points_at_once_lose_none(table, tmp_path) -> None:
    # Four real processes add 15 points each to one table.json at the same time, as the shards
    # of a multi-GPU grid do: every point of every process is in the table afterwards (each its
    # own config: a table holds one launch of a config).
    import subprocess
    import sys

    folder = tmp_path / "grid"
    template = table.points[0].model_copy(update={"baseline": False}).model_dump_json()
    (tmp_path / "point.json").write_text(template)
    script = (
        "import sys; from pathlib import Path; "
        "from benchmarks.search_measure import store_point; from benchmarks.search_table import Point, load_table; "
        "folder = Path(sys.argv[1]); template = Point.model_validate_json(Path(sys.argv[2]).read_text()); "
        "settings = load_table(folder).settings; "
        "[store_point(folder / 'table.json', settings, template.model_copy(update={'label': f'{sys.argv[3]}-{i}', "
        "'effective': {**template.effective, 'max_num_seqs': 1000 * (int(sys.argv[3][5:]) + 1) + i}})) "
        "for i in range(15)]"
    )
    # Run from the repository's root: `python -c` finds the benchmarks package there.
    processes = [subprocess.Popen([sys.executable, "-c", script, str(folder), str(tmp_path / "point.json"),
                                   f"shard{k}"], cwd=ROOT) for k in range(4)]
    assert [p.wait(timeout=120) for p in processes] == [0, 0, 0, 0]
    labels = {p.label for p in search_table.load_table(folder).points}
    assert {f"shard{k}-{i}" for k in range(4) for i in range(15)} <= labels
    assert {p.label for p in table.points} <= labels  # what was there before is kept too


def test_the_least_any_baseline_first_search_can_spend_is_the_baseline_plus_the_cheapest_good_point(table) -> None:
    # The synthetic grid: 9 points of POINT_S each; the defaults carry 6, the best (10) is one
    # launch away, so no search that measures the defaults first can spend less than 2 points.
    assert search_replay.least_share_baseline_first(table, 10.0, 9 * POINT_S) == pytest.approx(2 / 9)
    # When the defaults already reach 0.95x of the best, the baseline's launch alone.
    assert search_replay.least_share_baseline_first(table, 6.0, 9 * POINT_S) == pytest.approx(1 / 9)


def test_a_measured_table_takes_a_larger_grid_but_no_other_change(table) -> None:
    stored = table.settings
    larger = {**stored, "grid": {"max_num_seqs": [2, 4, 8, 16], "max_num_batched_tokens": [512, 1024, 2048, 4096]},
              "measured_as": "worded since", "hint": "worded since"}
    assert search_table.settings_conflicts(stored, larger) == []
    # A table measured before the ladder had a field compares it at its default.
    older = {**stored, "ladder": {k: v for k, v in stored["ladder"].items() if k != "single_step"}}
    assert search_table.settings_conflicts(older, stored) == []
    smaller = {**stored, "grid": {"max_num_seqs": [4, 8], "max_num_batched_tokens": [512, 1024, 2048]}}
    assert search_table.settings_conflicts(stored, smaller) == ["grid"]
    assert search_table.settings_conflicts(stored, {**stored, "slos": ["ttft_p95_ms=500"]}) == ["slos"]
    steeper = {**stored, "ladder": {**stored["ladder"], "growth": 3.0}}
    assert search_table.settings_conflicts(stored, steeper) == ["ladder"]


def test_extending_a_grid_keeps_its_points_and_the_report_says_it_was_measured_in_parts(table, tmp_path) -> None:
    folder = tmp_path / "grid"
    larger = {**table.settings, "grid": {"max_num_seqs": [4, 8, 16, 32], "max_num_batched_tokens": [512, 1024, 2048]}}
    search_measure.extend_grid(folder / "table.json", larger)
    search_measure.extend_grid(folder / "table.json", larger)  # a second shard finds it extended: one record
    extended = search_table.load_table(folder)
    assert {p.label for p in extended.points} == {p.label for p in table.points}
    assert extended.missing() == [(32, 512), (32, 1024), (32, 2048)]
    assert extended.settings["extended"] == [{"grid": table.settings["grid"], "points": 9,
                                              "last_measured_at": "2026-11-23T00:00:00"}]
    for seqs, batched in extended.missing():
        trial_dir = folder / "trials" / f"s{seqs}-b{batched}"
        trial_dir.mkdir(parents=True)
        (trial_dir / "outcome.json").write_text(trial_outcome(trial_dir, capacity=ladder(3.0)).model_dump_json())
        new = point(f"s{seqs}-b{batched}", seqs, batched, 3.0, trial_dir).model_copy(
            update={"measured_at": "2026-11-26T10:00:00"})
        search_measure.store_point(folder / "table.json", extended.settings, new)
    result = search_replay.replay_table(search_table.load_table(folder), folder, seeds=[0], default_trials=6)
    assert result["grid"]["points"] == 12 and result["grid"]["cost_s"] == 12 * POINT_S
    markdown = search_report.tables({"grid": result}, 1)
    assert ("Measured in parts: 9 points on the grid max_num_seqs 4-16 x batched 512-2048 until "
            "2026-11-23T00:00:00; the grid was then extended and 3 points measured, the first done at 2026-11-26T10:00:00") in markdown


def write_repeat(folder: Path, table: Any, launches: list[tuple[int, int, float]], **settings: Any) -> None:
    """A table measuring some of `table`'s configs again, each launch costing 2 x POINT_S."""
    points = []
    for seqs, batched, rps in launches:
        label = f"s{seqs}-b{batched}"
        trial_dir = folder / "trials" / label
        trial_dir.mkdir(parents=True)
        (trial_dir / "outcome.json").write_text(
            trial_outcome(trial_dir, capacity=ladder(rps)).model_dump_json())
        points.append(point(label, seqs, batched, rps, trial_dir).model_copy(update={"wall_s": 2 * POINT_S}))
    repeat = search_table.Table(settings={**table.settings, **settings}, points=points)
    (folder / "table.json").write_text(repeat.model_dump_json())


def test_a_table_with_repeats_replays_each_launch_as_one_of_its_recorded_launches(table, tmp_path) -> None:
    # The peak (16 sequences, 512 tokens: 10 req/s) measured twice more, lower: one lucky launch.
    folder = tmp_path / "grid"
    write_repeat(tmp_path / "again-a", table, [(16, 512, 6.0)])
    write_repeat(tmp_path / "again-b", table, [(16, 512, 7.0)])
    (folder / "repeats.json").write_text(json.dumps({"tables": ["../again-a", "../again-b"]}))
    result = search_replay.replay_table(table, folder, seeds=[0, 1, 2], default_trials=6)
    # The grid's best is now the best median: 16/512's is 7, so 16/1024's single 8 is the best.
    assert result["grid"]["best_score"] == 8.0 and result["grid"]["best_point"] == "s16-b1024"
    assert result["grid"]["cost_s"] == pytest.approx(8 * POINT_S + (1 + 2 + 2) / 3 * POINT_S)
    # Launches 10, 6, 7 of one config: SD 2.08; the best points under 0.95x 8 carry 7 (8/512, and
    # the peak's median), 1 below: 2 (1.28 x 2.08 / 1)^2 = 14.2, so 15 launches of each.
    apart = result["launches_to_tell_apart"]
    assert apart["pooled_sd"] == pytest.approx(2.0817, abs=1e-3) and apart["below"] == 7.0
    assert apart["launches_per_config"] == 15
    assert "**15 launches of each**" in search_report.tables({"grid": result}, 3)
    pooled = search_table.pooled(table, search_table.load_repeats(table, folder))
    peak = pooled.by_key()[(16, 512)]
    assert peak.score == 7.0 and [p.score for p in peak.launches] == [10.0, 6.0, 7.0]
    # A launch of the peak answers with one of its three launches, drawn anew each time.
    runner = search_replay.TableRunner(pooled, search_replay.VirtualClock(), DEFAULTS, seed=0)
    from server.config import ServerConfig

    seen = {runner.run(ServerConfig(engine={"model": "tiny", "max_num_batched_tokens": 512}), None,
                       tmp_path / f"t{i}").capacity.capacity_rps for i in range(30)}
    assert seen == {10.0, 6.0, 7.0}
    # A search is judged by the median of the config it would pick (its best launch so far).
    launches = [pooled.by_key()[(16, 2048)], peak.launches[0]]
    truth = {p.key: p.score for p in pooled.points}
    assert search_replay.Run.of(launches, truth=truth).best == [6.0, 7.0]
    assert "7, median of 3 launches (10, 6, 7; mean 167 s)" in search_report.tables({"grid": result}, 3)


def test_a_repeat_measured_otherwise_or_elsewhere_is_named(table, tmp_path) -> None:
    folder = tmp_path / "grid"
    repeats = folder / "repeats.json"
    repeats.write_text(json.dumps({"tables": ["../nowhere"]}))
    with pytest.raises(SystemExit, match=r"grid/repeats.json: tables: \.\./nowhere: no table.json there"):
        search_table.load_repeats(table, folder)
    write_repeat(tmp_path / "other-slos", table, [(16, 512, 6.0)], slos=["ttft_p95_ms=500"])
    repeats.write_text(json.dumps({"tables": ["../other-slos"]}))
    with pytest.raises(SystemExit, match=r"tables: \.\./other-slos: measured with another slos"):
        search_table.load_repeats(table, folder)
    write_repeat(tmp_path / "stray", table, [(32, 512, 6.0)])
    repeats.write_text(json.dumps({"tables": ["../stray"]}))
    with pytest.raises(SystemExit, match=r"s32-b512 \(max_num_seqs=32, max_num_batched_tokens=512\) is not a point"):
        search_table.load_repeats(table, folder)
    repeats.write_text(json.dumps({"table": ["../stray"]}))
    with pytest.raises(SystemExit, match=r"grid/repeats.json: tables: Field required"):
        search_table.load_repeats(table, folder)


def idle_ladder(rps: float, running: float, **server: Any) -> CapacityResult:
    """`ladder(rps)` with every step's server metrics saying at most `running` requests ran."""
    measured = ladder(rps)
    metrics = ServerMetrics(num_waiting_max=0, num_running_max=running, **server)
    return measured.model_copy(update={"steps": [s.model_copy(update={"server": metrics}) for s in measured.steps]})


def rewrite_ladder(table: Any, key: tuple[int, int], measured: CapacityResult) -> None:
    point = table.by_key()[key]
    outcome = trial_outcome(point.trial_dir, capacity=measured)
    point.outcome_path().write_text(outcome.model_dump_json())


def test_points_whose_sequence_cap_never_bound_are_judged_as_one_scheduler_config(table, tmp_path) -> None:
    # 8 and 16 sequences at 1024 tokens (5 and 8 req/s): no step ran more than 3 at once, under
    # half of either cap. 4 sequences at 1024 ran 3, over half its cap: the cap may have bound.
    for seqs, rps in ((8, 5.0), (16, 8.0), (4, 2.0)):
        rewrite_ladder(table, (seqs, 1024), idle_ladder(rps, 3))
    merged, classes = search_table.one_scheduler_config(table)
    assert [(c.labels, c.batched, c.smallest_cap, c.peak_running, c.launches, c.score) for c in classes] == [
        (["s8-b1024", "s16-b1024"], 1024, 8, 3.0, 2, 6.5)]
    points = merged.by_key()
    assert points[(8, 1024)].score == points[(16, 1024)].score == 6.5
    assert points[(4, 1024)].score == 2.0 and points[(16, 512)].score == 10.0  # left as they were
    # A launch of either answers with one of both launches, under its own name.
    runner = search_replay.TableRunner(merged, search_replay.VirtualClock(), DEFAULTS, seed=0)
    from server.config import ServerConfig

    config = ServerConfig(engine={"model": "tiny", "max_num_seqs": 8, "max_num_batched_tokens": 1024})
    seen = {runner.run(config, None, tmp_path / f"t{i}").capacity.capacity_rps for i in range(20)}
    assert seen == {5.0, 8.0} and {p.label for p in runner.calls} == {"s8-b1024"}
    # The replay judges every strategy per config and says what ours would be judged as one.
    result = search_replay.replay_table(table, tmp_path / "grid", seeds=[0, 1], default_trials=6)
    assert result["done_when_judged_otherwise"]["judge"] == "as one scheduler config"
    assert {p["label"]: p["score"] for p in result["table"]}["s8-b1024"] == 5.0
    report = search_report.tables({"grid": result}, 2)
    assert "**One scheduler config:** s8-b1024, s16-b1024 (batched 1024)" in report
    assert "The same done-when for ours, judged as one scheduler config" in report
    # Their two launches (5, 8) are one config's spread, SD 2.12: no point was measured twice,
    # yet telling the peak (10) from the best point under 0.95x it (8, per point) takes
    # 2 (1.28 x 2.12 / 2)^2 = 3.7, so 4 launches of each, not "none to know".
    apart = result["launches_to_tell_apart"]
    assert apart["pooled_sd"] == pytest.approx(2.1213, abs=1e-3) and apart["below"] == 8.0
    assert apart["launches_per_config"] == 4 and apart["scheduler_configs"] == 1
    assert "**4 launches of each**" in report and "1 of them several grid points that ran as one scheduler config" in report
    as_one = search_replay.replay_table(table, tmp_path / "grid", seeds=[0, 1], default_trials=6, as_one=True)
    assert {p["label"]: p["score"] for p in as_one["table"]}["s8-b1024"] == 6.5
    assert as_one["done_when_judged_otherwise"]["judge"] == "per config"


def test_a_preemption_a_full_kv_cache_or_a_missing_metric_keeps_points_apart(table) -> None:
    rewrite_ladder(table, (16, 1024), idle_ladder(8.0, 3))
    for other in (idle_ladder(5.0, 3, preemptions=2), idle_ladder(5.0, 3, kv_cache_usage_max=0.95), ladder(5.0)):
        rewrite_ladder(table, (8, 1024), other)
        assert search_table.one_scheduler_config(table)[1] == []


def test_a_folder_without_a_table_is_named_in_one_line(tmp_path: Path) -> None:
    from benchmarks.search_table import load_table

    with pytest.raises(SystemExit, match=r"/table.json: not found \(give a `search_efficiency.py measure --table` folder\)$"):
        load_table(tmp_path)
    (tmp_path / "table.json").write_text('{"points": []}')
    with pytest.raises(SystemExit, match=r"/table.json: settings: Field required$"):
        load_table(tmp_path)



def test_the_default_replay_leaves_out_a_grid_measured_in_part_and_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A GPU grid measured across device sessions is not replayed until done (its replay would
    stop at the first missing point): `replay` without --table runs the others."""
    grid = write_table(tmp_path / "h200-2099-01-01" / "code" / "grid")
    assert search_efficiency.measured_whole(grid)
    assert capsys.readouterr().err == ""
    table = search_table.Table.model_validate_json((grid / "table.json").read_text())
    table.points = [p for p in table.points if p.label != "s4-b512"]
    (grid / "table.json").write_text(table.model_dump_json())
    assert not search_efficiency.measured_whole(grid)
    assert capsys.readouterr().err.strip() == f"skipping {grid}: 8 of 9 points measured so far"
