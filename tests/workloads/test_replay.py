"""The replayer against a real local HTTP server with known delays (tests/workloads/echo_server.py).

The server runs in its own process, so its timing does not share the replayer's event loop.
It sends token k at request time + ttft + k*itl on absolute deadlines: a correct client
measures TTFT ~ ttft, gaps ~ itl and E2E ~ ttft + (n-1)*itl, plus a little transport time.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from autotune.measure.server_start import free_port
from workloads.errors import WorkloadError
from workloads.prompts import PromptFactory
from workloads.replay import ReplayMode, ReplayOptions, ReplayRun, client_session, replay
from workloads.replay_summary import CLIENT_LAG_WARN_MS, ReplaySummary, summarize
from workloads.slo import parse_slo
from workloads.trace import Trace, TraceRequest

# No bound here is on how fast this machine is: the echo server records when it read each
# request and when it wrote each token (tests/workloads/echo_server.py), so what the client
# measured is set beside what the server did, in the same run. A correct client is never
# below the server's own figure (it sends before the server reads, reads after the server
# writes), and its median excess over many observations is transport time, a fraction of a
# millisecond; a broken client (a wrong start, an empty chunk taken for a token, tokens
# counted per chunk) is off by a whole server delay in every observation. A stall of the
# machine moves single observations, not the median.


def stats(url: str, tag: str) -> dict:
    return httpx.get(f"{url}/tag={tag}/stats", trust_env=False).json()


def server_view(url: str, tag: str) -> list[dict]:
    """Per request, in arrival order: its prompt's first tokens and the server's TTFT, token
    gaps and last token, in ms."""
    views = []
    for timing in stats(url, tag)["timings"]:
        tokens = timing["tokens"]
        views.append({
            "prompt_head": timing["prompt_head"],
            "ttft_ms": (tokens[0] - timing["received"]) * 1e3,
            "gaps_ms": list(np.diff(tokens) * 1e3),
            "last_ms": (tokens[-1] - timing["received"]) * 1e3,
        })
    return views


def trace_of(
    n: int, *, spacing_ms: float = 0.0, input_length: int = 16, output_length: int = 8
) -> Trace:
    return Trace.from_requests(
        TraceRequest(
            timestamp=i * spacing_ms, input_length=input_length, output_length=output_length
        )
        for i in range(n)
    )


def run(trace: Trace, url: str, on_progress=None, **options):
    return asyncio.run(replay(trace, url, ReplayOptions(**options), on_progress=on_progress))


# -- what one request measures --------------------------------------------------------------


@pytest.mark.slow
def test_ttft_itl_and_e2e_match_the_server_delays(echo: str) -> None:
    ttft, itl, n, requests = 150.0, 30.0, 8, 9
    # empty=1: the server sends an empty chunk at once; it is not a token.
    url = f"{echo}/ttft={ttft:g},itl={itl:g},empty=1,tag=delays"
    # One after another (each takes 360 ms): a stall of a loaded machine then moves one or two
    # observations, not the median. 50 ms apart, all six were in flight at once and one stall
    # of 224-418 ms moved five of the six TTFTs (a fresh clone beside a CPU `autotune run`).
    result = run(trace_of(requests, spacing_ms=400, output_length=n), url)
    assert result.summary.completed == requests and result.summary.failed == 0
    # Each request's prompt is its own (PromptFactory): it names the server's record of it.
    server = {tuple(view["prompt_head"]): view for view in server_view(echo, "delays")}
    assert len(server) == requests
    ttft_excess, e2e_excess, gap_error = [], [], []
    for record in result.records:
        seen = server[tuple(PromptFactory().prompt(record.index, 16)[:8])]
        assert record.error is None and record.status == 200
        assert record.output_tokens == n and record.input_tokens == 16
        assert len(record.itl_ms) == n - 1 and len(seen["gaps_ms"]) == n - 1
        # Never below what the server did, and the server never below what it was asked.
        assert record.ttft_ms >= seen["ttft_ms"] >= ttft - 1
        assert record.e2e_ms >= seen["last_ms"] >= ttft + (n - 1) * itl - 1
        ttft_excess.append(record.ttft_ms - seen["ttft_ms"])
        e2e_excess.append(record.e2e_ms - seen["last_ms"])
        gap_error += [abs(a - b) for a, b in zip(record.itl_ms, seen["gaps_ms"], strict=True)]
    # A client that took the empty chunk for the first token would be ~ttft short; one that
    # missed a token gap would be off by ~itl: far beyond half an itl in every observation.
    assert np.median(ttft_excess) < itl / 2, ttft_excess
    assert np.median(e2e_excess) < itl / 2, e2e_excess
    assert np.median(gap_error) < itl / 2, gap_error
    summary = result.summary
    assert summary.total_output_tokens == requests * n
    assert summary.mean_tpot_ms == pytest.approx(
        np.mean([(r.e2e_ms - r.ttft_ms) / (n - 1) for r in result.records]), rel=1e-9
    )


def test_tokens_bundled_in_one_chunk_are_spread_when_the_chunk_says_how_many(echo: str) -> None:
    # Chunks of 3 tokens every 60 ms, each with token_ids: 0,0 for the first chunk's extra
    # tokens, then each later chunk's time since the one before, shared by its 3 tokens.
    url = f"{echo}/ttft=50,itl=20,chunk=3,ids=1,tag=spread"
    record = run(trace_of(1, output_length=9), url).records[0]
    assert record.output_tokens == 9
    assert len(record.itl_ms) == 8
    assert record.itl_ms[:2] == [0.0, 0.0]
    second, third = record.itl_ms[2:5], record.itl_ms[5:8]
    assert second == pytest.approx([second[0]] * 3) and third == pytest.approx([third[0]] * 3)
    assert second[0] > 0 and third[0] > 0
    # The spread gaps add up to the time between the first and the last chunk.
    assert sum(record.itl_ms) <= record.e2e_ms - record.ttft_ms


def test_unannounced_bundles_count_one_gap_per_chunk_and_tokens_from_usage(echo: str) -> None:
    url = f"{echo}/ttft=50,itl=20,chunk=3,tag=bundled"
    record = run(trace_of(1, output_length=9), url).records[0]
    assert record.output_tokens == 9  # from the usage chunk
    assert len(record.itl_ms) == 2  # three chunks: one gap between each two
    [seen] = server_view(echo, "bundled")
    assert len(seen["gaps_ms"]) == 2
    assert all(gap > 0 for gap in record.itl_ms)
    assert sum(record.itl_ms) <= record.e2e_ms - record.ttft_ms


@pytest.mark.slow
def test_request_body_has_exact_prompt_length_and_benchmark_fields(echo: str) -> None:
    trace = trace_of(1, input_length=37, output_length=5)
    run(trace, f"{echo}/tag=body", model="m1", api_token="s3cret")
    seen = stats(echo, "body")
    body = seen["last_body"]
    assert body["prompt_len"] == 37
    assert all(100 <= token < 4000 for token in body["prompt_head"])
    assert body["max_tokens"] == 5 and body["min_tokens"] == 5 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["model"] == "m1"
    assert seen["last_authorization"] == "Bearer s3cret"

    run(trace, f"{echo}/tag=plain", benchmark_mode=False)
    body = stats(echo, "plain")["last_body"]
    assert "ignore_eos" not in body and "min_tokens" not in body and "model" not in body


def test_requests_sharing_hash_ids_send_the_same_leading_tokens(echo: str) -> None:
    requests = [
        TraceRequest(timestamp=0, input_length=600, output_length=1, hash_ids=[5, 6]),
        TraceRequest(timestamp=1, input_length=700, output_length=1, hash_ids=[5, 9]),
    ]
    run(Trace.from_requests(requests), f"{echo}/tag=prefix")
    head = stats(echo, "prefix")["last_body"]["prompt_head"]  # the second request's
    assert head == PromptFactory().prompt(0, 600, [5, 6])[: len(head)]
    assert head != PromptFactory().prompt(1, 700)[: len(head)]


def test_an_empty_trace_gives_an_empty_result(echo: str) -> None:
    result = run(Trace.from_requests([]), f"{echo}/tag=empty")
    assert result.records == [] and result.summary.completed == 0


# -- schedules ------------------------------------------------------------------------------


@pytest.mark.slow
def test_timed_mode_keeps_the_schedule_through_a_client_stall(
    echo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 10 ms apart: 100 req/s for 3 s, a cheap answer each. The client's event loop blocks
    # for half a second while it builds request 100 (as a GC pause or a busy host would).
    trace = trace_of(300, spacing_ms=10, output_length=2)
    build = ReplayRun.body

    def stalling_body(self: ReplayRun, i: int) -> bytes:
        if i == 100:
            time.sleep(0.5)
        return build(self, i)

    monkeypatch.setattr(ReplayRun, "body", stalling_body)
    result = run(trace, f"{echo}/ttft=2,itl=1,tag=rate")
    summary = result.summary
    assert summary.completed == 300, {r.error for r in result.records}
    records = sorted(result.records, key=lambda r: r.index)
    expected = np.arange(300) * 0.01
    assert np.allclose([r.scheduled_s for r in records], expected)
    lags = [r.lag_ms for r in records]
    assert min(lags) >= 0  # never early
    assert summary.duration >= expected[-1]
    # Absolute deadlines: the stall makes the requests due during it late, not every later
    # one. A client that sleeps relative durations carries the stall forward, so each of the
    # last 100 sends would be at least as late as request 100, the one the stall held back.
    assert min(lags[-100:]) < lags[100], (min(lags[-100:]), lags[100])
    # The lag figures are those of the records, and the run says when the client lagged.
    assert summary.send_lag_p50_ms == pytest.approx(float(np.percentile(lags, 50)), abs=1e-6)
    assert summary.client_lagging == (summary.send_lag_p99_ms > CLIENT_LAG_WARN_MS)


@pytest.mark.slow
def test_duration_cuts_the_trace_on_the_replayed_clock(echo: str) -> None:
    trace = trace_of(20, spacing_ms=100, output_length=1)  # 0 .. 1.9 s
    result = run(trace, f"{echo}/tag=cut", speedup=2.0, duration_s=0.5)  # 0 .. 0.95 s
    assert [r.index for r in result.records] == list(range(10))


@pytest.mark.slow
def test_closed_loop_keeps_exactly_n_in_flight_on_n_connections(echo: str) -> None:
    n = 4
    before = stats(echo, "closed")["connections"]
    # Answer lengths 1..8 tokens (100..380 ms) so requests end at staggered times; the
    # timestamps (1 s apart) must be ignored: the run takes about 2 s, not 39.
    trace = Trace.from_requests(
        TraceRequest(timestamp=i * 1000.0, input_length=16, output_length=1 + i * 5 % 8)
        for i in range(40)
    )
    result = run(trace, f"{echo}/ttft=100,itl=40,tag=closed", mode=f"concurrency={n}")
    assert result.summary.completed == 40
    assert result.summary.duration < trace.timestamps_ms[-1] / 1000
    seen = stats(echo, "closed")
    assert seen["max_in_flight"] == n
    # Keep-alive: one connection per slot (+1: the stats request's own connection).
    assert seen["connections"] - before <= n + 1
    # Each end (but the last n) is followed by the send that refills its slot: never before
    # it (never n + 1 in flight), and at once: a client that refilled only when a whole batch
    # was done would wait out the batch's longer answers (40-280 ms) for most slots.
    ends = sorted(r.sent_s + r.e2e_ms / 1e3 for r in result.records)
    sends = sorted(r.sent_s for r in result.records)
    refill_ms = (np.array(sends[n:]) - np.array(ends[: 40 - n])) * 1e3
    assert refill_ms.min() >= 0
    assert np.median(refill_ms) < 0.1 * np.median([r.e2e_ms for r in result.records]), refill_ms


def test_mode_text_is_validated() -> None:
    assert ReplayMode.parse("concurrency=8").concurrency == 8
    assert str(ReplayMode.parse(" timed ")) == "timed"
    for bad in ("closed", "concurrency=0", "concurrency=x", "concurrency"):
        with pytest.raises(WorkloadError, match="concurrency=N"):
            ReplayMode.parse(bad)


# -- failures are measurements --------------------------------------------------------------


def test_http_errors_are_recorded_not_raised(echo: str) -> None:
    result = run(trace_of(3), f"{echo}/status=500,tag=fail")
    assert result.summary.completed == 0 and result.summary.failed == 3
    for record in result.records:
        assert record.status == 500
        assert record.error.startswith("HTTP 500") and "injected failure" in record.error
        assert record.ttft_ms is None and record.e2e_ms is None
        assert record.failed_after_ms is not None and record.failed_after_ms >= 0  # when it ended
    assert result.summary.mean_ttft_ms is None


def test_an_error_event_mid_stream_fails_the_request(echo: str) -> None:
    result = run(trace_of(2, output_length=6), f"{echo}/itl=2,err=3,tag=midstream")
    assert result.summary.failed == 2 and result.summary.completed == 0
    for record in result.records:
        assert record.status == 200
        assert record.error.startswith("server error in stream") and "injected" in record.error


def test_connection_refused_is_recorded(echo: str) -> None:
    result = run(trace_of(2), f"http://127.0.0.1:{free_port()}")
    assert result.summary.failed == 2
    assert all(r.status is None and r.error.startswith("connection failed") for r in result.records)


def test_timeout_is_recorded_and_does_not_wait_for_the_server(echo: str) -> None:
    result = run(trace_of(1), f"{echo}/ttft=60000,tag=slow", timeout_s=0.3)
    assert result.records[0].error.startswith("timeout")
    assert result.records[0].e2e_ms is None
    assert result.records[0].failed_after_ms is not None  # it ended for the client at the timeout
    # The server is still holding the request (its first token is a minute away): the
    # client gave up at its timeout instead of waiting for the answer.
    assert stats(echo, "slow")["in_flight"] == 1


# -- goodput and SLOs -----------------------------------------------------------------------


@pytest.mark.slow
def test_goodput_counts_only_requests_meeting_every_slo(echo: str) -> None:
    # Same server delays, two answer lengths: 2 tokens finish in ~20 ms, 20 tokens in no less
    # than 200 ms (the server's deadlines), over the 100 ms end-to-end SLO whatever happens.
    requests = [
        TraceRequest(timestamp=i * 20.0, input_length=8, output_length=2 if i % 3 else 20)
        for i in range(12)
    ]
    slos = [parse_slo("e2el_p99_ms=100"), parse_slo("tpot_p50_ms=50")]
    result = run(Trace.from_requests(requests), f"{echo}/ttft=10,itl=10,tag=good", slos=slos)
    summary = result.summary
    assert summary.completed == 12
    # Good: a request within every SLO's value on its own figures (as `vllm bench serve`).
    good = [
        r for r in result.records
        if r.e2e_ms <= 100 and (r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1) <= 50
    ]
    assert summary.request_goodput * summary.duration == pytest.approx(len(good))
    assert all(r.output_tokens == 2 for r in good)  # no long answer is ever good
    tpot = [(r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1) for r in result.records]
    assert summary.slo_met == {
        "e2el_p99_ms=100": False,
        "tpot_p50_ms=50": bool(np.percentile(tpot, 50) <= 50),
    }
    # The running tally and a summary of the written records agree (up to the order in which
    # floats were added: the tally adds in completion order, the records are in trace order).
    again = summarize(result.records, summary.duration, slos).model_dump()
    assert again == {
        name: pytest.approx(value, rel=1e-12) if isinstance(value, float) else value
        for name, value in summary.model_dump().items()
    }
    assert run(Trace.from_requests(requests), f"{echo}/tag=good2").summary.request_goodput is None


def test_failed_requests_are_never_good(echo: str) -> None:
    result = run(trace_of(2), f"{echo}/status=503,tag=bad", slos=[parse_slo("ttft_p50_ms=1000")])
    assert result.summary.request_goodput == 0


# -- progress and pruning -------------------------------------------------------------------


@pytest.mark.slow
def test_on_progress_returning_true_stops_sending_and_cancels_in_flight(echo: str) -> None:
    calls: list[tuple[float, ReplaySummary]] = []

    def on_progress(elapsed_s: float, summary: ReplaySummary) -> bool:
        calls.append((elapsed_s, summary))
        return len(calls) == 2  # stop when asked the second time

    # 20 req/s for 10 s, each answer takes ~500 ms: ~10 in flight at any time.
    trace = trace_of(200, spacing_ms=50, output_length=10)
    result = run(trace, f"{echo}/ttft=50,itl=50,tag=prune", on_progress=on_progress)
    elapsed = [c[0] for c in calls]
    assert len(calls) == 2  # never asked again after it said stop
    # About once a second: at each whole second of the replay's clock, not before it.
    assert elapsed[0] >= 0.99 and elapsed[1] >= max(1.99, elapsed[0])
    assert calls[0][1].completed <= calls[1][1].completed
    summary = result.summary
    assert summary.stopped_early and summary.cancelled > 0
    assert summary.completed + summary.failed + summary.cancelled == len(result.records)
    assert summary.failed == 0
    # Sending stopped: the requests sent are the schedule's first ones, far from all of it.
    assert sorted(r.index for r in result.records) == list(range(len(result.records)))
    assert len(result.records) < len(trace) / 2
    assert all(r.cancelled == (r.error is not None) for r in result.records)


@pytest.mark.slow
def test_on_progress_returning_false_changes_nothing(echo: str) -> None:
    calls: list[float] = []
    trace = trace_of(30, spacing_ms=50, output_length=2)
    result = run(trace, f"{echo}/tag=watch", on_progress=lambda t, s: calls.append(t))
    assert result.summary.completed == 30 and not result.summary.stopped_early
    # The schedule lasts 1.45 s: asked at least at 1 s, once per whole second of the run.
    assert calls and all(t >= k + 0.99 for k, t in enumerate(calls)), calls
    assert len(calls) <= result.summary.duration


# -- summaries --------------------------------------------------------------------------------


def test_summary_of_nothing_is_explicit() -> None:
    summary = summarize([], 1.0)
    assert summary.completed == 0 and summary.request_throughput == 0
    assert summary.mean_ttft_ms is None and summary.send_lag_p99_ms is None


def test_replay_result_writes_records_and_summary(echo: str, tmp_path: Path) -> None:
    result = run(trace_of(3, output_length=2), f"{echo}/tag=write")
    result.write(tmp_path / "requests.jsonl", tmp_path / "summary.json")
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == [0, 1, 2]
    assert json.loads((tmp_path / "summary.json").read_text())["completed"] == 3


# -- CLI --------------------------------------------------------------------------------------


def cli(argv: list[str]) -> int:
    from autotune.cli import build_parser

    args = build_parser().parse_args(argv)
    return args.func(args)


def test_cli_replays_a_trace_file_and_writes_records(echo: str, tmp_path: Path, capsys) -> None:
    trace_file = tmp_path / "t.jsonl"
    trace_file.write_text(
        "".join(
            json.dumps({"timestamp": i * 20, "input_length": 10, "output_length": 3}) + "\n"
            for i in range(5)
        )
    )
    out = tmp_path / "run" / "requests.jsonl"
    argv = ["replay", "--workload", str(trace_file), "--url", f"{echo}/ttft=5,itl=5,tag=cli"]
    code = cli(argv + ["--mode", "concurrency=2", "--slo", "ttft_p95_ms=500", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Successful requests:" in printed and "Request goodput (req/s):" in printed
    assert len(out.read_text().splitlines()) == 5
    summary = json.loads((tmp_path / "run" / "requests.summary.json").read_text())
    assert summary["completed"] == 5 and summary["slo_met"] == {"ttft_p95_ms=500": True}
    assert stats(echo, "cli")["max_in_flight"] == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mode", "fast"], "concurrency=N"),
        (["--slo", "ttft<500"], "ttft_p95_ms=500"),
        (["--speedup", "0"], "--speedup"),
    ],
)
def test_cli_rejects_bad_options_with_a_workload_error(tmp_path: Path, flags, message) -> None:
    trace_file = tmp_path / "t.jsonl"
    trace_file.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1}\n')
    with pytest.raises(WorkloadError, match=message):
        cli(["replay", "--workload", str(trace_file), "--url", "http://127.0.0.1:9"] + flags)


def test_the_client_drops_idle_connections_before_the_server_does() -> None:
    """A request sent on a keep-alive connection the server is just closing fails as
    "Server disconnected" (seen in CI between ladder steps): the client must let go first."""
    import inspect

    import uvicorn

    async def keepalive() -> float:
        async with client_session(ReplayMode.parse("timed"), None) as session:
            return session.connector._keepalive_timeout  # aiohttp keeps no public getter

    server_idle_s = inspect.signature(uvicorn.Config).parameters["timeout_keep_alive"].default
    assert asyncio.run(keepalive()) < server_idle_s
