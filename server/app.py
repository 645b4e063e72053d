"""The HTTP server: FastAPI around one AsyncLLM (one process, one event loop).

Routes: POST /translate, POST /v1/completions, GET /health, GET /metrics, GET /info.
Every piece of state belongs to the app `create_app` returns; nothing lives at module level.
By default the app starts its own engine in this process; server.frontends runs it in each of
several front-end processes, each around its client of one shared engine core.

Over 400 lines in one module because every route shares `Handlers`' state (the engine, the
request metrics, the front end's identity); the engine's own settings live in server.config.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.config import ServerConfig
from server.engine import Delta, Engine, Generation
from server.protocol import (
    CompletionRequest,
    RequestError,
    TranslateRequest,
    TranslateResponse,
    Usage,
    check_benchmark_fields,
    check_context,
    check_token_ids,
    check_translate,
    error_body,
    translation_max_tokens,
    translation_prompt,
)
from server.recorder import Pending, TrafficRecorder
from workloads.gc_pauses import freeze_heap

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("server")
T = TypeVar("T")
# Starts (or connects to) the engine on entry, lets it go on exit.
EngineSource = Callable[[], AbstractAsyncContextManager[Engine]]
RETRY_AFTER_S = "1"
UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


@dataclass(frozen=True)
class FrontEnd:
    """Which of the server's front-end processes this app runs in (server.frontends)."""

    index: int = 0
    count: int = 1


class RequestMetrics:
    """The server's own request metrics, on a registry the app owns (vLLM's live in REGISTRY).

    Not `autotune.measure.scraper.ServerMetrics`: that is what the tuner reads from vLLM's
    series on `/metrics` over one window.

    With several front-end processes (`multiprocess_dir`: prometheus_client's
    PROMETHEUS_MULTIPROC_DIR, which vLLM sets before it spawns them), every process writes its
    values, vLLM's and ours, to files there; /metrics then reads them all, as vLLM's own
    /metrics does: counters and histograms summed, vLLM's gauges the most recent write (the
    engine core sends its scheduler stats to one front end per step), our in-flight gauge
    summed over live processes.
    """

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "server_requests",
            "HTTP requests answered, by route and status code.",
            ["route", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "server_request_duration_seconds",
            "Time from request to the end of the response (streams included), by route.",
            ["route"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "server_requests_in_flight",
            "Generation requests admitted and not yet finished.",
            registry=self.registry,
            multiprocess_mode="livesum",  # used only in multiprocess mode
        )
        self.rejected = Counter(
            "server_requests_rejected",
            "Requests refused with 503 by the admission limit (max_waiting_requests).",
            registry=self.registry,
        )

    def exposition(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(REGISTRY) + generate_latest(self.registry)
        every_process = CollectorRegistry()
        multiprocess.MultiProcessCollector(every_process, path=self.multiprocess_dir)
        return generate_latest(every_process)


class MetricsMiddleware:
    """Counts every answer by route and status; times it until its last byte (pure ASGI,
    so streamed responses pass through untouched)."""

    def __init__(self, app: ASGIApp, metrics: RequestMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # if the app raises before answering

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = scope.get("route")
            name = getattr(route, "path", "other")
            self.metrics.requests.labels(name, str(status)).inc()
            self.metrics.duration.labels(name).observe(time.perf_counter() - started)


class EngineHolder:
    """The engine once it has started, or why it has not."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.error: str | None = None

    def ready(self) -> Engine:
        if self.error is not None:
            raise RequestError(f"the engine failed: {self.error}", status=503)
        if self.engine is None:
            raise RequestError(
                "the engine is starting; retry shortly",
                status=503,
                headers={"Retry-After": RETRY_AFTER_S},
            )
        if self.engine.errored:
            raise RequestError("the engine has died; restart the server", status=503)
        return self.engine


@dataclass(eq=False, repr=False)
class Handlers:
    """The routes' logic, with the state of one app.

    A little over ~250 lines: one method per route plus the admission and streaming helpers
    they share, all on the same engine state."""

    config: ServerConfig
    holder: EngineHolder
    metrics: RequestMetrics
    recorder: TrafficRecorder | None = None
    front_end: FrontEnd = FrontEnd()
    in_flight: int = field(default=0, init=False)
    model_name: str = field(init=False)

    def __post_init__(self) -> None:
        engine = self.config.engine
        self.model_name = str(engine.get("served_model_name") or engine.get("model"))

    # --- admission -----------------------------------------------------------------------
    def admit(self, engine: Engine) -> None:
        """Refuses at once (503) when `max_waiting_requests` requests are already waiting.

        The scheduler runs at most max_num_seqs requests at a time; every admitted request
        beyond that is waiting for a slot. With several front-end processes each sees only its
        own requests: the engine-wide figure is estimated as if the others held as many (the
        kernel spreads connections over them), so the limit holds for the server as a whole.
        """
        limit = self.config.serving.max_waiting_requests
        if limit is not None:
            waiting = self.front_end.count * self.in_flight - engine.settings.max_num_seqs
            if waiting >= limit:
                self.metrics.rejected.inc()
                raise RequestError(
                    f"server busy: {waiting} requests waiting (limit {limit}); retry later",
                    status=503,
                    headers={"Retry-After": RETRY_AFTER_S},
                )
        self.in_flight += 1
        self.metrics.in_flight.inc()

    def release(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.dec()

    def begin_record(self, **fields: str | None) -> Pending | None:
        """Starts recording an admitted request (buffered in memory; no I/O here)."""
        return None if self.recorder is None else self.recorder.begin(**fields)

    # --- routes --------------------------------------------------------------------------
    async def health(self) -> JSONResponse:
        try:
            self.holder.ready()
        except RequestError as error:
            return JSONResponse({"status": "unavailable", "reason": error.message}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def metrics_text(self) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def info(self) -> JSONResponse:
        engine = self.holder.ready()
        return JSONResponse(
            {
                "engine": engine.settings.model_dump(),
                "serving": self.config.serving.model_dump(),
                "model": self.model_name,
                "process": {
                    "pid": os.getpid(),
                    "index": self.front_end.index,
                    "count": self.front_end.count,
                },
            }
        )

    async def translate(self, body: TranslateRequest, request: Request) -> TranslateResponse:
        engine = self.holder.ready()
        check_translate(body, max_input_chars=self.config.serving.max_input_chars)
        if not engine.has_tokenizer:
            raise RequestError(
                "this model runs without a tokenizer (skip_tokenizer_init), so it cannot "
                "translate text; use /v1/completions with token ids",
                field="text",
            )
        prompt_ids = engine.encode(
            translation_prompt(body.text, body.source_lang, body.target_lang)
        )
        text_tokens = len(engine.encode(body.text))
        room = engine.settings.max_model_len - len(prompt_ids)
        if room < 1:
            raise RequestError(
                f"text is too long for the model's context ({len(prompt_ids)} prompt tokens, "
                f"context {engine.settings.max_model_len})",
                field="text",
                status=413,
            )
        generation = Generation(
            max_tokens=min(translation_max_tokens(text_tokens), room),
            temperature=0.0,  # a translation should not vary from call to call
            stop=("\n",),  # the template puts the translation on one line
        )
        record = {"source_lang": body.source_lang, "target_lang": body.target_lang}
        delta = await self.generate_all(
            request, engine, prompt_ids, generation, record={**record, "text": body.text}
        )
        return TranslateResponse(
            translation=delta.text.strip(),
            source_lang=body.source_lang,
            target_lang=body.target_lang,
            usage=usage(delta.prompt_tokens, len(delta.token_ids)),
        )

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        engine = self.holder.ready()
        check_benchmark_fields(body, benchmark_mode=self.config.serving.benchmark_mode)
        if isinstance(body.prompt, str):
            if not engine.has_tokenizer:
                raise RequestError(
                    "this model runs without a tokenizer (skip_tokenizer_init): send the prompt "
                    "as a list of token ids",
                    field="prompt",
                )
            if not body.prompt:
                raise RequestError("the prompt is empty", field="prompt")
            prompt_ids = engine.encode(body.prompt)
        else:
            prompt_ids = body.prompt
            check_token_ids(prompt_ids, vocab_size=engine.settings.vocab_size)
        check_context(
            len(prompt_ids),
            body.max_tokens,
            max_model_len=engine.settings.max_model_len,
            field="max_tokens",
        )
        if body.min_tokens > body.max_tokens:
            raise RequestError("min_tokens is larger than max_tokens", field="min_tokens")
        if body.stop and not engine.has_tokenizer:
            raise RequestError("stop strings need a tokenizer; this model has none", field="stop")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        generation = Generation(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            repetition_penalty=body.repetition_penalty,
            stop=stop,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
        )
        record = {"text": body.prompt if isinstance(body.prompt, str) else None}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await self.stream(
                request, engine, prompt_ids, generation, include_usage, record=record
            )
        delta = await self.generate_all(request, engine, prompt_ids, generation, record=record)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        return JSONResponse(
            {
                **self.envelope(response_id),
                "choices": [choice(delta)],
                "usage": usage(delta.prompt_tokens, len(delta.token_ids)).model_dump(),
            }
        )

    # --- generation ----------------------------------------------------------------------
    async def generate_all(
        self,
        request: Request,
        engine: Engine,
        prompt_ids: list[int],
        generation: Generation,
        *,
        record: dict[str, str | None],
    ) -> Delta:
        self.admit(engine)
        pending = self.begin_record(**record)
        try:
            outputs = engine.generate(prompt_ids, generation, uuid.uuid4().hex, stream=False)
            delta = await until_disconnected(request, last(outputs))
            if pending is not None:
                pending.finish(delta.prompt_tokens, len(delta.token_ids))
            return delta
        except ClientGone:
            raise
        except Exception as error:
            raise engine_error(error) from error
        finally:
            self.release()
            if pending is not None:
                pending.drop()  # no-op after finish(); a failed request is not recorded

    async def stream(
        self,
        request: Request,
        engine: Engine,
        prompt_ids: list[int],
        generation: Generation,
        include_usage: bool,
        *,
        record: dict[str, str | None],
    ) -> StreamingResponse:
        self.admit(engine)
        pending = self.begin_record(**record)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        deltas = engine.generate(prompt_ids, generation, response_id, stream=True)
        try:
            # Wait for the first output before answering 200, so that a request vLLM refuses
            # gets a 4xx rather than an error inside a 200 stream.
            first = await until_disconnected(request, anext(deltas))
        except BaseException as error:
            await deltas.aclose()
            self.release()
            if pending is not None:
                pending.drop()
            if isinstance(error, ClientGone):
                raise
            if isinstance(error, Exception):
                raise engine_error(error) from error
            raise
        return StreamingResponse(
            self.sse(response_id, first, deltas, include_usage, pending),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def sse(
        self,
        response_id: str,
        first: Delta,
        deltas: AsyncIterator[Delta],
        include_usage: bool,
        pending: Pending | None = None,
    ) -> AsyncIterator[str]:
        """`data: {...}` events, then `data: [DONE]`. If the client goes, Starlette cancels
        this generator; the cancellation reaches AsyncLLM.generate, which aborts the request."""
        envelope = self.envelope(response_id)
        completion_tokens = 0
        prompt_tokens = first.prompt_tokens
        try:
            delta: Delta | None = first
            while delta is not None:
                completion_tokens += len(delta.token_ids)
                yield sse_event({**envelope, "choices": [choice(delta)]})
                delta = await anext(deltas, None)
            if pending is not None:
                pending.finish(prompt_tokens, completion_tokens)
            if include_usage:
                final = usage(prompt_tokens, completion_tokens).model_dump()
                yield sse_event({**envelope, "choices": [], "usage": final})
            yield "data: [DONE]\n\n"
        except Exception as error:  # engine failure mid-stream: the status line is already sent
            logger.warning("stream %s failed: %s", response_id, error)
            yield sse_event(error_body(f"generation failed: {error}"))
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]
            self.release()
            if pending is not None:
                pending.drop()  # no-op after finish(); a cut-short stream is not recorded

    def envelope(self, response_id: str) -> dict[str, Any]:
        return {
            "id": response_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }


async def last(deltas: AsyncIterator[Delta]) -> Delta:
    """The final output (run to the end, so that vLLM sees the request finish, not abort)."""
    final: Delta | None = None
    async for delta in deltas:
        final = delta
    if final is None:
        raise RuntimeError("the engine returned no output")
    return final


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def choice(delta: Delta) -> dict[str, Any]:
    # token_ids (vLLM's own name for them) let a client count tokens exactly even when
    # the text is empty (no tokenizer) or several tokens decode to one character.
    return {
        "index": 0,
        "text": delta.text,
        "token_ids": delta.token_ids,
        "logprobs": None,
        "finish_reason": delta.finish_reason,
    }


def sse_event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def engine_error(error: Exception) -> Exception:
    """Maps an exception from vLLM to what the client should see."""
    if isinstance(error, RequestError):
        return error
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # older vLLM: validation errors are ValueErrors
        VLLMClientError = ValueError  # noqa: N806
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:
        EngineDeadError = RuntimeError  # noqa: N806
    if isinstance(error, VLLMClientError | ValueError):
        return RequestError(f"the engine refused the request: {error}")
    if isinstance(error, EngineDeadError):
        return RequestError("the engine has died; restart the server", status=503)
    return error


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Awaits `awaitable`, cancelling it (which aborts the engine request) if the client
    disconnects first. Starlette does this for streams already; this covers the wait
    before the first byte and whole non-streamed answers."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watcher.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
        await work
    raise ClientGone()


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def bearer_auth(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise RequestError(
                "missing or wrong bearer token (send 'Authorization: Bearer <api_key>')",
                status=401,
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check


def install_error_handlers(app: FastAPI) -> None:
    async def on_request_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, RequestError)
        return JSONResponse(
            error_body(error.message, error.field), status_code=error.status, headers=error.headers
        )

    async def on_validation_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, RequestValidationError)
        first = error.errors()[0] if error.errors() else {"msg": "invalid request", "loc": ()}
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", "")
            return JSONResponse(
                error_body(f"the body is not valid JSON: {detail}".rstrip(": ")), 400
            )
        # pydantic adds the union member it tried ("str", "list[int]") to the location
        location = [
            str(part)
            for part in first.get("loc", ())
            if part != "body" and str(part) not in UNION_TAGS and "[" not in str(part)
        ]
        if not location:
            message = "the body must be a JSON object (send Content-Type: application/json)"
            return JSONResponse(error_body(message), status_code=400)
        message = f"{'.'.join(location)}: {first['msg']}"
        if first.get("type") != "missing" and "input" in first:
            message += f" (got {short_repr(first['input'])})"
        return JSONResponse(error_body(message, location[0]), status_code=400)

    async def on_http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, StarletteHTTPException)
        return JSONResponse(
            error_body(str(error.detail)), status_code=error.status_code, headers=error.headers
        )

    async def on_client_gone(request: Request, error: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    app.add_exception_handler(RequestError, on_request_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ClientGone, on_client_gone)


def short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.asynccontextmanager
async def in_process_engine(
    config: ServerConfig, vllm_config: VllmConfig | None = None
) -> AsyncIterator[Engine]:
    """AsyncLLM started in this process, in a worker thread (start-up blocks for tens of
    seconds; /health answers meanwhile), shut down on exit."""
    engine = await asyncio.to_thread(Engine.start, config, vllm_config)
    try:
        await engine.finish_start()
        yield engine
    finally:
        engine.shutdown()


def create_app(
    config: ServerConfig,
    *,
    vllm_config: VllmConfig | None = None,
    on_fatal: Callable[[str], None] | None = None,
    engine_source: EngineSource | None = None,
    front_end: FrontEnd = FrontEnd(),
    metrics: RequestMetrics | None = None,
) -> FastAPI:
    """The server for `config`. Its lifespan starts the engine (`engine_source`, by default
    `in_process_engine`) in the background, so that /health answers (503) while the engine
    loads; `on_fatal(message)` is called if the engine cannot start (the CLI uses it to stop
    uvicorn and exit non-zero)."""
    holder = EngineHolder()
    metrics = metrics or RequestMetrics()
    settings = config.serving.recorder
    recorder = TrafficRecorder(settings) if settings is not None else None
    handlers = Handlers(config, holder, metrics, recorder, front_end)
    source = engine_source or (lambda: in_process_engine(config, vllm_config))
    running = contextlib.AsyncExitStack()  # holds the engine once started

    async def start_engine() -> None:
        try:
            engine = await running.enter_async_context(source())
        except Exception as error:  # any start failure: report it in one line and stop
            holder.error = (
                f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            )
            logger.error("engine start failed: %s", holder.error)
            if on_fatal is not None:
                on_fatal(holder.error)
            return
        holder.engine = engine
        # What start-up made (vLLM, torch: ~650k objects) is never garbage: exempt it from
        # full collections, which would otherwise stall every request for ~0.3 s at a time.
        freeze_heap()
        logger.info("engine ready: %s", engine.settings.model_dump_json())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starting = asyncio.create_task(start_engine(), name="engine-start")
        if recorder is not None:
            await recorder.start()
        try:
            yield
        finally:
            # A start in progress cannot be interrupted (it runs in a thread); let it finish
            # so that the engine it made is shut down rather than orphaned.
            await starting
            holder.engine = None
            await running.aclose()
            if recorder is not None:
                await recorder.stop()  # writes what is still buffered

    app = FastAPI(
        title="vllm-autotune server",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    install_error_handlers(app)
    auth = [Depends(bearer_auth(config.api_key))]
    app.add_api_route("/health", handlers.health, methods=["GET"])
    app.add_api_route("/metrics", handlers.metrics_text, methods=["GET"], dependencies=auth)
    app.add_api_route("/info", handlers.info, methods=["GET"], dependencies=auth)
    app.add_api_route(
        "/translate",
        handlers.translate,
        methods=["POST"],
        dependencies=auth,
        response_model=TranslateResponse,
    )
    app.add_api_route("/v1/completions", handlers.completions, methods=["POST"], dependencies=auth)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
