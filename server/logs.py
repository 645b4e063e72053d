"""The server's own diagnostics on stderr ("engine ready: ...", "front end 2 of 4 ...").

vLLM and uvicorn configure their own loggers; nothing configured the `server` logger, so Python
dropped its INFO records and a server log never said when the engine was ready or with what
settings. Each server process (the main one and every spawned front end) calls this once.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s"


def configure_logging(level: int = logging.INFO) -> None:
    """INFO and above from the `server` loggers to stderr, once per process."""
    logger = logging.getLogger("server")
    if logger.handlers:  # configured already, by an earlier call or a host application
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # a host application's root handler would print it twice
