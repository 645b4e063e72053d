"""Per-process CPU use of a server's processes (autotune.measure.process_cpu), read from real
processes titled the way vLLM titles its engine core and front ends."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from autotune.measure.process_cpu import CpuReading, _Sample, cpu_use, read_cpu, role_of

# A child that takes a title, says so, then either spins or sleeps until stdin closes.
CHILD = """
import sys, threading, setproctitle
title, busy = sys.argv[1], sys.argv[2] == "busy"
if title != "-":
    setproctitle.setproctitle(title)
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
print("ready", flush=True)
while not done.is_set():
    if not busy:
        done.wait(0.05)
"""


@pytest.fixture
def spawn() -> Iterator:
    children: list[subprocess.Popen] = []

    def start(title: str, busy: bool) -> psutil.Process:
        child = subprocess.Popen([sys.executable, "-c", CHILD, title, "busy" if busy else "idle"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        children.append(child)
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        return psutil.Process(child.pid)

    yield start
    for child in children:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)


def test_roles_come_from_vllms_process_titles(spawn) -> None:
    main = spawn("-", busy=False)
    engine = spawn("VLLM::EngineCore", busy=False)
    front = spawn("VLLM::APIServer_3", busy=False)
    worker = spawn("VLLM::Worker", busy=False)
    other = spawn("-", busy=False)
    assert role_of(main, main.pid) == "main"
    assert role_of(engine, main.pid) == "engine core"
    assert role_of(worker, main.pid) == "engine worker"
    assert role_of(front, main.pid) == "front end 3"
    assert role_of(other, main.pid).startswith("python")


def test_the_busy_process_is_first_and_counted_only_for_the_span(spawn) -> None:
    main = spawn("-", busy=False)
    engine = spawn("VLLM::EngineCore", busy=True)
    processes = [main, engine]
    before = read_cpu(processes, main.pid, time.monotonic())
    # Wait on the condition (the spinner has used some CPU), not for a fixed time.
    deadline = time.monotonic() + 60
    while engine.cpu_times().user + engine.cpu_times().system < before.samples[engine.pid].cpu_s + 0.3:
        assert time.monotonic() < deadline, "the spinning child used no CPU in 60 s"
        time.sleep(0.05)
    after = read_cpu(processes, main.pid, time.monotonic())
    used = cpu_use(before, after)
    assert [p.role for p in used] == ["engine core", "main"]
    assert used[0].cpu_s >= 0.3 > used[1].cpu_s
    assert 0 < used[0].share <= 1.05  # one thread: at most one CPU's worth of the span
    assert used[0].involuntary_switches >= 0


def test_a_process_gone_by_the_end_is_left_out_and_a_new_one_counts_from_zero() -> None:
    before = CpuReading(at=10.0, samples={1: _Sample("main", 5.0, 10), 2: _Sample("engine core", 1.0, 0)})
    after = CpuReading(at=12.0, samples={1: _Sample("main", 6.0, 13), 3: _Sample("front end 0", 0.5, 2)})
    used = cpu_use(before, after)
    assert [(p.pid, p.role, p.cpu_s, p.share, p.involuntary_switches) for p in used] == [
        (1, "main", 1.0, 0.5, 3), (3, "front end 0", 0.5, 0.25, 2)]
    assert cpu_use(after, after) == []
