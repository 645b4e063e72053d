"""What vLLM's engine core did iteration by iteration, from server logs, launch beside launch.

With `enable_logging_iteration_details: true` in the engine settings (a benchmark column
`ours:1+enable_logging_iteration_details=true`, or the same key in a config), vLLM's engine
core logs one line per iteration: how many prefill ("context") and decode ("generation")
requests and tokens it ran, and how long the iteration took (with async scheduling: the wait
for its model output). This reads those lines from each log given and compares:

- decode-only iterations by batch size (generation requests): the time one takes; at equal
  batch size this is the engine's own speed, whatever the front end does;
- iterations that carry prefill tokens: how many, how many tokens, how long;
- seconds in which the engine ran at all: iterations per second by the largest batch of the
  second (an engine core whose Python work per running request bounds it runs fewer
  iterations a second as the batch grows, the same way whoever feeds it), and the share of the
  second spent inside iterations (the rest: scheduling, input and output handling, or nothing
  to do).

Why: on an H200 our one-process server's engine showed an ITL p95 of 22.7 ms where `vllm
serve`'s showed 9.9 ms at the same offered rate and config (results/benchmarks/
frontend_capacity.md, twenty-second session); this tells an engine that runs slower apart
from one that is fed differently.

    .venv/bin/python benchmarks/engine_iterations.py LOG [LOG ...] [--name NAME]

Logs may be gzipped. Results: printed, and with --name written to results/benchmarks/NAME.md.
"""

from __future__ import annotations

import gzip
import re
import shlex
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from workloads.errors import OneLineErrorParser
from workloads.files import write_text_atomic

ITERATION = re.compile(
    r"(?P<clock>\d\d-\d\d \d\d:\d\d:\d\d).*Iteration\(\d+\): (?P<ctx_req>\d+) context requests, "
    r"(?P<ctx_tok>\d+) context tokens, (?P<gen_req>\d+) generation requests, "
    r"(?P<gen_tok>\d+) generation tokens, iteration elapsed time: (?P<ms>[\d.]+) ms(?P<dummy> \(dummy\))?"
)
BATCH_BUCKETS = ((1, 16), (17, 32), (33, 64), (65, 128), (129, 256), (257, 512), (513, 1 << 20))


class Iterations:
    """The iteration lines of one log, as columns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        opener = gzip.open if path.suffix == ".gz" else open
        rows: list[tuple[str, int, int, int, float]] = []
        with opener(path, "rt", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                match = ITERATION.search(line)
                if match is None or match["dummy"]:
                    continue
                rows.append((match["clock"], int(match["ctx_req"]), int(match["ctx_tok"]),
                             int(match["gen_req"]), float(match["ms"])))
        self.clock = [row[0] for row in rows]
        self.ctx_requests = np.array([row[1] for row in rows], dtype=int)
        self.ctx_tokens = np.array([row[2] for row in rows], dtype=int)
        self.batch = np.array([row[3] for row in rows], dtype=int)
        self.ms = np.array([row[4] for row in rows], dtype=float)

    def __len__(self) -> int:
        return len(self.ms)

    def decode_only(self, low: int, high: int) -> np.ndarray:
        chosen = (self.ctx_requests == 0) & (self.batch >= low) & (self.batch <= high)
        return self.ms[chosen]

    def busy_seconds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per wall-clock second with 10 or more iterations (the log's clock has whole seconds;
        a quieter second is mostly idle): iterations, the share of the second spent inside
        iterations, and the largest batch (generation requests) of the second."""
        counts: dict[str, int] = defaultdict(int)
        spent: dict[str, float] = defaultdict(float)
        largest: dict[str, int] = defaultdict(int)
        for clock, ms, batch in zip(self.clock, self.ms, self.batch, strict=True):
            counts[clock] += 1
            spent[clock] += ms
            largest[clock] = max(largest[clock], int(batch))
        keys = [key for key in counts if counts[key] >= 10]
        return (np.array([counts[k] for k in keys], dtype=float),
                np.array([spent[k] / 1000 for k in keys], dtype=float),
                np.array([largest[k] for k in keys], dtype=int))


def quantiles(values: np.ndarray) -> str:
    if len(values) == 0:
        return "-"
    p50, p95 = np.percentile(values, [50, 95])
    return f"{p50:.2f} / {p95:.2f} ({len(values)})"


def report(logs: list[Iterations], labels: list[str]) -> str:
    lines = ["## Decode-only iterations: ms p50 / p95 (count), by batch size", "",
             "With async scheduling (vLLM's default on GPUs) the time vLLM logs is the wait for "
             "an output the GPU has mostly finished already, not the iteration's length: read "
             "the iterations per second below instead.", ""]
    lines.append("| batch | " + " | ".join(labels) + " |")
    lines.append("|---|" + "---|" * len(labels))
    for low, high in BATCH_BUCKETS:
        cells = [quantiles(log.decode_only(low, high)) for log in logs]
        if any(cell != "-" for cell in cells):
            name = f"{low}-{high}" if high < 1 << 20 else f">= {low}"
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Iterations per second by the largest batch of the second: p50 (seconds)", ""]
    lines.append("| largest batch | " + " | ".join(labels) + " |")
    lines.append("|---|" + "---|" * len(labels))
    seconds = [log.busy_seconds() for log in logs]
    for low, high in BATCH_BUCKETS:
        cells = []
        for per_second, _, largest in seconds:
            chosen = per_second[(largest >= low) & (largest <= high)]
            cells.append(f"{np.median(chosen):.0f} ({len(chosen)})" if len(chosen) else "-")
        if any(cell != "-" for cell in cells):
            name = f"{low}-{high}" if high < 1 << 20 else f">= {low}"
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Every iteration", "", "| log | iterations | with prefill | prefill tokens "
              "p50 / p95 | ms with prefill p50 / p95 | iterations / busy s p50 | share of busy s "
              "inside iterations p50 |", "|---|---|---|---|---|---|---|"]
    for label, log, (per_second, inside, _) in zip(labels, logs, seconds, strict=True):
        if len(log) == 0:
            lines.append(f"| {label} | 0 | - | - | - | - | - |")
            continue
        mixed = log.ctx_requests > 0
        rate = f"{np.median(per_second):.0f}" if len(per_second) else "-"
        share = f"{np.median(inside):.2f}" if len(inside) else "-"
        ctx = log.ctx_tokens[mixed]
        ctx_text = f"{np.percentile(ctx, 50):.0f} / {np.percentile(ctx, 95):.0f}" if len(ctx) else "-"
        lines.append(f"| {label} | {len(log)} | {mixed.mean():.2f} | {ctx_text} | "
                     f"{quantiles(log.ms[mixed])} | {rate} | {share} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path, help="server logs (plain or .gz)")
    parser.add_argument("--labels", help="comma-separated, one per log (default: the folder names)")
    parser.add_argument("--name", help="write results/benchmarks/NAME.md too")
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [path.parent.name for path in args.logs]
    if len(labels) != len(args.logs):
        parser.error(f"--labels: {len(labels)} labels for {len(args.logs)} logs")
    missing = [str(path) for path in args.logs if not path.is_file()]
    if missing:
        parser.error(f"no such log: {missing[0]}")
    logs = [Iterations(path) for path in args.logs]
    empty = [label for label, log in zip(labels, logs, strict=True) if len(log) == 0]
    if len(empty) == len(logs):
        parser.error("no iteration lines in any log: was enable_logging_iteration_details on?")
    command = shlex.join([".venv/bin/python", "benchmarks/engine_iterations.py", *sys.argv[1:]])
    text = f"# Engine iterations, launch beside launch\n\n- Command: `{command}`\n\n" + report(logs, labels)
    print(text)
    if args.name:
        write_text_atomic(Path(__file__).resolve().parents[1] / "results" / "benchmarks" / f"{args.name}.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
