"""The server's OpenAPI schema, fuzzed with schemathesis against the real session server.

The schema is the one FastAPI builds for the app `server.app.create_app` makes (the running
server does not publish it: `openapi_url=None`), with the same request models the server
validates with. Negative cases (data the schema forbids) must get a 4xx; positive ones any
non-5xx answer. Generations are kept short so that the run stays within seconds.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from server.app import create_app

pytestmark = pytest.mark.engine

RunningServer = Any  # conftest.RunningServer
ROUTES = [("POST", "/v1/completions"), ("POST", "/translate")]
MAX_EXAMPLES = {GenerationMode.NEGATIVE: 120, GenerationMode.POSITIVE: 80}
SHORT_OUTPUT = 32


@pytest.fixture(scope="module")
def api_schema(server: RunningServer) -> schemathesis.BaseSchema:
    serving = server.config.serving.model_copy(update={"recorder": None})
    app = create_app(server.config.model_copy(update={"serving": serving}))  # no engine: no lifespan
    return schemathesis.openapi.from_dict(app.openapi())


def keep_generations_short(body: Any, mode: GenerationMode) -> Any:
    """A valid-looking request may generate up to its max_tokens (the session server allows
    32k): cap what would be generated, keep values the server refuses as they are."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for name in ("max_tokens", "min_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and SHORT_OUTPUT < value <= 40_000:
            body[name] = SHORT_OUTPUT
    text = body.get("text")
    if mode == GenerationMode.POSITIVE and isinstance(text, str) and len(text) < 200 and len(text) % 2 == 0:
        # Half the short texts get a real language pair, so the translation path runs too.
        body.update(source_lang="en", target_lang="de")
    return body


@pytest.mark.parametrize("mode", [GenerationMode.NEGATIVE, GenerationMode.POSITIVE], ids=str)
@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_fuzzed_requests_never_get_a_server_error(
    server: RunningServer,
    api_schema: schemathesis.BaseSchema,
    reliability,
    method: str,
    path: str,
    mode: GenerationMode,
) -> None:
    reliability.start(
        f"OpenAPI fuzz (schemathesis): {method} {path}, {mode.value} cases",
        group="Bad input",
        injected=(
            f"schemathesis {mode.value} cases generated from the server's OpenAPI schema for "
            f"{method} {path} ({MAX_EXAMPLES[mode]} examples), sent with the bearer token to the "
            "real server"
            + (": bodies, types and values the schema forbids" if mode == GenerationMode.NEGATIVE
               else ": schema-valid bodies, generations capped at 32 tokens")
        ),
    )
    operation = api_schema[path][method]
    statuses: dict[int, int] = {}

    @settings(
        max_examples=MAX_EXAMPLES[mode],
        deadline=None,
        derandomize=True,  # the same cases every run: a CI failure reproduces
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: schemathesis.Case) -> None:
        case.body = keep_generations_short(case.body, mode)
        response = case.call(base_url=server.url, headers=server.headers, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.body, response.status_code, response.text[:300])
        if mode == GenerationMode.NEGATIVE:
            assert 400 <= response.status_code < 500, (case.body, response.status_code)

    fuzz()
    sent = sum(statuses.values())
    reliability.held(
        "no 5xx" + (" and every forbidden request refused with a 4xx" if mode == GenerationMode.NEGATIVE else "")
        + f" over {sent} requests; the server kept serving"
    )
    reliability.figure("requests sent", sent)
    reliability.figure("answers by status", ", ".join(f"{code}: {n}" for code, n in sorted(statuses.items())))
    assert server.process.poll() is None
