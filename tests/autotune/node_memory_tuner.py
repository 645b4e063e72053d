"""`python node_memory_tuner.py NODE_BYTES BEHAVIOUR.json autotune-args...`: fake_server_tuner.py
on a machine whose NUMA node holds NODE_BYTES of RAM: what the CPU defaults are derived from
(server.config.cpu_node_memory: the baseline's memory share and the searched band), so that a
test can change the machine between a study and its --resume."""

from __future__ import annotations

import sys

from fake_server_tuner import use_fake_server

import server.config
from autotune.cli import main

if __name__ == "__main__":
    node_bytes = int(sys.argv[1])
    server.config.cpu_node_memory = lambda: node_bytes  # type: ignore[assignment]
    use_fake_server(sys.argv[2])
    sys.exit(main(sys.argv[3:]))
