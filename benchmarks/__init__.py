"""The benchmarks (docs/benchmarks.md), a package so that they and the tests import each other's
modules as `benchmarks.X`. Each runnable one is still run as a file,
`.venv/bin/python benchmarks/X.py ...`: Python then puts benchmarks/ on sys.path, not the
repository, so such a script puts the repository there first (`if not __package__:` at its
top) for its `benchmarks.*` imports. Not shipped: the wheel holds autotune, server, workloads."""
