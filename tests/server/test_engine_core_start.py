"""How the engine core's process is started on vLLM's CPU platform (server.engine.
choose_engine_core_start), decided on real vLLM configs: no engine is started here.

That the session's real server forked its engine core is test_http.py's
test_on_cpu_the_engine_core_is_forked; that a tuner's trial server does is test_ladder_engine.py's
test_autotune_run_reports_the_baselines_capacity_and_headroom."""

from __future__ import annotations

import os

import pytest

from server.config import ServerConfig, ServingSettings, default_engine_settings
from server.engine import (
    START_METHOD_ENV,
    WORKER_PROCESS_ENV,
    choose_engine_core_start,
    keep_cpu_worker_in_engine_core,
    resolve_engine_config,
)

pytestmark = pytest.mark.slow  # imports vLLM (~10 s)


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    # monkeypatch puts back whatever these were, so no later test in this process inherits them
    # (the server code under test writes them). A delenv of an unset variable records nothing
    # to undo: set first, so that undoing removes what the test wrote.
    for name in (START_METHOD_ENV, WORKER_PROCESS_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def embedded(api_processes: int = 1) -> ServerConfig:
    return ServerConfig(engine=default_engine_settings(), serving=ServingSettings(api_processes=api_processes))


def server_start_method(config: ServerConfig) -> tuple[str, str | None]:
    """What the server process does: the chosen method, and the variable vLLM will read."""
    keep_cpu_worker_in_engine_core()
    chosen = choose_engine_core_start(config, resolve_engine_config(config))
    return chosen, os.environ.get(START_METHOD_ENV)


@pytest.mark.parametrize("as_the_server_does", [True, False])
def test_checking_a_config_leaves_the_start_method_unset(as_the_server_does: bool) -> None:
    # vLLM's CPU platform writes spawn while it builds the config. Left there in the tuner's own
    # process (which checks the baseline's config without keeping the worker inside the engine
    # core), every trial server inherited it as if the user had asked for spawn.
    if as_the_server_does:
        keep_cpu_worker_in_engine_core()
    resolve_engine_config(embedded())
    assert START_METHOD_ENV not in os.environ


def test_one_front_end_with_the_worker_inside_forks_the_engine_core() -> None:
    assert server_start_method(embedded()) == ("fork", None)  # unset: vLLM's own default


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_start_method_the_caller_set_wins(environment: pytest.MonkeyPatch, method: str) -> None:
    environment.setenv(START_METHOD_ENV, method)
    assert server_start_method(embedded()) == (method, method)


def test_several_front_ends_spawn_as_vllm_asks() -> None:
    # vLLM's multi-API-server path starts processes of its own with that method.
    assert server_start_method(embedded(api_processes=2)) == ("spawn", "spawn")


def test_a_model_worker_in_its_own_process_spawns_as_vllm_asks(environment: pytest.MonkeyPatch) -> None:
    environment.setenv(WORKER_PROCESS_ENV, "1")
    assert server_start_method(embedded()) == ("spawn", "spawn")
