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
    with pytest.raises(SystemExit, match=r"best.yaml: not found \(the run has not finished its gate\)"):
        main(["--tuned", str(tmp_path)])


def test_a_grid_with_fp8_points_gives_its_best_without_and_with_fp8(tmp_path: Path) -> None:
    from tests.benchmarks.test_search_quantization import write_table

    grid = write_table(tmp_path / "grid")
    table = rows(tmp_path, "--grid", str(grid))
    assert round(table["grid's best without fp8"]["tuning"][0], 1) == 24.0
    assert round(table["grid's best with fp8"]["tuning"][0], 1) == 36.2
    assert table["grid's best with fp8"]["what"].endswith("max_num_batched_tokens=1024, quantization=fp8")
    assert table["grid's best with fp8"]["gpu_s"] == pytest.approx(16 * 60.0)  # every point's launch
