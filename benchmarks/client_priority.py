"""Does the trial server's CPU priority change what a trial measures? (supports item 4)

    .venv/bin/python benchmarks/client_priority.py [--quick] [--rounds 2] [--niceness 10]

The replayer runs in the tuner's process, on the machine the server runs on. vLLM's CPU
backend keeps every core busy (the engine-core process polls; the worker's OpenMP threads
take the rest), so the replayer can be starved of CPU and send requests late: the recorded
schedule is then not what the server saw. This runs real trials (autotune.trial.TrialRunner:
server start, warm-up, the `autotune run` default tuning window of the sample trace, stop)
with the server at the tuner's priority and at a lower one (`nice`), alternating, and
compares the replayer's send lag and what the trial measured.
Results: results/benchmarks/client_priority.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchlib import ROOT, Goal, Recorder, md_table, say, spread

SAMPLE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"
SLOS = ("ttft_p95_ms=1000", "tpot_p95_ms=100")  # `autotune run`'s CPU defaults
FIGURES = ("send_lag_p99_ms", "send_lag_max_ms", "request_goodput", "request_throughput",
           "p95_ttft_ms", "p95_tpot_ms", "mean_e2el_ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, a 15 s window")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of (default, niced) (default: 2; quick 1)")
    parser.add_argument("--niceness", type=int, default=10)
    parser.add_argument("--window-s", type=float, default=None, help="tuning window (default: 30; quick 15)")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 2)
    window_s = args.window_s or (15.0 if args.quick else 30.0)

    from autotune.trial import TrialRunner
    from server.config import ServerConfig, default_engine_settings
    from workloads.slo import parse_slos
    from workloads.trace import load_trace
    from workloads.windows import select_windows

    recorder = Recorder("client_priority", "Client priority: the trial server at the tuner's priority vs niced",
                        "quick" if args.quick else "full")
    window, _holdout, _info = select_windows(load_trace(SAMPLE), window_s, 20.0)
    slos = parse_slos(SLOS)
    config = ServerConfig(engine=default_engine_settings())
    variants = {"same priority": 0, f"server nice {args.niceness}": args.niceness}
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="client-priority-") as work:
        for round_no in range(1, rounds + 1):
            for name, niceness in variants.items():
                runner = TrialRunner(slos=slos, server_niceness=niceness, startup_timeout_s=600)
                outcome = runner.run(config, window, Path(work) / f"r{round_no}-nice{niceness}")
                summary = outcome.summary
                row = {"round": round_no, "variant": name, "niceness": niceness, "ok": outcome.ok,
                       "failure": outcome.failure_detail}
                if summary is not None:
                    row.update({key: getattr(summary, key) for key in FIGURES})
                say(f"round {round_no} {name}: " + ", ".join(f"{k} {row.get(k)}" for k in FIGURES))
                runs.append(row)

    by_variant = {
        name: {key: spread([r[key] for r in runs if r["variant"] == name and r.get(key) is not None])
               for key in FIGURES}
        for name in variants
    }
    default_name, niced_name = list(variants)
    lag_default = by_variant[default_name]["send_lag_p99_ms"]["median"]
    lag_niced = by_variant[niced_name]["send_lag_p99_ms"]["median"]
    goals = [Goal(
        name="replayer send-lag p99 with the server niced (median of rounds)",
        target="<= 10 ms (the replayer's own lag warning)",
        measured=lag_niced,
        met=lag_niced is not None and lag_niced <= 10,
        note=f"at the tuner's priority: {lag_default:.1f} ms" if lag_default is not None else "",
    )]
    rows = [[r["round"], r["variant"], *(f"{r[k]:.3g}" if r.get(k) is not None else "-" for k in FIGURES)]
            for r in runs]
    table = [f"Window: {len(window)} requests, {window.duration_s():.0f} s of the sample trace at its recorded "
             f"times; config: vLLM's defaults as `autotune run` resolves them on CPU; SLOs {', '.join(SLOS)}.", "",
             "## Every run (alternating)", "", *md_table(["round", "variant", *FIGURES], rows), "",
             "## Median over rounds", ""]
    table += md_table(["variant", *FIGURES],
                      [[name, *(f"{by_variant[name][k]['median']:.3g}" if by_variant[name][k]["median"] is not None
                                else "-" for k in FIGURES)] for name in variants])
    ratio_rows = []
    for key in FIGURES:
        pairs = [(a[key], b[key]) for a, b in zip(runs[0::2], runs[1::2], strict=True)
                 if a.get(key) and b.get(key)]
        if pairs:
            ratio_rows.append([key, f"{statistics.median(b / a for a, b in pairs):.3f}"])
    table += ["", "## Niced / same priority, paired per round (median)", "", *md_table(["figure", "ratio"], ratio_rows)]
    result = recorder.result(
        settings={"rounds": rounds, "niceness": args.niceness, "window_s": window_s, "slos": list(SLOS)},
        goals=goals,
        results={"runs": runs, "by_variant": by_variant},
        notes=["Each run is a whole trial: its own server start, 4 warm-up requests, the window, stop.",
               "Send lag = how late the replayer sent each request against the recorded schedule."],
    )
    recorder.write(result, "\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
