"""Several front-end processes sharing one engine core (`serving.api_processes` > 1).

One Python process, one event loop, carries the engine of a small model on a big GPU only so
far (issue 17: ~85 req/s goodput where the engine carries 260+). `vllm serve
--api-server-count N` answers that with N API processes on one listening socket, each a client
of one engine core over ZMQ. This module runs *our* app the same way, through vLLM's own
launcher rather than a copy of it (its internals differ between vLLM 0.24 and 0.32):

- the main process builds the `vllm serve` arguments for our engine settings (vLLM's own
  parser, then our engine arguments set on it) and calls vLLM's `run_multi_api_server`. That
  starts the engine core once, binds the socket, spawns N processes and supervises them all;
- vLLM spawns each front end by a module-level name, `vllm.v1.utils.run_api_server_worker_proc`;
  for the time of the call that name is `run_api_process` with our config bound, so each
  process serves our FastAPI app (server.app) around its engine client
  (`build_async_engine_client(args, client_config=...)`, vLLM's own, for both versions);
- metrics: vLLM sets PROMETHEUS_MULTIPROC_DIR before spawning; every front end writes vLLM's
  and our metrics there, and /metrics reads them all (server.app.RequestMetrics);
- stopping: vLLM's handler turns SIGTERM/SIGINT in the main process into a shutdown of the
  front ends and the engine core; whatever is still alive after a failure is ended here
  (`stop_children`), so no process of the group outlives the server.

Accepting is the kernel's: every front end waits on the one shared socket (as vLLM 0.24's own
front ends do; vLLM 0.32's also balance accepts by open connections, ours do not).
Per-process behaviour: routes, auth and benchmark mode are the same in every process; the
admission limit is estimated from each process's share (server.app.Handlers.admit); the
recorder is refused with more than one process (server.config.ServingSettings).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import psutil

from server.config import ServerConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

    from server.engine import Engine

logger = logging.getLogger("server")
STOP_GRACE_S = 10.0  # SIGTERM to SIGKILL for processes left after a failure


def serve_app(build: Callable[[Callable[[str], None]], FastAPI], listener: socket.socket) -> str | None:
    """Serves `build(on_fatal)` with uvicorn on `listener` until stopped.

    Returns the engine's start failure (what the app passed to `on_fatal`), or None.
    """
    import uvicorn

    failures: list[str] = []
    server: uvicorn.Server | None = None

    def on_fatal(message: str) -> None:
        failures.append(message)
        if server is not None:
            server.should_exit = True

    app = build(on_fatal)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            workers=1,
            loop="auto",
            lifespan="on",
            access_log=False,
            timeout_graceful_shutdown=5,
        )
    )
    server.run(sockets=[listener])
    return failures[0] if failures else None


def vllm_serve_args(config: ServerConfig) -> argparse.Namespace:
    """`vllm serve --host H --port P --api-server-count N` with our engine settings.

    vLLM's own parser gives every option vLLM's launcher reads its default; our engine
    arguments are then set as they are (the values `AsyncEngineArgs(**settings)` takes in the
    one-process server, server.engine), so both paths build the same engine config.
    """
    from vllm.entrypoints.cli.serve import ServeSubcommand

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layout
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    argv = ["serve", "--host", config.host, "--port", str(config.port),
            "--api-server-count", str(config.serving.api_processes)]
    args = parser.parse_args(argv)
    for name, value in config.engine_settings().items():
        setattr(args, name, value)
    return args


def serve_shared_engine(config: ServerConfig) -> str | None:
    """Runs the engine core and `api_processes` front ends until stopped (blocking).

    Returns None after a clean stop (SIGTERM/SIGINT), else why it failed, in one line.
    """
    import vllm.v1.utils as vllm_utils
    from vllm.entrypoints.cli.serve import run_multi_api_server

    args = vllm_serve_args(config)
    original = vllm_utils.run_api_server_worker_proc
    # The one hook: vLLM's APIServerProcessManager spawns this module-level name (it takes a
    # `target_server_fn`, but run_multi_api_server passes none). A partial of a module-level
    # function pickles by reference for the spawn context; the name is restored afterwards.
    vllm_utils.run_api_server_worker_proc = functools.partial(run_api_process, config)
    try:
        run_multi_api_server(args)
    except SystemExit:  # vLLM's SIGTERM/SIGINT handler: the group has been shut down
        return None
    except Exception as error:  # the engine or a front end failed: report it in one line
        text = str(error).strip()
        return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
    finally:
        vllm_utils.run_api_server_worker_proc = original
        stop_children()
    return None


def stop_children(grace_s: float = STOP_GRACE_S) -> None:
    """Ends every process this one started that is still alive (SIGTERM, then SIGKILL).

    vLLM shuts its processes down on a clean stop; after an exception during start-up (the
    engine core failed its handshake) its front ends are left to a garbage-collector hook.
    """
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def run_api_process(
    config: ServerConfig,
    listen_address: str,
    sock: socket.socket,
    args: argparse.Namespace,
    client_config: dict[str, Any] | None = None,
) -> None:
    """One front-end process: our app on the shared socket, around its engine client.

    Called by vLLM's APIServerProcessManager in a spawned process, with the arguments it
    gives its own worker. Exits 1 if its engine client cannot start (vLLM then stops all).
    """
    from server.app import FrontEnd, RequestMetrics, create_app
    from server.logs import configure_logging

    configure_logging()  # a spawned process: main()'s handler is not here
    client_config = dict(client_config or {})
    # vLLM 0.32's shared connection counts, for its own accept balancing (not used here).
    client_config.pop("api_server_loads", None)
    front_end = FrontEnd(
        index=int(client_config.get("client_index", 0)),
        count=int(client_config.get("client_count", 1)),
    )
    # vLLM's own title for its front ends (VLLM::APIServer_N): a tuner reading per-process
    # CPU use (autotune.measure.process_cpu) tells front ends from the engine core by it.
    from vllm.utils.system_utils import set_process_title

    set_process_title("APIServer", str(front_end.index))
    metrics = RequestMetrics(multiprocess_dir=os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
    logger.info("front end %d of %d (pid %d) on %s",
                front_end.index + 1, front_end.count, os.getpid(), listen_address)

    def build(on_fatal: Callable[[str], None]) -> FastAPI:
        return create_app(
            config,
            on_fatal=on_fatal,
            engine_source=lambda: engine_client(args, client_config),
            front_end=front_end,
            metrics=metrics,
        )

    failure = serve_app(build, sock)
    if failure is not None:
        raise SystemExit(1)


@contextlib.asynccontextmanager
async def engine_client(
    args: argparse.Namespace, client_config: dict[str, Any]
) -> AsyncIterator[Engine]:
    """This process's client of the shared engine core, as vLLM's own front ends make it."""
    try:
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    except ImportError:  # vLLM 0.24's layout
        from vllm.entrypoints.openai.api_server import build_async_engine_client

    from server.engine import Engine

    async with build_async_engine_client(args, client_config=client_config) as client:
        engine = Engine.attach(client)
        await engine.finish_start()
        yield engine
