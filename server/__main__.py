"""`python -m server [--config FILE] [--host H] [--port P] [--benchmark-mode] [--api-processes N]`

Without --config: the embedded tiny model (random weights) on 127.0.0.1:8000. With N > 1 front-end
processes (`serving.api_processes`), this process runs the engine core and N processes serve the
app on one socket (server.frontends); with 1, the app and AsyncLLM run here, one event loop.
Exit codes: 0 after a clean stop, 1 if the address cannot be bound or the engine fails to
start, 2 for a bad config. Started by the tuner (AUTOTUNE_PARENT_PID set), the server stops by
itself, engine included, once the tuner's process is gone (server.lifeline).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from server.config import (
    NO_MODEL_RULE,
    ConfigError,
    EngineSettingsRefused,
    ServerConfig,
    ServingSettings,
    check_model_available,
    validated,
)
from server.lifeline import watch_parent_from_env
from server.logs import configure_logging
from workloads.errors import OneLineErrorParser

PROG = "server"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineErrorParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", help=f"YAML config (the file `autotune` exports; {NO_MODEL_RULE})"
    )
    parser.add_argument("--host", help="address to bind (default: the config's, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default: the config's, 8000)")
    parser.add_argument(
        "--benchmark-mode",
        action="store_true",
        help="accept ignore_eos / min_tokens on /v1/completions (exact output lengths)",
    )
    parser.add_argument(
        "--api-processes",
        type=int,
        metavar="N",
        help="front-end processes sharing one engine core, as `vllm serve --api-server-count` "
             "(default: the config's serving.api_processes, 1)",
    )
    return parser.parse_args(argv)


def load_config(args: argparse.Namespace) -> ServerConfig:
    config = ServerConfig.load(args.config).with_default_model() if args.config else ServerConfig.default()
    check_model_available(str(config.engine["model"]), args.config or "<default config>")
    overrides: dict = {}
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        if not 1 <= args.port <= 65535:
            raise ConfigError("--port", "port", args.port, "must be between 1 and 65535")
        overrides["port"] = args.port
    serving: dict = {}
    if args.benchmark_mode:
        serving["benchmark_mode"] = True
    if args.api_processes is not None:
        serving["api_processes"] = args.api_processes
    if serving:  # validated again: --api-processes may conflict with the config's recorder
        where = args.config or "<default config>"
        data = {**config.serving.model_dump(), **serving}
        overrides["serving"] = validated(ServingSettings, data, where, "serving", None)
    return config.model_copy(update=overrides)


def bind(host: str, port: int) -> socket.socket:
    """The listening address, bound now (listening starts once uvicorn serves).

    Binding before the engine starts turns a taken port into an error within seconds; bound
    later (uvicorn's default), it would show only after the engine's tens of seconds of start.
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def release_in_forked_children(fd: int) -> None:
    """Every child this process forks gives up `fd` (the listening socket) at once.

    A forked engine core (server.engine.choose_engine_core_start; vLLM's default on GPUs too)
    would inherit it: outliving a SIGKILLed server, it kept the port open, and clients connected
    to a socket nobody accepted on and waited for ever (a tuner's replay hung 600 s). Closing the
    socket object is not enough: uvloop serves from the descriptor itself. The number is pointed
    at /dev/null rather than closed, so a stale close in the child cannot hit a reused number.
    """

    def give_up() -> None:
        null = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)

    os.register_at_fork(after_in_child=give_up)


def preload() -> None:
    """Imports what `main` imports on its way to serving (vLLM, torch, the app), and nothing
    more: a process that forks servers (autotune.measure.forkserver) calls it once, so that each
    server it forks starts where the import ended. Reads no engine setting and starts nothing."""
    import uvicorn  # noqa: F401
    import vllm.engine.arg_utils  # noqa: F401
    import vllm.usage.usage_lib  # noqa: F401
    import vllm.v1.engine.async_llm  # noqa: F401

    import server.app  # noqa: F401
    import server.engine  # noqa: F401
    import server.frontends  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    # First: a tuner killed while this server imports vLLM must not leave it behind.
    watch_parent_from_env()
    configure_logging()
    args = parse_args(argv)
    try:
        config = load_config(args)
    except ConfigError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    if config.api_server:
        print(f"{PROG}: note: {args.config}: not applied here, kept for `vllm serve`: "
              f"{', '.join(config.api_server)}", file=sys.stderr)
    try:
        listener = bind(config.host, config.port)
    except OSError as error:  # the message keeps "[Errno 98] Address already in use"
        print(f"{PROG}: error: cannot listen on {config.host}:{config.port}: {error}", file=sys.stderr)
        return 1
    with listener:
        return serve(args, config, listener)


def serve(args: argparse.Namespace, config: ServerConfig, listener: socket.socket) -> int:
    """Checks the engine settings with vLLM, then serves on `listener` until stopped."""
    from server.engine import (
        choose_engine_core_start,
        keep_cpu_worker_in_engine_core,
        resolve_engine_config,
    )

    keep_cpu_worker_in_engine_core()  # before the config: vLLM's platform picks the executor then
    # vLLM checks the values (dtype, lengths, memory fraction ...) when it builds its config;
    # doing that before the engine starts turns a bad value into exit 2, not a crash later.
    try:
        vllm_config = resolve_engine_config(config)
    except Exception as error:  # vLLM raises ValueError, TypeError, pydantic errors ...
        # vLLM's whole reason, on one line (a tuner reads the last lines of this log).
        refused = EngineSettingsRefused(args.config or "<default config>", config.engine, error)
        print(f"{PROG}: error: {refused}", file=sys.stderr)
        return 2

    choose_engine_core_start(config, vllm_config)  # where vLLM reads it when the engine starts

    from server.app import create_app
    from server.frontends import serve_app, serve_shared_engine

    host, port = listener.getsockname()[:2]
    processes = config.serving.api_processes
    if processes > 1:
        # vLLM binds the shared socket itself (SO_REUSEPORT on 0.32); ours only proved the
        # address free within seconds rather than after the engine's start.
        listener.close()
        print(f"{PROG}: {processes} front-end processes on {host}:{port}, one engine core; "
              "they answer once the engine is ready", file=sys.stderr, flush=True)
        failure = serve_shared_engine(config)
    else:
        release_in_forked_children(listener.fileno())
        print(f"{PROG}: listening on {host}:{port}; /health answers 503 until the engine is "
              "ready", file=sys.stderr, flush=True)
        failure = serve_app(
            lambda on_fatal: create_app(config, vllm_config=vllm_config, on_fatal=on_fatal),
            listener,
        )
    if failure is not None:
        print(f"{PROG}: error: the engine failed to start: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
