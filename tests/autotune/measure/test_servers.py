"""`--server vllm`: the command a trial starts, the file stock `vllm serve` is given, refusals.

No engine here: the command is read from the trial's server.log (the launcher writes it there
before starting anything) with a stand-in interpreter that exits at once, and the file is
parsed by vLLM's own `vllm serve` argument parser. tests/autotune/measure/test_servers_engine.py
serves a real window with stock `vllm serve`.
"""

from __future__ import annotations

import argparse
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autotune.decide.export import build_provenance, header_text
from autotune.errors import AutotuneError
from autotune.measure import servers
from autotune.measure.servers import TrialServer, deployed_server, trial_server
from autotune.measure.trial import TrialRunner
from autotune.search.gate import GateDecision
from autotune.search.objective import parse_objective
from server.config import (
    RecorderSettings,
    ServerConfig,
    ServingSettings,
    default_engine_settings,
)
from workloads.slo import parse_slos
from workloads.trace import Trace, TraceRequest

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"


def window() -> Trace:
    return Trace.from_requests([TraceRequest(timestamp=0.0, input_length=8, output_length=4)], source="t")


def stand_in_python(tmp_path: Path) -> Path:
    """An 'interpreter' that exits at once: the trial fails fast, its log keeps the command."""
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\necho 'stand-in python: not starting anything' >&2\nexit 3\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def config(**engine: object) -> ServerConfig:
    return ServerConfig(engine={**default_engine_settings(), **engine})


def started_command(trial_dir: Path) -> list[str]:
    first = (trial_dir / "server.log").read_text().splitlines()[0]
    return first.split(": starting ", 1)[1].split(" ")


def test_a_vllm_trial_starts_vllm_serve_with_engine_arguments_only(tmp_path: Path) -> None:
    python = stand_in_python(tmp_path)
    runner = TrialRunner(python=str(python), warmup_requests=0,
                         server=TrialServer(kind="vllm", api_server_count=2))
    outcome = runner.run(config(max_num_seqs=8), window(), tmp_path / "trial-0000")

    trial_dir = tmp_path / "trial-0000"
    argv = started_command(trial_dir)
    assert argv[:4] == [str(python), "-m", "server.vllm_serve", "serve"]
    port = argv[argv.index("--port") + 1]
    assert argv[4:] == ["--config", str(trial_dir / "vllm-serve.yaml"), "--port", port,
                        "--host", "127.0.0.1", "--api-server-count", "2"]
    # What ran is recorded with the (failed) outcome.
    assert outcome.failure == "crash" and outcome.server == "vllm serve --api-server-count 2 (stock vLLM)"
    # The trial's own config.yaml is still our format (best.yaml is built from it).
    assert ServerConfig.load(trial_dir / "config.yaml").engine["max_num_seqs"] == 8


def test_our_server_is_still_the_default(tmp_path: Path) -> None:
    python = stand_in_python(tmp_path)
    outcome = TrialRunner(python=str(python), warmup_requests=0).run(config(), window(), tmp_path / "t")
    argv = started_command(tmp_path / "t")
    assert argv[:3] == [str(python), "-m", "server"] and argv[-1] == "--benchmark-mode"
    assert argv[3] == "--config" and argv[4] == str(tmp_path / "t" / "config.yaml")
    assert outcome.server == "python -m server (vllm-autotune's server)"
    assert not (tmp_path / "t" / "vllm-serve.yaml").exists()


def test_our_server_with_several_front_ends(tmp_path: Path) -> None:
    python = stand_in_python(tmp_path)
    runner = TrialRunner(python=str(python), warmup_requests=0,
                         server=TrialServer(api_server_count=2))
    outcome = runner.run(config(max_num_seqs=8), window(), tmp_path / "t")
    argv = started_command(tmp_path / "t")
    port = argv[argv.index("--port") + 1]
    assert argv == [str(python), "-m", "server", "--config", str(tmp_path / "t" / "config.yaml"),
                    "--port", port, "--benchmark-mode", "--api-processes", "2"]
    assert outcome.server == "python -m server --api-processes 2 (vllm-autotune's server)"
    # The trial's config.yaml (what best.yaml is made from) carries the count too.
    served = ServerConfig.load(tmp_path / "t" / "config.yaml")
    assert served.serving.api_processes == 2 and served.engine["max_num_seqs"] == 8


def test_the_count_becomes_our_serving_setting() -> None:
    server = TrialServer(api_server_count=3)
    assert server.served(config()).serving.api_processes == 3
    assert TrialServer().served(config()).serving.api_processes == 1  # the config's own
    assert TrialServer(kind="vllm", api_server_count=3).served(config()) == config()


def vllm_serve_parser() -> argparse.ArgumentParser:
    """vLLM's own `vllm serve` parser (what `vllm serve --config FILE` runs through)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    return parser


def test_vllm_serve_parses_the_file_it_is_given(tmp_path: Path) -> None:
    served = config(
        max_num_seqs=8,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,  # a False whose default is True: `no-...: true`
        additional_config={"other_plugin": {"x": 1}},
    ).model_copy(update={"serving": ServingSettings(benchmark_mode=True), "api_key": "k",
                         "provenance": {"study": "s"}})
    path = tmp_path / "vllm-serve.yaml"
    served.write_vllm_serve(path)

    data = yaml.safe_load(path.read_text())
    # Host and port come on the command line; our section is ours alone.
    assert not {"host", "port", "api-key"} & set(data)
    assert data["additional-config"] == {"other_plugin": {"x": 1}}
    args = vllm_serve_parser().parse_args(["serve", "--config", str(path), "--port", "18000"])
    assert args.model == served.engine["model"] and args.load_format == "dummy"
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.port) == (8, 512, 18000)
    assert args.enable_prefix_caching is False
    assert args.additional_config == {"other_plugin": {"x": 1}}


def test_api_server_count_for_either_server(tmp_path: Path) -> None:
    assert trial_server("autotune", 2) == TrialServer(api_server_count=2)
    with pytest.raises(AutotuneError, match="must be at least 1"):
        trial_server("vllm", 0)
    assert trial_server("vllm", 4) == TrialServer(kind="vllm", api_server_count=4)
    assert trial_server(None, None) == TrialServer()
    # Our recorder records one process's traffic: refused with several.
    recording = config().model_copy(update={"serving": ServingSettings(
        recorder=RecorderSettings(directory=str(tmp_path / "traffic")))})
    with pytest.raises(AutotuneError, match=r"--api-server-count 2: the baseline: .*recorder needs api_processes 1"):
        TrialServer(api_server_count=2).check([("the baseline", recording)])
    TrialServer().check([("the baseline", recording)])


def test_our_server_settings_are_refused_for_vllm_serve() -> None:
    limited = config().model_copy(update={"serving": ServingSettings(max_waiting_requests=16)})
    with pytest.raises(AutotuneError, match="compare-mine sets our server's own max_waiting_requests"):
        TrialServer(kind="vllm").check([("the baseline", config()), ("compare-mine", limited)])
    TrialServer().check([("compare-mine", limited)])  # ours has it


def test_a_missing_vllm_serve_entry_point_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # A vLLM build without the CLI (the check looks for the module's file, importing nothing).
    monkeypatch.setattr(servers, "VLLM_CLI_MODULE", "vllm.entrypoints.cli.not_in_this_build")
    with pytest.raises(AutotuneError, match=r"--server vllm: vLLM's `vllm serve` entry point .* not installed"):
        trial_server("vllm", None)


@pytest.mark.slow
def test_the_cli_refuses_in_one_line(tmp_path: Path) -> None:
    baseline = tmp_path / "base.yaml"
    config().model_copy(update={"serving": ServingSettings(max_waiting_requests=4)}).write(baseline)
    recording = tmp_path / "recording.yaml"
    config().model_copy(update={"serving": ServingSettings(
        recorder=RecorderSettings(directory=str(tmp_path / "traffic")))}).write(recording)
    runs = {
        "count": ["--api-server-count", "2", "--baseline", str(recording)],
        "baseline": ["--server", "vllm", "--baseline", str(baseline)],
    }
    for name, flags in runs.items():
        done = subprocess.run(
            [sys.executable, "-m", "autotune", "run", "--workload", str(SAMPLE),
             "--output-dir", str(tmp_path / name), *flags],
            capture_output=True, text=True, timeout=300, cwd=ROOT,
        )
        assert done.returncode == 2, done.stderr[-2000:]
        errors = [line for line in done.stderr.splitlines() if "error" in line]
        assert len(errors) == 1, done.stderr[-2000:]
        assert ("--api-server-count" if name == "count" else "max_waiting_requests") in errors[0]
        assert not (tmp_path / name / "trial-0000").exists()  # refused before any trial


def test_provenance_and_header_say_which_server_ran_the_trials() -> None:
    slos = parse_slos(["ttft_p95_ms=500"])
    decision = GateDecision(winner="baseline", keep_baseline=True, reason="r", best_candidate=None,
                            baseline_median=None, candidate_median=None, effect=None, ci_low=None,
                            ci_high=None, noise=None, confidence=0.95, stats=[])
    provenance = build_provenance(
        decision=decision, winner_overrides={}, objective=parse_objective("capacity", slos),
        slos=slos, study_name="s", storage_url="sqlite://", command_line=["autotune", "run"],
        model="m", workload={"source": "w", "fingerprint": "f"}, baseline_source="defaults",
        effective_defaults={}, validation=[], search={},
        trial_server=TrialServer(kind="vllm", api_server_count=2),
    )
    assert provenance["trial_server"] == {"kind": "vllm", "api_server_count": 2,
                                          "ran": "vllm serve --api-server-count 2 (stock vLLM)"}
    assert "measured on: vllm serve --api-server-count 2 (stock vLLM)" in header_text(provenance)
    # retune keeps measuring on what the deployed config was measured on.
    assert deployed_server(provenance) == "vllm"
    assert deployed_server({}) == "autotune"
