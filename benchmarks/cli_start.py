"""What a command costs before it measures anything, with the vLLM facts cache empty and warm.

    .venv/bin/python benchmarks/cli_start.py [--rounds 3]

Three commands a user runs, each once per round with an empty facts cache (server.vllm_facts:
the process asks vLLM, importing it) and once with the cache that run left (it reads the
file), the order alternating per round, one process at a time:

- `refuse-space`: `autotune run` with a --space file naming an engine argument vLLM does not
  have (exit 2, one line);
- `refuse-config`: `python -m server --config` with a value of the wrong type (exit 2);
- `create-study`: `autotune run --workers-only`, everything a run checks and prepares before its
  first trial (trace, windows, baseline, vLLM's resolved defaults, the study), no server.

Reports wall and CPU seconds (the process and its children) per command and cache state, and
the ratio warm / cold of each round's pair.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: its folder is on sys.path, the repository (benchmarks.*) is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.benchlib import ROOT, Recorder, md_table, say
from server.vllm_facts import CACHE_DIR_ENV
from workloads.errors import OneLineErrorParser

SAMPLE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"


def commands(folder: Path) -> dict[str, tuple[list[str], int]]:
    """name -> (argv, the exit code it must end with)."""
    space = folder / "space.yaml"
    space.write_text("params:\n  max_num_seqz: {type: int, low: 1, high: 8}\n")
    config = folder / "config.yaml"
    config.write_text("max-num-seqs: many\n")
    python = sys.executable
    return {
        "refuse-space": ([python, "-m", "autotune", "run", "--workload", str(SAMPLE), "--space", str(space),
                          "--output-dir", str(folder / "out-space")], 2),
        "refuse-config": ([python, "-m", "server", "--config", str(config)], 2),
        "create-study": ([python, "-m", "autotune", "run", "--workload", str(SAMPLE), "--workers-only",
                          "--storage", f"sqlite:///{folder / 'study.db'}", "--study-name", "STUDY",
                          "--output-dir", str(folder / "out-study")], 0),
    }


def timed(argv: list[str], expect: int, cache: Path, log: Path) -> dict[str, float]:
    (log.parent / "study.db").unlink(missing_ok=True)  # create-study makes a new one each time
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log, "ab") as out:
        done = subprocess.run(argv, env={**os.environ, CACHE_DIR_ENV: str(cache)}, stdout=out,
                              stderr=subprocess.STDOUT, cwd=ROOT, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != expect:
        tail = log.read_text(errors="replace")[-2000:]
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}, expected {expect}:\n{tail}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    recorder = Recorder("cli_start", "Command start with the vLLM facts cache empty and warm", "full")
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="cli-start-") as tmp:
        folder = Path(tmp)
        log = folder / "commands.log"
        for round_no in range(args.rounds):
            for name, (argv, expect) in commands(folder).items():
                for state in (("cold", "warm") if round_no % 2 == 0 else ("warm", "cold")):
                    cache = folder / f"cache-{name}-{round_no}"
                    if state == "warm" and not cache.exists():  # warm it with one cold run first
                        timed(argv, expect, cache, log)
                    if state == "cold":
                        cache = folder / f"cold-{name}-{round_no}"
                    figures = timed(argv, expect, cache, log)
                    runs.setdefault(name, {}).setdefault(state, []).append(figures)
                    say(f"round {round_no + 1} {name} {state}: {figures['wall_s']} s wall, {figures['cpu_s']} s CPU")
    rows: list[list[Any]] = []
    results: dict[str, Any] = {}
    for name, states in runs.items():
        ratios = [w["wall_s"] / c["wall_s"] for w, c in zip(states["warm"], states["cold"], strict=True)]
        results[name] = {**states, "warm_over_cold_wall": [round(r, 3) for r in ratios]}
        rows.append([name, ", ".join(f"{r['wall_s']:.1f}" for r in states["cold"]),
                     ", ".join(f"{r['wall_s']:.1f}" for r in states["warm"]),
                     ", ".join(f"{r['cpu_s']:.1f}" for r in states["cold"]),
                     ", ".join(f"{r['cpu_s']:.1f}" for r in states["warm"]),
                     f"{statistics.median(ratios):.2f}"])
    tables = "\n".join(["## Per round (wall and CPU seconds)", "",
                        *md_table(["command", "cold wall", "warm wall", "cold CPU", "warm CPU",
                                   "warm / cold wall, median"], rows)])
    result = recorder.result(settings={"rounds": args.rounds}, goals=[], results=results, notes=[
        "cold: an empty facts cache, so the command imports vLLM to answer; warm: the cache a cold "
        "run of the same command left. One process at a time, the order alternating per round.",
    ])
    recorder.write(result, tables)


if __name__ == "__main__":
    main()
