"""The stale-server registry: servers that may outlive the tuner that started them.

Every start is recorded (a JSON file) until the whole process group is confirmed gone;
`reap_stale_servers` ends what a killed tuner left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Sequence
from pathlib import Path

import psutil
from pydantic import BaseModel

from workloads.files import write_text_atomic


class RegisteredServer(BaseModel):
    """One started server, kept in the registry until its group is confirmed gone."""

    pid: int
    pgid: int
    create_time: float  # psutil's, to tell our process from a recycled pid
    study: str = ""
    trial: str = ""
    port: int | None = None
    started: str = ""  # ISO time, for humans reading the file


class _RegistryFile(BaseModel):
    servers: list[RegisteredServer] = []


class StaleServerRegistry:
    """A JSON file listing servers that may still be running (atomic rewrites).

    One tuner process uses a registry at a time (one per study folder); no locking.
    """

    def __init__(self, path: Path):
        self.path = Path(path)

    def entries(self) -> list[RegisteredServer]:
        if not self.path.exists():
            return []
        return _RegistryFile.model_validate_json(self.path.read_text()).servers

    def add(self, entry: RegisteredServer) -> None:
        servers = [s for s in self.entries() if s.pid != entry.pid]
        self._write(servers + [entry])

    def remove(self, pid: int) -> None:
        self._write([s for s in self.entries() if s.pid != pid])

    def _write(self, servers: list[RegisteredServer]) -> None:
        write_text_atomic(self.path, _RegistryFile(servers=servers).model_dump_json(indent=2))


def _is_gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _group_members(pgid: int, created_after: float) -> list[psutil.Process]:
    """Processes of group `pgid` created no earlier than the group leader (not recycled)."""
    members = []
    for process in psutil.process_iter(["create_time"]):
        try:
            if os.getpgid(process.pid) != pgid:
                continue
        except (ProcessLookupError, PermissionError):
            continue
        created = process.info["create_time"]
        if created is not None and created + 0.05 >= created_after and not _is_gone(process):
            members.append(process)
    return members


def _signal_all(pgid: int | None, processes: Sequence[psutil.Process], sig: signal.Signals) -> None:
    """Signal the group (pass `pgid` only while a verified member is alive: an empty group's
    id is a free pid that a stranger may now lead) and each listed process."""
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    # Children that left the group (setsid) are still ours: signal them one by one.
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process.send_signal(sig)


def reap_stale_servers(registry_path: Path, *, grace_s: float = 10.0) -> list[int]:
    """End every registered server group that still has processes; return the pids ended.

    A registered group leader that exited (e.g. SIGKILLed) may have left children in its
    group, so the whole group is scanned; only processes created no earlier than the
    registered leader count, which keeps a recycled pid or pgid safe.
    """
    registry = StaleServerRegistry(registry_path)
    ended: list[int] = []
    for entry in registry.entries():
        members = _group_members(entry.pgid, entry.create_time)
        with contextlib.suppress(psutil.NoSuchProcess):
            leader = psutil.Process(entry.pid)
            if abs(leader.create_time() - entry.create_time) < 0.05 and not _is_gone(leader):
                if all(p.pid != leader.pid for p in members):
                    members.append(leader)
        if members:
            _signal_all(entry.pgid, members, signal.SIGTERM)
            _, alive = psutil.wait_procs(members, timeout=grace_s)
            alive = [p for p in alive if not _is_gone(p)]
            if alive:
                _signal_all(entry.pgid, alive, signal.SIGKILL)
                psutil.wait_procs(alive, timeout=grace_s)
            ended.extend(p.pid for p in members)
        if not _group_members(entry.pgid, entry.create_time):
            registry.remove(entry.pid)
    return sorted(ended)
