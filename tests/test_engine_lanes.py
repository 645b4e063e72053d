"""make test's engine lanes (tests/conftest.py): how the engine tests are split between two
workers, and each lane's own CPUs, which every process its tests start inherits."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parent / "conftest.py"


def load_conftest():
    spec = importlib.util.spec_from_file_location("suite_conftest", CONFTEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lanes = load_conftest()


class FakeItem:
    """What engine_lanes reads of a pytest item."""

    def __init__(self, nodeid: str, *, seconds: float | None = None, fixtures: tuple[str, ...] = (),
                 engine: bool = True) -> None:
        self.nodeid, self.fixturenames = nodeid, fixtures
        kwargs = {} if seconds is None else {"seconds": seconds}
        self.marker = pytest.mark.engine(**kwargs).mark if engine else None

    def get_closest_marker(self, name: str):
        return self.marker if name == "engine" else None


def test_tests_sharing_the_session_server_share_a_lane_and_the_lanes_are_balanced() -> None:
    items = [FakeItem(f"server::{i}", fixtures=("server",)) for i in range(10)]
    items += [FakeItem("a", seconds=70), FakeItem("b", seconds=60), FakeItem("c", seconds=40),
              FakeItem("d", seconds=30), FakeItem("plain", engine=False)]
    found = lanes.engine_lanes(items, 2)
    assert "plain" not in found and len({found[f"server::{i}"] for i in range(10)}) == 1
    totals = [0.0, 0.0]
    for item in items[:-1]:
        totals[found[item.nodeid]] += lanes.engine_seconds(item)
    totals[found["server::0"]] += lanes.SHARED_START_SECONDS["server"]
    # The longest unit first, each to the lane with the least so far: a 70 | b 60, c 40 (60 + 40),
    # the server's tests (a 30 s start + 10 x 1 s) 70 + 40, d 30 -> 110 | 130 (no split does better).
    assert sorted(totals) == [110.0, 130.0]
    assert lanes.engine_lanes(list(reversed(items)), 2) == found  # the same on every worker
    assert set(lanes.engine_lanes(items, 1).values()) == {0}


def test_a_unit_moves_or_swaps_out_of_the_longest_lane_where_that_shortens_it() -> None:
    items = [FakeItem("a", seconds=30), FakeItem("b", seconds=30), FakeItem("c", seconds=20),
             FakeItem("d", seconds=20), FakeItem("e", seconds=20)]
    found = lanes.engine_lanes(items, 2)
    totals = [0.0, 0.0]
    for item in items:
        totals[found[item.nodeid]] += lanes.engine_seconds(item)
    # Longest first alone: a | b, c | d, e -> 70 | 50; a 30 swapped with a 20 -> 60 | 60.
    assert sorted(totals) == [60.0, 60.0]


def test_each_lane_gets_its_own_cpus_unless_there_are_fewer_cpus_than_lanes() -> None:
    assert lanes.lane_cpus({0, 1}, 2) == [{0}, {1}]
    assert lanes.lane_cpus({4, 5, 6, 7, 8}, 2) == [{4, 5}, {6, 7}]  # runs of equal size
    assert lanes.lane_cpus({3}, 2) == [{3}]  # one lane of them all: nothing to keep apart
    assert lanes.lane_cpus({0, 1, 2}, 1) == [{0, 1, 2}]


# The inner suite: two engine tests in lanes of their own and one plain test, each writing the
# CPUs a process it starts may run on.
INNER_TESTS = """
import json, os, subprocess, sys
import pytest

def child_cpus(name):
    out = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                         capture_output=True, text=True, check=True).stdout
    with open(os.path.join(os.environ["LANES_OUT"], name), "w") as f:
        f.write(json.dumps({"child": json.loads(out), "test": sorted(os.sched_getaffinity(0))}))

@pytest.mark.engine(seconds=10)
def test_first_engine():
    child_cpus("first")

@pytest.mark.engine(seconds=10)
def test_second_engine():
    child_cpus("second")

def test_plain():
    child_cpus("plain")
"""


# With workers (make test), and in one process, where the plain test runs after both lanes' tests
# (lanes first): it gets every CPU back. Slow: an inner pytest run each (3-10 s).
@pytest.mark.slow
@pytest.mark.parametrize("workers", [["-p", "xdist", "-n", "2", "--dist", "loadgroup"], ["-p", "no:xdist"]],
                         ids=["workers", "one-process"])
def test_the_engine_lanes_run_on_cpus_of_their_own_and_their_processes_too(
    tmp_path: Path, workers: list[str]
) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(CONFTEST, suite / "conftest.py")
    (suite / "test_inner.py").write_text(INNER_TESTS)
    out = tmp_path / "out"
    out.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *workers, "--engine-lanes", "2", "-p", "no:cacheprovider",
         "-W", "ignore::pytest.PytestUnknownMarkWarning"],
        cwd=suite, env={**os.environ, "LANES_OUT": str(out)}, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0 and "3 passed" in run.stdout, run.stdout + run.stderr
    seen = {name: json.loads((out / name).read_text()) for name in ("first", "second", "plain")}
    allowed = sorted(os.sched_getaffinity(0))
    for found in seen.values():
        assert found["child"] == found["test"]  # a process a test starts runs where the test runs
    assert seen["plain"]["test"] == allowed  # tests outside the lanes may use every CPU
    first, second = set(seen["first"]["test"]), set(seen["second"]["test"])
    if len(allowed) >= 2:
        assert first and second and not first & second, seen  # the two engines never share a CPU
        assert first | second <= set(allowed)
    else:
        assert first == second == set(allowed), seen


@pytest.mark.parametrize("text", ["0", "-1", "two", ""])
def test_a_lane_count_below_one_or_not_a_number_is_refused_naming_the_option(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"--engine-lanes must be a whole number >= 1, got {text!r}"):
        lanes.lane_count(text)
    assert lanes.lane_count("2") == 2
