"""Run the whole benchmark set (issue 6), one benchmark after another, each with its log.

    .venv/bin/python benchmarks/run_all.py --quick     # about 10-15 minutes, results/benchmarks/quick/
    .venv/bin/python benchmarks/run_all.py             # the full set, about an hour, results/benchmarks/
    .venv/bin/python benchmarks/run_all.py --only serving_overhead,trace_scale

Every step that starts a vLLM engine runs under `flock /tmp/vllm-engines.lock` so that engine
users of a shared machine take turns (one engine of ours at a time); the grid of the search
benchmark is measured in chunks, each under the lock, so other users get turns in between.
Each step's output (vLLM's logs included) goes to results/benchmarks[/quick]/STEP.log and to
this process's stdout. The benchmarks are not part of the test suite.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import shutil
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: its folder is on sys.path, the repository (benchmarks.*) is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.benchlib import ENGINE_LOCK, RESULTS, ROOT
from workloads.errors import OneLineErrorParser

PYTHON = sys.executable


@dataclasses.dataclass(frozen=True)
class Step:
    name: str  # also the log's name
    argv: tuple[str, ...]  # after the interpreter
    engine: bool  # starts vLLM engines: run under the engine lock
    repeat_until_done: bool = False  # the grid: chunk after chunk until every point is measured


def steps(quick: bool) -> list[Step]:
    q = ("--quick",) if quick else ()
    grid_chunk = ("--max-points", "5" if quick else "8")
    return [
        Step("trace_scale", ("benchmarks/trace_scale.py", *q), engine=False),
        Step("replayer_rate", ("benchmarks/replayer_rate.py", "--realtime", *q,
                               *(("--loop", "asyncio", "--skip-client-cost") if quick else ())), engine=False),
        Step("replayer_fidelity", ("benchmarks/replayer_fidelity.py", *q), engine=True),
        Step("serving_overhead", ("benchmarks/serving_overhead.py", *q), engine=True),
        Step("search_grid", ("benchmarks/search_efficiency.py", "measure", "--objective", "capacity",
                             *q, *grid_chunk), engine=True, repeat_until_done=True),
        Step("search_efficiency", ("benchmarks/search_efficiency.py", "replay", *q), engine=False),
        Step("ladder_search", ("benchmarks/ladder_search.py",), engine=False),  # under a second
        Step("trial_overhead", ("benchmarks/trial_overhead.py", *q), engine=True),
        Step("capacity_repeats", ("benchmarks/capacity_repeats.py", *q), engine=True),
        Step("capacity_fidelity", ("benchmarks/capacity_fidelity.py", *q), engine=True),
    ]


def command(step: Step) -> list[str]:
    argv = [PYTHON, *step.argv]
    if step.engine:
        flock = shutil.which("flock")
        if flock is None:
            raise SystemExit("flock(1) not found: it keeps engine users of this machine taking turns")
        argv = [flock, str(ENGINE_LOCK), *argv]
    return argv


def run(step: Step, log_path: Path) -> int:
    argv = command(step)
    with open(log_path, "a", encoding="utf-8") as log:
        stamp = dt.datetime.now().isoformat(timespec="seconds")
        shown = " ".join(".venv/bin/python" if a == PYTHON else a for a in argv)
        log.write(f"# {stamp}: {shown}\n")
        log.flush()
        process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, errors="replace")
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            sys.stdout.write(f"[{step.name}] {line}")
            sys.stdout.flush()
        return process.wait()


def grid_done(quick: bool) -> bool:
    """True when the capacity grid's table holds every point (and the baseline)."""
    from benchmarks.search_table import default_table, load_table

    folder = default_table("capacity", quick)
    if not (folder / "table.json").exists():
        return False
    table = load_table(folder)
    return not table.missing() and table.baseline_point() is not None


def main() -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default=None, help="comma-separated step names")
    args = parser.parse_args()
    out_dir = RESULTS / "quick" if args.quick else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    chosen = steps(args.quick)
    if args.only:
        names = set(args.only.split(","))
        chosen = [s for s in chosen if s.name in names]
    started = time.monotonic()
    failed = []
    for step in chosen:
        log_path = out_dir / f"{step.name}.log"
        log_path.unlink(missing_ok=True)
        step_started = time.monotonic()
        while True:
            code = run(step, log_path)
            if code != 0 or not step.repeat_until_done or grid_done(args.quick):
                break
        print(f"== {step.name}: exit {code} after {time.monotonic() - step_started:.0f} s", flush=True)
        if code != 0:
            failed.append(step.name)
    print(f"== all steps done in {time.monotonic() - started:.0f} s; failed: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
