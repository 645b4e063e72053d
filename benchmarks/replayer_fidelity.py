"""Replayer fidelity (item 2): does our replayer measure what `vllm bench serve` measures?

Same server, same requests, same moment: the window's requests are split in two halves
(even and odd positions); the replayer (workloads.replay) sends one half while `vllm bench
serve --dataset-name timed_trace` sends the other, at the same time, each request at its
recorded time; then the halves swap. So per pair of runs each tool has measured every request
of the window once, under the very server state the other tool saw (on a shared machine,
separate runs differ by more than 3% from one minute to the next). Targets:

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
E2E over all requests of a pair, from each tool's own per-request figures (vLLM's from its
`--save-detailed` result; TPOT = (E2E - TTFT) / (tokens - 1) in both); goal: within 3%.

    .venv/bin/python benchmarks/replayer_fidelity.py [--quick] [--repeats 3]
        [--pairs 3] [--window-s 20] [--speedup 3] [--engine-speedup 1] [--targets echo,engine]

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

if not __package__:  # run as a file: its folder is on sys.path, the repository (benchmarks.*) is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.benchlib import ROOT, EngineWatch, Goal, Recorder, fmt, md_table, say, spread
from workloads.errors import OneLineErrorParser

METRICS = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms", "p99_e2el_ms")
TOLERANCE = 0.03
ECHO_SERVER = ROOT / "tests" / "workloads" / "echo_server.py"
VLLM_CLI = ROOT / "benchmarks" / "vllm_cli.py"
CHUNK = 16  # vLLM's timed_trace default: tokens per hash id


def make_window(args: argparse.Namespace, speedup: float):
    from workloads.trace_io import load_trace
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


# Per request, as each tool measured it: ms, keyed by the request's index in the window.
PerRequest = dict[int, dict[str, float | None]]


def vllm_command(trace_path: Path, n: int, base_url: str, result_path: Path) -> list[str]:
    return [
        sys.executable, str(VLLM_CLI), "bench-serve",
        "--backend", "vllm",
        "--base-url", base_url,
        "--endpoint", "/v1/completions",
        "--model", str(ROOT / "server" / "models" / "tiny-multilingual"),
        "--dataset-name", "timed_trace",
        "--dataset-path", str(trace_path),
        "--timed-trace-sec-multiplier", "0.001",
        "--num-prompts", str(n),
        "--temperature", "0",  # greedy, as the replayer asks (vLLM no longer defaults to it)
        "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed",
        "--result-dir", str(result_path.parent), "--result-filename", result_path.name,
    ]


def forward(stream, sink: list[str]) -> None:
    for line in stream:
        sink.append(line)
        sys.stdout.write(line)
    sys.stdout.flush()


def run_split(window, ours_idx: np.ndarray, vllm_idx: np.ndarray, base_url: str, work: Path,
              name: str) -> tuple[PerRequest, PerRequest, dict]:
    """Both tools at once against one server: the replayer sends the requests `ours_idx`,
    `vllm bench serve` the requests `vllm_idx`, each at its recorded time."""
    import threading

    from workloads.replay import ReplayOptions, replay
    from workloads.slo import request_tpot_ms

    trace_path = work / f"{name}.vllm.timed_trace.jsonl"
    write_timed_trace(window.subset(vllm_idx), trace_path)
    result_path = work / f"{name}.vllm.json"
    command = vllm_command(trace_path, len(vllm_idx), base_url, result_path)
    ours_trace = window.subset(ours_idx)
    lines: list[str] = []
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, errors="replace")
    assert process.stdout is not None
    for line in process.stdout:  # vLLM's start-up: imports, tokenizer, its ready-check request
        lines.append(line)
        sys.stdout.write(line)
        if "Starting main benchmark run" in line:
            break
    else:
        process.wait()
        raise RuntimeError(f"vllm bench serve exited {process.returncode} before its run started")
    # Its clock starts right after that line: start ours now (same schedule, same t=0).
    drain = threading.Thread(target=forward, args=(process.stdout, lines), daemon=True)
    drain.start()
    signalled = time.monotonic()
    result = asyncio.run(replay(ours_trace, base_url, ReplayOptions(mode="timed", benchmark_mode=True)))
    ours_ended = time.monotonic()
    code = process.wait()
    drain.join()
    if code != 0:
        raise RuntimeError(f"vllm bench serve exited {code}")
    ours: PerRequest = {}
    for record in result.records:
        if record.error is not None:
            continue
        ours[int(ours_idx[record.index])] = {
            "ttft": record.ttft_ms, "tpot": request_tpot_ms(record), "e2el": record.e2e_ms}
    data = json.loads(result_path.read_text())
    theirs: PerRequest = {}
    for position, index in enumerate(vllm_idx):
        if data["errors"][position]:
            continue
        ttft = data["ttfts"][position] * 1e3
        latency = data["latencies"][position] * 1e3
        out = data["output_lens"][position]
        theirs[int(index)] = {"ttft": ttft, "e2el": latency,
                              "tpot": (latency - ttft) / (out - 1) if out > 1 else None}
    info = {
        "ours_requests": len(ours_idx), "vllm_requests": len(vllm_idx),
        "ours_failed": result.summary.failed, "vllm_failed": data.get("failed"),
        "ours_send_lag_p99_ms": result.summary.send_lag_p99_ms,
        # From vLLM's "Starting main benchmark run" line to our replay's end, minus our run:
        # how late ours started after vLLM's clock did (the pipe and asyncio start-up).
        "ours_start_delay_ms": (ours_ended - signalled - result.summary.duration) * 1e3,
        "vllm_reported": {m: data.get(m) for m in METRICS},
        "ours_reported": {m: getattr(result.summary, m) for m in METRICS},
    }
    return ours, theirs, info


def metrics(per_request: PerRequest) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in ("ttft", "tpot", "e2el"):
        values = np.array([v[key] for v in per_request.values() if v[key] is not None], dtype=np.float64)
        out[f"mean_{key}_ms"] = float(values.mean()) if values.size else None
        out[f"p99_{key}_ms"] = float(np.percentile(values, 99)) if values.size else None
    return out


def paired_runs(window, base_url: str, work: Path, pairs: int, target: str) -> dict:
    """`pairs` pairs of split runs; in each pair the halves swap, so each tool measures every
    request of the window once per pair, under the same conditions as the other tool."""
    even = np.arange(0, len(window), 2)
    odd = np.arange(1, len(window), 2)
    out = []
    for pair in range(pairs):
        ours: PerRequest = {}
        theirs: PerRequest = {}
        runs = []
        for swap in (False, True):
            ours_idx, vllm_idx = (odd, even) if swap else (even, odd)
            with EngineWatch() as watch:
                o, t, info = run_split(window, ours_idx, vllm_idx, base_url, work,
                                       f"{target}-{pair + 1}-{'b' if swap else 'a'}")
            info["other_engine_share"] = watch.report()["share_with_foreign_engine"]
            ours.update(o)
            theirs.update(t)
            runs.append(info)
        figures = {"ours": metrics(ours), "vllm_bench": metrics(theirs),
                   "ours_measured": len(ours), "vllm_measured": len(theirs), "runs": runs}
        out.append(figures)
        say(f"[{target}] pair {pair + 1}: " + "; ".join(
            f"{m} ours {fmt(figures['ours'][m], 4)} vllm {fmt(figures['vllm_bench'][m], 4)}" for m in METRICS))
    return {"pairs": out}


def compare(pairs: list[dict]) -> dict:
    out = {}
    for metric in METRICS:
        ours = [p["ours"][metric] for p in pairs if p["ours"][metric] is not None]
        theirs = [p["vllm_bench"][metric] for p in pairs if p["vllm_bench"][metric] is not None]
        ratios = [p["ours"][metric] / p["vllm_bench"][metric] for p in pairs
                  if p["ours"][metric] is not None and p["vllm_bench"][metric]]
        if not ratios:
            out[metric] = None
            continue
        ratio = float(np.median(ratios))
        out[metric] = {
            "ours": spread(ours),
            "vllm_bench": spread(theirs),
            "paired_ratios": ratios,
            "ours_over_vllm_bench": ratio,
            "within_tolerance": abs(ratio - 1) <= TOLERANCE,
        }
    return out


def truth(window, ttft_ms: float, itl_ms: float) -> dict:
    out = window.output_lengths.astype(np.float64)
    e2e = ttft_ms + (out - 1) * itl_ms
    return {"mean_ttft_ms": ttft_ms, "p99_ttft_ms": ttft_ms, "mean_tpot_ms": itl_ms, "p99_tpot_ms": itl_ms,
            "mean_e2el_ms": float(e2e.mean()), "p99_e2el_ms": float(np.percentile(e2e, 99))}


def echo_target(window, work: Path, args: argparse.Namespace) -> dict:
    process = subprocess.Popen([sys.executable, str(ECHO_SERVER), "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline() if process.stdout else ""
        if not line.startswith("PORT "):
            raise RuntimeError(f"echo server did not start: {line!r}")
        base = f"http://127.0.0.1:{int(line.split()[1])}/ttft={args.echo_ttft_ms:g},itl={args.echo_itl_ms:g}"
        runs = paired_runs(window, base, work, args.pairs, "echo")
    finally:
        process.terminate()
        process.wait(timeout=10)
    return {**runs, "comparison": compare(runs["pairs"]),
            "truth": truth(window, args.echo_ttft_ms, args.echo_itl_ms)}


def engine_target(window, work: Path, args: argparse.Namespace) -> dict:
    from autotune.measure.launcher import ServerLauncher
    from server.config import ServerConfig, ServingSettings
    from workloads.replay import ReplayOptions, replay
    from workloads.trace import Trace, TraceRequest

    config = ServerConfig.default()
    engine = {**config.engine, "enable_prefix_caching": False}
    config = config.model_copy(update={"engine": engine, "serving": ServingSettings(benchmark_mode=True)})
    config_path = work / "engine.yaml"
    config.write(config_path)
    server = ServerLauncher().start(config_path, work / "engine-server.log")
    try:
        warm = Trace.from_requests([TraceRequest(timestamp=0, input_length=16, output_length=8)] * 8)
        asyncio.run(replay(warm, server.url, ReplayOptions(mode="concurrency=4")))
        runs = paired_runs(window, server.url, work, args.pairs, "engine")
    finally:
        teardown = server.stop()
    return {**runs, "comparison": compare(runs["pairs"]), "engine": engine,
            "server_teardown_s": teardown.seconds}


def main() -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 pair of runs per target, 8 s window")
    parser.add_argument("--pairs", type=int, default=None, help="pairs of split runs per target (default 3)")
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
    args.pairs = args.pairs or (1 if args.quick else 3)
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
        windows[target] = {"requests": len(window), "speedup": speedup,
                           "rate_rps": len(window) / max(window.duration_s(), 1e-9)}
        say(f"{target} window: {len(window)} requests over {window.duration_s():.1f} s "
            f"({windows[target]['rate_rps']:.1f} req/s); files in {work}")
        run = echo_target if target == "echo" else engine_target
        results[target] = run(window, work, args)
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
        "pairs": args.pairs, "echo_ttft_ms": args.echo_ttft_ms, "echo_itl_ms": args.echo_itl_ms,
        "trace": str(Path(args.trace).resolve().relative_to(ROOT)),
        "vllm_bench_command": " ".join(["benchmarks/vllm_cli.py", *vllm_command(
            Path("HALF.timed_trace.jsonl"), 0, "URL", Path("RESULT.json"))[3:]]),
    }
    notes = [
        "Definitions differ slightly between the tools, as documented in each: vllm bench serve "
        "starts TTFT at the first chunk with a choice and ends E2E at the last chunk with a choice; "
        "our replayer starts TTFT at the first chunk carrying a token and ends E2E at `data: [DONE]`.",
        "vllm bench serve sends one test request before each run (its ready check), before its clock "
        "starts; the replayer starts when vLLM prints that its main run starts (its clock starts "
        "right after), so both schedules share t=0 within the measured start delay.",
        "Requests differ only in what each tool sends besides the prompt: both greedy (temperature 0) "
        "with ignore_eos; the replayer also sends min_tokens = max_tokens (the server's benchmark mode).",
        "Both tools, the server and (for engine) the vLLM engine share this machine's 2 CPUs with "
        "other engineers' jobs; running the tools at the same time puts both under the same load.",
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
        pairs = data["pairs"]
        lines += [f"## {target}: {w['requests']} requests, {w['rate_rps']:.1f} req/s (trace replayed "
                  f"{w['speedup']:g}x); {len(pairs)} pairs of split runs", "",
                  "Each tool's figure per pair covers every request of the window once; the table "
                  "gives the median over pairs (min-max) and the median of the per-pair ratios.", ""]
        rows = []
        for metric in METRICS:
            c = data["comparison"][metric]
            if c is None:
                rows.append([metric, "-", "-", "-", "-"])
                continue
            o, v = c["ours"], c["vllm_bench"]
            row = [metric, f"{o['median']:.2f} ({o['min']:.2f}-{o['max']:.2f})",
                   f"{v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})",
                   f"{c['ours_over_vllm_bench']:.3f} ({min(c['paired_ratios']):.3f}-{max(c['paired_ratios']):.3f})",
                   "yes" if c["within_tolerance"] else "**no**"]
            if "truth" in data:
                t = data["truth"][metric]
                row += [f"{t:.2f}", f"{o['median'] / t - 1:+.1%}", f"{v['median'] / t - 1:+.1%}"]
            rows.append(row)
        headers = ["metric", "ours ms", "vllm bench serve ms", "ours / vllm (paired)", "within 3%"]
        if "truth" in data:
            headers += ["truth ms", "ours vs truth", "vllm vs truth"]
        lines += md_table(headers, rows)
        runs = [r for p in pairs for r in p["runs"]]
        lines += ["", "Split runs: measured requests ours " + ", ".join(str(p["ours_measured"]) for p in pairs)
                  + " / vllm " + ", ".join(str(p["vllm_measured"]) for p in pairs) + " per pair (of "
                  f"{w['requests']}); failed ours {sum(r['ours_failed'] for r in runs)}, vllm "
                  f"{sum(r['vllm_failed'] or 0 for r in runs)}; our send-lag p99 "
                  + ", ".join(fmt(r["ours_send_lag_p99_ms"]) for r in runs) + " ms; our start after vLLM's "
                  + ", ".join(fmt(r["ours_start_delay_ms"]) for r in runs) + " ms; another user's engine ran "
                  + ", ".join(format(r["other_engine_share"], ".0%") for r in runs) + " of each run.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
