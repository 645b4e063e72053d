"""Separate CPUs for the load client and the server it measures, where the host has enough.

On one host the replayer and the server take CPU from each other: on a 16-CPU H200 host,
four front-end processes of the server, its engine core and three replayer processes
competed, and whichever ran at the lower priority lost (a niced server: engine steps slowed,
TPOT rose; a niced client: send lag rose). A split gives each its own CPUs: the client the
last half of the host's (at least 2), kept in whole hyper-thread sibling groups, and the
server everything else. Below MIN_CPUS_TO_SPLIT the two share, as before: a 2-core laptop
cannot spare a core for either.

Why half (results/benchmarks/frontends-h200, Qwen2-1.5B shape at 200-670 req/s): with a
quarter (4 of 16 CPUs) the streaming replayer's send-lag p99 reached 6.5-9.6 ms above ~390
req/s; with half (8) it stayed <= 2.2 ms at every step up to 671 req/s. On its 8 CPUs the
server (four front ends and the engine core) used at most 1.94 CPUs at any step.

`auto` splits only for engines on an accelerator: vLLM's CPU backend binds its own OpenMP
threads to cores and must see all of them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from autotune.errors import AutotuneError

logger = logging.getLogger(__name__)

__all__ = ["CpuSplit", "parse_cpu_list"]

MIN_CPUS_TO_SPLIT = 8
CLIENT_SHARE = 0.5
SYS_CPUS = Path("/sys/devices/system/cpu")


def parse_cpu_list(text: str) -> frozenset[int]:
    """A Linux CPU list ("0-3,8,10-11") as a set of CPU numbers; ValueError when malformed."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        first, dash, last = part.strip().partition("-")
        low, high = int(first), int(last) if dash else int(first)
        if low < 0 or high < low:
            raise ValueError(part)
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int]) -> str:
    """The inverse of parse_cpu_list, runs collapsed: {0, 1, 2, 5} -> "0-2,5"."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in runs)


def sibling_groups(cpus: frozenset[int], sys_cpus: Path = SYS_CPUS) -> list[frozenset[int]]:
    """`cpus` in hyper-thread sibling groups (one group per CPU where the topology is unknown)."""
    groups: list[frozenset[int]] = []
    seen: set[int] = set()
    for cpu in sorted(cpus):
        if cpu in seen:
            continue
        try:
            siblings = parse_cpu_list((sys_cpus / f"cpu{cpu}/topology/thread_siblings_list").read_text())
        except (OSError, ValueError):
            siblings = frozenset({cpu})
        group = (siblings & cpus) | {cpu}
        seen.update(group)
        groups.append(frozenset(group))
    return groups


@dataclass(frozen=True)
class CpuSplit:
    """The client's CPUs and the server's: disjoint, both non-empty."""

    client: frozenset[int]
    server: frozenset[int]

    @classmethod
    def resolve(cls, spec: str, *, accelerator: str, available: frozenset[int] | None = None,
                sys_cpus: Path = SYS_CPUS) -> CpuSplit | None:
        """`--client-cpus`: "auto" (a split on hosts of MIN_CPUS_TO_SPLIT or more CPUs with a
        GPU engine), "off", or the client's CPU list ("12-15"; the server gets the rest)."""
        available = available if available is not None else frozenset(os.sched_getaffinity(0))
        if spec == "off":
            return None
        if spec == "auto":
            if accelerator == "cpu" or len(available) < MIN_CPUS_TO_SPLIT:
                return None
            return cls.client_share(available, sys_cpus)
        try:
            client = parse_cpu_list(spec)
        except ValueError:
            raise AutotuneError(f"--client-cpus {spec!r}: expected auto, off or a CPU list such "
                                "as 12-15 or 6,7") from None
        if not client <= available:
            raise AutotuneError(f"--client-cpus {spec}: CPUs {format_cpu_list(client - available)} "
                                f"are not available to this process ({format_cpu_list(available)})")
        if client == available:
            raise AutotuneError(f"--client-cpus {spec}: leaves no CPU for the server "
                                f"(available: {format_cpu_list(available)})")
        return cls(client=client, server=available - client)

    @classmethod
    def client_share(cls, available: frozenset[int], sys_cpus: Path = SYS_CPUS) -> CpuSplit:
        """The client gets whole sibling groups from the highest-numbered CPUs until it has
        CLIENT_SHARE of them (at least 2); the server the rest."""
        want = max(2, round(len(available) * CLIENT_SHARE))
        client: set[int] = set()
        for group in reversed(sibling_groups(available, sys_cpus)):
            if len(client) >= want:
                break
            client |= group
        return cls(client=frozenset(client), server=available - client)

    def describe(self) -> str:
        return f"client CPUs {format_cpu_list(self.client)}, server CPUs {format_cpu_list(self.server)}"

    def pin_server(self, pid: int) -> None:
        """Put a just-spawned server on the server's CPUs (the engine processes it starts
        later inherit them). Where not allowed, it runs where it is and says so in the log."""
        try:
            os.sched_setaffinity(pid, self.server)
        except OSError as error:
            logger.warning("could not pin server %d to CPUs %s: %s", pid,
                           format_cpu_list(self.server), error)

    @contextlib.contextmanager
    def client_pinned(self) -> Iterator[None]:
        """This thread on the client's CPUs for the block: its timing loop, and every process
        it starts (replay workers; the server until `pin_server` moves it), run there."""
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.client)
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)
