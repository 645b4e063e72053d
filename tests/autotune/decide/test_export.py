"""best.yaml: loads back, passes `vllm serve --config`, carries provenance, says the decision."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.decide.export import build_provenance, export_best, final_config
from autotune.search.gate import BASELINE, Measurement, decide
from autotune.search.objective import parse_objective
from server.config import ServerConfig, ServingSettings, default_engine_settings
from workloads.slo import parse_slos

SLOS = parse_slos(["ttft_p95_ms=1000", "tpot_p95_ms=100"])


def runs(baseline: list[float], candidate: list[float]) -> list[Measurement]:
    return [Measurement(candidate=BASELINE, repeat=i, value=v, slo_met=True) for i, v in enumerate(baseline)] + [
        Measurement(candidate="trial-0003", repeat=i, value=v, slo_met=True) for i, v in enumerate(candidate)
    ]


def export(tmp_path: Path, measurements: list[Measurement], overrides: dict) -> tuple[Path, ServerConfig]:
    baseline = ServerConfig(engine=default_engine_settings(), serving=ServingSettings(max_waiting_requests=8))
    decision = decide(measurements)
    chosen = {} if decision.keep_baseline else overrides
    provenance = build_provenance(
        decision=decision,
        winner_overrides=chosen,
        objective=parse_objective("goodput", SLOS),
        slos=SLOS,
        study_name="demo",
        storage_url="sqlite:///x/study.db",
        command_line=["autotune", "run", "--workload", "trace.jsonl"],
        model=str(baseline.engine["model"]),
        workload={"source": "trace.jsonl", "fingerprint": "abc123"},
        baseline_source="vLLM's defaults",
        effective_defaults={"max_num_seqs": 128},
        validation=[m.model_dump() for m in measurements],
        search={"trials": 6},
    )
    path = tmp_path / "best.yaml"
    export_best(path, final_config(baseline, chosen), provenance)
    return path, baseline


def test_winner_round_trips_and_records_where_it_came_from(tmp_path: Path) -> None:
    path, baseline = export(tmp_path, runs([2.0, 2.02], [3.0, 3.1]), {"max_num_seqs": 8})
    loaded = ServerConfig.load(path)
    assert loaded.engine["max_num_seqs"] == 8
    assert loaded.engine["model"] == baseline.engine["model"]
    # Deployed as the user runs it: not in benchmark mode, their admission limit kept.
    assert loaded.serving.benchmark_mode is False and loaded.serving.max_waiting_requests == 8
    provenance = loaded.provenance
    assert provenance["decision"]["emitted"] == "trial-0003"
    assert provenance["decision"]["effect"] > 0.4
    assert provenance["slos"] == ["ttft_p95_ms=1000", "tpot_p95_ms=100"]
    assert provenance["workload"]["fingerprint"] == "abc123"
    assert provenance["vllm_version"] and provenance["hardware"]["cpu"]
    assert provenance["command_line"] == "autotune run --workload trace.jsonl"
    assert path.read_text().startswith("# vllm-autotune ")


def test_kept_baseline_is_still_written_and_says_so(tmp_path: Path) -> None:
    path, baseline = export(tmp_path, runs([2.0, 2.3], [2.1, 2.2]), {"max_num_seqs": 8})
    text = path.read_text()
    assert "KEPT THE BASELINE" in text.splitlines()[1]
    loaded = ServerConfig.load(path)
    assert loaded.engine == baseline.engine
    assert loaded.provenance["decision"]["kept_baseline"] is True


@pytest.mark.slow
def test_vllm_serve_accepts_the_exported_file(tmp_path: Path) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    path, _ = export(tmp_path, runs([2.0, 2.02], [3.0, 3.1]),
                     {"max_num_seqs": 8, "max_num_batched_tokens": 512, "gpu_memory_utilization": 0.25})
    parser = FlexibleArgumentParser(prog="vllm")  # as vllm/entrypoints/cli/main.py builds it
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", "--config", str(path)])
    theirs = AsyncEngineArgs.from_cli_args(args)
    assert (theirs.max_num_seqs, theirs.max_num_batched_tokens, theirs.gpu_memory_utilization) == (8, 512, 0.25)
    provenance = args.additional_config["vllm_autotune"]["provenance"]
    assert provenance["decision"]["emitted"] == "trial-0003"
