"""Files written whole or not at all: a temporary file in the target's folder, then one rename.

A reader (another process, a crash, a Ctrl-C) sees the old file or the new one, never half of
one. The one helper every package uses (workloads is the bottom layer: server and autotune
import it).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


@contextmanager
def atomic_file(path: str | os.PathLike[str], mode: str = "w", *, shared: bool = False) -> Iterator[IO[Any]]:
    """Open a temporary file beside `path` for writing; on a clean exit it is flushed to disk
    and renamed over `path`, on an exception removed. `shared`: readable by everyone (0644,
    e.g. a trace); otherwise the owner's only (0600, as mkstemp creates it: configs may hold
    tokens)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    text = {} if "b" in mode else {"encoding": "utf-8", "newline": "\n"}
    try:
        with os.fdopen(fd, mode, **text) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        if shared:
            os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike[str], text: str, *, shared: bool = False) -> None:
    """`path` holds `text`, written whole or not at all."""
    with atomic_file(path, shared=shared) as handle:
        handle.write(text)
