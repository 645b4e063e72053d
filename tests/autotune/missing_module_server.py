"""A stand-in for `python -m server` on an install that lacks a module one code path imports
(vLLM's fp8 path imports loguru; an H200 trial died on it).

Usage: python missing_module_server.py COUNT_FILE HEALTHY fake_server.py-args...
Launches are counted in COUNT_FILE: the first HEALTHY run tests/autotune/fake_server.py with the
remaining arguments, every later one dies at start on a real failed import (Python's own
ModuleNotFoundError traceback in the server log, exit code 1).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

FAKE_SERVER = Path(__file__).with_name("fake_server.py")


def main() -> None:
    count_file, healthy, *rest = sys.argv[1:]
    counter = Path(count_file)
    launches = int(counter.read_text() or "0") + 1 if counter.exists() else 1
    counter.write_text(str(launches))
    if launches > int(healthy):
        import autotune_test_module_not_installed  # noqa: F401  (raises ModuleNotFoundError)
    sys.argv = [str(FAKE_SERVER), *rest]
    runpy.run_path(str(FAKE_SERVER), run_name="__main__")


if __name__ == "__main__":
    main()
