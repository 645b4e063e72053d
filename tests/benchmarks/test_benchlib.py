"""What every benchmark report's header says about the code it ran (benchmarks/benchlib.py)."""

from __future__ import annotations

import re

import pytest

from benchmarks import benchlib as bench


def test_a_copy_without_its_history_names_the_commit_it_was_made_from(monkeypatch: pytest.MonkeyPatch) -> None:
    # The lent GPU machine's copy of the checkout carries a stale .git: the header must not
    # name that commit when the copier says which one the copy is.
    monkeypatch.setenv(bench.SOURCE_COMMIT_ENV, "53b5457")
    assert bench.git_commit() == "53b5457 (from AUTOTUNE_SOURCE_COMMIT)"
    monkeypatch.delenv(bench.SOURCE_COMMIT_ENV)
    assert re.fullmatch(r"[0-9a-f]{7,}(\+uncommitted changes)?|unknown", bench.git_commit())
