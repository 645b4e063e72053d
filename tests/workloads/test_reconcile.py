"""Reconciling a replay run (workloads.reconcile) and `autotune replay`'s verdicts on bad servers.

Hand-made records for the rules themselves; the echo server (tests/workloads/echo_server.py,
its own process, real HTTP) for what a user sees: a server that fails 10% of requests misses
every p95 SLO, one that bundles tokens without usage is flagged, a correct one is not.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from workloads.reconcile import Reconciliation, combined, reconcile
from workloads.replay import ReplayOptions, replay
from workloads.replay_summary import ReplayResult, RequestRecord, summarize
from workloads.slo import parse_slo
from workloads.trace import Trace, TraceRequest

ROOT = Path(__file__).resolve().parents[2]


def trace_of(*output_lengths: int, spacing_ms: float = 0.0) -> Trace:
    return Trace.from_requests(
        TraceRequest(timestamp=i * spacing_ms, input_length=8, output_length=n)
        for i, n in enumerate(output_lengths)
    )


def record(index: int, *, usage: int | None, chunks: int | None, error: str | None = None,
           cancelled: bool = False) -> RequestRecord:
    output = usage if usage is not None else (chunks or 0)
    return RequestRecord(
        index=index, scheduled_s=0.0, sent_s=0.0, lag_ms=0.5, input_tokens=8,
        ttft_ms=None if error else 10.0, e2e_ms=None if error else 10.0 + output,
        itl_ms=[] if error else [1.0] * max(output - 1, 0), output_tokens=0 if error else output,
        usage_tokens=None if error else usage, chunk_tokens=None if error else chunks,
        status=200 if error is None else 400, error=error, cancelled=cancelled,
    )


def result_of(records: list[RequestRecord], **summary_fields) -> ReplayResult:
    summary = summarize(records, 1.0).model_copy(update=summary_fields)
    return ReplayResult(records=records, summary=summary)


# -- the rules, on hand-made records ----------------------------------------------------------


def test_exact_counts_from_usage_reconcile_with_nothing_to_say() -> None:
    trace = trace_of(5, 7, 3)
    records = [record(0, usage=5, chunks=5), record(1, usage=7, chunks=7),
               record(2, usage=None, chunks=None, error="HTTP 400: bad")]
    found = reconcile(trace, result_of(records), benchmark_mode=True)
    assert found.ok and found.problem is None and found.warnings == []
    assert (found.planned, found.sent, found.completed, found.failed, found.cancelled) == (3, 3, 2, 1, 0)
    # Tokens over completed requests only: the failed request's 3 are not asked of the server.
    assert (found.tokens_requested, found.tokens_received, found.tokens_source) == (12, 12, "usage")
    assert found.chunk_vs_usage == 0.0 and found.send_lag_p99_ms == pytest.approx(0.5)
    assert found.describe() == ("3 planned, 3 sent, 2 completed, 1 failed; "
                                "12 of 12 requested output tokens received (usage)")


def test_a_token_shortfall_counted_from_chunks_unscores_a_benchmark_run() -> None:
    # The figures: 5,908 tokens requested, 1,494 counted one per chunk, no usage.
    trace = trace_of(2954, 2954)
    records = [record(0, usage=None, chunks=747), record(1, usage=None, chunks=747)]
    found = reconcile(trace, result_of(records), benchmark_mode=True)
    assert found.tokens_source == "chunks" and found.chunk_vs_usage is None
    assert found.problem is not None and "\n" not in found.problem
    assert found.problem.startswith("received 1,494 of 5,908 requested output tokens (25%)")
    assert "counted from chunks" in found.problem and "TPOT/ITL would be wrong" in found.problem
    # Outside benchmark mode answers may end at EOS: the same counts are a warning only.
    relaxed = reconcile(trace, result_of(records), benchmark_mode=False)
    assert relaxed.ok and len(relaxed.warnings) == 1
    assert relaxed.warnings[0].startswith("received 1,494 of 5,908 requested output tokens (25%)")


@pytest.mark.parametrize(("received", "flagged"), [(95, False), (105, False), (94, True), (106, True)])
def test_tokens_may_differ_by_up_to_five_percent_either_way(received: int, flagged: bool) -> None:
    found = reconcile(trace_of(100), result_of([record(0, usage=received, chunks=received)]),
                      benchmark_mode=True)
    assert (found.problem is not None) == flagged
    if flagged and received > 100:
        assert "more than max_tokens" in found.problem


def test_usage_short_of_max_tokens_names_the_exact_length_fields() -> None:
    found = reconcile(trace_of(100), result_of([record(0, usage=50, chunks=50)]), benchmark_mode=True)
    assert "ignore_eos" in found.problem and "(usage)" not in found.problem


def test_chunks_disagreeing_with_usage_warn_that_gaps_are_per_chunk() -> None:
    # Usage is right (TPOT holds), but 4 tokens came per chunk: ITL's gaps are per chunk.
    trace = trace_of(8, 8)
    records = [record(0, usage=8, chunks=2), record(1, usage=8, chunks=2)]
    found = reconcile(trace, result_of(records), benchmark_mode=True)
    assert found.ok and found.tokens_received == 16 and found.tokens_source == "usage"
    assert (found.usage_tokens, found.chunk_tokens) == (16, 4)
    assert found.chunk_vs_usage == pytest.approx(-0.75)
    [warning] = found.warnings
    assert "per chunk, not per token" in warning and "-75%" in warning


def test_usage_on_some_answers_only_is_a_mixed_source() -> None:
    found = reconcile(trace_of(4, 4), result_of([record(0, usage=4, chunks=4),
                                                 record(1, usage=None, chunks=4)]),
                      benchmark_mode=True)
    assert found.ok and found.tokens_source == "mixed" and found.tokens_received == 8


def test_records_lost_on_the_way_back_unscore_the_run() -> None:
    trace = trace_of(4, 4, 4)
    records = [record(i, usage=4, chunks=4) for i in range(3)]
    summary = summarize(records, 1.0)
    found = reconcile(trace, ReplayResult(records=records[:2], summary=summary), benchmark_mode=True)
    assert found.problem.startswith("records lost: the run counted 3 requests finished")


def test_requests_never_sent_unscore_a_run_unless_it_was_stopped_early() -> None:
    trace = trace_of(4, 4, 4, 4)
    records = [record(0, usage=4, chunks=4), record(1, usage=4, chunks=4)]
    found = reconcile(trace, result_of(records, planned=4), benchmark_mode=True)
    assert found.problem.startswith("records lost: 2 of 4 planned requests were neither sent")
    early = result_of(records + [record(2, usage=None, chunks=None, error="cancelled: replay stopped",
                                        cancelled=True)], planned=4, stopped_early=True)
    found = reconcile(trace, early, benchmark_mode=True)
    assert found.ok and found.cancelled == 1 and found.sent == 3 and found.stopped_early
    # A duration cut plans fewer than the trace holds: the summary's `planned` says how many.
    assert reconcile(trace, result_of(records, planned=2), benchmark_mode=True).ok


def test_records_that_do_not_match_the_trace_unscore_the_run() -> None:
    trace = trace_of(4, 4)
    twice = [record(0, usage=4, chunks=4), record(0, usage=4, chunks=4)]
    assert "recorded twice" in reconcile(trace, result_of(twice), benchmark_mode=True).problem
    outside = [record(0, usage=4, chunks=4), record(7, usage=4, chunks=4)]
    assert "outside the 2 planned" in reconcile(trace, result_of(outside), benchmark_mode=True).problem


def test_records_written_before_the_token_counts_existed_still_reconcile() -> None:
    old = ('{"index": 0, "scheduled_s": 0, "sent_s": 0, "lag_ms": 0.1, "ttft_ms": 5, '
           '"itl_ms": [1, 1], "e2e_ms": 7, "input_tokens": 8, "output_tokens": 3, "status": 200}')
    loaded = RequestRecord.model_validate_json(old)
    assert loaded.usage_tokens is None and loaded.chunk_tokens is None
    found = reconcile(trace_of(3), result_of([loaded]), benchmark_mode=True)
    assert found.ok and found.tokens_received == 3


def test_combined_sums_the_steps_and_keeps_each_problem() -> None:
    good = reconcile(trace_of(4), result_of([record(0, usage=4, chunks=4)]), benchmark_mode=True)
    bad = reconcile(trace_of(8), result_of([record(0, usage=None, chunks=2)]), benchmark_mode=True)
    total = combined([good, bad])
    assert (total.planned, total.sent, total.completed) == (2, 2, 2)
    assert (total.tokens_requested, total.tokens_received, total.tokens_source) == (12, 6, "mixed")
    assert total.problem.startswith("run 2: received 2 of 8")
    assert Reconciliation.model_validate_json(total.model_dump_json()) == total
    assert combined([]).ok and combined([]).tokens_source is None


# -- against real servers (echo server, own process) ------------------------------------------


def replayed(url: str, trace: Trace, *, benchmark_mode: bool = True) -> Reconciliation:
    options = ReplayOptions(benchmark_mode=benchmark_mode)
    result = asyncio.run(replay(trace, url, options))
    return reconcile(trace, result, benchmark_mode=benchmark_mode)


def autotune_replay(trace: Trace, url: str, tmp_path: Path, *flags: str) -> tuple[str, dict]:
    """`autotune replay` as a user runs it (its own process): what it printed, and the
    summary JSON it wrote."""
    trace_file = tmp_path / "trace.jsonl"
    trace_file.write_text("".join(
        json.dumps({"timestamp": float(t), "input_length": int(i), "output_length": int(o)}) + "\n"
        for t, i, o in zip(trace.timestamps_ms, trace.input_lengths, trace.output_lengths, strict=True)
    ))
    out = tmp_path / "requests.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "autotune", "replay", "--workload", str(trace_file), "--url", url,
         "--out", str(out), *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads((tmp_path / "requests.summary.json").read_text())


@pytest.mark.slow
def test_autotune_replay_counts_failed_requests_as_slo_misses(echo: str, tmp_path: Path) -> None:
    # Every 10th request is answered HTTP 400; the 54 others are fast, far within both SLOs.
    trace = trace_of(*[4] * 60, spacing_ms=5)
    url = f"{echo}/ttft=1,itl=1,failevery=10,tag=tenpct"
    printed, summary = autotune_replay(trace, url, tmp_path, "--slo", "ttft_p95_ms=5000",
                                       "--slo", "tpot_p95_ms=5000")
    assert summary["failed"] == 6 and summary["completed"] == 54
    for spec in ("ttft_p95_ms=5000", "tpot_p95_ms=5000"):
        missed = summary["slo_violations"][spec]
        assert missed >= 6 and summary["slo_met"][spec] is False
        assert summary["slo_requests"][spec] == 60
        # 6 of 60 failed: a p95 lets 2 of them miss.
        assert f"{spec}: MISSED ({missed} of 60 over or failed; at most 2 may miss)" in printed
    assert "Requests planned / sent:" in printed and "60 / 60" in printed
    reconciliation = summary["reconciliation"]
    assert (reconciliation["planned"], reconciliation["sent"], reconciliation["failed"]) == (60, 60, 6)
    assert reconciliation["problem"] is None and reconciliation["tokens_received"] == 54 * 4


@pytest.mark.slow
def test_autotune_replay_warns_when_bundled_tokens_come_without_usage(echo: str, tmp_path: Path) -> None:
    # Four tokens per chunk, no usage, no token_ids: counted one per chunk, a quarter of them.
    trace = trace_of(*[8] * 10, spacing_ms=5)
    url = f"{echo}/ttft=1,itl=1,chunk=4,usage=0,tag=bundles-cli"
    printed, summary = autotune_replay(trace, url, tmp_path)
    # The send-lag warning may come too, on a busy machine (5 ms apart): not this test's subject.
    warning = [line for line in printed.splitlines()
               if line.startswith("WARNING:") and "replayer lagged its schedule" not in line]
    assert len(warning) == 1, printed
    assert "received 20 of 80 requested output tokens (25%)" in warning[0]
    assert summary["reconciliation"]["problem"].startswith("received 20 of 80")
    assert summary["reconciliation"]["tokens_source"] == "chunks"


def test_bundled_tokens_without_usage_are_a_problem_in_benchmark_mode(echo: str) -> None:
    trace = trace_of(*[8] * 5)
    found = replayed(f"{echo}/ttft=1,itl=1,chunk=4,usage=0,tag=bundles", trace)
    assert found.tokens_source == "chunks" and found.tokens_received == 10
    assert found.problem.startswith("received 10 of 40 requested output tokens (25%)")
    relaxed = replayed(f"{echo}/ttft=1,itl=1,chunk=4,usage=0,tag=bundles-eos", trace,
                       benchmark_mode=False)
    assert relaxed.ok and relaxed.warnings[0].startswith("received 10 of 40")


def test_bundled_tokens_with_usage_warn_that_gaps_are_per_chunk(echo: str) -> None:
    found = replayed(f"{echo}/ttft=1,itl=1,chunk=4,tag=bundles-usage", trace_of(*[8] * 5))
    assert found.ok and found.tokens_received == 40 and found.tokens_source == "usage"
    assert found.chunk_tokens == 10 and len(found.warnings) == 1
    assert "per chunk, not per token" in found.warnings[0]


@pytest.mark.parametrize(("options", "source"), [("", "usage"), ("chunk=4,ids=1,usage=0,", "chunks")])
def test_a_correct_server_reconciles_with_nothing_to_say(echo: str, options: str, source: str) -> None:
    # Usage, or chunks that say how many tokens they carry: exact counts either way.
    trace = trace_of(3, 8, 5, 12)
    found = replayed(f"{echo}/ttft=1,itl=1,{options}tag=correct-{source}", trace)
    assert found.problem is None and found.warnings == []
    assert (found.planned, found.sent, found.completed, found.failed) == (4, 4, 4, 0)
    assert found.tokens_requested == found.tokens_received == 28 and found.tokens_source == source


def test_a_failed_request_misses_every_slo_of_the_run(echo: str) -> None:
    slos = [parse_slo("ttft_p50_ms=5000"), parse_slo("itl_p50_ms=5000")]
    trace = trace_of(*[4] * 4)
    result = asyncio.run(replay(trace, f"{echo}/ttft=1,itl=1,failevery=2,tag=half",
                                ReplayOptions(slos=tuple(slos))))
    # Half failed: no p50 can hold, whatever the completed half measured.
    assert result.summary.failed == 2
    assert result.summary.slo_met == {"ttft_p50_ms=5000": False, "itl_p50_ms=5000": False}
    assert result.summary.slo_requests == {"ttft_p50_ms=5000": 4, "itl_p50_ms=5000": 4}


def test_slo_lines_state_what_they_were_judged_over() -> None:
    from workloads.replay_output import format_summary

    def answered(index: int, ttft_ms: float) -> RequestRecord:
        return RequestRecord(index=index, scheduled_s=0, sent_s=0, lag_ms=0, input_tokens=8,
                             ttft_ms=ttft_ms, e2e_ms=ttft_ms + 3, itl_ms=[1.0] * 3, output_tokens=4)

    # 3 of 60 over 500 ms, the p95 interpolating between 100 and 600 ms: within, by a hair.
    records = [answered(i, 100.0) for i in range(57)] + [answered(57 + i, 600.0) for i in range(3)]
    slos = [parse_slo("ttft_p95_ms=500"), parse_slo("itl_p99_ms=50")]
    printed = format_summary(summarize(records, 1.0, slos))
    assert "ttft_p95_ms=500: met (3 of 60 over or failed; the p95 still falls within)" in printed
    assert "itl_p99_ms=50: met (p99 of the token gaps of 60 completed requests; 0 of 60 failed, at most 0 may fail)" in printed
    failed = records[:59] + [record(59, usage=None, chunks=None, error="HTTP 400: no")]
    printed = format_summary(summarize(failed, 1.0, slos))
    assert "itl_p99_ms=50: MISSED (p99 of the token gaps of 59 completed requests; 1 of 60 failed" in printed
    # A summary written before the denominators were kept still prints its verdicts.
    old = summarize(records, 1.0, slos).model_copy(update={"slo_requests": {}})
    assert "ttft_p95_ms=500: met\n" in format_summary(old)
