"""Capacity repeatability (issue 16): the defaults' capacity measured by the load ladder in
three separate launches, and their spread (goal <= 10%), beside `max_num_seqs=1` (which must
carry less) and the ladder's own cost: launches, steps, seconds per capacity point.

Each run is one `autotune.measure.trial.TrialRunner` trial with the capacity ladder, on the tuning
window `autotune run` would choose from the sample trace, the CPU default SLOs, the CPU ladder
settings. Launches alternate (defaults, one-seq, defaults, ...) so slow drift of the machine
hits both alike.

    .venv/bin/python benchmarks/capacity_repeats.py [--quick] [--repeats 3]

Results: results/benchmarks/capacity_repeats.{json,md} (quick: results/benchmarks/quick/).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: its folder is on sys.path, the repository (benchmarks.*) is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.measure.ladder import LadderSettings
from autotune.measure.trial import TrialRunner
from autotune.search.objective import default_slos
from benchmarks.benchlib import ROOT, EngineWatch, Goal, Recorder, fmt, md_table, say, spread
from server.config import ServerConfig, default_engine_settings
from workloads.errors import OneLineErrorParser
from workloads.replay import ReplayOptions
from workloads.trace_io import load_trace
from workloads.windows import select_windows

SAMPLE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"
CONFIGS = {"defaults": {}, "one-seq": {"max_num_seqs": 1}}


def main() -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats of the defaults, 1 of one-seq")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    recorder = Recorder("capacity_repeats", "Capacity repeatability: the defaults' capacity in "
                        "separate launches (issue 16)", "quick" if args.quick else "full")
    trace = load_trace(SAMPLE)
    tuning, _holdout, _info = select_windows(trace, 30.0, 20.0)
    slos = default_slos("cpu")
    settings = LadderSettings.for_accelerator("cpu")
    order = []
    for repeat in range(repeats):
        order.append(("defaults", repeat))
        if repeat == 0 or not args.quick:
            order.append(("one-seq", repeat))
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="capacity-repeats-") as scratch, EngineWatch() as watch:
        runner = TrialRunner(replay=ReplayOptions(slos=slos), ladder=settings, stale_registry=Path(scratch) / "servers.json",
                             startup_timeout_s=300, say=say)
        for name, repeat in order:
            config = ServerConfig(engine={**default_engine_settings(), **CONFIGS[name]})
            started = time.monotonic()
            outcome = runner.run(config, tuning, Path(scratch) / f"{name}-{repeat}")
            wall = time.monotonic() - started
            capacity = outcome.capacity
            row = {
                "config": name,
                "repeat": repeat + 1,
                "ok": outcome.ok,
                "failure": outcome.failure,
                "capacity_rps": capacity.capacity_rps if capacity else None,
                "headroom": capacity.headroom if capacity else None,
                "bracketed": capacity.bracketed if capacity else None,
                "steps": len(capacity.steps) if capacity else 0,
                "ladder_s": outcome.timing.measure_s if outcome.timing else None,
                "engine_start_s": outcome.timing.ready_s if outcome.timing else None,
                "wall_s": round(wall, 1),
            }
            runs.append(row)
            say(f"{name} #{repeat + 1}: {fmt(row['capacity_rps'])} req/s in {row['steps']} steps, "
                f"wall {row['wall_s']} s")
    defaults = [r["capacity_rps"] for r in runs if r["config"] == "defaults" and r["capacity_rps"]]
    one_seq = [r["capacity_rps"] for r in runs if r["config"] == "one-seq" and r["capacity_rps"] is not None]
    stats = spread(defaults)
    relative = (stats["max"] - stats["min"]) / stats["median"] if defaults and stats["median"] else None
    goals = [
        Goal(name="defaults' capacity, relative spread of the repeats ((max-min)/median)",
             target="<= 0.10", measured=relative, met=None if relative is None else relative <= 0.10),
        Goal(name="max_num_seqs=1 carries less than every defaults repeat", target="true",
             measured=None if not one_seq else max(one_seq),
             met=bool(one_seq and defaults and max(one_seq) < min(defaults))),
    ]
    ladder_s = [r["ladder_s"] for r in runs if r["ladder_s"]]
    results = {
        "runs": runs,
        "defaults": stats,
        "one_seq": spread(one_seq),
        "relative_spread": relative,
        "ladder_s": spread(ladder_s),
        "steps": spread([r["steps"] for r in runs]),
        "launches_per_capacity_point": 1,
        "recorded_rps": runs[0]["capacity_rps"] / runs[0]["headroom"] if runs and runs[0]["headroom"] else None,
        "engine_watch": watch.report(),
    }
    table = md_table(
        ["config", "repeat", "capacity req/s", "headroom", "bracketed", "steps", "ladder s",
         "engine start s", "wall s"],
        [[r["config"], r["repeat"], fmt(r["capacity_rps"]), fmt(r["headroom"]), r["bracketed"],
          r["steps"], fmt(r["ladder_s"]), fmt(r["engine_start_s"]), r["wall_s"]] for r in runs],
    )
    notes = [
        f"Ladder: {settings.step_requests} requests and >= {settings.min_step_s:g} s per step, "
        f"growth x{settings.growth:g}, resolution {settings.resolution:.0%}; SLOs "
        + ", ".join(s.spec() for s in slos) + ".",
        "Capacity = the highest passing speed-up x the window's recorded rate; each figure is "
        "one engine launch.",
    ]
    recorder.write(recorder.result(settings=settings.model_dump(), goals=goals, results=results,
                                   notes=notes), "\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
