"""How long and how much memory: load + profile of a 1M-request trace.

    .venv/bin/python benchmarks/trace_scale.py [--quick] [--requests 1000000] [--repeats 3]

Writes a trace with every field (translation traffic: language pairs, sessions; plus
Mooncake-style hash_ids and recorded latencies, so every column and every profile
statistic is exercised), then loads and profiles it in a fresh child process per repeat.
Peak memory is the child's `ru_maxrss` (RUSAGE_CHILDREN), i.e. the whole interpreter
including numpy/scipy/pydantic imports. Goal: <= 10 s and <= 1 GB.
Results: results/benchmarks/trace_scale.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if not __package__:  # run as a file: its folder is on sys.path, the repository (benchmarks.*) is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.benchlib import Goal, Recorder, md_table, spread
from workloads.errors import OneLineErrorParser

ROOT = Path(__file__).resolve().parents[1]
GOAL_S = 10.0
GOAL_BYTES = 1024**3


def make_trace(path: Path, requests: int, seed: int) -> dict:
    from workloads.synthetic import TranslationSpec, translation
    from workloads.trace import HashIdColumn, Trace
    from workloads.trace_io import write_trace

    spec = TranslationSpec(duration_s=requests / 4.5 * 1.05)
    trace = translation(spec, seed=seed)
    trace = trace.subset(np.arange(min(requests, len(trace))))
    n = len(trace)
    rng = np.random.default_rng(seed)
    # One 512-token block per started 512 input tokens (at least 1); a shared system-prompt
    # block (id 0) for 70% of requests, the rest fresh ids.
    blocks = np.maximum(1, (trace.input_lengths + 511) // 512 + rng.integers(0, 3, size=n))
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(blocks, out=offsets[1:])
    values = np.arange(offsets[-1], dtype=np.int64) + 1
    shared = rng.random(n) < 0.7
    values[offsets[:-1][shared]] = 0
    hash_ids = HashIdColumn(values, offsets, np.ones(n, dtype=bool))
    latencies = 200 + trace.output_lengths * 20.0 * rng.uniform(0.8, 1.5, size=n)
    full = Trace(
        trace.timestamps_ms,
        trace.input_lengths,
        trace.output_lengths,
        hash_ids=hash_ids,
        source_langs=trace.source_langs,
        target_langs=trace.target_langs,
        session_ids=trace.session_ids,
        latencies_ms=latencies,
        source="benchmark",
    )
    started = time.perf_counter()
    write_trace(path, full)
    return {"requests": n, "write_s": time.perf_counter() - started}


def child(path: str) -> None:
    """Runs in a fresh interpreter: import, load, profile; prints timings as JSON."""
    started = time.perf_counter()
    from workloads.profile import profile_trace
    from workloads.trace_io import load_trace

    imported = time.perf_counter()
    cpu_imported = time.process_time()
    trace = load_trace(path)
    loaded = time.perf_counter()
    profile = profile_trace(trace)
    profiled = time.perf_counter()
    print(
        json.dumps(
            {
                "import_s": imported - started,
                "load_s": loaded - imported,
                "profile_s": profiled - loaded,
                "load_profile_s": profiled - imported,
                # CPU seconds of this process: the work itself, without waiting for a core
                # on a shared machine.
                "load_profile_cpu_s": time.process_time() - cpu_imported,
                "requests": len(trace),
                "fingerprint": profile.fingerprint,
            }
        )
    )


def measure(path: Path) -> dict:
    load_before = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    wall = time.perf_counter() - started
    # ru_maxrss of children is the largest of any child so far (KiB on Linux): each repeat
    # is one child of similar size, so the running maximum is the figure we want.
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result = json.loads(done.stdout)
    result["child_wall_s"] = wall
    result["loadavg_1min_before"] = load_before
    result["peak_rss_bytes"] = peak_kib * 1024
    result["peak_rss_grew"] = peak_kib > before
    return result


def main() -> int:
    parser = OneLineErrorParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="one repeat")
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (quick 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return 0
    args.repeats = args.repeats or (1 if args.quick else 3)
    recorder = Recorder("trace_scale", "Scale: load + profile of a 1M-request trace (item 5)",
                        "quick" if args.quick else "full")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scale.jsonl"
        made = make_trace(path, args.requests, args.seed)
        size = path.stat().st_size
        runs = [measure(path) for _ in range(args.repeats)]
    load_profile = [r["load_profile_s"] for r in runs]
    cpu = [r["load_profile_cpu_s"] for r in runs]
    peak = max(r["peak_rss_bytes"] for r in runs)
    median_s = float(np.median(load_profile))
    median_cpu = float(np.median(cpu))
    goals = [
        Goal(name="load + profile wall time (median of repeats)", target=f"<= {GOAL_S:g} s",
             measured=median_s, met=median_s <= GOAL_S,
             note=f"CPU time {median_cpu:.2f} s: the work itself, without waiting for a core"),
        Goal(name="peak RSS (whole interpreter, imports included)", target="<= 1 GiB",
             measured=peak / 2**30, met=peak <= GOAL_BYTES, note=f"{peak / 2**20:.0f} MiB"),
    ]
    results = {
        "trace": {**made, "file_bytes": size, "fields": "all (hash_ids, langs, session_id, latency_ms)"},
        "runs": runs,
        "load_profile_s": spread(load_profile),
        "load_profile_cpu_s": spread(cpu),
        "peak_rss_bytes": peak,
        "goal": {"seconds": GOAL_S, "bytes": GOAL_BYTES},
        "meets_goal": median_s <= GOAL_S and peak <= GOAL_BYTES,
        "meets_goal_cpu": median_cpu <= GOAL_S and peak <= GOAL_BYTES,
    }
    rows = [[i + 1, f"{r['import_s']:.2f}", f"{r['load_s']:.2f}", f"{r['profile_s']:.2f}",
             f"{r['load_profile_s']:.2f}", f"{r['load_profile_cpu_s']:.2f}",
             f"{r['peak_rss_bytes'] / 2**20:.0f}", f"{r['loadavg_1min_before']:.2f}"]
            for i, r in enumerate(runs)]
    table = ["## Runs (each in a fresh interpreter)", ""] + md_table(
        ["run", "import s", "load s", "profile s", "load+profile s", "load+profile CPU s",
         "peak RSS MiB", "load avg before"], rows)
    table += ["", f"Trace: {made['requests']} requests, {size / 1e6:.0f} MB of JSONL with every field "
                  f"(written in {made['write_s']:.1f} s)."]
    notes = [
        "Peak RSS is the child interpreter's ru_maxrss: numpy, scipy and pydantic imports included.",
        "Wall time on this shared 2-CPU machine includes waiting for a core while other jobs run; "
        "the CPU time is the work itself.",
    ]
    result = recorder.result(settings={"requests": args.requests, "repeats": args.repeats, "seed": args.seed},
                             goals=goals, results=results, notes=notes)
    recorder.write(result, "\n".join(table))
    print(
        f"{made['requests']} requests ({size / 1e6:.0f} MB): load+profile "
        f"{median_s:.2f} s median of {args.repeats} (CPU median {median_cpu:.2f} s); "
        f"peak RSS {peak / 2**20:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
