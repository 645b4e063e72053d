"""CPU use of the server's processes during a measured span (a ladder step, a window).

Why: on a GPU host a small model's engine core is a busy Python loop, and the front ends
beside it (ours or vLLM's) need CPU per request and per streamed token. When they fight for
the same cores the engine's steps slow down and the capacity falls, with nothing on the GPU
to show it (issue 17: the engine's own inter-token p95 was twice as high behind our four
front ends as behind vLLM's at the same rate). Per process this records the CPU seconds it
used, its share of one CPU, and how often the kernel took the CPU away from it (involuntary
context switches: the direct sign of contention).

Roles come from vLLM's process titles (`VLLM::EngineCore`, `VLLM::Worker`, `VLLM::APIServer_N`;
our front ends take the same titles, server.frontends), else "main" for the process the launcher
started, else the process's own name.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

import psutil
from pydantic import BaseModel


class ProcessCpu(BaseModel):
    """One server process during one span."""

    pid: int
    role: str  # "engine core", "front end N", "main", or the process's name
    cpu_s: float  # user + system seconds used in the span
    share: float  # cpu_s / the span's seconds: 1.0 = one CPU busy all the time
    involuntary_switches: int  # the kernel preempted it this often: contention for CPUs


@dataclass(frozen=True)
class _Sample:
    role: str
    cpu_s: float
    involuntary: int


@dataclass(frozen=True)
class CpuReading:
    """Cumulative CPU counters of a set of processes at one moment."""

    at: float  # time.monotonic()
    samples: dict[int, _Sample]


def role_of(process: psutil.Process, main_pid: int) -> str:
    try:
        title = " ".join(process.cmdline()) or process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "gone"
    if "EngineCore" in title:
        return "engine core"
    if "VLLM::Worker" in title:  # the model runner in its own process (vLLM's CPU platform, TP > 1)
        return "engine worker"
    front_end = re.search(r"APIServer_?(\d*)", title)
    if front_end:
        return f"front end {front_end.group(1)}".strip()
    if process.pid == main_pid:
        return "main"
    with contextlib.suppress(psutil.Error):
        return process.name()
    return "gone"


def read_cpu(processes: Iterable[psutil.Process], main_pid: int, at: float) -> CpuReading:
    """Counters of every process still alive (a process that is gone is left out)."""
    samples: dict[int, _Sample] = {}
    for process in processes:
        try:
            with process.oneshot():
                times = process.cpu_times()
                switches = process.num_ctx_switches()
            samples[process.pid] = _Sample(role_of(process, main_pid), times.user + times.system,
                                           switches.involuntary)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return CpuReading(at=at, samples=samples)


def cpu_use(before: CpuReading, after: CpuReading) -> list[ProcessCpu]:
    """Per process alive at the end: what it used between the readings, busiest first.

    A process that started in between counts from zero (its whole life is in the span).
    """
    span = after.at - before.at
    if span <= 0:
        return []
    used: list[ProcessCpu] = []
    for pid, late in after.samples.items():
        early = before.samples.get(pid)
        cpu_s = late.cpu_s - (early.cpu_s if early else 0.0)
        switches = late.involuntary - (early.involuntary if early else 0)
        used.append(ProcessCpu(pid=pid, role=late.role, cpu_s=round(cpu_s, 3),
                               share=round(cpu_s / span, 3), involuntary_switches=switches))
    return sorted(used, key=lambda p: p.cpu_s, reverse=True)
