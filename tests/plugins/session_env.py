"""The session's environment: what every process of a test session (the xdist workers, every
fixture whatever its scope, every process the tests start) inherits from the controller.

The whole session, fixtures of every scope included, runs with a high client-lag limit in the
environment (`AUTOTUNE_MAX_CLIENT_LAG_MS`, the default of `--max-client-lag-ms`): on CI's 2 cores, beside another job, the replayer of a
tuner test lagged past the limit its SLOs imply (50-100 ms) and a trial went unscored in tests
that are not about the client. The lag rule keeps its own tests (tests/autotune/measure/test_client_lag.py),
which pass their limits explicitly.

The session answers vLLM questions from a facts cache of its own (server.vllm_facts), made
empty at the start and shared by the xdist workers and every process the tests start: the first
process that asks imports vLLM and fills it, the rest read it, and a warm cache in the user's
home never hides a path that imports vLLM.

A test that leaves vLLM's engine-core start method in the environment errors (see
pytest_runtest_teardown).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from autotune.cli.flags import CLIENT_LAG_ENV
from autotune.measure.server_start import IPC_ENV
from server.vllm_facts import CACHE_DIR_ENV

START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"  # server.engine's (importing it imports vLLM)
_FACTS = pytest.StashKey[tuple[str, dict[str, str | None]]]()  # the facts folder, the env before
_START_METHOD = pytest.StashKey[str | None]()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        # Set before xdist starts its workers, which inherit them (and so does every fixture,
        # whatever its scope); restored at the session's end.
        facts = tempfile.mkdtemp(prefix="vllm-autotune-facts-")
        suite_env = {
            CACHE_DIR_ENV: facts,
            CLIENT_LAG_ENV: "60000",  # a limit no stall of a busy test machine reaches (see above)
            # The in-process engines' IPC sockets, gone with the folder (as the CLI's: server_start).
            IPC_ENV: facts,
        }
        config.stash[_FACTS] = (facts, {name: os.environ.get(name) for name in suite_env})
        os.environ.update(suite_env)


def pytest_unconfigure(config: pytest.Config) -> None:
    made = config.stash.get(_FACTS, None)
    if made is None:
        return
    facts, before = made
    shutil.rmtree(facts, ignore_errors=True)
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    item.stash[_START_METHOD] = os.environ.get(START_METHOD_ENV)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A test that leaves vLLM's engine-core start method in this process's environment (after
    every fixture's undo) errors: each later `autotune run` or server this process starts would
    inherit it as if a user had set it (vLLM's CPU platform writes "spawn" there while it
    builds a config)."""
    result = yield
    before, after = item.stash.get(_START_METHOD, None), os.environ.get(START_METHOD_ENV)
    if after != before:
        if before is None:
            os.environ.pop(START_METHOD_ENV, None)
        else:
            os.environ[START_METHOD_ENV] = before
        pytest.fail(f"the test left {START_METHOD_ENV}={after!r} in the environment (was {before!r})")
    return result
