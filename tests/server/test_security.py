"""Security defaults a deployment relies on: loopback unless told, benchmark-only fields refused
outside benchmark mode, the bearer token on every route but /health.

The bind and token tests use the session's real server (conftest.py). The benchmark-mode test
needs a server *not* in benchmark mode; rather than a second engine (~30 s), it runs the same
app in-process with a fake engine that records whether anything reached it: the test is about
our routing and checks, not about vLLM.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import server.app
from server.config import ServerConfig, ServingSettings
from server.engine import Delta, EngineSettings, Generation

RunningServer = Any  # conftest.RunningServer
SECURITY = "Security defaults"


@pytest.mark.engine
def test_the_server_listens_on_loopback_only_unless_told(server: RunningServer, reliability) -> None:
    reliability.start(
        "Binds 127.0.0.1 unless told",
        group=SECURITY,
        injected="the session server started with a config and --port, no host anywhere",
    )
    assert ServerConfig(engine={"model": "m"}).host == "127.0.0.1"
    processes = [psutil.Process(server.process.pid)]
    processes += processes[0].children(recursive=True)
    listening = {
        (conn.laddr.ip, conn.laddr.port)
        for process in processes
        for conn in process.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    }
    port = int(server.url.rsplit(":", 1)[1])
    assert (("127.0.0.1", port)) in listening
    assert all(ip in ("127.0.0.1", "::1") for ip, _ in listening), listening
    reliability.held(
        f"every listening socket of the server's {len(processes)} processes is on loopback: the "
        f"HTTP port 127.0.0.1:{port} and {len(listening) - 1} of the engine's internal sockets"
    )
    reliability.figure("listening sockets", len(listening))


class FakeEngine:
    """Stands in for server.engine.Engine; counts what reached it."""

    generated: list[Generation]

    def __init__(self) -> None:
        self.settings = EngineSettings(
            vllm_version="fake",
            usage_context="OPENAI_API_SERVER",
            model="fake",
            max_num_seqs=4,
            max_num_batched_tokens=2048,
            gpu_memory_utilization=0.3,
            max_model_len=2048,
            block_size=16,
            enforce_eager=True,
            skip_tokenizer_init=True,
            vocab_size=1000,
        )
        self.has_tokenizer = False
        self.errored = False
        self.generated = []

    @classmethod
    def start(cls, config: ServerConfig, vllm_config: Any = None) -> FakeEngine:
        return cls()

    async def finish_start(self) -> None:
        pass

    async def generate(
        self, prompt_token_ids: list[int], generation: Generation, request_id: str, *, stream: bool
    ) -> AsyncIterator[Delta]:
        self.generated.append(generation)
        count = generation.max_tokens
        yield Delta(text="", token_ids=[7] * count, prompt_tokens=len(prompt_token_ids), finish_reason="length")

    def shutdown(self) -> None:
        pass


def started_app(monkeypatch: pytest.MonkeyPatch, *, benchmark_mode: bool) -> tuple[TestClient, list[FakeEngine]]:
    engines: list[FakeEngine] = []

    class Recording(FakeEngine):
        @classmethod
        def start(cls, config: ServerConfig, vllm_config: Any = None) -> FakeEngine:
            engines.append(cls())
            return engines[-1]

    monkeypatch.setattr(server.app, "Engine", Recording)
    config = ServerConfig(engine={"model": "fake"}, serving=ServingSettings(benchmark_mode=benchmark_mode))
    return TestClient(server.app.create_app(config)), engines


def wait_ready(client: TestClient) -> None:
    deadline = time.monotonic() + 10
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the fake engine did not start"
        time.sleep(0.01)


@pytest.mark.parametrize(("field", "value"), [("ignore_eos", True), ("min_tokens", 5)])
def test_benchmark_only_fields_are_refused_over_http_outside_benchmark_mode(
    monkeypatch: pytest.MonkeyPatch, reliability, field: str, value: object
) -> None:
    reliability.start(
        f"Benchmark-only field `{field}` refused outside benchmark mode",
        group=SECURITY,
        injected=f"POST /v1/completions with {field}={value!r} to the app without --benchmark-mode "
        "(in-process, fake engine), then the same request with benchmark mode on",
    )
    client, engines = started_app(monkeypatch, benchmark_mode=False)
    body = {"prompt": [1, 2, 3], "max_tokens": 8, field: value}
    with client:
        wait_ready(client)
        refused = client.post("/v1/completions", json=body)
        plain = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 8})
    assert refused.status_code == 400
    assert refused.json()["error"]["field"] == field
    assert "--benchmark-mode" in refused.json()["error"]["message"]
    assert plain.status_code == 200
    assert [g.max_tokens for g in engines[0].generated] == [8]  # only the plain request ran
    reliability.held(
        f"400 naming `{field}` (\"{refused.json()['error']['message']}\"); the engine never saw it; "
        "the same request without the field was served"
    )
    client, engines = started_app(monkeypatch, benchmark_mode=True)
    with client:
        wait_ready(client)
        accepted = client.post("/v1/completions", json=body)
    assert accepted.status_code == 200 and len(engines[0].generated) == 1
    reliability.held("with benchmark mode on, the same request was served")


TOKEN_SHAPED = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=0, max_size=24
)


def near_misses(key: str) -> st.SearchStrategy[str]:
    return st.one_of(
        TOKEN_SHAPED,
        st.just(key.upper()),
        st.just(key[:-1]),
        st.just(key + "x"),
        st.just(key[1:]),
        st.builds(lambda a, b: a + key + b, TOKEN_SHAPED, TOKEN_SHAPED).filter(lambda t: t != key),
    ).filter(lambda token: token != key)


@pytest.mark.engine
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_a_wrong_or_missing_bearer_token_is_refused_on_every_route(
    server: RunningServer, reliability, data: st.DataObject
) -> None:
    key = server.config.api_key
    reliability.start(
        "Bearer token enforced",
        group=SECURITY,
        injected=(
            "hypothesis: Authorization headers that are missing, use another scheme, or carry "
            "a wrong token (random, a prefix, a suffix, the token changed in case or wrapped in "
            "other characters), on POST /v1/completions, POST /translate, GET /metrics, GET /info"
        ),
    )
    scheme = data.draw(st.sampled_from(["Bearer", "bearer", "Basic", "Token", ""]), label="scheme")
    token = data.draw(st.one_of(near_misses(key), st.just(key)), label="token")
    header = f"{scheme} {token}".strip()
    route = data.draw(st.sampled_from(["/v1/completions", "/translate", "/metrics", "/info"]), label="route")
    headers = {} if data.draw(st.booleans(), label="no header") else {"Authorization": header}
    # An invalid body: with the right token the answer is a 400, never a generation.
    if route in ("/metrics", "/info"):
        response = httpx.get(server.url + route, headers=headers, timeout=30)
    else:
        response = httpx.post(server.url + route, json={"prompt": []}, headers=headers, timeout=30)
    right = bool(headers) and scheme.lower() == "bearer" and token == key
    if right:
        assert response.status_code != 401
        reliability.count("right token (answered, not 401)")
    else:
        assert response.status_code == 401, (headers, route, response.status_code)
        assert response.headers["www-authenticate"] == "Bearer"
        reliability.count("wrong or missing token (401)")
    reliability.held(
        "every request without the exact token got 401 + WWW-Authenticate: Bearer; the exact "
        "token got through; /health needs none (test_http.py)"
    )
