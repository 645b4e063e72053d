"""The traffic commands end to end: files in, files and exit codes out."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from autotune.cli import main as autotune_main
from workloads.profile import profile_trace
from workloads.synthetic import TranslationSpec, translation
from workloads.trace_io import load_trace, write_trace

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def cli() -> Callable[[list[str]], int]:
    """The traffic commands as `autotune` runs them (autotune.cli: bad input exits 2)."""
    return autotune_main


def test_convert_then_profile(cli, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "burst.jsonl"
    assert (
        cli(["convert", "--from", "burstgpt", str(FIXTURES / "burstgpt_small.csv"), str(out)]) == 0
    )
    assert "2 failed requests (0 response tokens) dropped" in capsys.readouterr().out
    assert len(load_trace(out)) == 5
    assert cli(["profile", str(out), "--json"]) == 0
    profile = json.loads(capsys.readouterr().out)
    assert profile["requests"] == 5 and len(profile["fingerprint"]) == 16
    assert cli(["profile", str(out), "--plot", str(tmp_path / "plots")]) == 0
    assert "fingerprint" in capsys.readouterr().out
    assert (tmp_path / "plots" / "arrivals.png").is_file()


def test_bad_input_exits_2_with_file_and_line(
    cli, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli(
        [
            "convert",
            "--from",
            "azure",
            str(FIXTURES / "azure_malformed.csv"),
            str(tmp_path / "x.jsonl"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("autotune: error: ") and "azure_malformed.csv:4: field 'TIMESTAMP'" in err
    assert not (tmp_path / "x.jsonl").exists()
    assert (
        cli(
            [
                "convert",
                "--from",
                "azure",
                "--model",
                "GPT-4",
                str(FIXTURES / "azure_small.csv"),
                str(tmp_path / "y.jsonl"),
            ]
        )
        == 2
    )
    assert cli(["profile", str(tmp_path / "absent.jsonl")]) == 2
    # --skip-invalid turns the same file into a warning with the count.
    ok = cli(
        [
            "convert",
            "--from",
            "azure",
            "--skip-invalid",
            str(FIXTURES / "azure_malformed.csv"),
            str(tmp_path / "x.jsonl"),
        ]
    )
    assert ok == 0 and "1 invalid rows skipped" in capsys.readouterr().out


def test_generate_and_window(cli, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gen.jsonl"
    assert cli(["generate", str(out), "--duration-s", "300", "--rate", "6", "--seed", "4"]) == 0
    trace = load_trace(out)
    assert trace.duration_s() == pytest.approx(300, abs=5)
    like = tmp_path / "like.jsonl"
    assert (
        cli(
            [
                "generate",
                str(like),
                "--like",
                str(out),
                "--duration-s",
                "120",
                "--arrivals",
                "poisson",
            ]
        )
        == 0
    )
    assert load_trace(like).duration_s() == pytest.approx(120, abs=5)
    assert (
        cli(
            [
                "window",
                str(out),
                "--tuning-s",
                "60",
                "--holdout-s",
                "30",
                "--out-dir",
                str(tmp_path / "w"),
            ]
        )
        == 0
    )
    info = json.loads((tmp_path / "w" / "windows.json").read_text())
    tuning = load_trace(tmp_path / "w" / "tuning.jsonl")
    assert len(tuning) == info["tuning"]["requests"] and tuning.timestamps_ms[-1] < 60_000
    assert cli(["window", str(out), "--tuning-s", "200", "--holdout-s", "200"]) == 2
    assert cli(["generate", str(out), "--burst-fraction", "1.5"]) == 2


def test_drift_exit_codes(cli, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = translation(TranslationSpec(duration_s=1200), seed=0)
    first, second = trace.slice_time(0, 600_000), trace.slice_time(600_000, 1_200_000)
    ref, cur = tmp_path / "ref.jsonl", tmp_path / "cur.jsonl"
    write_trace(ref, first)
    write_trace(cur, second)
    assert cli(["drift", "--reference", str(ref), "--current", str(cur)]) == 0
    assert "no drift" in capsys.readouterr().out
    config = tmp_path / "best.yaml"
    profile = profile_trace(first).model_dump(mode="json")
    config.write_text(
        yaml.safe_dump(
            {"additional-config": {"vllm_autotune": {"provenance": {"profile": profile}}}}
        )
    )
    fast = tmp_path / "fast.jsonl"
    write_trace(fast, second.replace(timestamps_ms=second.timestamps_ms / 2))
    assert cli(["drift", "--reference", str(config), "--current", str(fast), "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["drifted"] and any(
        t["name"] == "arrival_rate" and t["drifted"] for t in report["tests"]
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("max-num-seqs: 8\n")
    assert cli(["drift", "--reference", str(bad), "--current", str(cur)]) == 2
