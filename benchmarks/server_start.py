"""A trial server's start, forked from a fork server against a fresh `python -m server`.

    .venv/bin/python benchmarks/server_start.py [--rounds 3] [--config FILE] [--name NAME]

Each round starts the server twice with the same config (default: the embedded default),
the order alternating per round, one at a time: once as its own process (`python -m server`,
what every trial did before autotune.measure.forkserver) and once forked from a fork server
that imported vLLM and the server once, before the first round (its import is timed apart: a
tuner pays it once per run, beside its first server's start). Each start is timed from the
spawn to `/health` answering 200 (ServerLauncher.start), then the server is stopped.
Reports seconds per start and the ratio forked / own process of each round's pair.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.measure.forkserver import ForkedServer, ForkServer  # noqa: E402
from autotune.measure.launcher import ServerLauncher  # noqa: E402
from benchmarks.benchlib import Recorder, md_table, say  # noqa: E402
from server.config import ServerConfig  # noqa: E402


def start_once(launcher: ServerLauncher, config: Path, log: Path) -> tuple[float, bool]:
    """Seconds from spawn to ready, and whether the server was forked."""
    server = launcher.start(config, log)
    try:
        assert server.ready_at is not None
        return server.ready_at - server.spawned_at, isinstance(server.popen, ForkedServer)
    finally:
        report = server.stop()
        if report.leftover_pids:
            raise SystemExit(f"processes left after stop: {report.leftover_pids}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--config", type=Path, help="server config (default: the embedded default)")
    parser.add_argument("--name", default="server_start", help="results/benchmarks/NAME.{md,json}")
    args = parser.parse_args()
    recorder = Recorder(args.name, "Trial server start: forked from a fork server vs its own process", "full")
    starts: dict[str, list[float]] = {"own process": [], "forked": []}
    with tempfile.TemporaryDirectory(prefix="server-start-") as tmp:
        folder = Path(tmp)
        config = args.config
        if config is None:
            config = folder / "config.yaml"
            ServerConfig.default().write(config)
        began = time.monotonic()
        forkserver = ForkServer(stderr_path=folder / "forkserver.log")
        if not forkserver.wait_ready():
            raise SystemExit(f"{forkserver.describe_exit()}: see {folder / 'forkserver.log'}")
        import_s = time.monotonic() - began
        say(f"fork server imported in {import_s:.1f} s")
        launchers = {"own process": ServerLauncher(startup_timeout_s=600),
                     "forked": ServerLauncher(startup_timeout_s=600, forkserver=forkserver)}
        try:
            for round_no in range(args.rounds):
                order = ("own process", "forked") if round_no % 2 == 0 else ("forked", "own process")
                for name in order:
                    seconds, forked = start_once(launchers[name], config, folder / f"{name}-{round_no}.log")
                    if forked != (name == "forked"):
                        raise SystemExit(f"round {round_no + 1} {name}: the server was "
                                         f"{'forked' if forked else 'its own process'}")
                    starts[name].append(round(seconds, 2))
                    say(f"round {round_no + 1} {name}: ready after {seconds:.1f} s")
        finally:
            forkserver.close()
    ratios = [f / o for f, o in zip(starts["forked"], starts["own process"], strict=True)]
    rows: list[list[Any]] = [
        [name, ", ".join(f"{s:.1f}" for s in values), f"{statistics.median(values):.1f}"]
        for name, values in starts.items()
    ]
    tables = "\n".join([
        "## Seconds from spawn to ready, per round", "",
        *md_table(["start", "per round", "median"], rows), "",
        f"Forked / own process, per round: {', '.join(f'{r:.2f}' for r in ratios)} "
        f"(median {statistics.median(ratios):.2f}). The fork server's own import: {import_s:.1f} s, "
        "once per tuner run.",
    ])
    result = recorder.result(
        settings={"rounds": args.rounds, "config": str(args.config or "the embedded default")},
        goals=[],
        results={"starts_s": starts, "forked_over_own": [round(r, 3) for r in ratios],
                 "forkserver_import_s": round(import_s, 2)},
        notes=["One server at a time, the order alternating per round; each stopped (process group "
               "gone) before the next start."],
    )
    recorder.write(result, tables)


if __name__ == "__main__":
    main()
