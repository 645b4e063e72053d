"""make test's engine lanes (`--engine-lanes N` under `--dist loadgroup`): the tests that start
vLLM engines or PostgreSQL run one at a time on each of the first N xdist workers, each lane on
CPUs of its own, and take their next test as they finish the last.

The `postgres` marker is set here from the fixture a test uses (`postgres_url`), so that a
test cannot forget it. Under `pytest -n 4 --dist loadgroup --engine-lanes 2` (make test) the
tests marked `engine` or `postgres` run in two engine lanes: the first two workers run them, one
test at a time each, while the other workers run every other test beside them. Each lane runs on
its own CPUs (half of those allowed; one core each on 2 cores), and so does every process its
tests start. Two end-to-end engine tests side by side on 2 cores took 97 s unpinned, as long as
one after the other (96 s), and 51 s each pinned to a core of its own, as long as alone. The
cause is OpenMP: torch sizes each engine's thread pool from its CPUs, and two engines' 4 threads
on 2 cores wait for each other at every parallel region; with OMP_NUM_THREADS=1, unpinned, the
same pair took 54 s and 49 s (results/benchmarks/engine_lanes_omp_2026-11-28.log). Two lanes
without pinning took 711 s against 704 s for one lane; pinned, 501-533 s
(results/test-suite-runs.md). The tests sharing a session-scoped engine or cluster (the `server`
fixture, PostgreSQL) are one unit of work. The lanes take the units as they finish, longest
first by each test's `@pytest.mark.engine(seconds=S)` (its measured duration in make test), then
those marked `engine(load_sensitive=True)` (their duration grows most with other tests beside
them: the retune test's one-sequence windows drained in 178 s against 73 s alone), then the short
ones (LaneSchedule). Lanes fixed in advance by those marks ended 66 s apart (405 and 471 s) when
one test took 84 s instead of 35. (xdist's own `xdist_group` marker does nothing under pytest
9.2: the workers write the plan to a file the scheduler reads.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from autotune.measure.server_start import SERVER_NICE, renice_autogroup
from workloads.files import write_text_atomic

LANE_FILE_ENV = "AUTOTUNE_TEST_ENGINE_LANE"  # where the workers write the lane plan for the scheduler
DEFAULT_ENGINE_SECONDS = 1.0  # a lane test without `seconds=`: most use the session server
SHARED = ("server", "postgres_url")  # session-scoped: the tests using one share a lane
# Once a lane: the session server's start (~30 s); PostgreSQL's initdb is in the one test's seconds.
SHARED_START_SECONDS = {"server": 30.0, "postgres_url": 0.0}
# Units shorter than this go last in the plan: they even out the lanes' ends.
SHORT_UNIT_SECONDS = 25.0
_LANE_CPUS = pytest.StashKey[list[set[int]]]()  # each lane's CPUs
_LANE_FILE = pytest.StashKey[tuple[str, str | None]]()  # the lane file's folder, the variable before


def lane_count(text: str) -> int:
    """--engine-lanes: a whole number of lanes, at least 1."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"--engine-lanes must be a whole number >= 1, got {text!r}")
    return count


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--engine-lanes",
        metavar="N",
        type=lane_count,
        default=1,
        help="under --dist loadgroup, run the engine and PostgreSQL tests in N lanes, each one "
        "test at a time on its own worker and its own share of the CPUs (make test: 2). Default 1.",
    )


def pytest_configure(config: pytest.Config) -> None:
    worker = xdist_worker(config)
    # A worker's --dist is "no"; xdist keeps whether it was loadgroup here.
    if worker is not None and getattr(config.option, "loadgroup", False) and \
            lane_index(worker, config.getoption("engine_lanes")) is None:
        yield_to_the_lanes()
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        # Set before xdist starts its workers, which inherit it; restored at the session's end.
        folder = tempfile.mkdtemp(prefix="vllm-autotune-lanes-")
        config.stash[_LANE_FILE] = (folder, os.environ.get(LANE_FILE_ENV))
        os.environ[LANE_FILE_ENV] = os.path.join(folder, "engine-lane.txt")


def pytest_unconfigure(config: pytest.Config) -> None:
    made = config.stash.get(_LANE_FILE, None)
    if made is None:
        return
    folder, before = made
    shutil.rmtree(folder, ignore_errors=True)
    if before is None:
        os.environ.pop(LANE_FILE_ENV, None)
    else:
        os.environ[LANE_FILE_ENV] = before


def engine_starts(item: pytest.Item) -> int:
    """How many engines a test starts (`@pytest.mark.engine(starts=N)`, default 1)."""
    marker = item.get_closest_marker("engine")
    return 0 if marker is None else int(marker.kwargs.get("starts", 1))


def engine_seconds(item: pytest.Item) -> float:
    """About how long a lane test takes in make test on 2 cores (`@pytest.mark.engine(seconds=S)`,
    measured there): used only to balance the lanes, never asserted."""
    marker = item.get_closest_marker("engine")
    return DEFAULT_ENGINE_SECONDS if marker is None else float(marker.kwargs.get("seconds", DEFAULT_ENGINE_SECONDS))


def load_sensitive(item: pytest.Item) -> bool:
    """`@pytest.mark.engine(load_sensitive=True)`: best run once its lane has the CPUs to itself."""
    marker = item.get_closest_marker("engine")
    return marker is not None and bool(marker.kwargs.get("load_sensitive", False))


def in_engine_lane(item: pytest.Item) -> bool:
    return item.get_closest_marker("engine") is not None or item.get_closest_marker("postgres") is not None


def engine_plan(items: list[pytest.Item]) -> list[tuple[str, list[pytest.Item]]]:
    """The lane tests as units of work, in the order the lanes take them (the same on every worker).

    The tests sharing a session-scoped engine or cluster (the `server` fixture, PostgreSQL) are
    one unit, every other test its own. Longest first, so that what is left at the end is short
    enough to even out the lanes' ends; the load-sensitive units after the other long ones, once
    the tests without an engine are done, and the short units last, to fill in behind them."""
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        if in_engine_lane(item):
            fixtures = getattr(item, "fixturenames", ())
            units.setdefault(next((name for name in SHARED if name in fixtures), item.nodeid), []).append(item)

    def place(unit: tuple[str, list[pytest.Item]]) -> tuple[int, float, str]:
        key, members = unit
        seconds = sum(map(engine_seconds, members)) + SHARED_START_SECONDS.get(key, 0.0)
        stage = 2 if seconds < SHORT_UNIT_SECONDS else 1 if any(map(load_sensitive, members)) else 0
        return stage, -seconds, key

    return sorted(units.items(), key=place)


def xdist_worker(config: pytest.Config) -> str | None:
    """This process's xdist worker id ("gw0", ...), or None in the controller or a run without
    xdist. Not PYTEST_XDIST_WORKER: a pytest that a test starts inherits that variable from the
    worker it runs on, and would take itself for that worker (and pin itself to its lane)."""
    workerinput = getattr(config, "workerinput", None)
    return workerinput["workerid"] if workerinput else None


def lane_index(worker: str | None, count: int) -> int | None:
    """The lane an xdist worker runs (gw0 the first, ...), or None for a worker of other tests."""
    if worker is None or not worker.startswith("gw") or not worker[2:].isdigit():
        return None
    index = int(worker[2:])
    return index if index < count else None


class LaneSchedule:
    """Which unit of work an xdist worker gets next: the scheduler's decisions, without xdist.

    The first `lanes` workers run the lane units, one test at a time each and in the plan's
    order, each taking the next unit as it finishes its last test: a lane that finishes early
    takes more, so the lanes end together however far a test's duration is from its mark. A
    worker holds its last test until it is sent another (xdist runs a test knowing the next),
    so behind its lane test a lane worker gets one short test (a filler, reserved from the other
    workers) rather than its next lane unit ahead of time. The other workers take every other
    test; once no lane unit is left, the lanes take those too."""

    def __init__(self, lanes: int, lane_units: list[str], fillers: set[str]) -> None:
        self.lanes = lanes
        self.lane_units = {unit: position for position, unit in enumerate(lane_units)}
        self.fillers = fillers

    def next_unit(self, is_lane: bool, pending: list[str], queue: list[str]) -> str | None:
        """The unit a worker gets now, from `queue` (the units not given out yet, in order), or
        None; `pending` names the unit of each test it has been given and not finished."""
        if not is_lane:
            if len(pending) > 2:  # as xdist's own: a few tests ahead
                return None
            return next((unit for unit in queue if unit not in self.lane_units and unit not in self.fillers), None)
        if len(pending) > 1:
            return None
        lane_queue = sorted((unit for unit in queue if unit in self.lane_units), key=self.lane_units.__getitem__)
        if pending and pending[0] in self.lane_units:  # about to run its last lane test
            filler = next((unit for unit in queue if unit in self.fillers), None)
            if filler is not None:
                return filler
        return lane_queue[0] if lane_queue else next(iter(queue), None)

    def has_work_for(self, is_lane: bool, queue: list[str]) -> bool:
        """Whether any unit left is one this worker may get (else it is told to finish)."""
        if is_lane:
            return bool(queue)
        return any(unit not in self.lane_units and unit not in self.fillers for unit in queue)


def yield_to_the_lanes() -> None:
    """A worker of the tests without an engine leads a session of its own, whose autogroup (the
    Linux scheduler shares CPU time between sessions first) runs at the engine servers' nice
    value. In the workers' session, every test without an engine outweighed a lane's engine
    server (nice SERVER_NICE in its own session, so that a tuner's client comes first) ~9 to 1 on
    their shared core: the one-sequence ladder test took 100 s beside them against 48-56 s after
    them. The processes' own nice values stay as they were (a server still runs below the test
    that started it), and the processes its tests start inherit the session unless they start
    their own."""
    with contextlib.suppress(OSError):  # already a session leader
        os.setsid()
    with contextlib.suppress(OSError):  # no autogroups here: the CPUs are shared as before
        renice_autogroup(os.getpid(), SERVER_NICE)


def lane_cpus(allowed: set[int], count: int) -> list[set[int]]:
    """The CPUs of each of `count` lanes: `allowed` cut into `count` runs of equal size, or one
    lane of them all when there are fewer CPUs than lanes."""
    cpus = sorted(allowed)
    if len(cpus) < count:
        return [set(cpus)]
    size = len(cpus) // count
    return [set(cpus[lane * size:(lane + 1) * size]) for lane in range(count)]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "postgres_url" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgres)
    config.stash[_LANE_CPUS] = lane_cpus(os.sched_getaffinity(0), config.getoption("engine_lanes"))
    plan = engine_plan(items)
    # The lanes' tests first, in the plan's order, then everything else in pytest's order: the
    # order of a run without workers, and of each unit's tests under the scheduler below.
    position = {item.nodeid: index for index, item in enumerate(item for _, members in plan for item in members)}
    items.sort(key=lambda item: position.get(item.nodeid, len(position)))
    lane_file = os.environ.get(LANE_FILE_ENV)
    if hasattr(config, "workerinput") and lane_file:  # every worker collects the same: last one wins
        lines = [f"lane\t{key}\t{item.nodeid}" for key, members in plan for item in members]
        lines += [f"filler\t\t{item.nodeid}" for item in items
                  if item.nodeid not in position and item.get_closest_marker("slow") is None]
        write_text_atomic(lane_file, "".join(line + "\n" for line in lines))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup`: the engine lanes as LaneSchedule says; every other test is its own unit."""
    if config.getoption("dist", None) != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class EngineLanes(LoadScopeScheduling):
        schedule_: LaneSchedule | None = None
        unit_of: dict[str, str]
        index_of: dict[str, int]

        def _plan(self) -> LaneSchedule:
            if self.schedule_ is None:  # read once every worker has collected (xdist schedules then)
                self.unit_of, units, fillers = {}, [], []
                for line in Path(os.environ[LANE_FILE_ENV]).read_text().splitlines():
                    kind, key, nodeid = line.split("\t")
                    if kind == "lane":
                        self.unit_of[nodeid] = f"engine lane unit {key}"
                        if self.unit_of[nodeid] not in units:
                            units.append(self.unit_of[nodeid])
                    else:
                        fillers.append(nodeid)
                lanes = config.getoption("engine_lanes")
                # The last short tests, one behind each lane unit and one for each lane's end.
                reserved = set(fillers[max(0, len(fillers) - len(units) - lanes):])
                self.schedule_ = LaneSchedule(lanes, units, reserved)
            return self.schedule_

        def _split_scope(self, nodeid: str) -> str:
            self._plan()
            return self.unit_of.get(nodeid, nodeid)

        def _is_lane(self, node) -> bool:
            return lane_index(node.gateway.id, self._plan().lanes) is not None

        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            lane = self._is_lane(node)
            while True:
                pending = [scope for scope, unit in self.assigned_work[node].items()
                           for done in unit.values() if not done]
                scope = self._plan().next_unit(lane, pending, list(self.workqueue))
                if scope is None:
                    break
                work_unit = self.workqueue.pop(scope)
                self.assigned_work[node][scope] = work_unit
                node.send_runtest_some([self.index_of[nodeid] for nodeid, done in work_unit.items() if not done])
            if not self._plan().has_work_for(lane, list(self.workqueue)):
                node.shutdown()

        def schedule(self) -> None:
            assert self.collection_is_completed
            if self.collection is None:
                if not self._check_nodes_have_same_collection():
                    self.log("**Different tests collected, aborting run**")
                    return
                self.collection = list(next(iter(self.registered_collections.values())))
                # Every worker collected the same (checked above): one index for all of them.
                self.index_of = {nodeid: index for index, nodeid in enumerate(self.collection)}
                for nodeid in self.collection:
                    self.workqueue.setdefault(self._split_scope(nodeid), {})[nodeid] = False
            # The lanes first: they take the plan's first units.
            for node in sorted(self.nodes, key=lambda node: (not self._is_lane(node), node.gateway.id)):
                self._reschedule(node)

    return EngineLanes(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A lane test runs on its lane's CPUs, and so does every process it starts (they inherit the
    worker's affinity): two engine tests allowed the same CPUs slowed each other ~2x (see above).
    Without workers the tests run one at a time, on every CPU."""
    cpus = item.config.stash.get(_LANE_CPUS, [])
    lane = lane_index(xdist_worker(item.config), len(cpus))
    if len(cpus) < 2 or lane is None or not in_engine_lane(item):
        return (yield)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus[lane])
    try:
        return (yield)
    finally:
        os.sched_setaffinity(0, before)
