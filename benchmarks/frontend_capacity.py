"""Front-end capacity (issue 17, item 4): how much of the engine's capacity each way of
serving it keeps, measured with the capacity ladder on the same config, traffic and SLOs.

    python3 benchmarks/frontend_capacity.py --trace traffic.jsonl [--model DIR]
        [--max-model-len N] [--columns in_process,ours:1,ours:4,vllm:1,vllm:4]
        [--window-s 30] [--slo ttft_p95_ms=500 --slo tpot_p95_ms=50] [--rounds 1]
        [--step-requests N] [--name frontend_capacity]

Columns (each one engine launch per round, one at a time, the order rotating per round):
  in_process  AsyncLLM in a child process driven by the ladder in that same process
              (`benchmarks/inprocess_ladder.py`): the engine's capacity with no front end
  ours:N      `python -m server` with N front-end processes (`--api-server-count N`)
  vllm:N      stock `vllm serve --api-server-count N` (`--server vllm`)
Any column may change engine arguments for its launches: `ours:1+max_num_batched_tokens=512+
max_cudagraph_capture_size=1024` (values read as YAML). Such columns are compared with the
first column (capacity ratio of medians, and paired per round): a config's effect measured side
by side, with the same traffic and SLOs, on one machine.
The HTTP columns are measured exactly as `autotune run` measures a trial (`TrialRunner` with
the ladder; the replayer splits the load among its own processes at high rates).

Capacity = the highest passing speed-up x the window's recorded rate. The ladder of every
column after the first starts at the first column's capacity (finer steps near the cliff:
fewer steps, same bisection). Reported per column: capacity, ratio to in_process, ours:N
over vllm:N at equal N, the replayer's send-lag p99 over the steps (issue 17 asks <= 5 ms),
engine start and ladder seconds.

The window: the first `--window-s` seconds of the trace's most representative window
(`select_windows`, as `autotune run --tuning-window` picks it).

`--ladders K` (K > 1, HTTP columns): each launch runs the ladder K times back to back on the
same server, each with fresh prompt tokens, hinted at `--start-speedup` (finer steps from there,
as the search grids' points ran from the baseline's capacity), so that the spread of a
config's capacity within one launch can be set against the spread between launches (issue 18:
is a launch's capacity noisy because of the launch, or because of the ladder's measurement?).
Every ladder is a row; `ladder-K.json` in the launch's folder keeps its steps.

`--settle off|alternate` (default on): whether the ladder waits between steps for a lone
request to be answered at idle speed (`LadderSettings.settle_probe`, autotune.measure.settle),
or only for the running/waiting gauges; `alternate` with `--ladders K` runs the launch's
ladders off, on, off, on...: the wait's effect on the capacity, side by side on one server.
Results: results/benchmarks/{name}.{json,md}; every launch's folder (server log, ladder
steps, per-request records) under results/benchmarks/{name}-runs/.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: its folder is on sys.path, the repository (benchmarks.*) is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.measure.cpu_split import CpuSplit
from autotune.measure.ladder import CapacityResult, LadderSettings, recorded_rate
from autotune.measure.servers import TrialServer
from autotune.measure.trial import TrialRunner
from autotune.prepare import load_baseline
from autotune.request import TuningRequest
from benchmarks.benchlib import ROOT, Goal, Recorder, engine_changes, fmt, md_table, say, spread
from server.config import ServerConfig
from workloads.errors import OneLineErrorParser
from workloads.files import write_text_atomic
from workloads.prompts import PromptFactory
from workloads.replay import ReplayOptions
from workloads.slo import parse_slos
from workloads.trace_io import load_trace, write_trace
from workloads.windows import select_windows

GOAL_IN_PROCESS = 0.95  # ours / in-process
GOAL_VLLM = 1.0  # ours / vllm serve at equal front-end processes
GOAL_LAG_MS = 5.0  # the replayer's own send-lag p99


@dataclasses.dataclass(frozen=True)
class Column:
    label: str  # as given
    kind: str  # in_process | ours | vllm
    count: int | None  # front-end processes
    engine: dict[str, Any]  # engine arguments changed for this column's launches


def parse_column(text: str) -> Column:
    """'in_process' | 'ours:N' | 'vllm:N', each optionally followed by '+KEY=VALUE' parts."""
    head, engine = engine_changes("frontend_capacity", text)
    if head == "in_process":
        return Column(text, "in_process", None, engine)
    kind, _, count = head.partition(":")
    if kind in ("ours", "vllm") and count.isdigit() and int(count) >= 1:
        return Column(text, kind, int(count), engine)
    raise SystemExit(f"frontend_capacity: column {text!r}: expected in_process, ours:N or vllm:N (N >= 1), "
                     "optionally +KEY=VALUE")


def safe_name(label: str) -> str:
    """A column label as a folder name: 'ours:1+max_num_seqs=512' -> 'ours-1+max_num_seqs-512'."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "-", label)


def engine_config(trace: str, model: str | None, max_model_len: int | None) -> ServerConfig:
    """The config every column serves: the baseline `autotune run --model M` would measure
    (vLLM's defaults for M with dummy weights; the embedded model without --model)."""
    request = TuningRequest(workload=trace, study_name="frontend-capacity", output_dir=Path("."),
                            command_line=[], model=model, load_format="dummy" if model else None,
                            max_model_len=max_model_len)
    return load_baseline(request)[0]


def in_process(config: ServerConfig, window_path: Path, settings: LadderSettings, slo_texts: list[str],
               run_dir: Path) -> tuple[CapacityResult, float, float]:
    """The in_process column: the ladder in a child process that owns the engine."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config.write(run_dir / "config.yaml")
    (run_dir / "ladder-settings.json").write_text(settings.model_dump_json())
    out = run_dir / "result.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "inprocess_ladder.py"),
               "--config", str(run_dir / "config.yaml"), "--window", str(window_path),
               "--ladder", str(run_dir / "ladder-settings.json"), "--out", str(out)]
    for text in slo_texts:
        command += ["--slo", text]
    with open(run_dir / "ladder.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"frontend_capacity: the in-process ladder failed (exit {done.returncode}); "
                         f"see {run_dir / 'ladder.log'}")
    data = json.loads(out.read_text())
    return CapacityResult.model_validate(data["capacity"]), data["ready_s"], data["ladder_s"]


class RepeatedLadders(TrialRunner):
    """A TrialRunner whose launch runs the ladder `ladders` times back to back; each ladder's
    result is kept in `capacities` and written to the trial folder as `ladder-K.json`."""

    def __init__(self, ladders: int, settle: str = "on", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ladders = ladders
        self.settle = settle
        self.capacities: list[CapacityResult] = []
        self.settled: list[bool] = []  # per ladder: did it wait for an idle probe

    async def _measure_ladder(self, trial: Any, window: Any, start_speedup: float | None) -> None:
        base, base_ladder = self.replay, self.ladder
        assert base_ladder is not None
        try:
            for index in range(self.ladders):
                # Prompt seeds far from the previous ladder's: nothing it left cached can hit.
                self.replay = dataclasses.replace(base, prompts=PromptFactory(seed=1000 * index))
                settle = self.settle == "on" or (self.settle == "alternate" and index % 2 == 1)
                self.ladder = base_ladder.model_copy(update={"settle_probe": settle})
                await super()._measure_ladder(trial, window, start_speedup)
                self.capacities.append(trial.capacity)
                self.settled.append(settle)
                write_text_atomic(trial.dir / f"ladder-{index + 1}.json", trial.capacity.model_dump_json(indent=1))
                say(f"    ladder {index + 1} of {self.ladders} (idle probe {'on' if settle else 'off'}): "
                    f"{trial.capacity.describe()}")
        finally:
            self.replay, self.ladder = base, base_ladder


def relative_range(values: list[float]) -> float | None:
    """(max - min) / median, None for no values."""
    return (max(values) - min(values)) / spread(values)["median"] if values else None


def within_and_between(rows: list[dict[str, Any]]) -> list[str]:
    """Per column with several ladders per launch: the spread within each launch and that of
    the launches' medians ((max - min) / median)."""
    lines: list[str] = []
    columns = sorted({r["column"] for r in rows if r.get("ladder")})
    for column in columns:
        launches: dict[int, list[float]] = {}
        for row in rows:
            if row["column"] == column and row.get("ladder") and row["capacity_rps"] is not None:
                launches.setdefault(row["round"], []).append(row["capacity_rps"])
        within = {k: spread(v) for k, v in launches.items()}
        medians = [w["median"] for w in within.values()]
        lines.append(f"- {column}: within each launch (range / median) "
                     + ", ".join(f"launch {k}: {fmt(relative_range(v))} ({', '.join(fmt(x) for x in v)})" for k, v in launches.items())
                     + f"; between the launches' medians ({', '.join(fmt(m) for m in medians)}): {fmt(relative_range(medians))}; "
                     f"all {sum(len(v) for v in launches.values())} ladders: {fmt(relative_range([x for v in launches.values() for x in v]))}")
    return ["", "## Within and between launches", ""] + lines if lines else []


def settle_fields(capacity: CapacityResult | None) -> dict[str, Any]:
    """How the waits between a ladder's steps went: after how many steps the server was not
    idle yet once its gauges were (a first probe slower than idle allows), the slowest probe,
    and the seconds waited in all."""
    if capacity is None:
        return {"busy_after_steps": None, "slowest_probe_ms": None, "settle_s": None}
    steps = [*capacity.steps, *capacity.unscored]
    idle, limit = capacity.idle_probe_ms, capacity.idle_limit_ms
    probes = [p for s in steps for p in s.settle_probes_ms if p is not None]
    return {
        "idle_probe_ms": idle,
        "busy_after_steps": None if limit is None else sum(
            1 for s in steps if s.settle_probes_ms and (s.settle_probes_ms[0] is None or s.settle_probes_ms[0] > limit)),
        "slowest_probe_ms": max(probes, default=None),
        "settle_s": round(sum(s.drain_s for s in steps), 1),
    }


def settle_comparison(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """Per column with ladders of both kinds: median capacity waiting on the gauges alone
    against waiting for an idle probe too, and the ratio, launch by launch."""
    compared: dict[str, Any] = {}
    for column in sorted({r["column"] for r in rows}):
        mine = [r for r in rows if r["column"] == column and r["capacity_rps"] is not None]
        off = [r["capacity_rps"] for r in mine if r.get("settle") is False]
        on = [r["capacity_rps"] for r in mine if r.get("settle") is True]
        if off and on:
            compared[column] = {"gauges_only": off, "idle_probe": on,
                                "ratio_of_medians": spread(on)["median"] / spread(off)["median"]}
    if not compared:
        return compared, []
    return compared, ["", "## Waiting for an idle probe between steps against the gauges alone", ""] + md_table(
        ["column", "capacity, gauges alone", "capacity, idle probe too", "ratio of medians"],
        [[column, ", ".join(fmt(x) for x in c["gauges_only"]), ", ".join(fmt(x) for x in c["idle_probe"]),
          fmt(c["ratio_of_medians"])] for column, c in compared.items()])


def lag_p99(capacity: CapacityResult) -> float | None:
    """The worst step's send-lag p99 (the in-process column's client lag counts too)."""
    lags = [s.summary.send_lag_p99_ms for s in capacity.steps if s.summary.send_lag_p99_ms is not None]
    return max(lags) if lags else None


def cpu_by_role(step: Any) -> dict[str, Any]:
    """One ladder step's server CPU use, by role: engine core, front ends (summed), the rest."""
    processes = step.server.processes if step.server else []
    engine = [p for p in processes if p.role == "engine core"]
    fronts = [p for p in processes if p.role.startswith("front end")]
    # One front end: the main process serves HTTP itself (ours:1, vllm:1).
    if not fronts:
        fronts = [p for p in processes if p.role == "main"]
    rest = [p for p in processes if p not in engine and p not in fronts]
    seconds = step.seconds or 1.0
    sent = step.summary.completed + step.summary.failed + step.summary.cancelled
    return {
        "engine_share": sum(p.share for p in engine) if engine else None,
        "engine_preempted_per_s": (sum(p.involuntary_switches for p in engine) / seconds) if engine else None,
        "front_ends": len(fronts),
        "front_share": sum(p.share for p in fronts) if fronts else None,
        "front_max_share": max((p.share for p in fronts), default=None),
        # Per request sent (an abandoned step sent fewer than it planned).
        "front_cpu_ms_per_request": (1000 * sum(p.cpu_s for p in fronts) / sent) if fronts and sent else None,
        "rest_share": sum(p.share for p in rest) if rest else None,
    }


def cpu_table(rows: list[dict[str, Any]], steps: dict[str, list[Any]]) -> list[str]:
    """Per HTTP column and ladder step: the engine's own ITL and queue beside each process
    role's CPU use (why a front end costs the engine capacity: issue 17)."""
    lines = []
    # One launch's steps once, however many ladder rows it has (its last ladder's steps).
    for label in dict.fromkeys(f"r{row['round']} {row['column']}" for row in rows):
        for step in steps.get(label, []):
            cpu = cpu_by_role(step)
            server = step.server
            lines.append([label, fmt(step.offered_rps), "pass" if step.passed else "fail",
                          fmt(server.itl_p95_ms if server else None),
                          fmt(server.num_running_max if server else None),
                          fmt(cpu["engine_share"]), fmt(cpu["engine_preempted_per_s"]),
                          cpu["front_ends"], fmt(cpu["front_share"]), fmt(cpu["front_max_share"]),
                          fmt(cpu["front_cpu_ms_per_request"]), fmt(cpu["rest_share"])])
    if not lines:
        return []
    return ["", "## Server CPU per ladder step (shares of one CPU over the step)", ""] + md_table(
        ["launch", "offered req/s", "verdict", "engine ITL p95 ms", "running max", "engine core CPU",
         "engine core preempted /s", "front ends", "front ends CPU", "busiest front end", "front-end CPU ms / request",
         "other server processes CPU"], lines)


def per_round(rows: list[dict[str, Any]], top: str, bottom: str) -> dict[int, float]:
    """Round -> capacity of `top` over capacity of `bottom` in that round (both launched minutes
    apart on one machine); rounds where either has no capacity are left out."""
    ratios: dict[int, float] = {}
    for round_index in sorted({r["round"] for r in rows}):
        a = next((r["capacity_rps"] for r in rows if r["round"] == round_index and r["column"] == top), None)
        b = next((r["capacity_rps"] for r in rows if r["round"] == round_index and r["column"] == bottom), None)
        if a and b:
            ratios[round_index] = a / b
    return ratios


def issue_goals(rows: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, float | None], list[Goal]]:
    """Each column's median capacity, its ratio to in_process, and issue 17's goals: every
    ours:N[+changes] against in_process and against vllm:N with the same engine changes (ratio
    of medians, per round beside it), and the replayer's worst send-lag over the HTTP columns."""
    by_column: dict[str, list[float]] = {}
    for row in rows:
        if row["capacity_rps"] is not None:
            by_column.setdefault(row["column"], []).append(row["capacity_rps"])
    medians = {label: spread(values)["median"] for label, values in by_column.items()}
    base = medians.get("in_process")
    ratios = {label: (value / base if base and value is not None else None) for label, value in medians.items()}
    goals: list[Goal] = []
    for label, value in medians.items():
        if not label.startswith("ours:"):
            continue
        count, plus, changes = label.removeprefix("ours:").partition("+")
        for reference, target in ((f"in_process{plus}{changes}", GOAL_IN_PROCESS), (f"vllm:{count}{plus}{changes}", GOAL_VLLM)):
            if reference not in medians and plus:
                continue  # no twin with the same engine changes in this run
            twin = medians.get(reference)
            measured = value / twin if twin else None
            paired = list(per_round(rows, label, reference).values())
            goals.append(Goal(name=f"{label} capacity / {reference}", target=f">= {target}", measured=measured,
                              met=None if measured is None else measured >= target,
                              note=f"ratio of medians; per round {', '.join(fmt(x) for x in paired)}" if paired else ""))
    lags = [r["lag_p99_ms"] for r in rows if r["lag_p99_ms"] is not None and not r["column"].startswith("in_process")]
    worst = max(lags) if lags else None
    goals.append(Goal(name="replayer send-lag p99, worst step of any HTTP column", target=f"<= {GOAL_LAG_MS} ms",
                      measured=worst, met=None if worst is None else worst <= GOAL_LAG_MS))
    return medians, ratios, goals


def versus_first(rows: list[dict[str, Any]], columns: list[Column]) -> tuple[dict[str, Any], list[str]]:
    """Each column that changes engine arguments against the first column: ratio of median
    capacities, and the ratio within each round (same machine minutes, side by side)."""
    first = columns[0].label
    compared: dict[str, Any] = {}
    for column in columns[1:]:
        if not column.engine:
            continue
        mine = [r["capacity_rps"] for r in rows if r["column"] == column.label and r["capacity_rps"]]
        theirs = [r["capacity_rps"] for r in rows if r["column"] == first and r["capacity_rps"]]
        paired = list(per_round(rows, column.label, first).values())
        median_ratio = (spread(mine)["median"] / spread(theirs)["median"]) if mine and theirs else None
        compared[column.label] = {"ratio_of_medians": median_ratio, "paired": paired}
    if not compared:
        return compared, []
    lines = ["", f"## Engine changes against `{first}` (capacity ratio)", ""] + md_table(
        ["column", "ratio of medians", "per round"],
        [[label, fmt(c["ratio_of_medians"]), ", ".join(fmt(x) for x in c["paired"]) or "-"]
         for label, c in compared.items()])
    return compared, lines


def main() -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--model", help="model folder (default: the embedded tiny model)")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--columns", default="in_process,ours:1,vllm:1")
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--slo", action="append", default=None)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--step-requests", type=int)
    parser.add_argument("--min-step-s", type=float)
    parser.add_argument("--start-speedup", type=float, default=1.0)
    parser.add_argument("--name", default="frontend_capacity")
    parser.add_argument("--ladders", type=int, default=1,
                        help="ladders per launch of an HTTP column, back to back (see the docstring)")
    parser.add_argument("--settle", choices=("on", "off", "alternate"), default="on",
                        help="wait for an idle probe between ladder steps (alternate: per ladder of a launch)")
    parser.add_argument("--client-cpus", default="auto",
                        help="as autotune run's --client-cpus: the replayer's CPUs, the server the rest")
    args = parser.parse_args()
    columns = [parse_column(c.strip()) for c in args.columns.split(",") if c.strip()]
    slo_texts = args.slo or ["ttft_p95_ms=500", "tpot_p95_ms=50"]
    slos = parse_slos(slo_texts)
    accelerator = "cpu" if args.model is None else "gpu"
    overrides: dict[str, Any] = {"start_speedup": args.start_speedup}
    if args.step_requests:
        overrides["step_requests"] = args.step_requests
    if args.min_step_s:
        overrides["min_step_s"] = args.min_step_s
    settings = LadderSettings.for_accelerator(accelerator, **overrides)
    if args.settle == "off":
        settings = settings.model_copy(update={"settle_probe": False})
    config = engine_config(args.trace, args.model, args.max_model_len)
    cpu_split = CpuSplit.resolve(args.client_cpus, accelerator=accelerator)

    recorder = Recorder(args.name, "Front-end capacity: in-process AsyncLLM, our server and vllm "
                        "serve with 1 and N front-end processes (issue 17)", "full")
    runs_dir = recorder.out_dir / f"{args.name}-runs"
    trace = load_trace(args.trace)
    window, _holdout, _info = select_windows(trace, args.window_s, args.window_s)
    runs_dir.mkdir(parents=True, exist_ok=True)
    window_path = runs_dir / "window.jsonl"
    write_trace(window_path, window)

    rows: list[dict[str, Any]] = []
    steps_by_launch: dict[str, list[Any]] = {}
    hint: float | None = None
    with tempfile.TemporaryDirectory(prefix="frontend-capacity-") as scratch:
        for round_index in range(args.rounds):
            shift = round_index % len(columns)
            for column in columns[shift:] + columns[:shift]:
                kind, count, label = column.kind, column.count, column.label
                served = config.model_copy(update={"engine": {**config.engine, **column.engine}})
                run_dir = runs_dir / f"r{round_index + 1}-{safe_name(label)}"
                # K ladders: each as a grid point after the baseline ran, hinted at --start-speedup.
                ladder = settings.hinted(hint if args.ladders == 1 else args.start_speedup)
                say(f"round {round_index + 1}: {label} (ladder from x{ladder.start_speedup:.3g})")
                started = time.monotonic()
                if kind == "in_process":
                    capacity, ready_s, ladder_s = in_process(served, window_path, ladder, slo_texts, run_dir)
                    failure = None
                else:
                    server = TrialServer(kind="vllm" if kind == "vllm" else "autotune", api_server_count=count)
                    runner = RepeatedLadders(args.ladders, args.settle, replay=ReplayOptions(slos=slos), ladder=ladder,
                                             server=server, startup_timeout_s=900,
                                             stale_registry=Path(scratch) / "servers.json", say=say,
                                             cpu_split=cpu_split)
                    outcome = runner.run(served, window, run_dir)
                    capacity = outcome.capacity
                    if args.ladders > 1:  # one row per ladder of this launch (the last is `capacity`)
                        for index, each in enumerate(runner.capacities[:-1]):
                            rows.append({"round": round_index + 1, "column": label, "ladder": index + 1,
                                         "settle": runner.settled[index],
                                         "capacity_rps": each.capacity_rps, "bracketed": each.bracketed,
                                         "steps": len(each.steps), "lag_p99_ms": lag_p99(each),
                                         "ready_s": None, "ladder_s": None, "wall_s": None, "failure": None,
                                         "describe": each.describe(), **settle_fields(each)})
                    failure = outcome.failure
                    if capacity:
                        steps_by_launch[f"r{round_index + 1} {label}"] = capacity.steps
                    ready_s = outcome.timing.ready_s if outcome.timing else None
                    ladder_s = outcome.timing.measure_s if outcome.timing else None
                wall = time.monotonic() - started
                row = {
                    "round": round_index + 1, "column": label,
                    "ladder": len(runner.capacities) if kind != "in_process" and args.ladders > 1 else None,
                    "settle": runner.settled[-1] if kind != "in_process" and runner.settled else settings.settle_probe,
                    "capacity_rps": capacity.capacity_rps if capacity else None,
                    "bracketed": capacity.bracketed if capacity else None,
                    "steps": len(capacity.steps) if capacity else 0,
                    "lag_p99_ms": lag_p99(capacity) if capacity else None,
                    "ready_s": ready_s, "ladder_s": ladder_s, "wall_s": round(wall, 1),
                    "failure": failure, "describe": capacity.describe() if capacity else failure,
                    **settle_fields(capacity),
                }
                rows.append(row)
                say(f"  {label}: {row['describe']} (worst step send-lag p99 {fmt(row['lag_p99_ms'])} ms)")
                if hint is None and capacity and capacity.capacity_speedup:
                    hint = capacity.capacity_speedup

    medians, ratios, goals = issue_goals(rows)
    table = md_table(
        ["round", "column", "ladder", "idle probe", "capacity req/s", "/ in_process of its round", "bracketed",
         "steps", "busy after steps (gauges idle)", "slowest probe ms", "waited s", "worst lag p99 ms",
         "engine start s", "ladder s", "failure"],
        [[r["round"], r["column"], r.get("ladder") or "", "on" if r.get("settle") else "off", fmt(r["capacity_rps"]),
          fmt(per_round(rows, r["column"], "in_process").get(r["round"])), r["bracketed"],
          r["steps"], fmt(r.get("busy_after_steps")), fmt(r.get("slowest_probe_ms")), fmt(r.get("settle_s")),
          fmt(r["lag_p99_ms"]), fmt(r["ready_s"]), fmt(r["ladder_s"]), r["failure"] or ""]
         for r in rows],
    )
    compared, compared_lines = versus_first(rows, columns)
    settled, settled_lines = settle_comparison(rows)
    compared_lines = compared_lines + settled_lines + within_and_between(rows)
    results = {"rows": rows, "median_capacity_rps": medians, "ratio_to_in_process": ratios,
               "versus_first_column": compared, "idle_probe_versus_gauges": settled,
               "recorded_rps": recorded_rate(window), "window_requests": len(window)}
    notes = [
        f"Engine settings (every column): {json.dumps(config.engine, sort_keys=True)}.",
        f"Ladder: {settings.step_requests} requests and >= {settings.min_step_s:g} s per step, growth "
        f"x{settings.growth:g}, resolution {settings.resolution:.0%}; SLOs {', '.join(slo_texts)}; columns after "
        "the first start at the first column's capacity.",
        f"Window: {len(window)} requests, {window.duration_s():.0f} s of {args.trace}.",
        "The in_process column's client shares its event loop with AsyncLLM's output handler (no HTTP).",
        "HTTP columns: " + (f"replayer and server on separate CPUs ({cpu_split.describe()}; --client-cpus "
                            f"{args.client_cpus})" if cpu_split else "replayer and server share the host's CPUs "
                            f"(--client-cpus {args.client_cpus})") + "; the in_process column runs unpinned.",
    ]
    recorder.write(recorder.result(settings={"ladder": settings.model_dump(), "columns": args.columns,
                                             "slos": slo_texts, "rounds": args.rounds, "ladders": args.ladders},
                                   goals=goals, results={**results, "cpu_split": cpu_split.describe() if cpu_split else None},
                                   notes=notes),
                   "\n".join(table + compared_lines + cpu_table(rows, steps_by_launch)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
