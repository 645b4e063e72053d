"""Durations in and out: `--time-budget 30m`, `--gpu-seconds 2h` and the per-trial progress line."""

from __future__ import annotations

import re

from autotune.errors import AutotuneError

# A sign is accepted so that `-5` is refused for what it is (not more than 0), not as a typo.
_DURATION = re.compile(r"^\s*(?P<value>[-+]?[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>s|m|h)?\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str, *, option: str = "--time-budget") -> float:
    """`90`, `90s`, `30m`, `1.5h` -> seconds (a bare number is seconds)."""
    match = _DURATION.match(text)
    if match is None:
        raise AutotuneError(
            f"{option} {text!r}: expected a number with an optional unit s, m or h (e.g. 30m)"
        )
    seconds = float(match["value"]) * _UNIT_S[match["unit"] or "s"]
    if seconds <= 0:
        raise AutotuneError(f"{option} {text!r}: must be more than 0 seconds")
    return seconds


def format_duration(seconds: float | None) -> str:
    """`75.2` -> `1m15s`; `None` -> `?`."""
    if seconds is None:
        return "?"
    total = max(0, int(round(seconds)))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def progress_line(
    *,
    done: int,
    total: int | None,
    elapsed_s: float,
    best: str,
    eta_s: float | None,
    this: str,
) -> str:
    """`trial 3/6  elapsed 2m14s  best 1.83 req/s (trial 2)  ETA 5m40s  | this: ...`."""
    count = f"{done}/{total}" if total is not None else f"{done}"
    return (
        f"trial {count}  elapsed {format_duration(elapsed_s)}  best {best}  "
        f"ETA {format_duration(eta_s)}  | {this}"
    )


def say(line: str) -> None:
    """A line for the person watching the run (stdout, flushed at once)."""
    print(line, flush=True)
