"""The suite's plugins, registered here (pytest takes `pytest_plugins` only from a conftest it
loads at the start, as it does this one for any test under tests/); each is a module of
tests/plugins/ with one job:

- engine_lanes: `--engine-lanes N` under `--dist loadgroup` (make test): the tests marked
  `engine` or `postgres` run in N lanes of their own, one test at a time each, on CPUs of their
  own, scheduled as each lane finishes its last; sets the `postgres` marker from the fixture.
- fork_server: `--shared-fork-server` (make test): one fork server for the session, which every
  trial server the tests start is forked from.
- reliability: the `reliability` fixture and marker, and `--reliability-dir DIR` (make
  reliability), which writes the record of the scenarios (results/reliability.{json,md}).
- session_env: the environment every process of the session inherits (a facts cache of its
  own, a high client-lag limit), and the check that no test leaves vLLM's start method in it.
"""

pytest_plugins = [
    "tests.plugins.engine_lanes",
    "tests.plugins.fork_server",
    "tests.plugins.reliability",
    "tests.plugins.session_env",
]
