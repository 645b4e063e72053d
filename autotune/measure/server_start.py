"""What starting a server takes besides the launcher: a free port, a CPU priority below the
load client's, a folder for its IPC sockets, the tail of its log, and why it exited."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

StartFailureKind = Literal["oom", "start_timeout", "crash", "port_in_use", "invalid_config", "environment"]
IPC_ENV = "VLLM_RPC_BASE_PATH"  # where vLLM puts its ZMQ IPC sockets (default: the temp folder)

# What vLLM, torch and the OS write when memory (GPU, CPU or KV cache) runs out.
_OOM_PATTERNS = re.compile(
    "|".join(
        [
            r"out of memory",
            r"OutOfMemory",
            r"Cannot allocate memory",
            r"MemoryError",
            r"insufficient memory",
            r"No available memory for the cache blocks",
            r"larger than the available KV cache memory",
            r"is less than desired (?:GPU|CPU) memory utilization",
            r"less than requested memory for kv",
            r"less than the engine's budget",
            # An engine core killed by the OOM killer shows up as exit code -9.
            r"Failed core proc\(s\): \{[^}]*: -9\b",
            r"exit code:? -9\b",
        ]
    ),
    re.IGNORECASE,
)
_PORT_IN_USE = re.compile(r"address already in use|\[Errno 98\]|\[Errno 48\]", re.IGNORECASE)
# vLLM validates engine arguments in pydantic config classes: a rejected combination (e.g.
# max_num_batched_tokens < max_num_seqs) is the config's fault, not a crash.
_INVALID_CONFIG = re.compile(r"validation error for \w*Config\b|ConfigError")
# The install or the machine, not the config: a module the configured code path imports is
# missing (vLLM's fp8 path imports loguru through compressed-tensors: an H200 trial died on it
# and was recorded as invalid_config), a broken build (a missing symbol or shared library, a
# kernel not built for this GPU), or no usable CUDA driver or device. Every later trial would
# fail alike. A CUDA error that one kernel raises at run time (an illegal memory access) is
# left out: it can follow from a config's batch shapes, and is a crash of that config.
_ENVIRONMENT = re.compile(
    "|".join(
        [
            r"ModuleNotFoundError",
            r"No module named",
            r"ImportError: cannot import name",
            r"undefined symbol",
            r"cannot open shared object file",
            r"no kernel image is available for execution on the device",
            r"Found no NVIDIA driver",
            r"NVIDIA driver on your system is too old",
            r"CUDA driver version is insufficient",
            r"no CUDA-capable device is detected",
            r"No CUDA GPUs are available",
            r"CUDA driver initialization failed",
            r"cudaErrorInsufficientDriver|cudaErrorNoDevice|CUDA_ERROR_NO_DEVICE|CUDA_ERROR_NOT_INITIALIZED",
            r"Failed to infer device type",
        ]
    )
)
_MISSING_MODULE = re.compile(r"No module named '?([\w.]+)'?")
_PYDANTIC_REASON = re.compile(r"^\s*Value error, ")
# The last alternative is our server's own refusal ("server: error: FILE: vLLM rejected the engine
# settings (...): vLLM's whole reason"): one line, kept whole in the trial's failure.
_ERROR_LINE = re.compile(r"^\s*[\w.]*(Error|Exception|Interrupt)\b.*:|^\S*error:|^\S*Error\b|^\w+: error: ")
_LOG_TAIL_LINES = 40
# The server under test runs at this nice value (and so does its session's autogroup):
# on a host it shares with the load client, the client must never wait for a CPU behind
# the server it measures. Measured on the 2-core CI machine, where vLLM's engine core
# spins on its worker's queue: send lag p99 2,070 ms and TTFT p95 2,435 ms at 3 req/s with
# both at 0; 1 ms and 14 ms with the server's autogroup at 10 (same server, same traffic).
SERVER_NICE = 10

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (bind to port 0, read it back, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> list[str]:
    """The last `lines` lines of a log file (empty if it does not exist)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            text = handle.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    return text.splitlines()[-lines:]


def headline(tail: Sequence[str]) -> str:
    """The line of a log tail that best says what went wrong (the last error line, or the
    pydantic "Value error, ..." reason printed right under it)."""
    for index in range(len(tail) - 1, -1, -1):
        if _ERROR_LINE.search(tail[index]):
            following = tail[index + 1 : index + 4]
            reasons = [line for line in following if _PYDANTIC_REASON.search(line)]
            return (reasons[0] if reasons else tail[index]).strip()
    for line in reversed(tail):
        if line.strip():
            return line.strip()
    return "(empty log)"


def classify_exit(returncode: int | None, tail: Sequence[str]) -> StartFailureKind:
    """Why a server process that should be serving has exited."""
    text = "\n".join(tail)
    if returncode == -signal.SIGKILL or _OOM_PATTERNS.search(text):
        return "oom"
    if _PORT_IN_USE.search(text):
        return "port_in_use"
    # Before invalid_config: our server exits 2 on an import that fails while vLLM builds its
    # config ("vLLM rejected the engine settings: No module named 'loguru'").
    if _ENVIRONMENT.search(text):
        return "environment"
    # Exit code 2: the server's own "bad config file" exit, as for the autotune CLI.
    if returncode == 2 or _INVALID_CONFIG.search(text):
        return "invalid_config"
    return "crash"


def memory_problem(tail: Sequence[str]) -> str | None:
    """The log line that says memory ran out (the last one `classify_exit` called `oom` by),
    one line; None when no line does (a SIGKILL with nothing logged)."""
    for line in reversed(tail):
        if _OOM_PATTERNS.search(line):
            return line.strip()
    return None


def environment_problem(tail: Sequence[str]) -> str | None:
    """What an `environment` failure's log says, in one line: "missing module 'loguru'" where a
    module is missing, else the log line that names the problem; None when nothing does."""
    for line in reversed(tail):
        found = _MISSING_MODULE.search(line)
        if found:
            return f"missing module '{found.group(1)}'"
    for line in reversed(tail):
        if _ENVIRONMENT.search(line):
            return line.strip()
    return None


def yield_cpu_to_clients(pid: int, nice: int = SERVER_NICE) -> None:
    """Lower a just-spawned server's CPU priority below the load client's (see SERVER_NICE).

    Sets the process's nice value (inherited by the engine processes it starts later) and,
    when the server leads its own session, its autogroup's: with autogroup scheduling (the
    Linux default) CPU time is shared between sessions first, so a nice value alone would
    only rank the server's own processes against each other. Where either is not allowed
    or not available the server runs as it is, and measurements say so through send lag.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except OSError as exc:
        logger.debug("could not renice server %d: %s", pid, exc)
    try:
        # Only a session leader's autogroup is the server's alone (not the caller's).
        if os.getsid(pid) == pid:
            renice_autogroup(pid, nice)
    except OSError as exc:
        logger.debug("could not renice server %d's autogroup: %s", pid, exc)


def renice_autogroup(pid: int, nice: int) -> None:
    """The nice value of `pid`'s autogroup (its session's share against other sessions)."""
    Path(f"/proc/{pid}/autogroup").write_text(f"{nice}\n")



@contextlib.contextmanager
def private_ipc_folder() -> Iterator[Path | None]:
    """vLLM's IPC sockets, for every server this process starts, in a folder of its own that
    goes when the block ends. vLLM names one socket file per engine connection in
    `VLLM_RPC_BASE_PATH` (default /tmp) and a stopped server leaves them there: a long study
    would leave thousands in /tmp. The servers and the fork server inherit the variable (so
    one value for the whole run: the fork server only forks servers of its own environment).
    A value the user set is kept (None is yielded)."""
    if os.environ.get(IPC_ENV):
        yield None
        return
    folder = tempfile.mkdtemp(prefix="autotune-ipc-")
    os.environ[IPC_ENV] = folder
    try:
        yield Path(folder)
    finally:
        if os.environ.get(IPC_ENV) == folder:
            del os.environ[IPC_ENV]
        shutil.rmtree(folder, ignore_errors=True)
