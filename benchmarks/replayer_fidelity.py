"""Replayer fidelity (item 2): does our replayer measure what `vllm bench serve` measures?

Same server, same requests at the same times: the replayer (workloads.replay) and
`vllm bench serve --dataset-name timed_trace` take turns, `--repeats` runs each, on

  echo     a trivial local server with exact, known delays (tests/workloads/echo_server.py:
           first token after TTFT ms, then one token every ITL ms), so both tools can also be
           checked against the truth: TTFT = TTFT, TPOT = ITL, E2E = TTFT + (n-1) * ITL;
  engine   our server on the real vLLM CPU engine (embedded tiny model, the default config
           with prefix caching off, so neither tool's repeated prompts hit a cache).

The requests: a window of workloads/samples/translation_trace.jsonl (the tuner's window
choice), replayed `--speedup`x faster on echo and `--engine-speedup`x on the engine (the
recorded rate by default: a 2-CPU engine pushed into a growing queue turns every
millisecond of difference into seconds); written once per target with the scaled timestamps for both tools
(as a `timed_trace` file for vLLM, with one fresh 16-token hash id per prompt chunk so its
prompts have the exact lengths and share nothing). Compared: mean and p99 of TTFT, TPOT and
E2E as each tool reports them (goal: within 3%), and each tool's spread between its own
repeats (the noise floor of the comparison).

    .venv/bin/python benchmarks/replayer_fidelity.py [--quick] [--repeats 3]
        [--window-s 20] [--speedup 3] [--engine-speedup 1] [--targets echo,engine]

The highest sustained send rate is measured by benchmarks/replayer_rate.py.
Results: results/benchmarks/replayer_fidelity.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from benchlib import ROOT, EngineWatch, Goal, Recorder, fmt, md_table, say, spread

METRICS = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms", "p99_e2el_ms")
TOLERANCE = 0.03
ECHO_SERVER = ROOT / "tests" / "workloads" / "echo_server.py"
VLLM_CLI = ROOT / "benchmarks" / "vllm_cli.py"
CHUNK = 16  # vLLM's timed_trace default: tokens per hash id


def make_window(args: argparse.Namespace, speedup: float):
    from workloads.trace import load_trace
    from workloads.windows import select_windows

    trace = load_trace(args.trace)
    tuning, _, _ = select_windows(trace, args.window_s * speedup, 20.0)
    return tuning.replace(timestamps_ms=tuning.timestamps_ms / speedup, source=f"fidelity window x{speedup:g}")


def write_timed_trace(window, path: Path) -> None:
    """The window as a vLLM `timed_trace` file: ms timestamps, exact-length prompts."""
    next_id = 0
    with open(path, "w") as out:
        for i in range(len(window)):
            n = int(window.input_lengths[i])
            blocks = (n + CHUNK - 1) // CHUNK
            out.write(json.dumps({
                "timestamp": float(window.timestamps_ms[i]),
                "input_length": n,
                "output_length": int(window.output_lengths[i]),
                "hash_ids": list(range(next_id, next_id + blocks)),
            }) + "\n")
            next_id += blocks


def run_ours(window, url: str) -> dict:
    from workloads.replay import replay

    started = time.monotonic()
    result = asyncio.run(replay(window, url, mode="timed", benchmark_mode=True))
    s = result.summary
    figures = {m: getattr(s, m) for m in METRICS}
    figures.update(
        completed=s.completed, failed=s.failed, duration_s=s.duration,
        request_throughput=s.request_throughput, send_lag_p99_ms=s.send_lag_p99_ms,
        wall_s=time.monotonic() - started,
    )
    return figures


def run_vllm(trace_path: Path, n: int, base_url: str, work: Path, name: str) -> dict:
    out_name = f"vllm-bench-{name}.json"
    command = [
        sys.executable, str(VLLM_CLI), "bench-serve",
        "--backend", "vllm",
        "--base-url", base_url,
        "--endpoint", "/v1/completions",
        "--model", str(ROOT / "server" / "models" / "tiny-multilingual"),
        "--dataset-name", "timed_trace",
        "--dataset-path", str(trace_path),
        "--timed-trace-sec-multiplier", "0.001",
        "--num-prompts", str(n),
        "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(work), "--result-filename", out_name,
    ]
    started = time.monotonic()
    subprocess.run(command, check=True, cwd=ROOT)
    data = json.loads((work / out_name).read_text())
    figures = {m: data.get(m) for m in METRICS}
    figures.update(
        completed=data.get("completed"), failed=data.get("failed"), duration_s=data.get("duration"),
        request_throughput=data.get("request_throughput"), wall_s=time.monotonic() - started,
        command=" ".join(["benchmarks/vllm_cli.py bench-serve", *command[3:]]),
    )
    return figures


def alternate(window, trace_path: Path, base_url: str, work: Path, repeats: int, target: str) -> dict:
    runs: dict[str, list[dict]] = {"ours": [], "vllm_bench": []}
    for repeat in range(repeats):
        # Alternate which tool goes first, so a drifting machine hits both alike.
        order = ("ours", "vllm_bench") if repeat % 2 == 0 else ("vllm_bench", "ours")
        for tool in order:
            with EngineWatch() as watch:
                if tool == "ours":
                    figures = run_ours(window, base_url)
                else:
                    figures = run_vllm(trace_path, len(window), base_url, work, f"{target}-{repeat + 1}")
            figures["other_engine_share"] = watch.report()["share_with_foreign_engine"]
            runs[tool].append(figures)
            say(f"[{target}] {tool} run {repeat + 1}: " + ", ".join(
                f"{m} {fmt(figures[m], 4)}" for m in METRICS) + f", completed {figures['completed']}")
    return runs


def compare(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for metric in METRICS:
        ours = [r[metric] for r in runs["ours"] if r[metric] is not None]
        theirs = [r[metric] for r in runs["vllm_bench"] if r[metric] is not None]
        if not ours or not theirs:
            out[metric] = None
            continue
        ratio = float(np.median(ours)) / float(np.median(theirs))
        out[metric] = {
            "ours": spread(ours),
            "vllm_bench": spread(theirs),
            "ours_over_vllm_bench": ratio,
            "within_tolerance": abs(ratio - 1) <= TOLERANCE,
            # Repeat-to-repeat spread of each tool: (max - min) / median.
            "ours_spread": (max(ours) - min(ours)) / float(np.median(ours)),
            "vllm_bench_spread": (max(theirs) - min(theirs)) / float(np.median(theirs)),
        }
    return out


def truth(window, ttft_ms: float, itl_ms: float) -> dict:
    out = window.output_lengths.astype(np.float64)
    e2e = ttft_ms + (out - 1) * itl_ms
    return {"mean_ttft_ms": ttft_ms, "p99_ttft_ms": ttft_ms, "mean_tpot_ms": itl_ms, "p99_tpot_ms": itl_ms,
            "mean_e2el_ms": float(e2e.mean()), "p99_e2el_ms": float(np.percentile(e2e, 99))}


def echo_target(window, trace_path: Path, work: Path, args: argparse.Namespace) -> dict:
    process = subprocess.Popen([sys.executable, str(ECHO_SERVER), "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline() if process.stdout else ""
        if not line.startswith("PORT "):
            raise RuntimeError(f"echo server did not start: {line!r}")
        base = f"http://127.0.0.1:{int(line.split()[1])}/ttft={args.echo_ttft_ms:g},itl={args.echo_itl_ms:g}"
        runs = alternate(window, trace_path, base, work, args.repeats, "echo")
    finally:
        process.terminate()
        process.wait(timeout=10)
    return {"runs": runs, "comparison": compare(runs), "truth": truth(window, args.echo_ttft_ms, args.echo_itl_ms)}


def engine_target(window, trace_path: Path, work: Path, args: argparse.Namespace) -> dict:
    from autotune.launcher import ServerLauncher
    from server.config import ServerConfig, ServingSettings
    from workloads.replay import replay
    from workloads.trace import Trace, TraceRequest

    config = ServerConfig.default()
    engine = {**config.engine, "enable_prefix_caching": False}
    config = config.model_copy(update={"engine": engine, "serving": ServingSettings(benchmark_mode=True)})
    config_path = work / "engine.yaml"
    config.write(config_path)
    server = ServerLauncher().start(config_path, work / "engine-server.log")
    try:
        warm = Trace.from_requests([TraceRequest(timestamp=0, input_length=16, output_length=8)] * 8)
        asyncio.run(replay(warm, server.url, mode="concurrency=4"))
        runs = alternate(window, trace_path, server.url, work, args.repeats, "engine")
    finally:
        teardown = server.stop()
    return {"runs": runs, "comparison": compare(runs), "engine": engine,
            "server_teardown_s": teardown.seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat per tool, 8 s window")
    parser.add_argument("--repeats", type=int, default=None, help="runs per tool per target (default 3)")
    parser.add_argument("--window-s", type=float, default=None, help="wall seconds (default 20; quick 8)")
    parser.add_argument("--speedup", type=float, default=3.0, help="echo target: replay this much faster")
    parser.add_argument("--engine-speedup", type=float, default=1.0,
                        help="engine target: replay this much faster (1: the recorded rate, which the "
                        "2-CPU engine serves without a growing queue)")
    parser.add_argument("--trace", default=str(ROOT / "workloads" / "samples" / "translation_trace.jsonl"))
    parser.add_argument("--targets", default="echo,engine")
    parser.add_argument("--echo-ttft-ms", type=float, default=50.0)
    parser.add_argument("--echo-itl-ms", type=float, default=10.0)
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.window_s = args.window_s or (8.0 if args.quick else 20.0)
    recorder = Recorder("replayer_fidelity", "Replayer fidelity: our replayer vs `vllm bench serve` (item 2)",
                        "quick" if args.quick else "full")
    work = Path(tempfile.mkdtemp(prefix="replayer_fidelity."))
    targets = [t for t in args.targets.split(",") if t]
    results: dict = {}
    windows = {}
    for target in targets:
        speedup = args.speedup if target == "echo" else args.engine_speedup
        window = make_window(args, speedup)
        trace_path = work / f"{target}.timed_trace.jsonl"
        write_timed_trace(window, trace_path)
        windows[target] = {"requests": len(window), "speedup": speedup,
                           "rate_rps": len(window) / max(window.duration_s(), 1e-9)}
        say(f"{target} window: {len(window)} requests over {window.duration_s():.1f} s "
            f"({windows[target]['rate_rps']:.1f} req/s); files in {work}")
        run = echo_target if target == "echo" else engine_target
        results[target] = run(window, trace_path, work, args)
        results[target]["window"] = windows[target]
    goals = []
    for target, data in results.items():
        comparison = data["comparison"]
        worst = max((abs(c["ours_over_vllm_bench"] - 1) for c in comparison.values() if c), default=None)
        failing = [m for m, c in comparison.items() if c and not c["within_tolerance"]]
        goals.append(Goal(
            name=f"{target}: mean and p99 TTFT, TPOT, E2E agree with vllm bench serve",
            target=f"within {TOLERANCE:.0%} (largest |ours/vllm - 1|)",
            measured=worst,
            met=None if worst is None else worst <= TOLERANCE,
            note="outside: " + ", ".join(failing) if failing else "",
        ))
    settings = {
        "windows": windows, "window_wall_s": args.window_s, "speedup_echo": args.speedup,
        "speedup_engine": args.engine_speedup,
        "repeats": args.repeats, "echo_ttft_ms": args.echo_ttft_ms, "echo_itl_ms": args.echo_itl_ms,
        "trace": str(Path(args.trace).resolve().relative_to(ROOT)),
        "vllm_bench_command": next((r["command"] for d in results.values() for r in d["runs"]["vllm_bench"]), None),
    }
    notes = [
        "Definitions differ slightly between the tools, as documented in each: vllm bench serve "
        "starts TTFT at the first chunk with a choice and ends E2E at the last chunk with a choice; "
        "our replayer starts TTFT at the first chunk carrying a token and ends E2E at `data: [DONE]`.",
        "vllm bench serve sends one test request before each run (its ready check); the replayer does not.",
        "Both tools, the server and (for engine) the vLLM engine share this machine's 2 CPUs with "
        "other engineers' jobs: the per-tool spread between repeats is the noise floor of the comparison.",
        "`vllm bench serve` runs as benchmarks/vllm_cli.py bench-serve, vLLM's own parser and main for "
        "that subcommand (the `vllm` console script cannot start on this CPU; see that file).",
    ]
    result = recorder.result(settings=settings, goals=goals, results=results, notes=notes)
    recorder.write(result, tables(results))
    for goal in goals:
        say(f"{goal.name}: {fmt(goal.measured)} ({goal.target}) {goal.note}")
    return 0


def tables(results: dict) -> str:
    lines = []
    for target, data in results.items():
        w = data["window"]
        lines += [f"## {target}: median over repeats (min-max)", "",
                  f"{w['requests']} requests, {w['rate_rps']:.1f} req/s (trace replayed {w['speedup']:g}x).", ""]
        rows = []
        for metric in METRICS:
            c = data["comparison"][metric]
            if c is None:
                rows.append([metric, "-", "-", "-", "-"])
                continue
            o, v = c["ours"], c["vllm_bench"]
            row = [metric, f"{o['median']:.2f} ({o['min']:.2f}-{o['max']:.2f})",
                   f"{v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})",
                   f"{c['ours_over_vllm_bench']:.3f}", "yes" if c["within_tolerance"] else "**no**"]
            if "truth" in data:
                t = data["truth"][metric]
                row += [f"{t:.2f}", f"{o['median'] / t - 1:+.1%}", f"{v['median'] / t - 1:+.1%}"]
            rows.append(row)
        headers = ["metric", "ours ms", "vllm bench serve ms", "ours / vllm", "within 3%"]
        if "truth" in data:
            headers += ["truth ms", "ours vs truth", "vllm vs truth"]
        lines += md_table(headers, rows)
        runs = data["runs"]
        lines += ["", "Runs: " + "; ".join(
            f"{tool} completed {', '.join(str(r['completed']) for r in rs)}, duration "
            f"{', '.join(fmt(r['duration_s']) for r in rs)} s" for tool, rs in runs.items()), ""]
        lags = [r["send_lag_p99_ms"] for r in runs["ours"]]
        lines += [f"Our replayer's send-lag p99: {', '.join(fmt(v) for v in lags)} ms.", ""]
        lines += ["Share of each run during which another user's vLLM engine ran: " + "; ".join(
            f"{tool} {', '.join(format(r['other_engine_share'], '.0%') for r in rs)}"
            for tool, rs in runs.items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
