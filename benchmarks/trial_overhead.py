"""Trial overhead (item 4): where the wall time of a trial goes, and what shrinks the part
that does not measure anything.

1. From real trials: the TrialTiming (launch, ready, warm-up, measure, teardown) of every
   trial of the search-efficiency grid (benchmarks/search_efficiency.py measure), plus a
   breakdown of the engine start read from each trial's server.log (vLLM's log timestamps,
   one-second resolution): our server's imports, the engine-core process, the worker process,
   the engine's own init (model load, KV cache, profiling), and the rest until /health is 200.
2. Engine-start variants, started one at a time with the tuner's own launcher
   (autotune.measure.launcher.ServerLauncher), each followed by a short closed-loop throughput check:
     eager             the tuner's CPU default (enforce_eager: no torch.compile)
     compile_cold      enforce_eager false, empty vLLM cache (VLLM_CACHE_ROOT)
     compile_warm      enforce_eager false, same config again on that cache (what a kept
                       compile cache saves)
     compile_warm_other enforce_eager false, another max_num_seqs / max_num_batched_tokens
                       on that cache (the next trial of a study changes exactly these)
     eager#2           eager again, last: how far two starts of one config differ here
     eager_mem0.3      eager with gpu_memory_utilization 0.3, the CPU default until
                       2026-11-25 (vLLM fills the KV cache at start: what the smaller default saves)
   (`distributed_executor_backend: uni`, which would save the worker process, is not an
   option: vLLM's CPU platform turns it back into `mp`.)

    .venv/bin/python benchmarks/trial_overhead.py [--quick] [--table benchmarks/data/search_grid]
        [--variants eager,compile_cold,...] [--rounds 2] [--name trial_overhead]

Results: results/benchmarks/NAME.{json,md} (default trial_overhead).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

if not __package__:  # run as a file: its folder is on sys.path, the repository (benchmarks.*) is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.benchlib import (
    DATA,
    ROOT,
    EngineWatch,
    Goal,
    Recorder,
    fmt,
    md_table,
    say,
    spread,
)
from workloads.errors import OneLineErrorParser

PHASES = ("launch_s", "ready_s", "warmup_s", "measure_s", "teardown_s")
VARIANTS = ("eager", "compile_cold", "compile_warm", "compile_warm_other", "eager#2")
QUICK_VARIANTS = ("eager", "compile_cold")
_VLLM_STAMP = re.compile(r"^\((\w+)(?:-\d+)? pid=\d+\) \w+ (\d\d-\d\d \d\d:\d\d:\d\d) ")
_SPAWN = re.compile(r"^# autotune (\S+): starting")
_INIT_DONE = "init engine (profile, create kv cache, warmup model) took"


# -- 1. real trials ----------------------------------------------------------------------------


def start_breakdown(log_path: Path, ready_s: float) -> dict[str, float] | None:
    """Engine-start phases from a server.log (seconds; vLLM stamps have 1 s resolution)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    spawned: dt.datetime | None = None
    first: dict[str, dt.datetime] = {}
    init_done: dt.datetime | None = None
    for line in lines:
        match = _SPAWN.match(line)
        if match:
            spawned = dt.datetime.fromisoformat(match.group(1))
            first.clear()
            init_done = None
            continue
        match = _VLLM_STAMP.match(line)
        if not match or spawned is None:
            continue
        stamp = dt.datetime.strptime(f"{spawned.year}-{match.group(2)}", "%Y-%m-%d %H:%M:%S")
        role = {"MainProcess": "main", "EngineCore": "engine_core", "VllmWorker": "worker",
                "Worker": "worker"}.get(match.group(1))
        if role:
            first.setdefault(role, stamp)
        if _INIT_DONE in line and init_done is None:
            init_done = stamp
    if spawned is None or not {"main", "engine_core", "worker"} <= first.keys() or init_done is None:
        return None
    ready = spawned + dt.timedelta(seconds=ready_s)

    def gap(a: dt.datetime, b: dt.datetime) -> float:
        return (b - a).total_seconds()

    return {
        "server_imports_s": gap(spawned, first["main"]),
        "engine_core_process_s": gap(first["main"], first["engine_core"]),
        "worker_process_s": gap(first["engine_core"], first["worker"]),
        "engine_init_s": gap(first["worker"], init_done),
        "until_ready_s": gap(init_done, ready),
    }


def real_trials(table_path: Path) -> dict[str, Any]:
    from pydantic import TypeAdapter

    data = TypeAdapter(dict).validate_json(table_path.read_text())
    trials = []
    for point in data["points"]:
        timing = point.get("timing")
        if not timing:
            continue
        wall = point["wall_s"]
        other = wall - sum(timing[p] for p in PHASES if p != "launch_s")
        breakdown = start_breakdown(ROOT / point["trial_dir"] / "server.log", timing["ready_s"])
        trials.append({
            "label": point["label"], "wall_s": wall, **timing, "other_s": other,
            "non_measuring_s": wall - timing["measure_s"], "load_1min_before": point["load_1min_before"],
            "other_engine_share": point.get("other_engine_share", 0.0),
            "start": breakdown,
        })
    summary: dict[str, Any] = {"trials": len(trials)}
    for key in (*PHASES, "other_s", "non_measuring_s", "wall_s"):
        summary[key] = spread([t[key] for t in trials])
    summary["non_measuring_share"] = spread([t["non_measuring_s"] / t["wall_s"] for t in trials])
    alone = [t for t in trials if t["other_engine_share"] == 0]
    summary["alone"] = {"trials": len(alone), "ready_s": spread([t["ready_s"] for t in alone]),
                        "non_measuring_s": spread([t["non_measuring_s"] for t in alone])}
    with_start = [t["start"] for t in trials if t["start"]]
    summary["start_breakdown"] = {
        key: spread([s[key] for s in with_start]) for key in (with_start[0] if with_start else {})
    }
    summary["start_breakdown_trials"] = len(with_start)
    loads = np.array([t["load_1min_before"] for t in trials])
    ready = np.array([t["ready_s"] for t in trials])
    if len(trials) > 2 and loads.std() > 0:
        summary["ready_vs_load_correlation"] = float(np.corrcoef(loads, ready)[0, 1])
    return {"summary": summary, "trials": trials, "table": str(table_path.relative_to(ROOT))
            if table_path.is_relative_to(ROOT) else str(table_path)}


# -- 2. engine-start variants -------------------------------------------------------------------


def variant_config(name: str):
    from server.config import ServerConfig, ServingSettings

    name = name.split("#")[0]  # "eager#2": the same config, started again
    config = ServerConfig.default()
    engine = dict(config.engine)
    if name.startswith("compile"):
        engine["enforce_eager"] = False
    if name == "compile_warm_other":
        engine.update(max_num_seqs=8, max_num_batched_tokens=512)
    if name == "eager_mem0.3":
        engine["gpu_memory_utilization"] = 0.3
    return config.model_copy(update={"engine": engine, "serving": ServingSettings(benchmark_mode=True)})


def start_variant(name: str, work: Path, cache_root: Path, run: int) -> dict[str, Any]:
    from autotune.measure.launcher import ServerLauncher, ServerStartFailed
    from workloads.replay import ReplayOptions, replay
    from workloads.trace import Trace, TraceRequest

    config = variant_config(name)
    slug = name.replace("#", "-")
    config_path = work / f"{slug}-{run}.yaml"
    config.write(config_path)
    log_path = work / f"{slug}-{run}.log"
    env = {**os.environ, "VLLM_CACHE_ROOT": str(cache_root)}
    launcher = ServerLauncher(env=env, startup_timeout_s=600)
    load = os.getloadavg()[0]
    started = time.monotonic()
    try:
        server = launcher.start(config_path, log_path)
    except ServerStartFailed as failure:
        return {"variant": name, "ok": False, "failure": f"{failure.kind}: {failure.detail}",
                "load_1min_before": load}
    ready_s = server.ready_at - server.spawned_at
    try:
        rng = np.random.default_rng(0)
        requests = [TraceRequest(timestamp=0, input_length=int(n), output_length=32)
                    for n in rng.integers(32, 129, size=128)]
        trace = Trace.from_requests(requests)
        closed_loop = ReplayOptions(mode="concurrency=8")
        asyncio.run(replay(Trace.from_requests(requests[:8]), server.url, closed_loop))
        result = asyncio.run(replay(trace, server.url, closed_loop))
    finally:
        teardown = server.stop()
    return {
        "variant": name,
        "ok": True,
        "ready_s": ready_s,
        "start": start_breakdown(log_path, ready_s),
        "requests_per_s": result.summary.request_throughput,
        "completed": result.summary.completed,
        "teardown_s": teardown.seconds,
        "total_s": time.monotonic() - started,
        "load_1min_before": load,
        "log": str(log_path),
    }


def variants(names: list[str], rounds: int) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="trial_overhead."))
    runs = []
    for run in range(rounds):
        cache_root = work / f"vllm-cache-{run}"  # empty: compile_cold compiles from scratch
        cache_root.mkdir()
        for name in names:
            say(f"round {run + 1}: {name} (load {os.getloadavg()[0]:.2f})")
            with EngineWatch() as watch:
                row = start_variant(name, work, cache_root, run)
            row["round"] = run
            row["other_engine_share"] = watch.report()["share_with_foreign_engine"]
            runs.append(row)
            if row["ok"]:
                say(f"  ready {row['ready_s']:.1f} s, {row['requests_per_s']:.2f} req/s, "
                    f"teardown {row['teardown_s']:.1f} s, start {row['start']}")
            else:
                say(f"  failed: {row['failure']}")
    return runs


def main() -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"variants {','.join(QUICK_VARIANTS)}")
    parser.add_argument("--table", default=None, help="search-grid table folder (default: "
                        "benchmarks/data/search_grid; quick: /tmp/search_grid_capacity_quick, which run_all.py --quick measures)")
    parser.add_argument("--variants", default=None)
    parser.add_argument("--rounds", type=int, default=None, help="default 2 (quick 1)")
    parser.add_argument("--name", default="trial_overhead", help="results file name under results/benchmarks")
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 2)
    table_dir = Path(args.table or ("/tmp/search_grid_capacity_quick" if args.quick else DATA / "search_grid"))
    names = [v for v in (args.variants or ",".join(QUICK_VARIANTS if args.quick else VARIANTS)).split(",") if v]
    recorder = Recorder(args.name, "Trial overhead: where a trial's time goes (item 4)",
                        "quick" if args.quick else "full")
    trials = real_trials(table_dir / "table.json")
    s = trials["summary"]
    say(f"{s['trials']} real trials: wall median {fmt(s['wall_s']['median'])} s, ready "
        f"{fmt(s['ready_s']['median'])} s, measure {fmt(s['measure_s']['median'])} s")
    starts = variants(names, args.rounds)
    by_variant: dict[str, Any] = {}
    for name in names:
        rows = [r for r in starts if r["variant"] == name and r["ok"]]
        by_variant[name] = {
            "ready_s": spread([r["ready_s"] for r in rows]),
            "requests_per_s": spread([r["requests_per_s"] for r in rows]),
            "teardown_s": spread([r["teardown_s"] for r in rows]),
            "engine_init_s": spread([r["start"]["engine_init_s"] for r in rows if r.get("start")]),
            "failed": sum(1 for r in starts if r["variant"] == name and not r["ok"]),
        }
    share = s["non_measuring_share"]["median"]
    goals = [Goal(name="non-measuring share of a trial's wall time (median over the grid's trials)",
                  target="as small as possible (no number given in the issue)", measured=share, met=None)]
    notes = [
        f"Real trials: the {s['trials']} trials of the search-efficiency grid ({trials['table']}), "
        "each a full autotune.measure.trial.TrialRunner run (4 warm-up requests, then the window).",
        "Start breakdown: vLLM's log lines carry one-second timestamps; each phase is the gap "
        "between the first line of one process and the first line of the next, so each figure is "
        "+-1 s. server_imports_s = spawn -> our server's first vLLM log line (Python, torch and "
        "vLLM imports); engine_core_process_s = -> first EngineCore line (engine config, spawn "
        "and imports of the engine-core process); worker_process_s = -> first Worker line (spawn "
        "and imports of the worker process); engine_init_s = -> 'init engine ... took' (model load, "
        "KV cache, profiling); until_ready_s = -> /health 200.",
        "What the tuner does about the non-measuring part: enforce_eager is on by default on CPU "
        "(server.config.default_engine_settings), so no trial pays torch.compile; the vLLM cache "
        "(VLLM_CACHE_ROOT, default ~/.cache/vllm) is not cleared between trials, so with compile on "
        "a later trial reuses what an earlier one compiled where vLLM's cache key matches; configs "
        "that break a relation are not launched at all; the MedianPruner stops a trial whose goodput "
        "so far is below the median after 40% of the window (live runs only, not in these figures); "
        "the warm-up is 4 short requests.",
        "Not available on CPU: distributed_executor_backend uni (which would save the worker process, "
        "one of the three Python processes a start spawns): vLLM's CPU platform sets it back to mp.",
        "Other engineers' jobs share the 2 CPUs: start times grow with the load (see "
        "ready_vs_load_correlation and each trial's load_1min_before).",
    ]
    result = recorder.result(
        settings={"table": trials["table"], "variants": names, "rounds": args.rounds},
        goals=goals,
        results={"real_trials": trials, "variants": by_variant, "variant_runs": starts},
        notes=notes,
    )
    recorder.write(result, tables(trials, by_variant, starts))
    return 0


def tables(trials: dict, by_variant: dict, starts: list[dict]) -> str:
    s = trials["summary"]
    lines = [f"## A trial's wall time ({s['trials']} real trials; seconds: median, p25-p75, min-max)", ""]
    rows = []
    for key, label in (("launch_s", "launch (spawn -> process running)"),
                       ("ready_s", "ready (spawn -> /health 200: engine start)"),
                       ("warmup_s", "warm-up"), ("measure_s", "measure (the window)"),
                       ("teardown_s", "teardown (stop -> all gone, memory back)"),
                       ("other_s", "other (config, files, scraping)"),
                       ("non_measuring_s", "everything but measure"), ("wall_s", "trial wall")):
        v = s[key]
        rows.append([label, fmt(v["median"]), f"{fmt(v['p25'])}-{fmt(v['p75'])}", f"{fmt(v['min'])}-{fmt(v['max'])}"])
    lines += md_table(["phase", "median s", "p25-p75", "min-max"], rows)
    share = s["non_measuring_share"]
    lines += ["", f"Non-measuring share of the trial wall: median {share['median']:.0%} "
                  f"(range {share['min']:.0%}-{share['max']:.0%}).", ""]
    alone = s["alone"]
    if alone["trials"]:
        lines += [f"Trials during which no other user's vLLM engine ran ({alone['trials']}): engine "
                  f"ready median {fmt(alone['ready_s']['median'])} s, non-measuring median "
                  f"{fmt(alone['non_measuring_s']['median'])} s.", ""]
    if s.get("ready_vs_load_correlation") is not None:
        lines += [f"Correlation of engine start time with the machine's 1-min load average before "
                  f"the trial: {s['ready_vs_load_correlation']:.2f}.", ""]
    if s["start_breakdown"]:
        lines += [f"## Engine start, phase by phase ({s['start_breakdown_trials']} trials, +-1 s each)", ""]
        lines += md_table(["phase", "median s", "min-max"], [
            [k, fmt(v["median"]), f"{fmt(v['min'])}-{fmt(v['max'])}"] for k, v in s["start_breakdown"].items()])
        lines.append("")
    lines += ["## Engine-start variants (tuner's launcher; one start each per round)", ""]
    rows = []
    for name, v in by_variant.items():
        init = v["engine_init_s"]
        rows.append([name, fmt(v["ready_s"]["median"]),
                     f"{fmt(init['median'])} ({fmt(init['min'])}-{fmt(init['max'])})",
                     fmt(v["requests_per_s"]["median"]), fmt(v["teardown_s"]["median"]), v["ready_s"]["n"],
                     v["failed"]])
    lines += md_table(["variant", "ready s (median)", "engine init s (median, min-max)",
                       "req/s (128 req, c=8, 32 out)", "teardown s", "starts", "failed"], rows)
    lines += ["", "Engine init = model load, KV-cache allocation, profiling and (with compile) "
                  "torch.compile: the phase the compile settings change; the import phases before it "
                  "vary by tens of seconds from start to start on this shared machine.", ""]
    lines += ["", "Per start:", ""]
    lines += md_table(["round", "variant", "load before", "another engine ran", "ready s",
                       "start phases (s)", "req/s"], [
        [r["round"] + 1, r["variant"], f"{r['load_1min_before']:.2f}", f"{r['other_engine_share']:.0%}",
         fmt(r.get("ready_s")), ", ".join(f"{k.removesuffix('_s')} {v:.0f}" for k, v in (r.get("start") or {}).items())
         or r.get("failure", "-"), fmt(r.get("requests_per_s"))] for r in starts])
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
