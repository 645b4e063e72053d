"""How long and how much memory: load + profile of a 1M-request trace.

    .venv/bin/python benchmarks/trace_scale.py [--requests 1000000] [--repeats 3]

Writes a trace with every field (translation traffic: language pairs, sessions; plus
Mooncake-style hash_ids and recorded latencies, so every column and every profile
statistic is exercised), then loads and profiles it in a fresh child process per repeat.
Peak memory is the child's `ru_maxrss` (RUSAGE_CHILDREN), i.e. the whole interpreter
including numpy/scipy/pydantic imports. Goal: <= 10 s and <= 1 GB.
Results: results/benchmarks/trace_scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GOAL_S = 10.0
GOAL_BYTES = 1024**3


def make_trace(path: Path, requests: int, seed: int) -> dict:
    from workloads.synthetic import TranslationSpec, translation
    from workloads.trace import HashIdColumn, Trace, write_trace

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
    from workloads.trace import load_trace

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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "results" / "benchmarks" / "trace_scale.json"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scale.jsonl"
        made = make_trace(path, args.requests, args.seed)
        size = path.stat().st_size
        runs = [measure(path) for _ in range(args.repeats)]
    load_profile = [r["load_profile_s"] for r in runs]
    cpu = [r["load_profile_cpu_s"] for r in runs]
    peak = max(r["peak_rss_bytes"] for r in runs)
    report = {
        "command": f"python benchmarks/trace_scale.py --requests {args.requests} --repeats {args.repeats}",
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "trace": {
            **made,
            "file_bytes": size,
            "fields": "all (hash_ids, langs, session_id, latency_ms)",
        },
        "runs": runs,
        "load_profile_s": {
            "min": min(load_profile),
            "median": float(np.median(load_profile)),
            "max": max(load_profile),
        },
        "load_profile_cpu_s": {"min": min(cpu), "median": float(np.median(cpu)), "max": max(cpu)},
        "peak_rss_bytes": peak,
        "goal": {"seconds": GOAL_S, "bytes": GOAL_BYTES},
        "meets_goal": float(np.median(load_profile)) <= GOAL_S and peak <= GOAL_BYTES,
        "meets_goal_cpu": float(np.median(cpu)) <= GOAL_S and peak <= GOAL_BYTES,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp_out, out)
    print(
        f"{made['requests']} requests ({size / 1e6:.0f} MB): load+profile "
        f"{report['load_profile_s']['median']:.2f} s median of {args.repeats} "
        f"(min {min(load_profile):.2f}, max {max(load_profile):.2f}; CPU median "
        f"{float(np.median(cpu)):.2f} s); peak RSS {peak / 2**20:.0f} MiB; "
        f"goal <= {GOAL_S:g} s and <= 1 GiB: {'met' if report['meets_goal'] else 'NOT met'} -> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
