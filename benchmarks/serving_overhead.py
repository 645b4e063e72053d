"""Serving overhead (item 1): the same engine driven in-process, through our server, through
`vllm serve`; same engine config, same requests, same client code for the two HTTP columns.

    .venv/bin/python benchmarks/serving_overhead.py [--quick] [--requests 192]
        [--concurrency 8] [--output-len 32] [--rounds 3] [--repeats 3] [--columns A,B] [--name N]

Columns:
  in_process   AsyncLLM built in a child process of this script, requests submitted
               directly (`AsyncLLM.generate`, streamed deltas, no HTTP)
  our_server   `python -m server --config C --benchmark-mode`, POST /v1/completions (SSE)
  our_server_equal  the same server with its session at the client's priority (not in the
               default columns: shows why the HTTP servers yield the CPU to the client)
  our_server_all_threads  the same server with as many engine threads as CPUs (OMP_NUM_THREADS),
               as before it left one CPU to its front end (server.engine.leave_a_cpu_to_the_front_end)
  vllm_serve   vLLM's OpenAI server on the same YAML (`benchmarks/vllm_cli.py serve`, which
               runs what `vllm serve` runs; see that file for why not the `vllm` script)
Any column may change engine arguments for its launches only: `our_server+stream_interval=4`,
`in_process+max_num_seqs=8+enable_prefix_caching=false` (values read as YAML; the label with its
changes is the column's name in the results). Such a column is compared with in_process and
with its kind without changes (e.g. our_server), where those columns run too.

The request set: `--requests` token-id prompts of 32..128 tokens (seeded), `--output-len`
tokens each (ignore_eos), closed loop at `--concurrency`. Per request: TTFT (send -> first
chunk with a choice, the rule of `vllm bench serve`) and TPOT ((E2E - TTFT) / (tokens - 1)).

Robustness on a shared, noisy 2-CPU machine: `--rounds` rounds; each round starts each column
once (one engine at a time), in an order that rotates from round to round, warms it up, and
measures the request set `--repeats` times. Figures are medians over all repeats, with the
spread; the ratios are also taken round by round (paired: the columns of one round ran
minutes apart) and their median and range reported. The client runs on the same CPUs as the
server, so client CPU counts against every column alike.
Where the CPU goes: every repeat also records the CPU seconds of each process (the client, the
HTTP server's main process, vLLM's engine core and model worker, the rest), reported per request
and as a share of one CPU, to tell a front end that costs CPU from an engine that gets less of it.
Results: results/benchmarks/serving_overhead.{json,md}.

Over 400 lines in one file on purpose: the columns, their client, the figures and the report are
one measurement, read together; what other benchmarks share is in benchlib.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil

if not __package__:  # run as a file: its folder is on sys.path, the repository (benchmarks.*) is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.measure.process_cpu import CpuReading, cpu_use, read_cpu
from autotune.measure.server_start import free_port, yield_cpu_to_clients
from benchmarks.benchlib import (
    ROOT,
    EngineWatch,
    Goal,
    Recorder,
    engine_changes,
    fmt,
    md_table,
    say,
    spread,
)
from server.config import ServerConfig, ServingSettings
from workloads.errors import OneLineErrorParser

COLUMNS = ("in_process", "our_server", "vllm_serve")
KINDS = ("in_process", "our_server", "our_server_equal", "our_server_all_threads", "vllm_serve")
# (numerator, denominator) column pairs whose ratios are reported when both columns run.
PAIRS = (("our_server", "in_process"), ("our_server", "vllm_serve"), ("vllm_serve", "in_process"),
         ("our_server", "our_server_equal"), ("our_server", "our_server_all_threads"),
         ("our_server_all_threads", "in_process"))
GOAL_IN_PROCESS = 0.97
GOAL_VLLM_SERVE = 1.0
WARMUP_REQUESTS = 16
INPUT_RANGE = (32, 128)


def request_set(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(INPUT_RANGE[0], INPUT_RANGE[1] + 1, size=count)
    return [rng.integers(100, 4000, size=int(n)).tolist() for n in lengths]


@dataclasses.dataclass(frozen=True)
class Column:
    label: str  # as given; the column's key in every result: 'our_server+stream_interval=4'
    kind: str  # one of KINDS
    engine: dict[str, Any]  # engine arguments changed for this column's launches


def parse_columns(text: str) -> list[Column]:
    """'A,B,...': each a kind (KINDS), optionally followed by '+KEY=VALUE' engine changes."""
    columns: list[Column] = []
    for label in (part.strip() for part in text.split(",")):
        if not label:
            continue
        kind, engine = engine_changes("serving_overhead", label)
        if kind not in KINDS:
            raise SystemExit(f"serving_overhead: column {label!r}: {kind!r} is not one of {', '.join(KINDS)}")
        if any(c.label == label for c in columns):
            raise SystemExit(f"serving_overhead: column {label!r}: given twice")
        columns.append(Column(label, kind, engine))
    if not columns:
        raise SystemExit(f"serving_overhead: --columns {text!r} names no column")
    return columns


def ratio_pairs(columns: list[Column]) -> list[tuple[str, str]]:
    """(numerator, denominator) labels: PAIRS among the columns that run, then each column with
    engine changes over in_process and over its kind without changes."""
    labels = [c.label for c in columns]
    pairs = [(top, bottom) for top, bottom in PAIRS if top in labels and bottom in labels]
    for column in columns:
        if not column.engine:
            continue
        for bottom in ("in_process", column.kind):
            if bottom in labels and (column.label, bottom) not in pairs:
                pairs.append((column.label, bottom))
    return pairs


# One request's measurement: (ttft_s, e2e_s, output_tokens).
Sample = tuple[float, float, int]


async def closed_loop(
    prompts: list[list[int]], concurrency: int, send: Callable[[list[int]], Awaitable[Sample]]
) -> tuple[float, list[Sample]]:
    """Runs every prompt with at most `concurrency` in flight; returns (seconds, samples)."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    samples: list[Sample] = []

    async def worker() -> None:
        while not queue.empty():
            sample = await send(queue.get_nowait())
            samples.append(sample)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started, samples


def repeat_figures(seconds: float, samples: list[Sample], expected_tokens: int) -> dict:
    tokens = sum(s[2] for s in samples)
    if tokens != expected_tokens:
        raise RuntimeError(f"expected {expected_tokens} output tokens, got {tokens}")
    ttft = np.array([s[0] for s in samples]) * 1e3
    tpot = np.array([(s[1] - s[0]) / (s[2] - 1) for s in samples if s[2] > 1]) * 1e3
    return {
        "seconds": seconds,
        "requests_per_s": len(samples) / seconds,
        "output_tokens_per_s": tokens / seconds,
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p95_ms": float(np.percentile(ttft, 95)),
        "tpot_p50_ms": float(np.percentile(tpot, 50)),
        "tpot_p95_ms": float(np.percentile(tpot, 95)),
    }


def cpu_roles(before: CpuReading, after: CpuReading, server_pid: int | None) -> dict[str, dict[str, float]]:
    """Role -> CPU seconds and share of one CPU between the readings, for this process and all
    its descendants. Roles: the client (this process; with AsyncLLM's output handling in the
    in-process column), the HTTP server's main process, vLLM's engine core, its model worker
    (a process of its own on the CPU platform), everything else."""
    me = os.getpid()
    used: dict[str, dict[str, float]] = {}
    for process in cpu_use(before, after):
        if process.pid == me:
            role = "client" if server_pid else "client + AsyncLLM"
        elif process.pid == server_pid:
            role = "server"
        elif process.role in ("engine core", "engine worker"):
            role = process.role
        else:
            role = "other"
        entry = used.setdefault(role, {"cpu_s": 0.0, "share": 0.0})
        entry["cpu_s"] += process.cpu_s
        entry["share"] += process.share
    return used


def read_tree_cpu() -> CpuReading:
    me = psutil.Process()
    return read_cpu([me, *me.children(recursive=True)], me.pid, time.monotonic())


async def measure(
    prompts: list[list[int]], args: argparse.Namespace, send: Callable[[list[int]], Awaitable[Sample]],
    server_pid: int | None = None,
) -> list[dict]:
    await closed_loop(prompts[:WARMUP_REQUESTS], args.concurrency, send)
    repeats = []
    for _ in range(args.repeats):
        before = read_tree_cpu()
        seconds, samples = await closed_loop(prompts, args.concurrency, send)
        figures = repeat_figures(seconds, samples, len(prompts) * args.output_len)
        figures["cpu"] = cpu_roles(before, read_tree_cpu(), server_pid)
        repeats.append(figures)
    return repeats


# -- in-process column (runs in a child process: `--child-in-process CONFIG`) ---------------


async def in_process(config: ServerConfig, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from server.engine import effective_settings, resolve_engine_config, usage_context

    started = time.monotonic()
    vllm_config = resolve_engine_config(config)
    llm = AsyncLLM.from_vllm_config(
        vllm_config=vllm_config, usage_context=usage_context(), disable_log_stats=False
    )
    ready_s = time.monotonic() - started
    params = SamplingParams(
        max_tokens=args.output_len,
        ignore_eos=True,
        temperature=0,
        output_kind=RequestOutputKind.DELTA,
    )

    async def send(prompt: list[int]) -> Sample:
        count = 0
        ttft = None
        sent = time.perf_counter()
        # Streamed like the HTTP columns: every engine step's new tokens are consumed.
        async for output in llm.generate({"prompt_token_ids": prompt}, params, uuid.uuid4().hex):
            new = len(output.outputs[0].token_ids)
            if ttft is None and new:
                ttft = time.perf_counter() - sent
            count += new
        assert ttft is not None
        return ttft, time.perf_counter() - sent, count

    try:
        repeats = await measure(prompts, args, send)
        return {
            "ready_s": ready_s,
            "repeats": repeats,
            "engine": effective_settings(vllm_config).model_dump(),
        }
    finally:
        llm.shutdown()


def child_in_process(args: argparse.Namespace) -> None:
    config = ServerConfig.load(args.child_in_process)
    result = asyncio.run(in_process(config, request_set(args.requests, args.seed), args))
    Path(args.child_out).write_text(json.dumps(result))


# -- HTTP columns ------------------------------------------------------------------------------


async def over_http(url: str, prompts: list[list[int]], args: argparse.Namespace, server_pid: int) -> list[dict]:
    import aiohttp  # what `vllm bench serve` uses; lighter on the CPU than httpx

    connector = aiohttp.TCPConnector(limit=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def send(prompt: list[int]) -> Sample:
            payload = {
                "model": args.model,  # vLLM checks it; ours accepts any
                "prompt": prompt,
                "max_tokens": args.output_len,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            count = 0
            ttft = None
            sent = time.perf_counter()
            last = sent
            async with session.post(url + "/v1/completions", json=payload) as response:
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
                async for line in response.content:
                    if not line.startswith(b"data: {"):
                        continue
                    now = time.perf_counter()
                    data = json.loads(line[6:])
                    if data.get("choices"):
                        if ttft is None:
                            ttft = now - sent
                        last = now
                    usage = data.get("usage")
                    if usage:
                        count = usage["completion_tokens"]
            assert ttft is not None
            return ttft, last - sent, count

        return await measure(prompts, args, send, server_pid)


def run_server(command: list[str], url: str, log_path: Path, timeout_s: float = 300, *,
               yield_cpu: bool = True, env: dict[str, str] | None = None):
    """Starts `command` in its own process group and waits for GET /health == 200."""
    import httpx

    log = open(log_path, "ab")  # noqa: SIM115 (closed with the process in stop_server)
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env=env)
    # As autotune's launcher does: the server's own session (its autogroup) below the client's.
    # At equal priority the two sessions' CPU shares made whole repeats stall (TTFT ~450 ms, every
    # token in one read) for our server and vllm serve alike; in one session they did not.
    if yield_cpu:
        yield_cpu_to_clients(process.pid)
    deadline = started + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[:4]} exited {process.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, log, time.monotonic() - started
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(process, log)
    raise RuntimeError(f"{command[:4]} not healthy after {timeout_s} s; see {log_path}")


def stop_server(process: subprocess.Popen, log) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    log.close()


def http_column(command: list[str], port: int, log_path: Path, prompts, args, *,
                yield_cpu: bool = True, env: dict[str, str] | None = None) -> dict:
    url = f"http://127.0.0.1:{port}"
    process, log, ready_s = run_server(command, url, log_path, yield_cpu=yield_cpu, env=env)
    try:
        return {"ready_s": ready_s, "repeats": asyncio.run(over_http(url, prompts, args, process.pid))}
    finally:
        stop_server(process, log)


def run_column(column: Column, work: Path, config: ServerConfig, prompts, args) -> dict:
    port = free_port()
    stem = re.sub(r"[^A-Za-z0-9_.+=-]", "-", column.label)
    served = config.model_copy(update={"engine": {**config.engine, **column.engine}, "port": port})
    config_path = work / f"{stem}.yaml"
    served.write(config_path)
    log_path = work / f"{stem}.log"
    if column.kind == "in_process":
        out = work / f"{stem}.json"
        with open(log_path, "ab") as log:
            subprocess.run(
                [sys.executable, __file__, "--child-in-process", str(config_path),
                 "--child-out", str(out), "--requests", str(args.requests),
                 "--concurrency", str(args.concurrency), "--output-len", str(args.output_len),
                 "--repeats", str(args.repeats), "--seed", str(args.seed)],
                stdout=log, stderr=subprocess.STDOUT, check=True, cwd=ROOT,
            )
        return json.loads(out.read_text())
    if column.kind in ("our_server", "our_server_equal", "our_server_all_threads"):
        command = [sys.executable, "-m", "server", "--config", str(config_path), "--benchmark-mode"]
        env = None
        if column.kind == "our_server_all_threads":
            env = {**os.environ, "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))}
        return http_column(command, port, log_path, prompts, args,
                           yield_cpu=column.kind != "our_server_equal", env=env)
    command = [sys.executable, str(ROOT / "benchmarks" / "vllm_cli.py"), "serve", "--config", str(config_path)]
    return http_column(command, port, log_path, prompts, args)


# -- figures -----------------------------------------------------------------------------------

METRICS = ("requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms",
           "tpot_p95_ms")


def summarise(sessions: dict[str, list[dict]]) -> dict:
    """Per column: every metric's median and spread over all repeats of all rounds."""
    out = {}
    for name, rounds in sessions.items():
        repeats = [rep for session in rounds for rep in session["repeats"]]
        out[name] = {metric: spread([rep[metric] for rep in repeats]) for metric in METRICS}
        out[name]["ready_s"] = spread([session["ready_s"] for session in rounds])
        out[name]["share_with_other_engine"] = spread(
            [session["other_engines"]["share_with_foreign_engine"] for session in rounds])
    return out


def paired_ratios(sessions: dict[str, list[dict]], top: str, bottom: str, metric: str) -> dict:
    """top/bottom per round (medians of that round's repeats): median and range."""
    ratios = []
    for a, b in zip(sessions[top], sessions[bottom], strict=True):
        ratios.append(
            float(np.median([r[metric] for r in a["repeats"]]))
            / float(np.median([r[metric] for r in b["repeats"]]))
        )
    return spread(ratios) | {"per_round": ratios}


def ratios_for(sessions: dict[str, list[dict]], summary: dict, columns: list[Column]) -> dict:
    """'TOP/BOTTOM' -> per metric: ratio of medians and paired per round (ratio_pairs)."""
    return {
        f"{top}/{bottom}": {
            metric: {
                "ratio_of_medians": summary[top][metric]["median"] / summary[bottom][metric]["median"],
                "paired": paired_ratios(sessions, top, bottom, metric),
            }
            for metric in METRICS
        }
        for top, bottom in ratio_pairs(columns)
    }


def main() -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 2 repeats, 128 requests")
    parser.add_argument("--requests", type=int, default=None, help="default 192 (quick 128)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (quick 1)")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (quick 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--columns", default=",".join(COLUMNS))
    parser.add_argument("--name", default="serving_overhead", help="results file name under results/benchmarks")
    parser.add_argument("--render", type=Path, default=None,
                        help="only rewrite the markdown of an existing result JSON (figures unchanged)")
    parser.add_argument("--child-in-process", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_in_process:
        child_in_process(args)
        return 0
    if args.render:
        return render(args.render)
    # Every column runs vLLM's engine one way: on the CPU platform, the model worker inside the
    # engine core's process, as our server does; vllm serve and the in-process child inherit it.
    from server.engine import keep_cpu_worker_in_engine_core

    keep_cpu_worker_in_engine_core()
    args.requests = args.requests or (128 if args.quick else 192)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.repeats = args.repeats or (2 if args.quick else 3)
    columns = parse_columns(args.columns)
    recorder = Recorder(args.name, "Serving overhead: in-process vs our server vs vllm serve (item 1)",
                        "quick" if args.quick else "full")

    config = ServerConfig.default().model_copy(update={"serving": ServingSettings(benchmark_mode=True)})
    args.model = str(config.engine["model"])
    prompts = request_set(args.requests, args.seed)
    work = Path(tempfile.mkdtemp(prefix="serving_overhead."))
    sessions: dict[str, list[dict]] = {column.label: [] for column in columns}
    order_log = []
    for round_index in range(args.rounds):
        shift = round_index % len(columns)
        order = columns[shift:] + columns[:shift]
        for column in order:
            name = column.label
            say(f"round {round_index + 1}/{args.rounds}: {name} (load {os.getloadavg()[0]:.2f})")
            load = os.getloadavg()[0]
            with EngineWatch() as watch:
                session = run_column(column, work, config, prompts, args)
            session["round"] = round_index
            session["column"] = name
            session["engine_changes"] = column.engine
            session["order"] = len(order_log)
            session["load_1min_before"] = load
            session["other_engines"] = watch.report()
            sessions[name].append(session)
            order_log.append(name)
            rps = [r["requests_per_s"] for r in session["repeats"]]
            say(f"  {name}: ready {session['ready_s']:.1f} s, req/s " + ", ".join(f"{v:.2f}" for v in rps)
                + f"; another user's engine ran {session['other_engines']['share_with_foreign_engine']:.0%} "
                "of the time")

    summary = summarise(sessions)
    ratios = ratios_for(sessions, summary, columns)
    goals = []
    for bottom, target in (("in_process", GOAL_IN_PROCESS), ("vllm_serve", GOAL_VLLM_SERVE)):
        key = f"our_server/{bottom}"
        if key in ratios:
            measured = ratios[key]["requests_per_s"]["ratio_of_medians"]
            paired = ratios[key]["requests_per_s"]["paired"]
            goals.append(Goal(
                name=f"throughput, our server / {bottom}",
                target=f">= {target:g}",
                measured=measured,
                met=measured >= target,
                note=f"paired per round: median {paired['median']:.3f}, range "
                     f"{paired['min']:.3f}-{paired['max']:.3f}",
            ))
    settings = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "input_tokens": list(INPUT_RANGE),
        "output_tokens": args.output_len,
        "rounds": args.rounds,
        "repeats_per_round": args.repeats,
        "warmup_requests": WARMUP_REQUESTS,
        "column_order": order_log,
        "engine_config": config.engine,
        "engine_changes": {column.label: column.engine for column in columns if column.engine},
        "engine_effective": sessions["in_process"][0]["engine"] if "in_process" in sessions else None,
    }
    notes = notes_for(sessions)
    result = recorder.result(
        settings=settings,
        goals=goals,
        results={"columns": summary, "ratios": ratios, "sessions": sessions},
        notes=notes,
    )
    recorder.write(result, tables(summary, ratios, sessions))
    for goal in goals:
        say(f"{goal.name}: {goal.measured:.3f} (target {goal.target}) {goal.note}")
    return 0


def notes_for(sessions: dict[str, list[dict]]) -> list[str]:
    contaminated = sorted({s["round"] + 1 for rounds in sessions.values() for s in rounds
                           if s["other_engines"]["share_with_foreign_engine"] > 0})
    changed = {s["column"]: s["engine_changes"] for rounds in sessions.values() for s in rounds
               if s.get("engine_changes")}
    return [
        "Figures are medians over every measured repeat (rounds x repeats); 'spread' is min-max "
        "over those repeats. Paired ratios divide the two columns' medians within each round.",
        "One engine at a time: the columns of a round run one after another, each with its own "
        "engine start, and the column order rotates between rounds so that a slow period on the "
        "shared machine does not always hit the same column.",
        "Engine ready: for the HTTP columns from the server process's spawn to /health 200 "
        "(Python, torch and vLLM imports included); for in_process from the AsyncLLM constructor "
        "call in an already started interpreter, so the columns' ready times are not comparable.",
        "The HTTP client (aiohttp, this process) and the server share the machine's 2 CPUs; "
        "so does the in-process column's own frontend. Other engineers' jobs ran on the same "
        "machine (see the load averages).",
        "Each HTTP server runs in its own session with that session's autogroup at nice 10, below "
        "the client, as autotune's launcher starts trial servers (autotune.measure.server_start."
        "yield_cpu_to_clients); the in-process column runs in this script's session. Before "
        "2026-11-25 evening the servers' sessions ran at nice 0: whole repeats of both HTTP "
        "columns then stalled (TTFT p50 ~440-480 ms, every token of an answer in one read, "
        "18-30 req/s), which no trial ever saw.",
        "Another user's vLLM engine ran during part of round(s) "
        f"{', '.join(map(str, contaminated)) or 'none'} (sampled once a second; per session in "
        "'sessions[].other_engines'): those sessions competed for the CPUs.",
        "Every column ran vLLM's model worker the same way: inside the engine core's process "
        f"(VLLM_ENABLE_V1_MULTIPROCESSING={os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING', 'unset')}"
        " here; our server sets 0 on the CPU platform, server.engine.keep_cpu_worker_in_engine_core, "
        "and the in-process child and vllm serve inherit it from this script). Before 2026-11-26 the "
        "worker ran in a process of its own that busy-polled the engine core.",
        "vllm_serve: `benchmarks/vllm_cli.py serve --config FILE` = vLLM's api_server module, what "
        "`vllm serve` runs with one API server; the `vllm` console script itself cannot start on "
        "this CPU (see benchmarks/vllm_cli.py).",
    ] + ([
        "Engine arguments changed for one column's launches only (over settings.engine_config): "
        + "; ".join(f"{label}: {json.dumps(engine, sort_keys=True)}" for label, engine in changed.items())
        + ". Each such column is compared with in_process and with its kind without changes."
    ] if changed else [])


def render(path: Path) -> int:
    """Rewrite NAME.md (and the notes in NAME.json) from a run's JSON with the current text;
    every measured figure, the command and the date stay as they were."""
    from benchmarks.benchlib import BenchmarkResult, render_markdown, write_text_atomic

    path = path.resolve()
    result = BenchmarkResult.model_validate_json(path.read_text())
    data = result.results
    result.notes = notes_for(data["sessions"])
    write_text_atomic(path, result.model_dump_json(indent=2) + "\n")
    folder = str(path.parent.relative_to(ROOT))
    write_text_atomic(path.with_suffix(".md"), render_markdown(
        result, tables(data["columns"], data["ratios"], data["sessions"]), folder))
    return 0


CPU_ROLES = ("client + AsyncLLM", "client", "server", "engine core", "engine worker", "other")


def cpu_table(sessions: dict[str, list[dict]]) -> list[str]:
    """Per column, per role: CPU milliseconds per request and share of one CPU (medians over the
    repeats that recorded them; runs before 2026-11-25 night did not)."""
    rows = []
    for name, rounds in sessions.items():
        repeats = [rep for session in rounds for rep in session["repeats"] if "cpu" in rep]
        if not repeats:
            continue
        requests = [rep["requests_per_s"] * rep["seconds"] for rep in repeats]
        row = [name]
        for role in CPU_ROLES:
            per_request = [rep["cpu"][role]["cpu_s"] * 1e3 / n for rep, n in zip(repeats, requests, strict=True)
                           if role in rep["cpu"]]
            shares = [rep["cpu"][role]["share"] for rep in repeats if role in rep["cpu"]]
            row.append(f"{fmt(float(np.median(per_request)))} ({fmt(float(np.median(shares)))})"
                       if per_request else "-")
        totals = [sum(v["cpu_s"] for v in rep["cpu"].values()) * 1e3 / n for rep, n in zip(repeats, requests, strict=True)]
        row.append(fmt(float(np.median(totals))))
        rows.append(row)
    if not rows:
        return []
    return ["", "## CPU per request by process: ms per request (share of one CPU), median over repeats", ""] + md_table(
        ["column", *CPU_ROLES, "all, ms per request"], rows)


def tables(summary: dict, ratios: dict, sessions: dict[str, list[dict]]) -> str:
    def cell(s: dict, digits: int = 3) -> str:
        return f"{fmt(s['median'], digits)} ({fmt(s['min'], digits)}-{fmt(s['max'], digits)})"

    lines = ["## Per column (median over repeats, min-max in brackets)", ""]
    lines += md_table(
        ["column", "req/s", "output tok/s", "TTFT p50 ms", "TTFT p95 ms", "TPOT p50 ms",
         "TPOT p95 ms", "engine ready s", "repeats", "time another engine ran (median)"],
        [
            [name, cell(s["requests_per_s"]), cell(s["output_tokens_per_s"], 4), cell(s["ttft_p50_ms"]),
             cell(s["ttft_p95_ms"]), cell(s["tpot_p50_ms"]), cell(s["tpot_p95_ms"]),
             fmt(s["ready_s"]["median"]), s["requests_per_s"]["n"],
             f"{s['share_with_other_engine']['median']:.0%}"]
            for name, s in summary.items()
        ],
    )
    lines += cpu_table(sessions)
    lines += ["", "## Ratios (ratio of medians; paired per round: median, range)", ""]
    rows = []
    for key, by_metric in ratios.items():
        for metric in METRICS:
            r = by_metric[metric]
            p = r["paired"]
            rows.append([key, metric, f"{r['ratio_of_medians']:.3f}",
                         f"{p['median']:.3f} ({p['min']:.3f}-{p['max']:.3f})"])
    lines += md_table(["ratio", "metric", "ratio of medians", "paired per round"], rows)
    lines += ["", "Throughput ratios above 1 are better for the numerator; latency ratios below 1 are.", ""]
    lines += ["## Sessions in the order they ran", ""]
    ordered = sorted((s for rounds in sessions.values() for s in rounds), key=lambda s: s["order"])
    lines += md_table(
        ["#", "round", "column", "load before", "engine ready s", "req/s per repeat",
         "time another engine ran"],
        [[s["order"] + 1, s["round"] + 1, s["column"], f"{s['load_1min_before']:.2f}", f"{s['ready_s']:.1f}",
          ", ".join(f"{r['requests_per_s']:.2f}" for r in s["repeats"]),
          f"{s['other_engines']['share_with_foreign_engine']:.0%}"] for s in ordered],
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
