"""The search benchmark's quantization axis (issue 59: max_num_seqs x max_num_batched_tokens x
{none, fp8}) on a synthetic table shaped like the H200 survey (defaults 20.5 req/s, fp8 28.9,
fp8 with 1024 batched tokens 36.2), and the committed tables, which have no such axis, replaying
as they did before it existed. No engine runs here."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from autotune.measure.ladder import LadderSettings
from benchmarks import search_efficiency, search_measure, search_replay, search_report, search_table
from tests.benchmarks.test_search_efficiency import SLOS, ladder, point
from tests.factories import trial_outcome

ROOT = Path(__file__).resolve().parents[2]
SEQS = [512, 1024]
BATCHED = [1024, 2048, 4096, 8192]
DEFAULTS = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192}  # vLLM's on an H200
# req/s at 1024 sequences by batched budget; 512 sequences carry 1 less. fp8 weights carry more
# at every budget, most with the smallest: the H200 survey's shape.
NONE_RPS = {8192: 20.5, 4096: 22.0, 2048: 23.5, 1024: 24.0}
FP8_RPS = {8192: 28.9, 4096: 31.0, 2048: 33.5, 1024: 36.2}
POINT_S = 60.0


def capacity_of(seqs: int, batched: int, quantization: str | None) -> float:
    return (FP8_RPS if quantization == "fp8" else NONE_RPS)[batched] - (1.0 if seqs == 512 else 0.0)


def write_table(folder: Path, quantizations: tuple[str, ...] = ("none", "fp8")) -> Path:
    """A measured capacity table as `measure --quantization ...` writes it."""
    points = []
    for quantization in [None if q == "none" else q for q in quantizations]:
        for seqs in SEQS:
            for batched in BATCHED:
                baseline = quantization is None and {"max_num_seqs": seqs, "max_num_batched_tokens": batched} == DEFAULTS
                label = "baseline" if baseline else search_table.point_label(seqs, batched, quantization)
                trial_dir = folder / "trials" / label
                trial_dir.mkdir(parents=True)
                rps = capacity_of(seqs, batched, quantization)
                (trial_dir / "outcome.json").write_text(trial_outcome(trial_dir, capacity=ladder(rps)).model_dump_json())
                measured = point(label, seqs, batched, rps, trial_dir, baseline=baseline)
                points.append(measured.model_copy(update={"quantization": quantization, "wall_s": POINT_S}))
    settings: dict[str, Any] = {
        "trace": "workloads/samples/translation_trace.jsonl", "objective": "capacity",
        "measured_as": "a synthetic table", "window_start_s": 300.0, "window_recorded_s": 30.0,
        "window_requests": 140, "recorded_rps": 4.7, "slos": SLOS,
        "ladder": LadderSettings.for_accelerator("cpu").model_dump(),
        "defaults": DEFAULTS, "baseline_engine": {"model": "tiny"},
        "grid": search_measure.grid_settings(SEQS, BATCHED, quantizations),
    }
    table = search_table.Table(settings=settings, points=points)
    (folder / "table.json").write_text(table.model_dump_json())
    return folder


@pytest.fixture()
def table(tmp_path: Path) -> Any:
    return search_table.load_table(write_table(tmp_path / "grid"))


def test_a_table_with_fp8_points_loads_with_them_apart_from_the_default_weights(table, tmp_path) -> None:
    assert table.has_fp8() and table.missing() == [] and len(table.grid_points()) == 16
    points = table.by_key()
    assert points[(1024, 8192)].baseline and points[(1024, 8192)].score == 20.5
    assert points[(1024, 8192, "fp8")].label == "s1024-b8192-fp8" and points[(1024, 8192, "fp8")].score == 28.9
    # auto_tune.sh's loops with one more around them: every point at the default weights first.
    labels = [p.label for p in table.grid_points()]
    assert labels[:4] == ["s512-b1024", "s512-b2048", "s512-b4096", "s512-b8192"]
    assert labels[7:9] == ["baseline", "s512-b1024-fp8"] and labels[-1] == "s1024-b8192-fp8"
    # table.json names the weights of fp8 points only: a point at the default weights is written
    # as before the axis existed.
    written = json.loads((tmp_path / "grid" / "table.json").read_text())["points"]
    assert [p["quantization"] for p in written if "quantization" in p] == ["fp8"] * 8
    assert written[0]["label"] == "s512-b1024" and "quantization" not in written[0]


def test_a_config_lands_on_its_point_by_its_weights(table, tmp_path) -> None:
    from server.config import ServerConfig

    runner = search_replay.TableRunner(table, search_replay.VirtualClock(), DEFAULTS)
    fp8 = runner.run(ServerConfig(engine={"model": "tiny", "quantization": "fp8"}), None, tmp_path / "t")
    assert fp8.capacity.capacity_rps == 28.9
    plain = runner.run(ServerConfig(engine={"model": "tiny", "quantization": None}), None, tmp_path / "u")
    assert plain.capacity.capacity_rps == 20.5
    assert [p.label for p in runner.calls] == ["s1024-b8192-fp8", "baseline"]
    space = search_replay.replay_space(table)
    # As `autotune run --allow fp8` adds it, less kv_cache_dtype, which the table did not measure.
    assert space.params["quantization"].choices == [None, "fp8"] and "kv_cache_dtype" not in space.params


def test_ours_queues_fp8_first_and_reaches_fp8_with_1024_batched_tokens_on_the_fourth_launch(table, tmp_path) -> None:
    replay = search_replay.Replay.of(table, tmp_path / "grid")
    for seed in range(3):
        launched = search_replay.run_study(replay, seed=seed, n_trials=6)
        # fp8 weights first (28.9, paid off), then the prefill budget the baseline's TPOT asked
        # for, from fp8: 2048 (33.5), and one step further, 1024 (36.2, the grid's best).
        assert [p.label for p in launched[:4]] == ["baseline", "s1024-b8192-fp8", "s1024-b2048-fp8",
                                                   "s1024-b1024-fp8"]
        assert search_replay.Run.of(launched).reached(0.95 * 36.2) == (4, 4 * POINT_S)
    # Without the first phase the study still searches the weights: over a few seeds TPE tries fp8.
    plain = [search_replay.run_study(replay, seed=seed, n_trials=6, first_moves=False) for seed in range(3)]
    assert all(run[0].label == "baseline" for run in plain)
    assert any(p.quantization == "fp8" for run in plain for p in run)


def test_random_and_grid_order_cover_the_fp8_points(table) -> None:
    shuffled = search_replay.run_random(table, 0)
    assert len(shuffled) == 16 and sum(p.quantization == "fp8" for p in shuffled) == 8
    in_order = search_replay.run_grid_order(table)
    assert [p.quantization for p in in_order] == [None] * 8 + ["fp8"] * 8


def test_the_report_states_the_grids_best_without_and_with_fp8(table, tmp_path) -> None:
    result = search_replay.replay_table(table, tmp_path / "grid", seeds=[0, 1], default_trials=6)
    grid = result["grid"]
    assert grid["best_score"] == 36.2 and grid["best_point"] == "s1024-b1024-fp8"
    assert grid["best_by_quantization"] == {"none": {"point": "s1024-b1024", "score": 24.0},
                                            "fp8": {"point": "s1024-b1024-fp8", "score": 36.2}}
    # The done-when is against the best of either: ours gets there in 4 of 16 launches.
    assert result["done_when"]["median_share"] == pytest.approx(4 / 16) and result["done_when"]["met"]
    markdown = search_report.tables({"grid": result}, 2)
    assert ("Grid's best without fp8 (vLLM's default weights): **24 req/s** (s1024-b1024, 0.66x the grid's "
            "best); with fp8 weights (`quantization: fp8`, changes numerics): **36.2 req/s** (s1024-b1024-fp8, "
            "1.00x the grid's best); fp8's best is 1.51x the best without.") in markdown
    # The fp8 rows under those at the default weights, batched 1024 first.
    assert "| max_num_seqs 1024 | 24 (60 s, 2 steps, -) |" in markdown
    assert "| max_num_seqs 1024, fp8 | 36.2 (60 s, 2 steps, -) |" in markdown
    assert markdown.index("max_num_seqs 1024 |") < markdown.index("max_num_seqs 512, fp8 |")


def test_measure_orders_and_labels_the_fp8_points_beside_the_default_weights() -> None:
    quantizations = (None, "fp8")
    order = search_measure.measurement_order(SEQS, BATCHED, (1024, 8192), 0, quantizations)
    assert order[0] == ("baseline", None, None, None)
    labels = [label for label, *_ in order[1:]]
    assert len(labels) == len(set(labels)) == 15  # the defaults' knobs with fp8 are a point of their own
    assert "s1024-b8192-fp8" in labels and "s1024-b8192" not in labels
    assert {q for _, _, _, q in order[1:]} == {None, "fp8"}
    assert all(label.endswith("-fp8") == (q == "fp8") for label, _, _, q in order[1:])
    # --quantization none (the default) measures what was measured before the axis existed.
    assert search_measure.measurement_order(SEQS, BATCHED, (1024, 8192), 0, (None,)) == \
        search_measure.measurement_order(SEQS, BATCHED, (1024, 8192), 0)
    shards = [search_measure.shard_points(order, (k, 4)) for k in range(4)]
    assert sorted(label for shard in shards for label, *_ in shard) == sorted(labels)
    assert search_measure.grid_settings(SEQS, BATCHED, ("none",)) == {"max_num_seqs": SEQS,
                                                                      "max_num_batched_tokens": BATCHED}
    assert search_measure.grid_settings(SEQS, BATCHED, ("none", "fp8"))["quantization"] == ["none", "fp8"]


def test_a_fp8_point_runs_with_quantization_fp8_and_the_baseline_with_vllms_default() -> None:
    from server.config import ServerConfig

    baseline = ServerConfig(engine={"model": "tiny"})
    fp8 = search_measure.point_config(baseline, 1024, 1024, "fp8")
    assert fp8.engine == {"model": "tiny", "max_num_seqs": 1024, "max_num_batched_tokens": 1024, "quantization": "fp8"}
    assert "quantization" not in search_measure.point_config(baseline, None, None).engine
    assert fp8.serving.benchmark_mode


def test_the_quantization_flag_takes_none_and_fp8_and_names_anything_else() -> None:
    assert search_efficiency.quantization_list("fp8,none") == ("none", "fp8")
    assert search_efficiency.quantization_list("none") == ("none",)
    with pytest.raises(argparse.ArgumentTypeError, match="'int8' is not one of none, fp8"):
        search_efficiency.quantization_list("none,int8")
    with pytest.raises(argparse.ArgumentTypeError, match="include none"):
        search_efficiency.quantization_list("fp8")


def test_a_table_measured_without_fp8_takes_the_fp8_points_and_keeps_its_own(tmp_path) -> None:
    folder = write_table(tmp_path / "grid", ("none",))
    before = search_table.load_table(folder)
    assert not before.has_fp8() and "quantization" not in before.settings["grid"]
    wider = {**before.settings, "grid": search_measure.grid_settings(SEQS, BATCHED, ("none", "fp8"))}
    assert search_table.settings_conflicts(before.settings, wider) == []
    # Dropping the axis again is a smaller grid: refused, as for any axis.
    assert search_table.settings_conflicts(wider, before.settings) == ["grid"]
    search_measure.extend_grid(folder / "table.json", wider)
    extended = search_table.load_table(folder)
    assert {p.label for p in extended.points} == {p.label for p in before.points}
    assert extended.missing() == [(s, b, "fp8") for s in SEQS for b in BATCHED]
    assert extended.settings["extended"][0]["grid"] == before.settings["grid"]
    report = search_report.axes(extended.settings["grid"])
    assert report == "max_num_seqs 512-1024 x batched 1024-8192 x quantization none, fp8"


# Figures of the committed H100 grid (pooled with its repeats) and the H200 x4 grid, replayed for
# seeds 0-2 with --trials 6 by the code before the quantization axis existed (commit 9501bd2).
H100 = "h100-2026-11-23c/long-prompts/grid"
H200_X4 = "h200-x4-2026-11-26/long-prompts/grid"
BEFORE_THE_AXIS = {
    H100: {
        "grid": (13.989850763254791, "s128-b1024", 1987.4682641276336), "median_share": 0.21955069308215017,
        "ours": [["baseline", "s1024-b2048", "s1024-b1024", "s512-b1024", "s256-b1024", "s128-b4096"],
                 ["baseline", "s1024-b2048", "s1024-b1024", "s512-b2048", "s128-b1024", "s128-b512"],
                 ["baseline", "s1024-b2048", "s1024-b1024", "s512-b1024", "s256-b1024", "s128-b4096"]],
        "plain": [["baseline", "s512-b2048", "s512-b4096", "s128-b512", "s512-b1024"],
                  ["baseline", "s512-b2048", "s256-b512", "s128-b512", "s128-b8192"],
                  ["baseline", "s128-b2048", "s256-b2048", "s128-b512", "s128-b8192"]],
    },
    H200_X4: {
        "grid": (14.79246617688766, "s256-b1024", 2153.1613831749996), "median_share": 0.2273588658798699,
        "ours": [["baseline", "s1024-b2048", "s1024-b1024", "s512-b1024", "s256-b1024", "s128-b4096"]] * 3,
        "plain": [["baseline", "s512-b2048", "s512-b4096", "s128-b512", "s512-b1024"],
                  ["baseline", "s512-b2048", "s256-b512", "s128-b4096", "s1024-b1024", "s1024-b2048"],
                  ["baseline", "s128-b2048", "s256-b2048", "s512-b512", "s128-b8192", "s512-b2048"]],
    },
}
RANDOM_SEED_0 = ["s128-b2048", "s512-b512", "s128-b4096", "s512-b8192", "s128-b512", "s512-b2048"]


@pytest.mark.parametrize("name", [H100, H200_X4])
def test_a_committed_table_without_the_axis_replays_as_before_it(name: str) -> None:
    folder = ROOT / "benchmarks" / "data" / name
    table = search_table.load_table(folder)
    assert not table.has_fp8() and all("quantization" not in p.model_dump() for p in table.points)
    result = search_replay.replay_table(table, folder, seeds=[0, 1, 2], default_trials=6)
    pinned = BEFORE_THE_AXIS[name]
    grid = result["grid"]
    assert (grid["best_score"], grid["best_point"], grid["cost_s"]) == pytest.approx(pinned["grid"])
    assert "best_by_quantization" not in grid
    assert result["done_when"]["median_share"] == pytest.approx(pinned["median_share"])
    strategies = result["strategies"]
    assert strategies["ours (autotune run defaults: --trials 6)"]["launched"] == pinned["ours"]
    assert strategies["plain TPE, --trials 6"]["launched"] == pinned["plain"]
    assert strategies["random (grid in random order)"]["launched"][0][:6] == RANDOM_SEED_0
    assert "without fp8" not in search_report.tables({name: result}, 3)
