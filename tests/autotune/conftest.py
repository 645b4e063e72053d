"""Fixtures for the tuner's tests.

`conversation_trace`: writes a Mooncake-format JSONL (what `autotune convert --from mooncake`
reads) shaped like the public Mooncake conversation trace that failed a new user (issue 20):
multi-turn conversations sharing prefix blocks (`hash_ids`, 512 tokens each, block 0 common
to every request), prompts of median ~11.6k tokens and up to 191k, outputs of a few hundred
tokens, arrivals batched on a 3-second grid at ~1.3 requests/s. Called as
`conversation_trace(path, duration_s=900, rate_rps=1.3, seed=0)`.

`postgres_url`: a throwaway PostgreSQL cluster (initdb into a temp folder, trust auth, TCP on
127.0.0.1 at a free port only, no Unix socket), stopped and deleted afterwards; the test is
skipped, with the reason, where no server is installed. PostgreSQL refuses to run as root; as
root (CI) the server runs as the `postgres` user that Debian's `postgresql` package creates.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from autotune.cli.flags import fork_server_socket
from autotune.measure.forkserver import ForkServers

BLOCK_TOKENS = 512
LONGEST_PROMPT = 191_000


def find_bin_dir() -> Path | None:
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(on_path).parent
    # Debian keeps the server binaries off PATH, one folder per major version.
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: p.parent.parent.name)
    return found[-1].parent if found else None


def missing() -> str | None:
    """Why a cluster cannot be started here, or None."""
    if find_bin_dir() is None:
        return ("PostgreSQL server binaries (initdb, pg_ctl) not found; install Debian's "
                "`postgresql` package (.ci/run does when it runs as root)")
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        return "psycopg2 is not installed: pip install -e '.[dev]' (or '.[postgres]')"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no `postgres` user to run the server as"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def cluster() -> Iterator[str]:
    """Yields a SQLAlchemy URL of a fresh database server; stops and deletes it after."""
    bin_dir = find_bin_dir()
    assert bin_dir is not None
    as_user: list[str] = []
    # pytest's tmp_path is private to root (0700): the postgres user could not enter it.
    folder = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
    if os.geteuid() == 0:
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(folder, "postgres", "postgres")
    data, log = folder / "data", folder / "server.log"
    port = _free_port()
    try:
        subprocess.run([*as_user, str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U",
                        "postgres", "-E", "UTF8", "--no-sync"],
                       check=True, capture_output=True, timeout=120)
        with open(data / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.write(f"\nlisten_addresses = '127.0.0.1'\nport = {port}\n"
                       "unix_socket_directories = ''\nfsync = off\nmax_connections = 50\n")
        subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w",
                        "-t", "60", "start"], check=True, capture_output=True, timeout=90)
        try:
            yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres"
        finally:
            subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate",
                            "-w", "stop"], capture_output=True, timeout=60)
    except subprocess.CalledProcessError as error:
        detail = (error.stderr or b"").decode(errors="replace").strip().splitlines()[-3:]
        tail = log.read_text(errors="replace").splitlines()[-5:] if log.exists() else []
        raise RuntimeError(f"PostgreSQL did not start: {' | '.join(detail + tail)}") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _CurrentStdout:
    """A stream that is whatever sys.stdout is when written to."""

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()


@pytest.fixture(autouse=True)
def vllm_logs_to_this_test_s_output() -> Iterator[None]:
    """vLLM sets up its log handler once per process, on the stdout of that moment: under
    pytest's capture, one test's stream, closed after it. A later test that asks vLLM in
    process (the tuner's pre-flight resolves its defaults) then got "--- Logging error ---"
    tracebacks on stderr, which a one-line refusal test read as a second line. vLLM's
    handlers write to the stdout of the moment instead."""
    for handler in logging.getLogger("vllm").handlers:
        if type(handler) is logging.StreamHandler:  # vLLM's own, not pytest's capture handlers
            handler.stream = _CurrentStdout()  # not setStream: it flushes the closed one first
    yield


@pytest.fixture
def large_numa_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees a 32 GiB NUMA node, whatever this machine's holds right now: the CPU
    memory band and the baseline's share follow the node's size (server.config.cpu_memory_share),
    and a VM's node can be 12 GiB at one moment and 19 GiB the next (seen on the CI VM)."""
    monkeypatch.setattr("server.config.cpu_node_memory", lambda: 32 * 2**30)


@pytest.fixture
def postgres_url() -> Iterator[str]:
    reason = missing()
    if reason:
        pytest.skip(reason)
    with cluster() as url:
        yield url


def write_conversation_trace(
    path: Path, *, duration_s: float = 900.0, rate_rps: float = 1.3, seed: int = 0
) -> Path:
    """See the module docstring (the `conversation_trace` fixture)."""
    rng = np.random.default_rng(seed)
    lines: list[str] = []
    next_block = 1
    conversations: list[list[int]] = []  # the blocks each open conversation has so far
    for tick_ms in range(0, int(duration_s * 1000), 3000):
        for _ in range(rng.poisson(rate_rps * 3)):
            if conversations and rng.random() < 0.5:  # a later turn: the history is its prefix
                history = conversations[int(rng.integers(len(conversations)))]
            else:
                history = []
                conversations.append(history)
            prompt = int(np.clip(rng.lognormal(math.log(11_600), 1.1), 200, LONGEST_PROMPT))
            blocks = max(1, math.ceil(prompt / BLOCK_TOKENS))
            while len(history) < blocks - 1:
                history.append(next_block)
                next_block += 1
            output = int(np.clip(rng.lognormal(math.log(350), 0.8), 1, 1000))
            record = {"timestamp": tick_ms, "input_length": prompt, "output_length": output,
                      "hash_ids": [0, *history[: blocks - 1]]}
            lines.append(json.dumps(record))
    # The longest prompt of the real trace, once, so the figures a user saw are all there.
    longest = json.loads(lines[len(lines) // 2])
    longest["input_length"] = LONGEST_PROMPT
    longest["hash_ids"] = [0, *range(next_block, next_block + LONGEST_PROMPT // BLOCK_TOKENS)]
    lines[len(lines) // 2] = json.dumps(longest)
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def conversation_trace() -> Callable[..., Path]:
    return write_conversation_trace


@pytest.fixture(scope="session")
def fork_servers() -> Iterator[ForkServers]:
    """One fork server for the in-process trial runners of this pytest process (or xdist
    worker): its import of vLLM (~10 s on 2 cores) is paid once, not per engine start."""
    servers = ForkServers(shared=fork_server_socket(None, os.environ))  # make test: the session's
    yield servers
    servers.close()
