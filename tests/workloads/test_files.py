"""Files written whole or not at all (workloads.files), the one helper every package uses."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from workloads.files import atomic_file, write_text_atomic


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "best.yaml"
    write_text_atomic(path, "old\n")
    with pytest.raises(RuntimeError), atomic_file(path) as handle:
        handle.write("half of the new")
        raise RuntimeError("killed")
    assert path.read_text() == "old\n"
    assert [p.name for p in path.parent.iterdir()] == ["best.yaml"]


def test_owner_only_by_default_and_shared_when_asked(tmp_path: Path) -> None:
    write_text_atomic(tmp_path / "config.yaml", "api-key: x\n")
    with atomic_file(tmp_path / "trace.jsonl", shared=True) as handle:
        handle.write("{}\n")
    with atomic_file(tmp_path / "plot.png", "wb", shared=True) as handle:
        handle.write(b"\x89PNG")
    assert stat.S_IMODE((tmp_path / "config.yaml").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "trace.jsonl").stat().st_mode) == 0o644
    assert (tmp_path / "plot.png").read_bytes() == b"\x89PNG"

