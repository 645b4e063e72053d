"""The benchmark tests import a benchmark script as its sibling scripts import it (by name, with
benchmarks/ on the path): each test module names its script in `BENCHMARK`."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench(request: pytest.FixtureRequest) -> ModuleType:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        return importlib.import_module(request.module.BENCHMARK)
