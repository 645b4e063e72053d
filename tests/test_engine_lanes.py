"""make test's engine lanes (tests/plugins/engine_lanes.py): how the engine tests are split
between two workers, and each lane's own CPUs, which every process its tests start inherits."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plugins import engine_lanes as lanes

PLUGIN = Path(lanes.__file__)


class FakeItem:
    """What engine_plan reads of a pytest item."""

    def __init__(self, nodeid: str, *, seconds: float | None = None, fixtures: tuple[str, ...] = (),
                 engine: bool = True, load_sensitive: bool = False) -> None:
        self.nodeid, self.fixturenames = nodeid, fixtures
        kwargs = {} if seconds is None else {"seconds": seconds}
        if load_sensitive:
            kwargs["load_sensitive"] = True
        self.marker = pytest.mark.engine(**kwargs).mark if engine else None

    def get_closest_marker(self, name: str):
        return self.marker if name == "engine" else None


def test_the_plan_takes_the_long_units_first_the_load_sensitive_next_and_the_short_last() -> None:
    items = [FakeItem(f"server::{i}", fixtures=("server",)) for i in range(10)]
    items += [FakeItem("short", seconds=10), FakeItem("a", seconds=70), FakeItem("tender", seconds=90, load_sensitive=True),
              FakeItem("b", seconds=60), FakeItem("plain", engine=False), FakeItem("shorter", seconds=5)]
    plan = lanes.engine_plan(items)
    # The session server's tests are one unit: its 30 s start + 10 x 1 s = 40 s.
    assert [key for key, _ in plan] == ["a", "b", "server", "tender", "short", "shorter"]
    assert [item.nodeid for item in dict(plan)["server"]] == [f"server::{i}" for i in range(10)]
    assert [key for key, _ in lanes.engine_plan(list(reversed(items)))] == [key for key, _ in plan]  # every worker


def test_a_lane_takes_the_plans_next_unit_with_one_short_test_behind_it_and_the_others_never_do() -> None:
    schedule = lanes.LaneSchedule(2, ["L1", "L2", "L3"], fillers={"f1", "f2"})
    queue = ["p1", "L3", "L2", "p2", "f1", "L1", "f2"]
    assert schedule.next_unit(True, [], queue) == "L1"  # the plan's order, not the queue's
    assert schedule.next_unit(True, ["L1"], queue) == "f1"  # its last test: a filler behind it
    assert schedule.next_unit(True, ["L1", "f1"], queue) is None  # nothing ahead of time
    assert schedule.next_unit(True, ["f1"], queue) == "L1"  # its lane test done: the next unit
    assert schedule.next_unit(True, ["L1"], ["p1", "L2"]) == "L2"  # no filler left: one unit ahead
    assert schedule.next_unit(True, ["f1"], ["p1", "f2"]) == "p1"  # no lane unit left: anything
    assert schedule.next_unit(False, [], queue) == "p1"
    assert schedule.next_unit(False, ["p1", "p1", "p1"], queue) is None  # three tests ahead at most
    assert schedule.next_unit(False, [], ["L2", "f1"]) is None  # never a lane unit or a filler
    assert not schedule.has_work_for(False, ["L2", "f1"]) and schedule.has_work_for(True, ["f1"])


def simulate(schedule, durations: dict[str, float], lanes_: int, others: int) -> dict[str, tuple[int, float, float]]:
    """xdist's workers under `schedule`: a worker runs its tests in order, and its last one only
    once it has another or has been told to finish. Returns unit -> (worker, start, end)."""
    queue = list(durations)
    workers = [{"lane": w < lanes_, "pending": [], "busy_until": 0.0, "done": False} for w in range(lanes_ + others)]
    ran: dict[str, tuple[int, float, float]] = {}
    now = 0.0
    while len(ran) < len(durations):
        for index, worker in enumerate(workers):
            while (unit := schedule.next_unit(worker["lane"], worker["pending"], queue)) is not None:
                queue.remove(unit)
                worker["pending"].append(unit)
            worker["done"] = not schedule.has_work_for(worker["lane"], queue)
            if worker["busy_until"] <= now and worker["pending"] and (len(worker["pending"]) > 1 or worker["done"]):
                unit = worker["pending"][0]
                ran[unit] = (index, now, now + durations[unit])
                worker["busy_until"] = now + durations[unit]
        ends = [w["busy_until"] for w in workers if w["busy_until"] > now]
        for worker in workers:  # the test that ends first leaves its worker's list
            if worker["busy_until"] == min(ends, default=now) and worker["pending"]:
                worker["pending"].pop(0)
        now = min(ends, default=now + 1)
    return ran


def test_a_lane_that_finishes_early_takes_the_next_unit_whatever_the_marks_said() -> None:
    # Planned by marks: A 100 s, B 90, C 40, D 30, E 20; A really takes 200 s, the rest as marked.
    real = {"A": 200.0, "B": 90.0, "C": 40.0, "D": 30.0, "E": 20.0}
    durations = {**real, "f1": 1.0, "f2": 1.0, "f3": 1.0, "f4": 1.0, "f5": 1.0, "f6": 1.0, "f7": 1.0, "p": 1.0}
    schedule = lanes.LaneSchedule(2, ["A", "B", "C", "D", "E"], fillers={f"f{i}" for i in range(1, 8)})
    ran = simulate(schedule, durations, lanes_=2, others=1)
    a_lane = ran["A"][0]
    assert {ran[unit][0] for unit in "BCDE"} == {1 - a_lane}  # the other lane took all the rest
    lane_end = max(end for unit, (_, _, end) in ran.items() if unit in real)
    assert lane_end == ran["A"][2] <= 200 + 2  # A alone decides: the other lane never waited on it
    assert ran["p"][0] == 2  # the third worker ran the other test, and no lane unit


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


# With workers (make test): the two engine tests on the two lanes' CPUs, the plain one on every CPU;
# in one process, one test at a time, each on every CPU. Slow: an inner pytest run each (3-10 s).
@pytest.mark.slow
@pytest.mark.parametrize("workers", [["-p", "xdist", "-n", "2", "--dist", "loadgroup"], ["-p", "no:xdist"]],
                         ids=["workers", "one-process"])
def test_the_engine_lanes_run_on_cpus_of_their_own_and_their_processes_too(
    tmp_path: Path, workers: list[str]
) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(PLUGIN, suite / "conftest.py")  # the plugin alone, as the inner suite's conftest
    (suite / "test_inner.py").write_text(INNER_TESTS)
    out = tmp_path / "out"
    out.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *workers, "--engine-lanes", "2", "-p", "no:cacheprovider",
         "-W", "ignore::pytest.PytestUnknownMarkWarning"],
        # As if this test ran on the first lane's worker (it may): the inner pytest inherits the
        # variable, and must not take itself for that worker.
        cwd=suite, env={**os.environ, "LANES_OUT": str(out), "PYTEST_XDIST_WORKER": "gw0"},
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0 and "3 passed" in run.stdout, run.stdout + run.stderr
    seen = {name: json.loads((out / name).read_text()) for name in ("first", "second", "plain")}
    allowed = sorted(os.sched_getaffinity(0))
    for found in seen.values():
        assert found["child"] == found["test"]  # a process a test starts runs where the test runs
    assert seen["plain"]["test"] == allowed  # tests outside the lanes may use every CPU
    first, second = set(seen["first"]["test"]), set(seen["second"]["test"])
    if len(allowed) >= 2 and "xdist" in workers:
        assert first and second and not first & second, seen  # the two engines never share a CPU
        assert first | second <= set(allowed)
    else:
        assert first == second == set(allowed), seen


@pytest.mark.parametrize("text", ["0", "-1", "two", ""])
def test_a_lane_count_below_one_or_not_a_number_is_refused_naming_the_option(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"--engine-lanes must be a whole number >= 1, got {text!r}"):
        lanes.lane_count(text)
    assert lanes.lane_count("2") == 2
