"""The load client and the server on separate CPUs (issue 17): which CPUs each gets, and
real processes landing there (the server and what it starts; the client and its workers)."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path

import psutil
import pytest

from autotune.cli import main
from autotune.errors import AutotuneError
from autotune.measure.cpu_split import CpuSplit, format_cpu_list, parse_cpu_list
from autotune.measure.launcher import ServerLauncher
from autotune.measure.server_registry import StaleServerRegistry
from workloads.replay_workers import auto_workers
from workloads.trace import Trace, TraceRequest

HELPERS = Path(__file__).resolve().parents[1]  # tests/autotune: the fake servers, the tuners, fixtures/
SAMPLE = str(HELPERS.parents[1] / "workloads" / "samples" / "translation_trace.jsonl")
SIXTEEN = frozenset(range(16))


def fake_topology(tmp_path: Path, siblings: dict[int, str]) -> Path:
    for cpu, text in siblings.items():
        folder = tmp_path / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "thread_siblings_list").write_text(text + "\n")
    return tmp_path


def test_cpu_lists_parse_and_print_as_linux_writes_them() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == frozenset({0, 1, 2, 3, 8, 10, 11})
    assert format_cpu_list(frozenset({0, 1, 2, 5, 7, 8})) == "0-2,5,7-8"
    for bad in ("", "a", "3-1", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_auto_gives_the_client_the_last_half_in_whole_sibling_pairs(tmp_path: Path) -> None:
    # Hyper-thread pairs (n, n + 8), as on many 16-vCPU cloud hosts.
    topology = fake_topology(tmp_path, {n: f"{n % 8},{n % 8 + 8}" for n in range(16)})
    split = CpuSplit.resolve("auto", accelerator="gpu", available=SIXTEEN, sys_cpus=topology)
    assert split is not None
    assert split.client == frozenset({4, 5, 6, 7, 12, 13, 14, 15})  # four whole pairs: no core shared
    assert split.server == SIXTEEN - split.client
    assert split.describe() == "client CPUs 4-7,12-15, server CPUs 0-3,8-11"
    # Unknown topology: one CPU per group, the highest-numbered half.
    plain = CpuSplit.resolve("auto", accelerator="gpu", available=SIXTEEN, sys_cpus=tmp_path / "none")
    assert plain is not None and plain.client == frozenset(range(8, 16))
    # An odd pair count: whole pairs until the client has at least half.
    ten = frozenset(range(10))
    pairs = fake_topology(tmp_path / "ten", {n: f"{n % 5},{n % 5 + 5}" for n in range(10)})
    odd = CpuSplit.resolve("auto", accelerator="gpu", available=ten, sys_cpus=pairs)
    assert odd is not None and odd.client == frozenset({2, 3, 4, 7, 8, 9}) and odd.server == frozenset({0, 1, 5, 6})


def test_auto_shares_on_small_hosts_and_for_cpu_engines() -> None:
    assert CpuSplit.resolve("auto", accelerator="gpu", available=frozenset(range(4))) is None
    assert CpuSplit.resolve("auto", accelerator="cpu", available=SIXTEEN) is None
    assert CpuSplit.resolve("off", accelerator="gpu", available=SIXTEEN) is None
    given = CpuSplit.resolve("12-15", accelerator="cpu", available=SIXTEEN)
    assert given == CpuSplit(client=frozenset({12, 13, 14, 15}), server=frozenset(range(12)))


@pytest.mark.parametrize("spec, why", [
    ("lots", "--client-cpus 'lots': expected auto, off or a CPU list such as 12-15 or 6,7"),
    ("14-17", "--client-cpus 14-17: CPUs 16-17 are not available to this process (0-15)"),
    ("0-15", "--client-cpus 0-15: leaves no CPU for the server (available: 0-15)"),
])
def test_a_bad_client_cpu_list_is_refused_in_one_line(spec: str, why: str) -> None:
    with pytest.raises(AutotuneError) as refused:
        CpuSplit.resolve(spec, accelerator="gpu", available=SIXTEEN)
    assert str(refused.value) == why


def test_autotune_run_refuses_a_bad_list_before_any_server_starts(tmp_path: Path, capsys) -> None:
    code = main(["run", "--workload", SAMPLE, "--client-cpus", "9999", "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err.startswith("autotune: error: --client-cpus 9999: CPUs 9999 are not available")
    assert not (tmp_path / "trials").exists()


def test_the_client_workers_take_every_client_cpu_the_split_gives() -> None:
    busy = Trace.from_requests(TraceRequest(timestamp=i * 1.0, input_length=8, output_length=4)
                               for i in range(2000))  # 1,000 req/s
    assert auto_workers(busy, 1.0, cores=16) == 8  # shared host: half the cores
    assert auto_workers(busy, 1.0, cores=16, client_cpus=4) == 4  # a client's own 4 CPUs
    # Its own CPUs are used as soon as one process is not plenty (not only at 4 x 125 req/s).
    assert auto_workers(busy, 0.1, cores=16, client_cpus=4) == 4  # 100 req/s
    assert auto_workers(busy, 0.1, cores=16) == 1  # shared: one process for 100 req/s
    assert auto_workers(busy, 0.05, cores=16, client_cpus=4) == 1  # 50 req/s


needs_two = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to split")


@needs_two
def test_the_server_runs_on_its_cpus_and_the_client_with_its_workers_on_the_others(tmp_path: Path) -> None:
    available = frozenset(os.sched_getaffinity(0))
    client_cpu = max(available)
    split = CpuSplit.resolve(str(client_cpu), accelerator="gpu", available=available)
    assert split is not None
    behaviour = tmp_path / "behaviour.json"
    behaviour.write_text(json.dumps({"spawn_child": True}))
    launcher = ServerLauncher(command=[sys.executable, str(HELPERS / "fake_server.py")],
                              registry=StaleServerRegistry(tmp_path / "servers.json"), study="s1",
                              startup_timeout_s=10.0, cpu_split=split)
    with split.client_pinned():
        assert os.sched_getaffinity(0) == {client_cpu}
        server = launcher.start(behaviour, tmp_path / "server.log")
        try:
            # The server and the process it started after its start: the server's CPUs only.
            child_pid = int(next(line.split()[-1] for line in (tmp_path / "server.log").read_text().splitlines()
                                 if "child pid" in line))
            assert set(psutil.Process(server.pid).cpu_affinity()) == split.server
            assert set(psutil.Process(child_pid).cpu_affinity()) == split.server
        finally:
            server.stop()
        # Processes spawned from the pinned thread (as replay workers are) stay on its CPU.
        context = multiprocessing.get_context("spawn")
        with context.Pool(1) as pool:
            assert pool.apply(os.sched_getaffinity, (0,)) == {client_cpu}
    assert os.sched_getaffinity(0) == available  # restored after the block
