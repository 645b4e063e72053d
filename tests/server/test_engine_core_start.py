"""How the engine core's process is started on vLLM's CPU platform (server.engine.
fork_cpu_engine_core), decided on real vLLM configs: no engine is started here.

That the session's real server forked its engine core is test_http.py's
test_on_cpu_the_engine_core_is_forked."""

from __future__ import annotations

import os

import pytest

from server.config import ServerConfig, ServingSettings, default_engine_settings
from server.engine import (
    START_METHOD_ENV,
    WORKER_PROCESS_ENV,
    keep_cpu_worker_in_engine_core,
    resolve_engine_config,
)

pytestmark = pytest.mark.slow  # imports vLLM (~10 s)


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    # vLLM's CPU platform writes the start method into the process environment; monkeypatch
    # puts back whatever these were, so no later test in this process inherits them.
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    monkeypatch.delenv(WORKER_PROCESS_ENV, raising=False)
    return monkeypatch


def embedded(api_processes: int = 1) -> ServerConfig:
    return ServerConfig(engine=default_engine_settings(), serving=ServingSettings(api_processes=api_processes))


def start_method_after_resolving(config: ServerConfig) -> str:
    keep_cpu_worker_in_engine_core()  # as the server does, before the config
    resolve_engine_config(config)
    return os.environ.get(START_METHOD_ENV, "fork (vLLM's default)")


def test_one_front_end_with_the_worker_inside_forks_the_engine_core() -> None:
    # vLLM's CPU platform wrote spawn while building the config; unset again, vLLM forks.
    assert start_method_after_resolving(embedded()) == "fork (vLLM's default)"


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_start_method_the_caller_set_wins(environment: pytest.MonkeyPatch, method: str) -> None:
    environment.setenv(START_METHOD_ENV, method)
    assert start_method_after_resolving(embedded()) == method


def test_several_front_ends_keep_vllms_spawn() -> None:
    # vLLM's multi-API-server path starts processes of its own with that method.
    assert start_method_after_resolving(embedded(api_processes=2)) == "spawn"


def test_a_model_worker_in_its_own_process_keeps_vllms_spawn(environment: pytest.MonkeyPatch) -> None:
    environment.setenv(WORKER_PROCESS_ENV, "1")
    assert start_method_after_resolving(embedded()) == "spawn"
