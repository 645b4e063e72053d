"""The KV cache a vLLM engine made of its memory, read from its startup log (server.log).

vLLM logs it once per engine start; the lines differ by backend and version:

    GPU (vLLM 0.24): "Available KV cache memory: 56.82 GiB"
                     "GPU KV cache size: 465,504 tokens"
    CPU (vLLM 0.32): "Auto set (0.23/9.09) GiB for KV cache on node 0, ..."
                     "CPU KV cache size: 120,960 tokens, Maximum concurrency for ..."

The log is the only place both figures appear without importing vLLM into the tuner, and it
works the same for stock `vllm serve`. A figure the log lacks stays None.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

logger = logging.getLogger(__name__)

_TOKENS = re.compile(r"\b[A-Z]+(?: \+ host)? KV cache size: (?P<tokens>[0-9,]+) tokens")
_GIB = (
    re.compile(r"Available KV cache memory: (?P<gib>[0-9.]+) GiB"),
    # CPU: "(Auto|Explicitly) set (KV/TOTAL) GiB for KV cache"
    re.compile(r"set \((?P<gib>[0-9.]+)/[0-9.]+\) GiB for KV cache"),
)


class KVCacheSize(BaseModel):
    """The engine's KV cache: memory and the tokens it holds."""

    gib: float | None = None
    tokens: int | None = None

    def describe(self) -> str:
        parts = []
        if self.gib is not None:
            parts.append(f"{self.gib:.3g} GiB")
        if self.tokens is not None:
            parts.append(f"{self.tokens:,} tokens")
        return ", ".join(parts) or "unknown"


def kv_cache_note(figures: dict[str, Any], who: str) -> str:
    """' (KV cache 1.2 GiB, 9,800 tokens)' from provenance-style figures (`{who}_kv_cache_gib`,
    `{who}_kv_cache_tokens`), or '' when neither is known."""
    size = KVCacheSize(gib=figures.get(f"{who}_kv_cache_gib"), tokens=figures.get(f"{who}_kv_cache_tokens"))
    return f" (KV cache {size.describe()})" if size.gib is not None or size.tokens is not None else ""


def parse_kv_cache(text: str) -> KVCacheSize | None:
    """The last KV cache figures in a server log (one engine per log), or None."""
    tokens = [match["tokens"] for match in _TOKENS.finditer(text)]
    gib = [match["gib"] for pattern in _GIB for match in pattern.finditer(text)]
    if not tokens and not gib:
        return None
    return KVCacheSize(
        gib=float(gib[-1]) if gib else None,
        tokens=int(tokens[-1].replace(",", "")) if tokens else None,
    )


def read_kv_cache(log: Path) -> KVCacheSize | None:
    """`parse_kv_cache` of a log file; None when it is missing or unreadable."""
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        logger.debug("no KV cache figures from %s: %s", log, error)
        return None
    return parse_kv_cache(text)
