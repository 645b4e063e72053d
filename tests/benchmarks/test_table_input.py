"""A damaged grid table, trial outcome or run folder, read by benchmarks/headline_table.py and
`search_efficiency.py replay`: one line naming the file, the field (a point by its label), the
value and the rule, no traceback (cases a new user broke on 2026-12-03)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.headline_table import main

ROOT = Path(__file__).resolve().parents[2]
CONV = ROOT / "benchmarks" / "data" / "h200-2026-12-03" / "conv"
FP8 = ROOT / "results" / "h200-2026-12-02-fp8" / "study"


@pytest.fixture()
def grid(tmp_path: Path) -> Path:
    for name in ("grid", "grid-repeat-1"):
        shutil.copytree(CONV / name, tmp_path / name)
    return tmp_path / "grid"


def edit_table(folder: Path, change: Callable[[dict], None]) -> None:
    path = folder / "table.json"
    table = json.loads(path.read_text())
    change(table)
    path.write_text(json.dumps(table))


def point(table: dict, label: str) -> dict:
    return next(p for p in table["points"] if p["label"] == label)


CASES = {
    "a score that is not a number": (
        lambda t: point(t, "s512-b1024").update(score=float("nan")),
        r"table.json: points\.\d+ \(s512-b1024\)\.score: Input should be a finite number \(got nan\)$"),
    "a negative cost": (
        lambda t: point(t, "s512-b2048").update(wall_s=-5),
        r"points\.\d+ \(s512-b2048\)\.wall_s: Input should be greater than or equal to 0 \(got -5\)$"),
    "what the engine ran with, unreadable": (
        lambda t: point(t, "s512-b4096")["effective"].update(max_num_seqs="lots"),
        r"points\.\d+ \(s512-b4096\): effective\.max_num_seqs is 'lots': a positive integer"),
    "one config twice": (
        lambda t: t["points"].append(dict(point(t, "s512-b8192"), label="again")),
        r"points: s512-b8192 and again are the same config"),
    "two baselines": (
        lambda t: point(t, "s512-b4096").update(baseline=True),
        r"points: 2 marked baseline \(baseline, s512-b4096\): one at most$"),
    "weights the grid does not know": (
        lambda t: point(t, "s512-b8192-fp8").update(quantization="int3"),
        r"\(s512-b8192-fp8\)\.quantization: Input should be 'fp8' \(got 'int3'\)$"),
    "SLOs as one string": (
        lambda t: t["settings"].update(slos="ttft_p95_ms=1000"),
        r"table.json: settings\.slos: Input should be a valid list \(got 'ttft_p95_ms=1000'\)$"),
    "a capacity table without its ladder": (
        lambda t: t["settings"].pop("ladder"),
        r"table.json: settings: ladder: missing: a capacity table records its ladder's settings$"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_damaged_table_is_named_in_one_line(case: str, grid: Path) -> None:
    change, says = CASES[case]
    edit_table(grid, change)
    with pytest.raises(SystemExit, match=says) as refused:
        main(["--grid", str(grid)])
    assert "\n" not in str(refused.value)


def test_repeats_naming_the_table_itself_or_one_table_twice_are_refused(grid: Path) -> None:
    for tables, says in (([".", "../grid-repeat-1"], r"tables: \. is this table itself"),
                         (["../grid-repeat-1", "../grid-repeat-1"], "a table named twice")):
        (grid / "repeats.json").write_text(json.dumps({"tables": tables}))
        with pytest.raises(SystemExit, match=says):
            main(["--grid", str(grid)])


def test_a_damaged_trial_outcome_or_trace_copy_names_its_file(grid: Path) -> None:
    outcome = grid / "trials" / "s512-b1024" / "outcome.json"
    outcome.write_text(outcome.read_text()[:500])
    with pytest.raises(SystemExit, match=r"s512-b1024/outcome.json: file: Invalid JSON: .* \(s512-b1024's trial outcome\)$"):
        main(["--grid", str(grid)])
    outcome.write_text("[]")
    (grid / "traffic.jsonl").write_text("not json\n")
    with pytest.raises(SystemExit, match=r"traffic.jsonl:1: .*not valid JSON"):
        main(["--grid", str(grid)])


def test_the_replay_names_a_damaged_outcome_in_one_line_as_a_real_process(grid: Path, tmp_path: Path) -> None:
    outcome = grid / "trials" / "s1024-b2048-fp8" / "outcome.json"
    outcome.write_text(json.dumps({"ok": "maybe"}))
    script = ROOT / "benchmarks" / "search_efficiency.py"
    done = subprocess.run([sys.executable, str(script), "replay", "--seeds", "1", "--table", str(grid),
                           "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    last = [line for line in done.stderr.splitlines() if line.strip()][-1]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert last.startswith(str(outcome)) and "ok: Input should be a valid boolean" in last, last


def test_a_run_whose_provenance_is_damaged_is_named_by_its_field_and_value(tmp_path: Path) -> None:
    run = tmp_path / "study"
    shutil.copytree(FP8, run)
    best = run / "best.yaml"
    best.write_text(best.read_text().replace("search_wall_s: 442.8", "search_wall_s: long", 1))
    with pytest.raises(SystemExit, match=r"best.yaml: not a finished run's best.yaml: additional-config\.vllm_autotune"
                                         r"\.provenance\.study\.search_wall_s: Input should be a valid number.*\(got 'long'\)$"):
        main(["--fp8", str(run)])
    shutil.rmtree(run)
    shutil.copytree(FP8, run)
    (run / "trials" / "trial-0001" / "outcome.json").unlink()
    with pytest.raises(SystemExit, match=r"trial-0001/outcome.json: not found \(the emitted trial's outcome"):
        main(["--fp8", str(run)])


def test_a_goodput_grid_or_run_is_refused_where_the_table_compares_capacity() -> None:
    with pytest.raises(SystemExit, match=r"search_grid/table.json: settings.objective: 'goodput': the headline "
                                         r"table compares capacity"):
        main(["--grid", str(ROOT / "benchmarks" / "data" / "search_grid")])
    with pytest.raises(SystemExit, match=r"provenance.objective: 'goodput': the headline table compares capacity"):
        main(["--tuned", str(ROOT / "results" / "h100-2026-11-23" / "rate-105" / "study")])


def test_a_replay_of_chosen_tables_writes_its_report_where_told_never_over_the_committed_one(tmp_path: Path) -> None:
    script = ROOT / "benchmarks" / "search_efficiency.py"
    table = ROOT / "benchmarks" / "data" / "search_grid_capacity"
    committed = (ROOT / "results" / "benchmarks" / "search_efficiency.md").read_bytes()
    refused = subprocess.run([sys.executable, str(script), "replay", "--seeds", "1", "--table", str(table)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--table replays only the tables given: give --out DIR" in refused.stderr
    out = tmp_path / "report"
    done = subprocess.run([sys.executable, str(script), "replay", "--seeds", "1", "--table", str(table),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = (out / "search_efficiency.md").read_text()
    assert "## `benchmarks/data/search_grid_capacity`: capacity grid" in report
    assert "## `benchmarks/data/h200-2026-12-03/conv/grid`" not in report  # only the table given
    assert (ROOT / "results" / "benchmarks" / "search_efficiency.md").read_bytes() == committed
