"""A trial server's start, forked from a fork server against a fresh `python -m server`.

    .venv/bin/python benchmarks/server_start.py [--rounds 3] [--config FILE] [--name NAME]

Each round starts the server twice with the same config (default: the embedded default),
the order alternating per round, one at a time: once as its own process (`python -m server`,
what every trial did before autotune.measure.forkserver) and once forked from a fork server
that imported vLLM and the server once, before the first round (its import is timed apart: a
tuner pays it once per run, beside its first server's start). Each start is timed from the
spawn to `/health` answering 200 (ServerLauncher.start), then the server is stopped.
Reports seconds per start and the ratio forked / own process of each round's pair.

`--requests N` (default 0: none): before it is stopped, each server also serves N streamed
completions (token-id prompts of 128 tokens, 64 output tokens forced with ignore_eos), 32 at a
time, and the output tokens per second are compared the same way: a forked server must serve
as fast as one started on its own.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

if not __package__:  # run as a file: its folder is on sys.path, the repository (benchmarks.*) is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.measure.forkserver import ForkedServer, ForkServer
from autotune.measure.launcher import ServerLauncher
from benchmarks.benchlib import Recorder, md_table, say
from server.config import ServerConfig
from workloads.errors import OneLineErrorParser


async def serve_burst(url: str, requests: int, concurrency: int = 32) -> float:
    """Output tokens per second over `requests` streamed completions, `concurrency` at a time."""
    body = {"prompt": [(7 * i) % 1000 + 1 for i in range(128)], "max_tokens": 64,
            "ignore_eos": True, "min_tokens": 64, "stream": True}
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        async def one() -> None:
            async with gate, client.stream("POST", url + "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for _ in response.aiter_lines():
                    pass

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(requests)))
        return requests * 64 / (time.perf_counter() - started)


def start_once(launcher: ServerLauncher, config: Path, log: Path, requests: int) -> tuple[float, float | None, bool]:
    """Seconds from spawn to ready, output tokens/s over `requests` (None: none asked), and
    whether the server was forked."""
    server = launcher.start(config, log)
    try:
        assert server.ready_at is not None
        ready_s = server.ready_at - server.spawned_at
        rate = asyncio.run(serve_burst(server.url, requests)) if requests else None
        return ready_s, rate, isinstance(server.popen, ForkedServer)
    finally:
        report = server.stop()
        if report.leftover_pids:
            raise SystemExit(f"processes left after stop: {report.leftover_pids}")


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--config", type=Path, help="server config (default: the embedded default)")
    parser.add_argument("--name", default="server_start", help="results/benchmarks/NAME.{md,json}")
    parser.add_argument("--requests", type=int, default=0, help="completions each server serves (default: none)")
    args = parser.parse_args()
    recorder = Recorder(args.name, "Trial server start: forked from a fork server vs its own process", "full")
    starts: dict[str, list[float]] = {"own process": [], "forked": []}
    serving: dict[str, list[float]] = {"own process": [], "forked": []}
    with tempfile.TemporaryDirectory(prefix="server-start-") as tmp:
        folder = Path(tmp)
        config = args.config
        if config is None:
            config = folder / "config.yaml"
            ServerConfig.default().write(config)
        began = time.monotonic()
        forkserver = ForkServer(stderr_path=folder / "forkserver.log")
        if not forkserver.wait_ready():
            raise SystemExit(f"{forkserver.describe_exit()}: see {folder / 'forkserver.log'}")
        import_s = time.monotonic() - began
        say(f"fork server imported in {import_s:.1f} s")
        launchers = {"own process": ServerLauncher(startup_timeout_s=600),
                     "forked": ServerLauncher(startup_timeout_s=600, forkserver=forkserver)}
        try:
            for round_no in range(args.rounds):
                order = ("own process", "forked") if round_no % 2 == 0 else ("forked", "own process")
                for name in order:
                    seconds, rate, forked = start_once(launchers[name], config, folder / f"{name}-{round_no}.log",
                                                       args.requests)
                    if forked != (name == "forked"):
                        raise SystemExit(f"round {round_no + 1} {name}: the server was "
                                         f"{'forked' if forked else 'its own process'}")
                    starts[name].append(round(seconds, 2))
                    served = ""
                    if rate is not None:
                        serving[name].append(round(rate, 1))
                        served = f", then {rate:.0f} output tokens/s over {args.requests} completions"
                    say(f"round {round_no + 1} {name}: ready after {seconds:.1f} s{served}")
        finally:
            forkserver.close()
    ratios = [f / o for f, o in zip(starts["forked"], starts["own process"], strict=True)]
    rows: list[list[Any]] = [
        [name, ", ".join(f"{s:.1f}" for s in values), f"{statistics.median(values):.1f}"]
        for name, values in starts.items()
    ]
    tables = "\n".join([
        "## Seconds from spawn to ready, per round", "",
        *md_table(["start", "per round", "median"], rows), "",
        f"Forked / own process, per round: {', '.join(f'{r:.2f}' for r in ratios)} "
        f"(median {statistics.median(ratios):.2f}). The fork server's own import: {import_s:.1f} s, "
        "once per tuner run.",
    ])
    if args.requests:
        served_ratios = [f / o for f, o in zip(serving["forked"], serving["own process"], strict=True)]
        tables += "\n".join([
            "", "", f"## Output tokens per second over {args.requests} completions, per round", "",
            *md_table(["start", "per round", "median"],
                      [[name, ", ".join(f"{r:.0f}" for r in values), f"{statistics.median(values):.0f}"]
                       for name, values in serving.items()]), "",
            f"Forked / own process, per round: {', '.join(f'{r:.2f}' for r in served_ratios)} "
            f"(median {statistics.median(served_ratios):.2f}).",
        ])
    result = recorder.result(
        settings={"rounds": args.rounds, "config": str(args.config or "the embedded default"),
                  "requests": args.requests},
        goals=[],
        results={"starts_s": starts, "forked_over_own": [round(r, 3) for r in ratios],
                 "output_tokens_per_s": serving if args.requests else None,
                 "forkserver_import_s": round(import_s, 2)},
        notes=["One server at a time, the order alternating per round; each stopped (process group "
               "gone) before the next start."],
    )
    recorder.write(result, tables)


if __name__ == "__main__":
    main()
