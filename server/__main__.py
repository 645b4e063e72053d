"""`python -m server [--config FILE] [--host H] [--port P] [--benchmark-mode]`

Without --config: the embedded tiny model (random weights) on 127.0.0.1:8000.
Exit codes: 0 after a clean stop, 1 if the engine fails to start, 2 for a bad config.
"""

from __future__ import annotations

import argparse
import sys

from server.config import ConfigError, ServerConfig

PROG = "server"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML config (the file `autotune` exports)")
    parser.add_argument("--host", help="address to bind (default: the config's, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default: the config's, 8000)")
    parser.add_argument(
        "--benchmark-mode",
        action="store_true",
        help="accept ignore_eos / min_tokens on /v1/completions (exact output lengths)",
    )
    return parser.parse_args(argv)


def load_config(args: argparse.Namespace) -> ServerConfig:
    config = ServerConfig.load(args.config) if args.config else ServerConfig.default()
    overrides: dict = {}
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        if not 1 <= args.port <= 65535:
            raise ConfigError("--port", "port", args.port, "must be between 1 and 65535")
        overrides["port"] = args.port
    if args.benchmark_mode:
        overrides["serving"] = config.serving.model_copy(update={"benchmark_mode": True})
    return config.model_copy(update=overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args)
    except ConfigError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2

    from server.engine import resolve_engine_config

    # vLLM checks the values (dtype, lengths, memory fraction ...) when it builds its config;
    # doing that before binding the port turns a bad value into exit 2, not a crash later.
    try:
        vllm_config = resolve_engine_config(config)
    except Exception as error:  # vLLM raises ValueError, TypeError, pydantic errors ...
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        where = args.config or "<default config>"
        print(
            f"{PROG}: error: {where}: vLLM rejected the engine settings: {first}", file=sys.stderr
        )
        return 2

    import uvicorn

    from server.app import create_app

    failures: list[str] = []
    server: uvicorn.Server | None = None

    def on_fatal(message: str) -> None:
        failures.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(config, vllm_config=vllm_config, on_fatal=on_fatal)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            workers=1,
            loop="auto",
            lifespan="on",
            access_log=False,
            timeout_graceful_shutdown=5,
        )
    )
    server.run()
    if failures:
        print(f"{PROG}: error: the engine failed to start: {failures[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
