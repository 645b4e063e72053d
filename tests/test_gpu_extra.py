"""The GPU install path holds what every knob the space can propose imports (issue 58)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_extra_installs_what_vllms_fp8_path_imports() -> None:
    # `autotune run --allow fp8` proposes quantization: fp8, whose vLLM code path imports
    # loguru (through compressed-tensors): an H200 install without it failed every fp8 engine.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower() for requirement in extras["gpu"]}
    assert {"vllm", "loguru"} <= names
