"""The capacity-fidelity benchmark's own logic (benchmarks/capacity_fidelity.py): what it reads
from `vllm bench serve`'s result JSON, the ratio table, and the timed_trace file it hands vLLM
(the window's requests with their token counts). No engine runs here; the tests marked slow
read our files with vLLM's own dataset class and argument parser (they import vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import capacity_fidelity as bench
from workloads.trace import Trace, TraceRequest

MODEL = Path(__file__).resolve().parents[2] / "server" / "models" / "tiny-multilingual"


def window(n: int = 30) -> Trace:
    """A recorded window: n requests 250 ms apart (4 req/s), lengths 1..200 tokens."""
    rng = np.random.default_rng(7)
    return Trace.from_requests(
        [TraceRequest(timestamp=250.0 * i, input_length=int(rng.integers(1, 201)),
                      output_length=int(rng.integers(1, 120))) for i in range(n)], source="test window")


def vllm_result(**changes: object) -> dict:
    """A result as vLLM 0.32's `vllm bench serve --save-result --save-detailed` writes it
    (trimmed to a few requests; keys we do not read included, as there)."""
    data = {
        "date": "20261201-212804", "backend": "vllm", "model_id": str(MODEL), "num_prompts": 4,
        "request_rate": "inf", "burstiness": 1.0, "max_concurrency": None,
        "duration": 2.5, "completed": 4, "failed": 0, "total_input_tokens": 400, "total_output_tokens": 80,
        "request_throughput": 1.6, "mean_ttft_ms": 20.8, "median_ttft_ms": 18.2, "p50_ttft_ms": 18.2,
        "p95_ttft_ms": 29.2, "p99_ttft_ms": 69.9, "mean_tpot_ms": 5.7, "median_tpot_ms": 5.5,
        "p50_tpot_ms": 5.5, "p95_tpot_ms": 7.0, "p99_tpot_ms": 8.9,
        "input_lens": [100, 100, 100, 100], "output_lens": [20, 20, 20, 20],
        "ttfts": [0.02, 0.018, 0.03, 0.017], "latencies": [0.12, 0.11, 0.13, 0.12],
        "start_times": [1000.0, 1000.5, 1001.0, 1001.5], "itls": [[0.005] * 19] * 4,
        "generated_texts": ["x"] * 4, "errors": ["", "", "", ""],
    }
    return {**data, **changes}


def test_vllm_bench_result_gives_its_percentiles_and_the_rate_it_really_sent(tmp_path: Path) -> None:
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps(vllm_result()))
    figures = bench.vllm_figures(bench.parse_vllm_result(path), run=2)
    assert (figures.client, figures.run) == ("vllm", 2)
    assert (figures.ttft_p95_ms, figures.tpot_p95_ms) == (29.2, 7.0)
    assert (figures.requests, figures.completed, figures.input_tokens, figures.output_tokens) == (4, 4, 400, 80)
    # Four sends 0.5 s apart: 3 gaps over 1.5 s, whatever rate was configured.
    assert figures.offered_rps == pytest.approx(2.0)


def test_a_vllm_run_with_nothing_completed_has_no_percentiles(tmp_path: Path) -> None:
    # vLLM writes 0 for the percentile of no values: that must not read as a 0 ms TTFT.
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps(vllm_result(completed=0, failed=4, p95_ttft_ms=0.0, p95_tpot_ms=0.0)))
    figures = bench.vllm_figures(bench.parse_vllm_result(path), run=1)
    assert figures.ttft_p95_ms is None and figures.tpot_p95_ms is None
    assert figures.requests == 4


def test_a_result_without_the_percentiles_we_compare_is_refused(tmp_path: Path) -> None:
    data = vllm_result()
    del data["p95_tpot_ms"]  # e.g. --metric-percentiles without 95
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="p95_tpot_ms"):
        bench.parse_vllm_result(path)


def runs(ours: list[tuple[float, float]], theirs: list[tuple[float, float]]) -> list:
    made = []
    for k, (mine, other) in enumerate(zip(ours, theirs, strict=True), start=1):
        for client, (ttft, tpot) in (("ours", mine), ("vllm", other)):
            made.append(bench.RunFigures(client=client, run=k, ttft_p95_ms=ttft, tpot_p95_ms=tpot, requests=100,
                                         completed=100, failed=0, offered_rps=5.0, input_tokens=1, output_tokens=1))
    return made


def test_the_ratio_table_takes_ours_over_theirs_per_pair_and_of_the_medians() -> None:
    table = runs(ours=[(400.0, 20.0), (600.0, 22.0), (500.0, 30.0)],
                 theirs=[(500.0, 20.0), (500.0, 20.0), (1000.0, 20.0)])
    comparison = bench.compare(table)
    ttft, tpot = comparison["ttft_p95_ms"], comparison["tpot_p95_ms"]
    assert ttft["paired_ratios"] == pytest.approx([0.8, 1.2, 0.5])
    assert (ttft["ours_median"], ttft["vllm_median"]) == (500.0, 500.0)
    assert ttft["ratio_of_medians"] == pytest.approx(1.0) and ttft["within_tolerance"] is True
    assert tpot["ratio_of_medians"] == pytest.approx(1.1) and tpot["within_tolerance"] is False
    goals = bench.goals(comparison)
    assert [g.met for g in goals] == [True, False]
    assert "per pair 0.8, 1.2, 0.5" in goals[0].note
    lines = bench.runs_table(table)
    vllm_rows = [line for line in lines if "vllm bench serve" in line]
    assert len(vllm_rows) == 3 and "| 0.8 | 1 |" in vllm_rows[0]  # pair 1: 400/500, 20/20


def test_a_run_without_a_figure_leaves_its_pair_out_of_the_ratios() -> None:
    table = runs(ours=[(400.0, 20.0), (600.0, 22.0)], theirs=[(500.0, 20.0), (500.0, 20.0)])
    table[3] = table[3].model_copy(update={"ttft_p95_ms": None, "tpot_p95_ms": None})  # vllm run 2: none done
    comparison = bench.compare(table)
    assert comparison["ttft_p95_ms"]["paired_ratios"] == pytest.approx([0.8])
    assert comparison["ttft_p95_ms"]["ratio_of_medians"] == pytest.approx(500.0 / 500.0)


def test_the_requests_sent_are_a_ladder_steps_requests_offering_the_rate() -> None:
    from autotune.measure.ladder import LadderSettings, offered_rate, step_trace

    recorded = window(30)  # 4 req/s
    sent = bench.measured_trace(recorded, rate_rps=8.0, requests=50, arrivals="recorded")
    step = step_trace(recorded, 1.0, LadderSettings(step_requests=50, min_step_s=1e-3))
    assert len(sent) == 50
    assert list(sent.input_lengths) == list(step.input_lengths[:50])
    assert list(sent.output_lengths) == list(step.output_lengths[:50])
    # The window's requests in order, repeated end to end (from wherever the step starts),
    # their arrival pattern kept and compressed to offer 8 req/s as sent.
    pairs = list(zip(recorded.input_lengths, recorded.output_lengths, strict=True))
    start = pairs.index((sent.input_lengths[0], sent.output_lengths[0]))
    assert [(sent.input_lengths[i], sent.output_lengths[i]) for i in range(50)] == [
        pairs[(start + i) % 30] for i in range(50)]
    assert offered_rate(sent) == pytest.approx(8.0)
    assert np.diff(sent.timestamps_ms) == pytest.approx(np.full(49, 125.0))
    poisson = bench.measured_trace(recorded, rate_rps=8.0, requests=200, arrivals="poisson", seed=3)
    assert list(poisson.input_lengths) == list(bench.measured_trace(recorded, 8.0, 200, "recorded").input_lengths)
    assert 6.5 < offered_rate(poisson) < 9.5  # Poisson at 8 req/s over 200 arrivals


def test_a_bursty_window_keeps_its_bursts_at_the_rate() -> None:
    from autotune.measure.ladder import offered_rate

    bursts = Trace.from_requests(
        [TraceRequest(timestamp=1000.0 * (i // 5) + 10.0 * (i % 5), input_length=10, output_length=5)
         for i in range(40)], source="bursts")  # 5 requests 10 ms apart, once a second
    sent = bench.measured_trace(bursts, rate_rps=10.0, requests=40, arrivals="recorded")
    gaps = np.diff(sent.timestamps_ms)
    assert offered_rate(sent) == pytest.approx(10.0)
    assert gaps.max() / gaps.min() == pytest.approx(960.0 / 10.0)  # the burst shape, scaled


def test_the_timed_trace_file_carries_every_requests_token_counts_and_fresh_hash_ids(tmp_path: Path) -> None:
    sent = bench.measured_trace(window(30), rate_rps=6.0, requests=40, arrivals="recorded")
    first, second = tmp_path / "run1.jsonl", tmp_path / "run2.jsonl"
    bench.write_timed_trace(sent, first, first_hash_id=1 * bench.HASH_ID_STRIDE)
    bench.write_timed_trace(sent, second, first_hash_id=2 * bench.HASH_ID_STRIDE)
    lines = [json.loads(line) for line in first.read_text().splitlines()]
    assert [line["input_length"] for line in lines] == [int(n) for n in sent.input_lengths]
    assert [line["output_length"] for line in lines] == [int(n) for n in sent.output_lengths]
    assert [line["timestamp"] for line in lines] == pytest.approx(list(sent.timestamps_ms), abs=1e-3)
    # vLLM builds a prompt of 16 tokens per hash id, the last one cut: enough ids, none shared.
    assert [len(line["hash_ids"]) for line in lines] == [-(-int(n) // bench.CHUNK) for n in sent.input_lengths]
    ids = [i for line in lines for i in line["hash_ids"]]
    later = {i for line in second.read_text().splitlines() for i in json.loads(line)["hash_ids"]}
    assert len(ids) == len(set(ids)) and not set(ids) & later


def test_the_window_is_the_one_autotune_run_measures() -> None:
    from autotune import preflight
    from autotune.search.objective import default_slos
    from server.config import ServerConfig
    from workloads.trace_io import load_trace

    trace = load_trace(bench.SAMPLE)
    slos = default_slos("cpu")
    config = ServerConfig(engine={"model": "m", "max_model_len": 2048})
    chosen = bench.choose_window(trace, config, slos, 30.0, 20.0)
    expected, _holdout, _info, _fit = preflight.fit_windows(trace, 30.0, 20.0, preflight.requirements(slos))
    assert list(chosen.timestamps_ms) == list(expected.timestamps_ms)
    assert len(chosen) >= 200  # the p95 SLOs' sample-size rule lengthened the 30 s asked for


@pytest.mark.slow  # imports vLLM's benchmark modules (~10-20 s)
def test_vllm_reads_our_file_as_prompts_of_exactly_the_windows_lengths(tmp_path: Path) -> None:
    from vllm.benchmarks.datasets.datasets import TimedTrace
    from vllm.tokenizers import get_tokenizer

    sent = bench.measured_trace(window(30), rate_rps=4.0, requests=30, arrivals="recorded")
    path = tmp_path / "trace.jsonl"
    bench.write_timed_trace(sent, path, first_hash_id=0)
    dataset = TimedTrace(dataset_path=str(path), random_seed=0, timed_trace_chunk_hash_size=bench.CHUNK,
                         timed_trace_sec_multiplier=0.001, timed_trace_label_timestamp="timestamp",
                         timed_trace_label_input_length="input_length",
                         timed_trace_label_output_length="output_length", timed_trace_label_hash_ids="hash_ids")
    samples = dataset.sample(tokenizer=get_tokenizer(str(MODEL)), num_requests=len(sent))
    assert [s.prompt_len for s in samples] == [int(n) for n in sent.input_lengths]
    assert [len(s.prompt) for s in samples] == [int(n) for n in sent.input_lengths]
    assert [s.expected_output_len for s in samples] == [int(n) for n in sent.output_lengths]
    assert [s.timestamp for s in samples] == pytest.approx(list(sent.timestamps_ms / 1000.0), abs=1e-6)


@pytest.mark.slow  # imports vLLM's benchmark modules (~10-20 s)
@pytest.mark.parametrize("arrivals", ["recorded", "poisson"])
def test_vllm_bench_serve_accepts_the_command_and_times_it_as_asked(arrivals: str) -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    command = bench.vllm_command(Path("d.jsonl"), 120, "http://127.0.0.1:8000", Path("/tmp/r.json"),
                                 arrivals=arrivals, rate_rps=7.5, seed=2, model=str(MODEL))
    assert command[1:3] == [str(bench.VLLM_CLI), "bench-serve"]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(command[3:])
    assert (args.dataset_name, args.num_prompts, args.ignore_eos, args.temperature) == ("timed_trace", 120, True, 0.0)
    assert "95" in args.metric_percentiles.split(",") and args.save_detailed
    if arrivals == "recorded":
        assert args.self_timed is None  # vLLM then times each request by the file's timestamps
    else:
        assert (args.self_timed, args.request_rate, args.burstiness) == (False, 7.5, 1.0)


def test_each_clients_ttft_is_set_against_the_servers_own_in_the_same_run() -> None:
    table = runs(ours=[(400.0, 20.0), (900.0, 22.0)], theirs=[(300.0, 20.0), (500.0, 20.0)])
    server_p95 = [400.0, 300.0, 1000.0, 500.0]  # the server's histogram saw each run move alike
    table = [r.model_copy(update={"server_ttft_p95_ms": p}) for r, p in zip(table, server_p95, strict=True)]
    assert bench.against_server(table) == {"ours": pytest.approx(0.95), "vllm": pytest.approx(1.0)}
    assert bench.relative_range([400.0, 900.0]) == pytest.approx(500.0 / 650.0)


def test_the_report_shows_the_vllm_command_as_typed_from_the_repository() -> None:
    work = Path("/tmp/capacity-fidelity-abc")
    command = bench.vllm_command(work / "vllm-1.timed_trace.jsonl", 120, "http://127.0.0.1:43827",
                                 work / "vllm-1.json", arrivals="recorded", rate_rps=5.0, seed=1,
                                 model=str(MODEL))
    shown = bench.shown_command(command, work)
    assert shown.startswith(".venv/bin/python benchmarks/vllm_cli.py bench-serve --backend vllm "
                            "--base-url http://127.0.0.1:PORT ")
    assert "--dataset-path WORK/vllm-1.timed_trace.jsonl" in shown and "--result-dir WORK " in shown
    assert "--model server/models/tiny-multilingual " in shown and "/tmp/" not in shown


def test_vllms_per_request_figures_follow_its_own_definitions() -> None:
    result = bench.VllmBenchResult.model_validate(vllm_result(
        ttfts=[0.02, 0.05, None, 0.01], latencies=[0.21, 0.05, None, 0.5], output_lens=[20, 1, 0, 50],
        errors=["", "", "timeout", ""]))
    ttfts, tpots = bench.vllm_per_request(result)
    assert ttfts == pytest.approx([20.0, 50.0, 10.0])  # the failed request has none
    assert tpots == pytest.approx([10.0, 10.0])  # (E2E - TTFT) / (n - 1); none for one token


def test_a_together_pair_gives_each_client_its_p95_over_both_halves() -> None:
    # Each half: one client's share of the requests; the pair's p95 is over all of them.
    halves = [([float(v) for v in range(1, 51)], [5.0] * 50), ([float(v) for v in range(51, 101)], [7.0] * 50)]
    sent = [bench.RunFigures(client="ours", run=1, ttft_p95_ms=None, tpot_p95_ms=None, requests=50, completed=50,
                             failed=0, offered_rps=rate, input_tokens=10, output_tokens=20, wall_s=30.0)
            for rate in (2.4, 2.6)]
    pair = bench.together_figures("ours", 1, halves, sent)
    assert pair.schedule == "together" and (pair.requests, pair.completed, pair.input_tokens) == (100, 100, 20)
    assert pair.ttft_p95_ms == pytest.approx(float(np.percentile(np.arange(1, 101), 95)))
    assert pair.tpot_p95_ms == pytest.approx(7.0) and pair.offered_rps == pytest.approx(2.5)
    # Together runs are compared among themselves, never with one-at-a-time runs.
    theirs = pair.model_copy(update={"client": "vllm", "ttft_p95_ms": pair.ttft_p95_ms * 2})
    alone = runs(ours=[(400.0, 20.0)], theirs=[(500.0, 20.0)])
    compared = bench.compare([*alone, pair, theirs], "together")
    assert compared["ttft_p95_ms"]["paired_ratios"] == pytest.approx([0.5])
    assert bench.compare([*alone, pair, theirs])["ttft_p95_ms"]["paired_ratios"] == pytest.approx([0.8])


def test_vllms_send_lag_is_read_against_the_files_schedule() -> None:
    # Sends at 0, 0.5, 1.02, 1.5 s (perf_counter from 1000) of a schedule 0, 0.5, 1.0, 1.5 s.
    result = bench.VllmBenchResult.model_validate(vllm_result(start_times=[1000.0, 1000.5, 1001.02, 1001.5]))
    lag = bench.vllm_send_lag_p99_ms(result, [0.0, 500.0, 1000.0, 1500.0])
    assert lag == pytest.approx(float(np.percentile([0.0, 0.0, 20.0, 0.0], 99)), abs=1e-6)
    assert bench.vllm_send_lag_p99_ms(result, [0.0, 500.0]) is None  # not one time per request
    figures = bench.vllm_figures(result, 1, [0.0, 500.0, 1000.0, 1500.0])
    assert figures.send_lag_p99_ms == pytest.approx(lag)
    assert bench.vllm_figures(result, 1).send_lag_p99_ms is None  # poisson: vLLM's own schedule


def test_a_runs_p95_comes_with_how_far_another_draw_could_move_it() -> None:
    rng = np.random.default_rng(1)
    few, many = rng.exponential(100.0, 60), rng.exponential(100.0, 6000)
    low, high = bench.p95_interval(list(few))
    assert low < float(np.percentile(few, 95)) < high
    wide = (high - low) / float(np.percentile(few, 95))
    low, high = bench.p95_interval(list(many))
    assert (high - low) / float(np.percentile(many, 95)) < wide / 5  # 100x the requests: ~10x narrower
    assert bench.p95_interval([5.0]) is None


def test_the_reading_sets_the_gap_against_each_clients_own_noise() -> None:
    table = runs(ours=[(400.0, 20.0), (1600.0, 22.0), (800.0, 30.0)],
                 theirs=[(1200.0, 20.0), (500.0, 20.0), (900.0, 20.0)])
    table = [r.model_copy(update={"ttft_p95_interval": (0.8 * r.ttft_p95_ms, 1.1 * r.ttft_p95_ms)}) for r in table]
    lines = bench.reading(table, bench.compare(table), None)
    assert lines[0].startswith("TTFT p95, one client at a time: ours / vllm 0.889 (per pair 0.333, 3.2, 0.889)")
    assert "range 1.5 (ours) and 0.78 (vllm) of their median" in lines[0]
    assert "x0.80 to x1.10 of itself" in lines[0]
    assert lines[1].startswith("TPOT p95") and "bootstrap" not in lines[1]  # no intervals given


FAKE_VLLM = """
import time
print("importing vLLM ...", flush=True)
end = time.process_time() + 0.3  # start-up CPU: not the run's
while time.process_time() < end: pass
print("Starting main benchmark run...", flush=True)
end = time.process_time() + 0.2
while time.process_time() < end: pass
print("============ Serving Benchmark Result ============", flush=True)
end = time.process_time() + 0.3  # writing its result: not the run's either
while time.process_time() < end: pass
raise SystemExit(3)
"""


def test_a_vllm_run_counts_the_cpu_of_its_main_run_only(tmp_path: Path) -> None:
    import asyncio
    import sys

    async def run() -> tuple[int, float | None]:
        vllm = bench.VllmRun([sys.executable, "-c", FAKE_VLLM], tmp_path / "vllm.log")
        await vllm.start()
        return await vllm.finish(), vllm.cpu_s

    code, cpu_s = asyncio.run(run())
    assert code == 3
    assert cpu_s is not None and 0.18 <= cpu_s < 0.45
    log = (tmp_path / "vllm.log").read_text()
    assert log.startswith("importing vLLM") and "Serving Benchmark Result" in log


def test_a_vllm_process_that_never_starts_its_run_is_reported_with_its_last_lines(tmp_path: Path) -> None:
    import asyncio
    import sys

    vllm = bench.VllmRun([sys.executable, "-c", "print('ValueError: no tokenizer'); raise SystemExit(1)"],
                         tmp_path / "vllm.log")
    with pytest.raises(SystemExit, match=r"exited 1; last lines of (.|\n)*no tokenizer"):
        asyncio.run(vllm.start())


def test_the_servers_own_counters_over_a_run_stand_beside_the_clients() -> None:
    from autotune.measure.scraper import parse_metrics

    def scrape(prompt: float, generated: float, done: float) -> str:
        return (f"vllm:prompt_tokens_total {prompt}\nvllm:generation_tokens_total {generated}\n"
                f'vllm:request_success_total{{finished_reason="length"}} {done}\n')

    before, after = parse_metrics(scrape(1000, 500, 10)), parse_metrics(scrape(8416, 8921, 130))
    run = runs(ours=[(400.0, 20.0)], theirs=[(500.0, 20.0)])[0]
    seen = bench.with_server_view(run, before, after)
    assert (seen.server_prompt_tokens, seen.server_generation_tokens, seen.server_requests) == (7416, 8421, 120)
    assert seen.ttft_p95_ms == run.ttft_p95_ms and seen.server_ttft_p95_ms is None  # no histogram scraped
