"""The traffic recorder on a real event loop and real files (no engine: the recorder's own logic)."""

from __future__ import annotations

import asyncio
import json
import random
import warnings
from pathlib import Path

import numpy as np
import pytest

from server.config import ConfigError, RecorderSettings, ServerConfig, ServingSettings
from server.recorder import TrafficRecorder, list_segments, read_recording
from workloads.profile import profile_trace
from workloads.trace_io import TraceWarning, load_trace

LANGS = [("en", "de"), ("de", "en"), ("en", "ja"), ("fr", "es")]


class FakeClock:
    """Deterministic time for timestamps; the event loop itself runs for real."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def strict_load(path: Path):
    """Loads a trace and fails on any repair (sorting, skipped lines)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", TraceWarning)
        return load_trace(path)


async def record_requests(
    recorder: TrafficRecorder, requests: list[dict], clock: FakeClock
) -> None:
    """Arrivals in order, completions in another order (as on a real server)."""
    pendings = []
    for request in requests:
        clock.now = request["arrival_s"]
        pendings.append(
            (recorder.begin(source_lang=request["src"], target_lang=request["tgt"]), request)
        )
    for pending, request in sorted(pendings, key=lambda item: item[1]["done_s"]):
        clock.now = request["done_s"]
        pending.finish(request["input_length"], request["output_length"])


def random_requests(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    t = 0.0
    requests = []
    for _ in range(n):
        t += rng.expovariate(5.0)
        src, tgt = rng.choice(LANGS)
        requests.append(
            {
                "arrival_s": t,
                "done_s": t + rng.uniform(0.05, 3.0),
                "input_length": rng.randint(10, 200),
                "output_length": rng.randint(1, 150),
                "src": src,
                "tgt": tgt,
            }
        )
    return requests


def test_recording_round_trips_through_the_loader_and_the_profile(tmp_path: Path) -> None:
    clock = FakeClock()
    requests = random_requests(300)

    async def main() -> TrafficRecorder:
        recorder = TrafficRecorder(RecorderSettings(directory=str(tmp_path)), clock=clock)
        await recorder.start()
        await record_requests(recorder, requests, clock)
        await recorder.stop()
        return recorder

    recorder = asyncio.run(main())
    segments = list_segments(tmp_path)
    assert len(segments) == 1 and recorder.recorded == 300
    trace = strict_load(segments[0].path)  # written in arrival order: no re-sorting needed
    by_arrival = sorted(requests, key=lambda r: r["arrival_s"])
    np.testing.assert_allclose(
        trace.timestamps_ms, [r["arrival_s"] * 1000 for r in by_arrival], atol=0.001
    )
    assert trace.input_lengths.tolist() == [r["input_length"] for r in by_arrival]
    assert trace.output_lengths.tolist() == [r["output_length"] for r in by_arrival]
    assert trace.source_langs == [r["src"] for r in by_arrival]
    assert trace.target_langs == [r["tgt"] for r in by_arrival]
    np.testing.assert_allclose(
        trace.latencies_ms,
        [(r["done_s"] - r["arrival_s"]) * 1000 for r in by_arrival],
        atol=0.001,
    )
    profile = profile_trace(trace)
    assert profile.requests == 300
    pairs = {(p.source_lang, p.target_lang) for p in profile.languages or []}
    assert pairs == set(LANGS)
    assert read_recording(tmp_path).input_lengths.tolist() == trace.input_lengths.tolist()


def test_a_slow_request_holds_back_later_arrivals_so_the_file_stays_sorted(tmp_path: Path) -> None:
    clock = FakeClock()

    async def main() -> list[int]:
        recorder = TrafficRecorder(RecorderSettings(directory=str(tmp_path)), clock=clock)
        await recorder.start()
        slow = recorder.begin()
        clock.now = 0.5
        recorder.begin().finish(20, 5)  # arrived after `slow`, finished first
        await recorder.flush()
        written_while_slow = recorder.recorded
        clock.now = 2.0
        slow.finish(10, 50)
        await recorder.flush()
        await recorder.stop()
        return [written_while_slow, recorder.recorded]

    counts = asyncio.run(main())
    assert counts == [0, 2]
    trace = strict_load(list_segments(tmp_path)[0].path)
    assert trace.input_lengths.tolist() == [10, 20]


def test_failed_and_abandoned_requests_are_not_recorded(tmp_path: Path) -> None:
    async def main() -> None:
        recorder = TrafficRecorder(RecorderSettings(directory=str(tmp_path)))
        await recorder.start()
        recorder.begin().drop()  # engine error / client gone
        done = recorder.begin()
        done.finish(12, 3)
        done.drop()  # the `finally` after a success: must not undo it
        await recorder.stop()

    asyncio.run(main())
    trace = strict_load(list_segments(tmp_path)[0].path)
    assert trace.input_lengths.tolist() == [12]


def test_background_task_flushes_without_being_asked(tmp_path: Path) -> None:
    settings = RecorderSettings(directory=str(tmp_path), flush_interval_s=0.05)

    async def main() -> int:
        recorder = TrafficRecorder(settings)
        await recorder.start()
        recorder.begin().finish(7, 7)
        await asyncio.sleep(0.5)
        on_disk = len(strict_load(list_segments(tmp_path)[0].path))
        await recorder.stop()
        return on_disk

    assert asyncio.run(main()) == 1


def test_rotation_keeps_every_file_and_the_folder_within_budget(tmp_path: Path) -> None:
    settings = RecorderSettings(
        directory=str(tmp_path), max_file_bytes=4096, max_total_bytes=3 * 4096
    )
    clock = FakeClock()
    foreign = tmp_path / "notes.txt"  # not ours: never counted or deleted
    foreign.write_text("x" * 10000)

    async def main() -> None:
        recorder = TrafficRecorder(settings, clock=clock)
        await recorder.start()
        for batch in range(20):  # ~20 flushes of 50 lines (~80 bytes each)
            for i in range(50):
                clock.now = batch * 10 + i * 0.01
                recorder.begin(source_lang="en", target_lang="de").finish(100 + i, 20)
            await recorder.flush()
        await recorder.stop()

    asyncio.run(main())
    segments = list_segments(tmp_path)
    sizes = [s.path.stat().st_size for s in segments]
    assert all(size <= 4096 for size in sizes)
    assert sum(sizes) <= 3 * 4096
    assert segments[0].number > 0  # the oldest files were deleted
    assert foreign.read_text() == "x" * 10000
    # What is left is the newest traffic, contiguous, ending with the last request.
    trace = read_recording(tmp_path)
    assert trace.timestamps_ms[-1] == pytest.approx((19 * 10 + 49 * 0.01) * 1000)
    assert bool(np.all(np.diff(trace.timestamps_ms) > 0))
    for segment in segments:
        strict_load(segment.path)  # every file is a valid trace on its own


def test_text_is_never_written_unless_enabled(tmp_path: Path) -> None:
    secret = "Mein geheimer Satz"

    async def main(directory: Path, record_text: bool) -> None:
        recorder = TrafficRecorder(
            RecorderSettings(directory=str(directory), record_text=record_text)
        )
        await recorder.start()
        recorder.begin(source_lang="de", target_lang="en", text=secret).finish(9, 4)
        recorder.begin(text=None).finish(5, 2)  # token-id prompt: no text
        await recorder.stop()

    asyncio.run(main(tmp_path / "off", False))
    files = list((tmp_path / "off").iterdir())
    assert len(files) == 1 and secret not in files[0].read_text()

    asyncio.run(main(tmp_path / "on", True))
    segment = list_segments(tmp_path / "on")[0]
    assert len(strict_load(segment.path)) == 2  # the trace stays a plain trace
    assert segment.text_path is not None
    texts = [json.loads(line)["text"] for line in segment.text_path.read_text().splitlines()]
    assert texts == [secret, None]


def test_runs_after_a_restart_are_placed_by_wall_clock(tmp_path: Path) -> None:
    async def run(wall_s: float, lengths: list[int]) -> None:
        clock = FakeClock()
        recorder = TrafficRecorder(
            RecorderSettings(directory=str(tmp_path)), clock=clock, wall_clock=lambda: wall_s
        )
        await recorder.start()
        for i, length in enumerate(lengths):
            clock.now = i * 1.0
            recorder.begin().finish(length, 1)
        await recorder.stop()

    asyncio.run(run(1_700_000_000.0, [10, 11]))
    asyncio.run(run(1_700_000_100.0, [12]))  # restarted 100 s later
    trace = read_recording(tmp_path)
    assert trace.input_lengths.tolist() == [10, 11, 12]
    assert trace.timestamps_ms.tolist() == [0.0, 1000.0, 100_000.0]


def test_a_disk_error_is_counted_not_raised(tmp_path: Path) -> None:
    directory = tmp_path / "traffic"

    async def main() -> TrafficRecorder:
        recorder = TrafficRecorder(RecorderSettings(directory=str(directory)))
        await recorder.start()
        directory.rmdir()
        directory.write_text("now a file")  # writes into it must fail
        recorder.begin().finish(3, 3)
        await recorder.stop()
        return recorder

    recorder = asyncio.run(main())
    assert recorder.write_errors == 1 and recorder.recorded == 0


def test_a_budget_smaller_than_one_file_is_a_config_error(tmp_path: Path) -> None:
    data = {
        "model": "m",
        "additional-config": {
            "vllm_autotune": {
                "serving": {
                    "recorder": {
                        "directory": "traffic",
                        "max_file_bytes": 1_000_000,
                        "max_total_bytes": 10_000,
                    }
                }
            }
        },
    }
    with pytest.raises(ConfigError, match="serving.recorder.*max_total_bytes"):
        ServerConfig.from_mapping(data, path="deployed.yaml")


def test_recorder_settings_survive_the_config_file(tmp_path: Path) -> None:
    settings = RecorderSettings(directory="/var/lib/traffic", max_file_bytes=8192)
    config = ServerConfig(engine={"model": "m"}, serving=ServingSettings(recorder=settings))
    path = tmp_path / "config.yaml"
    config.write(path)
    assert ServerConfig.load(path).serving.recorder == settings


def test_stop_during_busy_flushing_loses_nothing(tmp_path: Path) -> None:
    # Found by the overhead benchmark: stopping while a write was in flight lost its lines.
    settings = RecorderSettings(directory=str(tmp_path), flush_lines=50, flush_interval_s=0.01)

    async def main() -> TrafficRecorder:
        recorder = TrafficRecorder(settings)
        await recorder.start()
        for i in range(20_000):
            recorder.begin().finish(1 + i % 100, 1)
            if i % 100 == 0:
                await asyncio.sleep(0)  # let the flush loop start writes mid-stream
        await recorder.stop()
        return recorder

    recorder = asyncio.run(main())
    assert recorder.recorded == 20_000
    assert len(strict_load(list_segments(tmp_path)[0].path)) == 20_000
