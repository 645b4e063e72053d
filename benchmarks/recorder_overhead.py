"""What the traffic recorder costs the server: request-path time, throughput, event-loop lag.

    .venv/bin/python benchmarks/recorder_overhead.py [--records 200000] [--dir /tmp/rec]

1. Request path: `begin()` + `finish()` per record (what a handler pays), in µs.
2. Absorbed rate: records/s pushed through the recorder end to end (buffer, background flush,
   serialization and disk writes in the worker thread, rotation), until `stop()` returns.
3. Event-loop lag: a 1 ms ticker's lateness, with and without the recorder, at full speed
   (2.) and at a steady `--rate` (default 1000 requests/s, ~40x the reference user's 25
   concurrent translations), so disk work that leaked onto the loop would show.
Prints one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from server.config import RecorderSettings
from server.recorder import TrafficRecorder, list_segments
from workloads.errors import OneLineErrorParser


async def ticker(lags: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append((time.perf_counter() - start - 0.001) * 1000)


async def push(recorder: TrafficRecorder | None, records: int, batch: int) -> float:
    """Records `records` requests, yielding to the loop every `batch` (as handlers would)."""
    start = time.perf_counter()
    for i in range(records):
        if recorder is not None:
            recorder.begin(source_lang="en", target_lang="de").finish(40 + i % 160, 10 + i % 90)
        if i % batch == batch - 1:
            await asyncio.sleep(0)
    return time.perf_counter() - start


async def paced(recorder: TrafficRecorder | None, rate: float, seconds: float) -> float:
    """`rate` records per second for `seconds`, in 10 ms steps (a steady server)."""
    start = time.perf_counter()
    step = 0.01
    for tick in range(int(seconds / step)):
        for i in range(int(rate * step)):
            if recorder is not None:
                recorder.begin(source_lang="en", target_lang="de").finish(40 + i, 10 + i)
        await asyncio.sleep(max(0.0, start + (tick + 1) * step - time.perf_counter()))
    return time.perf_counter() - start


async def measure(
    directory: Path, records: int, with_recorder: bool, rate: float | None = None
) -> dict:
    settings = RecorderSettings(
        directory=str(directory), max_file_bytes=16 * 2**20, max_total_bytes=2**30
    )
    recorder = TrafficRecorder(settings) if with_recorder else None
    if recorder is not None:
        await recorder.start()
    lags: list[float] = []
    stop = asyncio.Event()
    tick = asyncio.create_task(ticker(lags, stop))
    start = time.perf_counter()
    if rate is None:
        path_s = await push(recorder, records, batch=50)
    else:
        path_s = await paced(recorder, rate, records / rate)
    if recorder is not None:
        await recorder.stop()
    total_s = time.perf_counter() - start
    stop.set()
    await tick
    lags.sort()
    result = {
        "loop_lag_p50_ms": round(statistics.median(lags), 3),
        "loop_lag_p99_ms": round(lags[int(0.99 * (len(lags) - 1))], 3),
        "loop_lag_max_ms": round(lags[-1], 3),
    }
    if recorder is not None and rate is None:
        written = sum(s.path.stat().st_size for s in list_segments(directory))
        result.update(
            request_path_us_per_record=round(path_s / records * 1e6, 2),
            absorbed_records_per_s=round(records / total_s),
            recorded=recorder.recorded,
            bytes_written=written,
            files=len(list_segments(directory)),
        )
    return result


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--rate", type=float, default=1000.0, help="steady records/s for 3.")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the steady run")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temp dir)"
    )
    args = parser.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="recorder-bench-"))
    try:
        without = asyncio.run(measure(base / "off", args.records, with_recorder=False))
        with_rec = asyncio.run(measure(base / "on", args.records, with_recorder=True))
        steady = int(args.rate * args.seconds)
        steady_off = asyncio.run(measure(base / "s-off", steady, False, rate=args.rate))
        steady_on = asyncio.run(measure(base / "s-on", steady, True, rate=args.rate))
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    report = {
        "full_speed": {"records": args.records, "recorder": with_rec, "no_recorder": without},
        "steady": {"rate_rps": args.rate, "recorder": steady_on, "no_recorder": steady_off},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
