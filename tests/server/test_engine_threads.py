"""On vLLM's CPU platform our server's engine runs one torch thread fewer than its CPUs, leaving
one to the front end (server.engine.leave_a_cpu_to_the_front_end); a user's OMP_NUM_THREADS wins.

In a process of its own: a torch thread count, once set, stays for the process. What it is
worth is measured in benchmarks/serving_overhead.py (column our_server_all_threads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, os, sys
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
from server.engine import leave_a_cpu_to_the_front_end
import torch
set_to = leave_a_cpu_to_the_front_end()
print(json.dumps({"set": set_to, "torch": torch.get_num_threads(), "env": os.environ.get("OMP_NUM_THREADS")}))
"""

pytestmark = [
    pytest.mark.slow,  # imports vLLM (~10 s)
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs"),
]


def probe(**env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | env
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT,
                          env=environment, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_cpus_give_the_engine_one_thread_and_the_front_end_the_other() -> None:
    assert probe() == {"set": 1, "torch": 1, "env": "1"}


def test_a_thread_count_the_user_set_is_kept() -> None:
    assert probe(OMP_NUM_THREADS="2") == {"set": None, "torch": 2, "env": "2"}
