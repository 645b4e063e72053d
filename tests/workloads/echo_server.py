"""A tiny OpenAI-style completions server with exact, known delays (for replayer tests).

Raw asyncio HTTP/1.1 (keep-alive, chunked SSE), no framework, so its own overhead is a few
tens of microseconds and its timing is what the test asks for. Run it as its own process:

    python tests/workloads/echo_server.py [--port 0]     # prints "PORT <n>" when listening

Behaviour is chosen per request by a path prefix, so one server serves every test:

    POST /ttft=150,itl=30,tag=a/v1/completions
        ttft    ms from the request to the first token chunk          (default 0)
        itl     ms between tokens                                     (default 0)
        chunk   tokens per chunk; chunks then come every chunk*itl ms  (default 1)
        ids     1: each chunk carries `token_ids` (its token count)    (default 0)
        empty   1: send an empty-text chunk at once, before the first token
        status  answer every request with this HTTP status and a JSON error body
        failevery  answer every Nth request of the tag (N, 2N, ...) with HTTP 400 and a JSON
                error body, the others normally                         (default: none)
        usage   0: send no usage chunk at the end                      (default 1)
        err     after this many tokens, send an error event (as vLLM does) and [DONE]
        tag     name under which requests are counted (default: the whole prefix)
    GET /tag=a/stats -> {"requests", "in_flight", "max_in_flight", "last_body",
                         "last_authorization", "timings", "connections" (server-wide)}
        timings: per request, in arrival order, {"received", "prompt_head", "tokens"}: when
        the request was read and when each token chunk was about to be written, in seconds of
        the machine's monotonic clock (time.monotonic() in any process), so that a test can
        set what its client measured beside what the server did.

Token k (0-based) is sent at request time + ttft + k*itl on absolute deadlines, so the
end-to-end time is ttft + (n-1)*itl however long each write took. Exactly `max_tokens`
tokens are sent, then a usage chunk (unless usage=0) and `data: [DONE]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass, field


@dataclass
class TagStats:
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    last_body: dict = field(default_factory=dict)
    last_authorization: str | None = None
    timings: list[dict] = field(default_factory=list)


@dataclass
class Options:
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    chunk: int = 1
    ids: bool = False
    empty: bool = False
    status: int = 200
    err: int | None = None
    fail_every: int | None = None
    usage: bool = True
    tag: str = ""

    @classmethod
    def parse(cls, prefix: str) -> Options:
        options = cls(tag=prefix)
        for item in filter(None, prefix.split(",")):
            key, _, value = item.partition("=")
            if key == "ttft":
                options.ttft_ms = float(value)
            elif key == "itl":
                options.itl_ms = float(value)
            elif key == "chunk":
                options.chunk = int(value)
            elif key == "ids":
                options.ids = value == "1"
            elif key == "empty":
                options.empty = value == "1"
            elif key == "status":
                options.status = int(value)
            elif key == "err":
                options.err = int(value)
            elif key == "failevery":
                options.fail_every = int(value)
            elif key == "usage":
                options.usage = value == "1"
            elif key == "tag":
                options.tag = value
            else:
                raise ValueError(f"unknown option {key!r}")
        return options


class EchoServer:
    def __init__(self) -> None:
        self.stats: dict[str, TagStats] = {}
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                await self.route(method, target, headers, body, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def route(
        self, method: str, target: str, headers: dict, body: bytes, writer: asyncio.StreamWriter
    ) -> None:
        path = target.strip("/")
        if method == "GET" and path.endswith("stats"):
            options = Options.parse(path[: -len("stats")].strip("/"))
            stats = self.stats.get(options.tag, TagStats())
            payload = dict(vars(stats), connections=self.connections)
            await self.respond_json(writer, 200, payload)
            return
        if method != "POST" or not path.endswith("v1/completions"):
            await self.respond_json(writer, 404, {"error": f"no route {method} {target}"})
            return
        options = Options.parse(path[: -len("v1/completions")].strip("/"))
        stats = self.stats.setdefault(options.tag, TagStats())
        request = json.loads(body)
        stats.requests += 1
        stats.in_flight += 1
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        stats.last_body = {k: v for k, v in request.items() if k != "prompt"}
        stats.last_body["prompt_len"] = len(request["prompt"])
        stats.last_body["prompt_head"] = request["prompt"][:8]
        stats.last_authorization = headers.get("authorization")
        timing: dict = {
            "received": asyncio.get_running_loop().time(),
            "prompt_head": request["prompt"][:8],
            "tokens": [],
        }
        stats.timings.append(timing)
        try:
            if options.status != 200:
                await self.respond_json(writer, options.status, {"error": "injected failure"})
            elif options.fail_every and stats.requests % options.fail_every == 0:
                await self.respond_json(writer, 400, {"error": "injected failure (every Nth)"})
            else:
                await self.stream(writer, options, request, timing["tokens"])
        finally:
            stats.in_flight -= 1

    async def respond_json(self, writer: asyncio.StreamWriter, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        await writer.drain()

    async def stream(
        self, writer: asyncio.StreamWriter, options: Options, request: dict, written: list[float]
    ) -> None:
        loop = asyncio.get_running_loop()  # its clock is time.monotonic()
        start = loop.time()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )

        async def event(payload: dict | str) -> None:
            text = payload if isinstance(payload, str) else json.dumps(payload)
            data = f"data: {text}\n\n".encode()
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()

        def chunk(text: str, token_ids: list[int] | None) -> dict:
            choice: dict = {"index": 0, "text": text, "finish_reason": None}
            if token_ids is not None:
                choice["token_ids"] = token_ids
            return {"object": "text_completion", "choices": [choice]}

        if options.empty:
            await event(chunk("", None))
        else:
            await writer.drain()  # headers now: a client must not take them for a token
        n = int(request["max_tokens"])
        sent = 0
        while sent < n:
            if options.err is not None and sent >= options.err:
                await event({"error": {"message": "injected engine failure", "code": 500}})
                break
            k = min(options.chunk, n - sent)
            deadline = start + (options.ttft_ms + sent * options.itl_ms) / 1000.0
            await asyncio.sleep(max(deadline - loop.time(), 0.0))
            ids = list(range(sent, sent + k))
            written.append(loop.time())  # before the write: no client can see the chunk earlier
            await event(chunk(" t" * k, ids if options.ids else None))
            sent += k
        usage = {
            "prompt_tokens": len(request["prompt"]),
            "completion_tokens": n,
            "total_tokens": len(request["prompt"]) + n,
        }
        if options.err is None and options.usage:
            await event({"object": "text_completion", "choices": [], "usage": usage})
        await event("[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()


async def serve(host: str, port: int) -> None:
    server = EchoServer()
    listener = await asyncio.start_server(server.handle, host, port, backlog=4096)
    bound = listener.sockets[0].getsockname()[1]
    print(f"PORT {bound}", flush=True)
    async with listener:
        await listener.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    try:
        asyncio.run(serve(args.host, args.port))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
