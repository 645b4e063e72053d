"""benchmarks/headline_table.py on committed runs: the figures the README and results folders state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.headline_table import main

ROOT = Path(__file__).resolve().parents[2]
LONG_PROMPTS = ROOT / "results" / "h200-2026-11-25" / "long-prompts" / "study"
LONG_PROMPTS_GRID = ROOT / "benchmarks" / "data" / "h200-2026-11-25" / "long-prompts" / "grid"
FP8 = ROOT / "results" / "h200-2026-12-02-fp8" / "study"


def rows(tmp_path: Path, *argv: str) -> dict[str, dict]:
    out = tmp_path / "table.md"
    assert main([*argv, "--out", str(out)]) == 0
    assert out.read_text().startswith("| config | settings | held-out capacity")
    return {row["config"].split(":")[0]: row for row in json.loads(out.with_suffix(".json").read_text())}


def test_the_long_prompt_scenario_reads_as_its_readme_states(tmp_path: Path) -> None:
    # results/h200-2026-11-25/README.md: defaults 14.0 (14, 14, 14), hand-tuned 14.0, tuned 14.8
    # (14.8, 14.8, 15.6) with 1024 batched tokens; the grid's best 14.0 on the tuning window.
    table = rows(tmp_path, "--grid", str(LONG_PROMPTS_GRID), "--tuned", str(LONG_PROMPTS))
    assert [round(v, 1) for v in table["vLLM's defaults"]["held_out"]] == [14.0, 14.0, 14.0]
    assert [round(v, 1) for v in table["hand-tuned"]["held_out"]] == [14.0, 14.0, 14.0]
    tuned = table["tuned (default space)"]
    assert sorted(round(v, 1) for v in tuned["held_out"]) == [14.8, 14.8, 15.6]
    assert "max_num_batched_tokens=1024" in tuned["what"]
    assert round(tuned["grid_best"], 1) == 14.0  # judged against the grid's best without fp8
    assert tuned["gpu_s"] == pytest.approx(302.7 + 884.5)
    assert "grid's best with fp8" not in table  # this grid has no quantization axis


def test_the_fp8_run_reads_1_67x_the_defaults(tmp_path: Path) -> None:
    table = rows(tmp_path, "--fp8", str(FP8))
    fp8 = table["tuned (--allow fp8)"]
    assert "quantization=fp8" in fp8["what"]
    ratio = sorted(fp8["held_out"])[1] / sorted(table["vLLM's defaults"]["held_out"])[1]
    assert ratio == pytest.approx(1.67, abs=0.005)
    assert (tmp_path / "table.md").read_text().count("1.67x") == 1


def test_a_run_without_its_gate_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"best.yaml: not found \(not an `autotune run` output dir, or the run "
                                         r"has not finished its gate\)"):
        main(["--tuned", str(tmp_path)])


def test_inputs_of_two_scenarios_or_swapped_runs_are_refused_in_one_line(tmp_path: Path) -> None:
    """The long-prompt run and grid (Azure code lengths, TTFT 500 / TPOT 50 ms) and the fp8 run
    (Azure conversation, 1000 / 25 ms) are two scenarios: one table of them would read 2.29x."""
    with pytest.raises(SystemExit, match=r"fp8/study/best.yaml: another trace \(fingerprint\) than .*: "
                                         r"deae9f9c83cee253 against ac6155dd891cedfa$"):
        main(["--tuned", str(LONG_PROMPTS), "--fp8", str(FP8)])
    with pytest.raises(SystemExit, match=r"^--grid: measured with another trace \(fingerprint\)"):
        main(["--grid", str(LONG_PROMPTS_GRID), "--fp8", str(FP8)])
    with pytest.raises(SystemExit, match=r"^--tuned .*: that run used --allow fp8; give it as --fp8$"):
        main(["--tuned", str(FP8)])
    with pytest.raises(SystemExit, match=r"^--fp8 .*: that run did not use --allow fp8; give it as --tuned$"):
        main(["--fp8", str(LONG_PROMPTS)])


@pytest.mark.parametrize("best_yaml", ["", "max-num-seqs: 16\n", "{not: [yaml\n"])
def test_a_file_that_is_not_a_runs_best_yaml_is_named_in_one_line(best_yaml: str, tmp_path: Path) -> None:
    (tmp_path / "best.yaml").write_text(best_yaml)
    with pytest.raises(SystemExit, match=r"best.yaml: not a finished run's best.yaml") as refused:
        main(["--tuned", str(tmp_path)])
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("table_json, says", [("", "file: Invalid JSON"), ("{}", "settings: Field required"),
                                              ('{"settings": {"grid": {}}, "points": []}', "settings.trace: Field required"),
                                              ('{"settings": {"trace": "t.jsonl", "grid": {"max_num_seqs": [8], '
                                               '"max_num_batched_tokens": [512]}, "objective": "capacity", "slos": [], '
                                               '"window_start_s": 0, "ladder": {}}, "points": []}', "no measured point")])
def test_a_grid_folder_without_a_measured_table_is_named_in_one_line(table_json: str, says: str,
                                                                     tmp_path: Path) -> None:
    (tmp_path / "table.json").write_text(table_json)
    with pytest.raises(SystemExit, match=says):
        main(["--grid", str(tmp_path)])


def test_out_must_be_a_markdown_file(tmp_path: Path) -> None:
    for out in (tmp_path, tmp_path / "table.json"):
        with pytest.raises(SystemExit, match=r"give a .md file to write"):
            main(["--tuned", str(LONG_PROMPTS), "--out", str(out)])


def test_a_grid_with_fp8_points_gives_its_best_without_and_with_fp8(tmp_path: Path) -> None:
    from tests.benchmarks.test_search_quantization import write_table

    grid = write_table(tmp_path / "grid")
    table = rows(tmp_path, "--grid", str(grid))
    assert round(table["grid's best without fp8"]["tuning"][0], 1) == 24.0
    assert round(table["grid's best with fp8"]["tuning"][0], 1) == 36.2
    assert table["grid's best with fp8"]["what"].endswith("max_num_batched_tokens=1024, quantization=fp8")
    assert table["grid's best with fp8"]["gpu_s"] == pytest.approx(16 * 60.0)  # every point's launch


def test_the_conversation_grid_says_what_its_launches_support_beside_its_single_best(tmp_path: Path) -> None:
    # results/h200-2026-12-03/conv/README.md: the single-launch bests 21.1 (s512-b1024) and 36.2
    # (s1024-b1024-fp8) each share a scheduler config with a point launched at 18.5 and 22.2
    # (max_num_seqs never bound); as one config the bests are 19.8 and 32.0, which the tuned
    # runs' tuning-window capacities (19.4, 32.0) sit at 0.98x and 1.00x of.
    grid = ROOT / "benchmarks" / "data" / "h200-2026-12-03" / "conv" / "grid"
    table = rows(tmp_path, "--grid", str(grid), "--tuned", str(ROOT / "results" / "h200-2026-12-02" / "conv" / "tuned"),
                 "--fp8", str(FP8))
    assert [round(v, 1) for v in table["grid's best without fp8"]["tuning"]] == [21.1]
    assert [round(v, 1) for v in table["grid's best with fp8"]["tuning"]] == [36.2]
    plain = table["grid's best without fp8, as one scheduler config"]
    assert sorted(round(v, 1) for v in plain["tuning"]) == [18.5, 21.1]
    assert plain["what"] == "max_num_seqs never bound, max_num_batched_tokens=1024"
    fp8 = table["grid's best with fp8, as one scheduler config"]
    assert [round(v, 1) for v in fp8["tuning"]] == [32.0, 32.0]
    assert round(table["tuned (--allow fp8)"]["tuning"][0], 1) == 32.0


def test_the_code_grid_reads_as_the_readme_states(tmp_path: Path) -> None:
    # README.md and results/h200-2026-12-04/code/README.md: defaults 0.715, the best without fp8
    # 0.753 (s1024-b4096), with fp8 2.57 (s1024-b2048-fp8); 6 points, 1,505 s charged.
    grid = ROOT / "benchmarks" / "data" / "h200-2026-12-04" / "code" / "grid"
    table = rows(tmp_path, "--grid", str(grid))
    assert [round(v, 3) for v in table["vLLM's defaults"]["tuning"]] == [0.715]
    assert [round(v, 3) for v in table["grid's best without fp8"]["tuning"]] == [0.753]
    assert table["grid's best without fp8"]["what"] == "max_num_seqs=1024, max_num_batched_tokens=4096"
    assert [round(v, 2) for v in table["grid's best with fp8"]["tuning"]] == [2.57]
    assert table["grid's best with fp8"]["gpu_s"] == pytest.approx(1505, abs=1)
    assert "| 0.715 |" in (tmp_path / "table.md").read_text()  # 3 significant figures, not "0.7"


def test_a_grid_whose_points_all_ran_apart_has_no_scheduler_config_rows(tmp_path: Path) -> None:
    from tests.benchmarks.test_search_quantization import write_table

    table = rows(tmp_path, "--grid", str(write_table(tmp_path / "grid")))  # no server metrics: kept apart
    assert "grid's best with fp8" in table and not [name for name in table if "scheduler config" in name]
