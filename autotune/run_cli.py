"""`run_request` where it was before autotune/cli/ held the command line: the search
benchmark (benchmarks/search_measure.py) imports it from here. Everything else imports
autotune.cli.run; delete this module once the benchmark does too."""

from autotune.cli.run import run_request

__all__ = ["run_request"]
