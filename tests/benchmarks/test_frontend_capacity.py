"""The front-end capacity benchmark's columns (benchmarks/frontend_capacity.py): a column may
change engine arguments, and such columns are compared with the first one, round by round.
No engine runs here."""

from __future__ import annotations

import pytest

from benchmarks import frontend_capacity as bench


def test_a_column_names_its_server_and_its_engine_changes() -> None:
    column = bench.parse_column("ours:4+max_num_batched_tokens=512+enable_prefix_caching=false")
    assert (column.kind, column.count) == ("ours", 4)
    assert column.engine == {"max_num_batched_tokens": 512, "enable_prefix_caching": False}
    assert bench.parse_column("vllm:1").engine == {}
    assert bench.parse_column("in_process+max_num_seqs=8").kind == "in_process"
    assert "/" not in bench.safe_name(column.label) and ":" not in bench.safe_name(column.label)


@pytest.mark.parametrize("text, why", [
    ("ours:1+max_num_seqs", "'max_num_seqs' is not KEY=VALUE"),
    ("ours:0", "expected in_process, ours:N or vllm:N (N >= 1)"),
    ("sglang:1", "expected in_process, ours:N or vllm:N (N >= 1)"),
])
def test_a_bad_column_is_refused_in_one_line(text: str, why: str) -> None:
    with pytest.raises(SystemExit) as refused:
        bench.parse_column(text)
    message = str(refused.value)
    assert message.startswith(f"frontend_capacity: column {text!r}: ") and why in message
    assert "\n" not in message


def test_engine_changes_are_compared_with_the_first_column_round_by_round() -> None:
    columns = [bench.parse_column(text) for text in ("ours:1", "ours:1+max_num_seqs=512", "vllm:1")]
    rows = [
        {"round": 1, "column": "ours:1", "capacity_rps": 100.0},
        {"round": 1, "column": "ours:1+max_num_seqs=512", "capacity_rps": 150.0},
        {"round": 1, "column": "vllm:1", "capacity_rps": 90.0},
        {"round": 2, "column": "ours:1+max_num_seqs=512", "capacity_rps": 120.0},
        {"round": 2, "column": "ours:1", "capacity_rps": 120.0},
        {"round": 2, "column": "vllm:1", "capacity_rps": None},  # a failed launch
    ]
    compared, lines = bench.versus_first(rows, columns)
    assert list(compared) == ["ours:1+max_num_seqs=512"]  # vllm:1 changes no engine argument
    assert compared["ours:1+max_num_seqs=512"]["paired"] == [1.5, 1.0]
    assert compared["ours:1+max_num_seqs=512"]["ratio_of_medians"] == pytest.approx(135 / 110)
    assert any("ours:1+max_num_seqs=512" in line and "1.5, 1" in line for line in lines)


def test_each_launch_is_compared_with_the_in_process_launch_of_its_own_round() -> None:
    # The in-process reference moves between launches (here 400 then 300 req/s): a launch's
    # share is taken against its own round's reference, never against another round's.
    rows = [
        {"round": 1, "column": "in_process", "capacity_rps": 400.0},
        {"round": 1, "column": "ours:4", "capacity_rps": 300.0},
        {"round": 2, "column": "ours:4", "capacity_rps": 285.0},
        {"round": 2, "column": "in_process", "capacity_rps": 300.0},
        {"round": 3, "column": "ours:4", "capacity_rps": 250.0},
        {"round": 3, "column": "in_process", "capacity_rps": None},  # a failed launch
    ]
    assert bench.per_round(rows, "ours:4", "in_process") == {1: 0.75, 2: 0.95}


@pytest.mark.slow
def test_several_ladders_run_back_to_back_in_one_launch(tmp_path) -> None:
    """`--ladders 2 --settle alternate`: one server start, two ladders, each kept, the first
    waiting on the gauges alone between steps, the second for an idle probe too; the report
    sets the spread within the launch against that between launches (a fake server: no engine)."""
    import json
    import sys
    from pathlib import Path

    from autotune.measure.ladder import LadderSettings
    from server.config import ServerConfig
    from workloads.replay import ReplayOptions
    from workloads.slo import parse_slo
    from workloads.trace import Trace, TraceRequest

    fake = Path(__file__).resolve().parents[1] / "autotune" / "fake_server.py"
    behaviour = tmp_path / "behaviour.json"
    behaviour.write_text(json.dumps({"slots": 6, "token_delay_s": 0.04}))
    runner = bench.RepeatedLadders(
        2, "alternate", server_command=[sys.executable, str(fake), "--behaviour", str(behaviour)],
        startup_timeout_s=20, warmup_requests=1, scrape_interval_s=0.2,
        stale_registry=tmp_path / "servers.json",
        replay=ReplayOptions(slos=[parse_slo("ttft_p95_ms=600")], max_send_lag_ms=60_000),
        ladder=LadderSettings(step_requests=20, min_step_s=1.0, resolution=0.5, max_steps=4))
    window = Trace.from_requests([TraceRequest(timestamp=i * 100.0, input_length=10 + i, output_length=5)
                                  for i in range(20)], source="test window")
    outcome = runner.run(ServerConfig(engine={"model": "fake"}), window, tmp_path / "launch")
    assert outcome.ok, outcome.failure_detail
    assert len(runner.capacities) == 2 and all(c.steps for c in runner.capacities)
    assert runner.settled == [False, True]
    gauges_only, probed = runner.capacities
    assert gauges_only.idle_probe_ms is None and all(s.settle_probes_ms == [] for s in gauges_only.steps)
    assert probed.idle_probe_ms is not None and all(s.settle_probes_ms for s in probed.steps)
    assert runner.ladder is not None and runner.ladder.settle_probe  # the runner's own settings restored
    assert (tmp_path / "launch" / "server.log").read_text().count("fake server pid starting") == 1
    assert [json.loads((tmp_path / "launch" / f"ladder-{k}.json").read_text())["capacity_rps"]
            for k in (1, 2)] == [c.capacity_rps for c in runner.capacities]
    rows = [{"round": r, "column": "ours:1", "ladder": k, "capacity_rps": value}
            for r, values in ((1, (10.0, 12.0)), (2, (14.0, 14.0))) for k, value in enumerate(values, 1)]
    [line] = [x for x in bench.within_and_between(rows) if x.startswith("- ours:1")]
    assert "launch 1: 0.182 (10, 12)" in line and "launch 2: 0 (14, 14)" in line
    assert "between the launches' medians (11, 14): 0.24" in line


def test_ladders_with_and_without_the_idle_probe_are_set_side_by_side() -> None:
    rows = [{"round": 1, "column": "vllm:1", "settle": k % 2 == 1, "capacity_rps": value}
            for k, value in enumerate((120.0, 250.0, 140.0, 260.0))]
    compared, lines = bench.settle_comparison(rows)
    assert compared["vllm:1"]["gauges_only"] == [120.0, 140.0]
    assert compared["vllm:1"]["ratio_of_medians"] == pytest.approx(255 / 130)
    assert any(line.startswith("| vllm:1 | 120, 140 | 250, 260 |") for line in lines)


def test_ours_is_judged_against_its_twins_with_the_same_front_ends_and_engine_changes() -> None:
    rows = [
        {"round": 1, "column": "ours:4+max_num_batched_tokens=512", "capacity_rps": 200.0, "lag_p99_ms": 2.0},
        {"round": 1, "column": "vllm:4+max_num_batched_tokens=512", "capacity_rps": 250.0, "lag_p99_ms": 3.0},
        {"round": 1, "column": "vllm:4", "capacity_rps": 100.0, "lag_p99_ms": 6.0},
        {"round": 1, "column": "in_process+max_num_batched_tokens=512", "capacity_rps": 160.0, "lag_p99_ms": 12.0},
        {"round": 2, "column": "vllm:4+max_num_batched_tokens=512", "capacity_rps": 200.0, "lag_p99_ms": 2.0},
        {"round": 2, "column": "ours:4+max_num_batched_tokens=512", "capacity_rps": 220.0, "lag_p99_ms": 2.0},
    ]
    _, _, goals = bench.issue_goals(rows)
    by_name = {g.name.partition(" capacity / ")[2]: g for g in goals if " capacity / " in g.name}
    # The twins carry the same change (vllm medians 210 / 225), never plain vllm:4 (100).
    assert set(by_name) == {"vllm:4+max_num_batched_tokens=512", "in_process+max_num_batched_tokens=512"}
    vllm = by_name["vllm:4+max_num_batched_tokens=512"]
    assert vllm.measured == pytest.approx(210 / 225) and vllm.met is False and "0.8, 1.1" in vllm.note
    assert by_name["in_process+max_num_batched_tokens=512"].measured == pytest.approx(210 / 160)
    # The in-process column's own client is not the replayer: its lag is not the replayer's.
    lag = next(g for g in goals if "send-lag" in g.name)
    assert lag.measured == 6.0 and lag.met is False


def test_a_plain_column_without_its_twin_says_not_measured() -> None:
    _, _, goals = bench.issue_goals([{"round": 1, "column": "ours:4", "capacity_rps": 200.0, "lag_p99_ms": 2.0}])
    assert [(g.name, g.met) for g in goals if " capacity / " in g.name] == [
        ("ours:4 capacity / in_process", None), ("ours:4 capacity / vllm:4", None)]
