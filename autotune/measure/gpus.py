"""How many GPUs this host gives the tuner's engines, counted without importing torch or vLLM.

The topology parameters (`tensor_parallel_size`, `data_parallel_size`: autotune.search.space)
must fit the host: one engine of a config holds TP x PP x DP GPUs. Importing torch to ask
costs seconds and creates a CUDA context in the tuner that the trials' engines would share
memory with, so the count is read the way CUDA itself would narrow it:

1. `CUDA_VISIBLE_DEVICES`, when set: the engines see only those devices (an empty value or
   "-1" hides every one). A list is counted up to its first empty entry, as CUDA stops there.
2. Else `nvidia-smi -L` (no shell, 10 s at most): one "GPU N: ..." line per device (MIG
   slices are listed under their GPU and not counted: vLLM takes whole devices).
3. Else 0: no NVIDIA GPU visible (a CPU host, or a driver that does not answer).

The environment and the command runner are parameters, so tests fake an N-GPU host.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable, Mapping, Sequence

logger = logging.getLogger(__name__)

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
NVIDIA_SMI = ("nvidia-smi", "-L")
SMI_TIMEOUT_S = 10.0

Runner = Callable[[Sequence[str]], str]


def run_nvidia_smi(command: Sequence[str]) -> str:
    """stdout of `command` (no shell); OSError or subprocess errors propagate."""
    done = subprocess.run(list(command), capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=True)
    return done.stdout


def count_gpus(environ: Mapping[str, str] | None = None, run: Runner = run_nvidia_smi) -> int:
    """The GPUs an engine started from this process may use (see the module docstring); 0 when
    none is visible. Never raises: a missing or failing `nvidia-smi` counts as no GPU."""
    environ = os.environ if environ is None else environ
    visible = environ.get(VISIBLE_ENV)
    if visible is not None:
        return visible_count(visible)
    try:
        listing = run(NVIDIA_SMI)
    except (OSError, subprocess.SubprocessError) as error:
        logger.debug("nvidia-smi -L: %s; counting no GPU", error)
        return 0
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def visible_count(value: str) -> int:
    """Devices a CUDA_VISIBLE_DEVICES value leaves visible: "0,1" 2, "" 0, "-1" 0, "0,,1" 1."""
    count = 0
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break  # CUDA ignores the list from the first invalid entry on
        count += 1
    return count
