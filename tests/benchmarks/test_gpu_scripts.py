"""scripts/gpu/headline-h200.sh, checked on the CPU before a device session spends its minutes:
its grids are ones the search replay can replay, and bad arguments are refused in one line."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks.search_table import check_powers_of_two, launchable

ROOT = Path(__file__).resolve().parents[2]
HEADLINE = ROOT / "scripts" / "gpu" / "headline-h200.sh"


def scenario_grids() -> dict[str, dict[str, list[int]]]:
    """Each scenario's `seqs=...; batched=...` as the script sets them."""
    text = HEADLINE.read_text()
    grids = {}
    for name, seqs, batched in re.findall(r"^\s*(\w+)\)\n\s*model=.*?seqs=([\d,]+); batched=([\d,]+);", text, re.M | re.S):
        grids[name] = {"max_num_seqs": [int(v) for v in seqs.split(",")],
                       "max_num_batched_tokens": [int(v) for v in batched.split(",")]}
    return grids


def test_every_scenario_grid_holds_every_power_of_two_between_its_ends() -> None:
    grids = scenario_grids()
    assert sorted(grids) == ["code", "conv", "translation"]
    for name, grid in grids.items():
        check_powers_of_two({"grid": grid})  # SystemExit naming the axis otherwise
        assert all(launchable(s, b) for s in grid["max_num_seqs"] for b in grid["max_num_batched_tokens"]), name


@pytest.mark.parametrize("argv, says", [
    (["conv"], "4 arguments, not 1"),
    (["chat", "grid", "/k", "/r"], "scenario 'chat': not conv, code or translation"),
    (["conv", "sweep", "/k", "/r"], "piece 'sweep': not grid, tuned or fp8"),
    (["conv", "grid", "/nowhere", "/r"], "KIT_DIR /nowhere: no models/ folder"),
])
def test_bad_arguments_are_refused_in_one_line_before_any_work(argv: list[str], says: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = subprocess.run([shutil.which("bash") or "/bin/bash", str(HEADLINE), *[a.replace("/r", str(run)) for a in argv]], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and says in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert not run.exists()  # nothing made, nothing converted
