"""What results/ tracks stays what a clone can carry: summaries, no bulk (docs/results.md)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 20 * 1000 * 1000
BULK_SUFFIXES = (".gz", ".db", ".lock")
BULK_NAMES = ("server.log",)


def _tracked(folder: str) -> list[Path]:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run([git, "ls-files", "-z", folder], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode()
    return [ROOT / name for name in listed.split("\0") if name]


def test_results_tracks_at_most_20_mb_and_no_per_request_records_logs_or_databases() -> None:
    files = _tracked("results")
    bulk = [path.relative_to(ROOT).as_posix() for path in files
            if path.name.endswith(BULK_SUFFIXES) or path.name in BULK_NAMES
            or (path.suffix == ".jsonl" and path.name.startswith("requests"))]
    assert not bulk, f"bulk tracked under results/ (keep it out, docs/results.md): {bulk[:5]}"
    size = sum(path.stat().st_size for path in files if path.exists())
    assert size <= LIMIT_BYTES, f"results/ tracks {size / 1e6:.1f} MB (at most 20)"
