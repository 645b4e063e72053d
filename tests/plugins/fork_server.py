"""--shared-fork-server (make test): one fork server for the session.

With `--shared-fork-server` (make test) the controller starts one fork server for the session
(`autotune fork-server`'s) and names its socket in AUTOTUNE_FORK_SERVER_SOCKET: every trial
server the tests start, from their own trial runners or from the `autotune run` processes they
start, is forked from it where the environment is the suite's, instead of each of those
processes importing vLLM for a fork server of its own (~9 CPU-s each).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from autotune.cli.flags import FORK_SERVER_SOCKET_ENV
from autotune.measure.forkserver import ForkServer

# The fork server, the folder of its socket and log, the variable before.
_FORK_SERVER = pytest.StashKey[tuple[ForkServer, str, str | None]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shared-fork-server",
        action="store_true",
        help="start one fork server (autotune fork-server) for the session: every trial server "
        "the tests start, in their processes or in the tuners they run, is forked from it where "
        "its environment allows, instead of each process importing vLLM for one (make test).",
    )


@pytest.hookimpl(trylast=True)  # after session_env.py set the suite's environment
def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not config.getoption("shared_fork_server"):
        return  # a worker inherits the controller's variable (xdist starts them after this)
    folder = tempfile.mkdtemp(prefix="vllm-autotune-fork-server-")
    before = os.environ.get(FORK_SERVER_SOCKET_ENV)
    os.environ[FORK_SERVER_SOCKET_ENV] = os.path.join(folder, "forkserver.sock")
    # Started after the suite's environment is set: the workers' and their tuners' match it.
    server = ForkServer(listen=Path(os.environ[FORK_SERVER_SOCKET_ENV]), stderr_path=Path(folder) / "forkserver.log")
    config.stash[_FORK_SERVER] = (server, folder, before)


@pytest.hookimpl(tryfirst=True)  # before session_env.py removes the folder of its servers' IPC sockets
def pytest_unconfigure(config: pytest.Config) -> None:
    made = config.stash.get(_FORK_SERVER, None)
    if made is None:
        return
    server, folder, before = made
    server.close()
    shutil.rmtree(folder, ignore_errors=True)
    if before is None:
        os.environ.pop(FORK_SERVER_SOCKET_ENV, None)
    else:
        os.environ[FORK_SERVER_SOCKET_ENV] = before
