"""The server as a client sees it: a real `python -m server` process, real HTTP.

All tests share the session's server (see conftest.py); each leaves it idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from autotune.measure.process_cpu import role_of
from server.engine import KV_CACHE_USAGE_METRICS, TTFT_METRICS

pytestmark = pytest.mark.engine

# A generation long enough to still be running when the test acts: one sequence makes a few
# hundred tokens/s here, so this runs for over a minute unless aborted (conftest's
# max_model_len). While it runs, the server answers /metrics late (seconds, tens of seconds on
# a busy machine): a test that polls /metrics before it acts needs this margin (5,000 tokens
# was seen to finish first), one that can tell from the stream itself acts at once.
LONG = 30000


RunningServer = Any  # conftest.RunningServer (conftest is not importable by name)


def metric_values(server: RunningServer) -> dict[str, float]:
    """Every sample of /metrics, summed over label sets (name -> value)."""
    response = httpx.get(server.url + "/metrics", headers=server.headers, timeout=10)
    response.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def generated_tokens(server: RunningServer) -> float:
    return metric_values(server)["vllm:generation_tokens_total"]


def finished_requests(server: RunningServer) -> float:
    """vLLM's count of requests that ran to their end (`vllm:request_success_total`, every
    finished_reason). A request aborted because its client left is not counted: it leaves
    the engine without finishing."""
    return metric_values(server)["vllm:request_success_total"]


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


def idle(server: RunningServer) -> bool:
    values = metric_values(server)
    return values["vllm:num_requests_running"] == 0 and values["server_requests_in_flight"] == 0


def sse_events(lines: list[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def test_health_answered_503_until_the_engine_was_ready(server: RunningServer) -> None:
    assert server.answered_503_while_starting
    assert httpx.get(server.url + "/health").status_code == 200  # no token needed
    # The server's log says that the engine became ready, and with which settings.
    ready = [line for line in server.log_path.read_text(errors="replace").splitlines() if "engine ready: " in line]
    assert len(ready) == 1, ready
    settings = json.loads(ready[0].split("engine ready: ", 1)[1])
    assert settings["max_num_seqs"] == server.config.engine["max_num_seqs"]


def test_on_cpu_the_model_worker_runs_inside_the_engine_core(server: RunningServer) -> None:
    # vLLM's CPU platform would give the worker a process of its own that busy-polls the engine
    # core (server.engine.keep_cpu_worker_in_engine_core says what that cost); ours keeps it in
    # the engine core's process, and the log says which executor ran.
    ready = [line for line in server.log_path.read_text(errors="replace").splitlines() if "engine ready: " in line]
    assert json.loads(ready[0].split("engine ready: ", 1)[1])["executor_backend"] == "uni"
    main = psutil.Process(server.process.pid)
    roles = [role_of(p, main.pid) for p in [main, *main.children(recursive=True)]]
    assert roles.count("engine core") == 1, roles
    assert "engine worker" not in roles, roles


def test_on_cpu_the_engine_core_is_forked(server: RunningServer) -> None:
    # vLLM's CPU platform spawns it, importing vLLM and torch again (~15 s of a 37-39 s start
    # on 2 cores); ours forks it from the server process (server.engine.choose_engine_core_start).
    ready = [line for line in server.log_path.read_text(errors="replace").splitlines() if "engine ready: " in line]
    assert json.loads(ready[0].split("engine ready: ", 1)[1])["engine_core_start"] == "fork"


def test_the_forked_engine_core_does_not_hold_the_listening_socket(server: RunningServer) -> None:
    # Held, it kept the port open after the server was SIGKILLed: clients connected and waited
    # for answers nobody would send (a tuner's replay hung for 600 s).
    port = int(server.url.rsplit(":", 1)[1])
    main = psutil.Process(server.process.pid)
    [core] = [p for p in main.children(recursive=True) if role_of(p, main.pid) == "engine core"]

    def listening(process: psutil.Process) -> list[Any]:
        return [c for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port]

    assert listening(main), "the server itself listens"
    assert listening(core) == []


def test_translate_round_trip(server: RunningServer) -> None:
    text = "The morning train to the coast was full of students."
    response = httpx.post(
        server.url + "/translate",
        json={"text": text, "source_lang": "en", "target_lang": "de"},
        headers=server.headers,
        timeout=60,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body["translation"], str)
    usage = body["usage"]
    # The prompt wraps the text in the language pair's template, so it is longer than the text.
    assert usage["prompt_tokens"] > len(text.split())
    assert 1 <= usage["completion_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize("n", [1, 37])
def test_streamed_completion_has_exactly_n_tokens_with_ignore_eos(
    server: RunningServer, n: int
) -> None:
    payload = {
        "prompt": list(range(100, 164)),
        "max_tokens": n,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=payload, headers=server.headers, timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(list(response.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    token_chunks = [chunk for chunk in chunks if chunk["choices"]]
    assert sum(len(chunk["choices"][0]["token_ids"]) for chunk in token_chunks) == n
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 64,
        "completion_tokens": n,
        "total_tokens": 64 + n,
    }


def test_non_streamed_text_completion_reports_usage(server: RunningServer) -> None:
    response = httpx.post(
        server.url + "/v1/completions",
        json={
            "prompt": "Der Zug nach Hamburg",
            "max_tokens": 8,
            "ignore_eos": True,
            "model": "any",
        },
        headers=server.headers,
        timeout=60,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["choices"][0]["token_ids"]) == 8
    assert body["usage"]["completion_tokens"] == 8


BAD_REQUESTS = [
    ("/translate", {"text": "", "source_lang": "en", "target_lang": "de"}, "text"),
    ("/translate", {"text": "   ", "source_lang": "en", "target_lang": "de"}, "text"),
    ("/translate", {"text": "Hallo", "source_lang": "xx", "target_lang": "en"}, "source_lang"),
    ("/translate", {"text": "Hallo", "source_lang": "de", "target_lang": "klingon"}, "target_lang"),
    ("/translate", {"text": "x" * 8001, "source_lang": "en", "target_lang": "de"}, "text"),
    ("/translate", {"text": 5, "source_lang": "en", "target_lang": "de"}, "text"),
    ("/translate", {"source_lang": "en", "target_lang": "de"}, "text"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 40000}, "max_tokens"),  # > max_model_len
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": [1, 2], "n": 3}, "n"),
    ("/v1/completions", {"prompt": [1, 2], "unknown_field": 1}, "unknown_field"),
]


@pytest.mark.parametrize(("route", "payload", "field"), BAD_REQUESTS)
def test_bad_input_gets_4xx_naming_the_field(
    server: RunningServer, route: str, payload: dict, field: str
) -> None:
    response = httpx.post(server.url + route, json=payload, headers=server.headers, timeout=30)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["message"]
    assert error["field"] == field


@pytest.mark.parametrize("body", [b'{"prompt": [1, 2', b"not json", b"[1, 2]", b""])
def test_broken_json_gets_400_and_the_server_keeps_serving(
    server: RunningServer, body: bytes
) -> None:
    headers = {**server.headers, "Content-Type": "application/json"}
    response = httpx.post(server.url + "/v1/completions", content=body, headers=headers)
    assert response.status_code == 400
    assert response.json()["error"]["message"]
    ok = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": [5, 6, 7], "max_tokens": 2},
        headers=server.headers,
        timeout=30,
    )
    assert ok.status_code == 200


def test_bearer_token_is_required_everywhere_but_health(server: RunningServer) -> None:
    completion = {"prompt": [5, 6], "max_tokens": 1}
    assert httpx.post(server.url + "/v1/completions", json=completion).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert (
        httpx.post(server.url + "/v1/completions", json=completion, headers=wrong).status_code
        == 401
    )
    assert httpx.get(server.url + "/metrics").status_code == 401
    translate = {"text": "Hallo", "source_lang": "de", "target_lang": "en"}
    assert httpx.post(server.url + "/translate", json=translate).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_have_kv_cache_usage_and_ttft(server: RunningServer) -> None:
    httpx.post(
        server.url + "/v1/completions",
        json={"prompt": [5, 6, 7], "max_tokens": 3},
        headers=server.headers,
        timeout=30,
    ).raise_for_status()
    values = metric_values(server)
    assert any(name in values for name in KV_CACHE_USAGE_METRICS)
    assert any(values.get(name + "_count", 0) >= 1 for name in TTFT_METRICS)
    assert values["server_requests_total"] >= 1  # the server's own metrics are there too


def test_client_disconnect_aborts_the_request_and_frees_the_slot(server: RunningServer) -> None:
    wait_for(lambda: idle(server), 30, "an idle server")
    tokens_before, finished_before = generated_tokens(server), finished_requests(server)
    payload = {"prompt": [5, 6, 7], "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=payload, headers=server.headers, timeout=60
    ) as response:
        lines = response.iter_lines()
        while not (line := next(lines)).startswith("data: "):
            pass
        # A streamed token, unfinished: the request is running in the engine right now (the
        # client leaves at once rather than polling /metrics, which lags while it streams).
        assert json.loads(line.removeprefix("data: "))["choices"][0]["finish_reason"] is None
    # Leaving the block closed the connection: the request left the engine (the slot is
    # free) without finishing, long before its LONG tokens: it was aborted.
    wait_for(lambda: idle(server), 60, "vllm:num_requests_running and in-flight back to 0")
    assert finished_requests(server) == finished_before
    assert generated_tokens(server) - tokens_before < LONG


def test_non_streamed_request_is_aborted_when_the_client_leaves(server: RunningServer) -> None:
    wait_for(lambda: idle(server), 30, "an idle server")
    tokens_before, finished_before = generated_tokens(server), finished_requests(server)
    payload = {"prompt": [5, 6, 7], "max_tokens": LONG, "ignore_eos": True}

    async def leave_while_generating() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers) as client:
            request = asyncio.create_task(client.post("/v1/completions", json=payload, timeout=None))
            deadline = time.monotonic() + 60
            while metric_values(server)["vllm:num_requests_running"] < 1:
                assert time.monotonic() < deadline and not request.done(), "never running"
                await asyncio.sleep(0.1)
            request.cancel()  # the client gives up: its connection closes
            with contextlib.suppress(asyncio.CancelledError):
                await request

    asyncio.run(leave_while_generating())
    wait_for(lambda: idle(server), 60, "the abandoned request to be aborted")
    assert finished_requests(server) == finished_before  # left the engine unfinished
    assert generated_tokens(server) - tokens_before < LONG


def test_admission_limit_answers_503_with_retry_after(server: RunningServer) -> None:
    wait_for(lambda: idle(server), 30, "an idle server")
    # running (max_num_seqs) + waiting (the limit): the next one must be refused
    admitted = server.config.engine["max_num_seqs"] + server.config.serving.max_waiting_requests

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(
            base_url=server.url, headers=server.headers, timeout=60
        ) as client:
            payload = {"prompt": [5, 6, 7], "max_tokens": LONG, "ignore_eos": True}
            holders = [
                asyncio.create_task(client.post("/v1/completions", json=payload))
                for _ in range(admitted)
            ]
            try:
                deadline = time.monotonic() + 60
                while metric_values(server)["server_requests_in_flight"] < admitted:
                    assert time.monotonic() < deadline, "requests were not admitted"
                    await asyncio.sleep(0.1)
                return await client.post("/v1/completions", json=payload)
            finally:
                for holder in holders:
                    holder.cancel()
                await asyncio.gather(*holders, return_exceptions=True)

    refused = asyncio.run(scenario())
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert "waiting" in refused.json()["error"]["message"]
    wait_for(lambda: idle(server), 60, "the cancelled requests to be aborted")
    assert metric_values(server)["server_requests_rejected_total"] >= 1
