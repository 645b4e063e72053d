"""Drift tests: quiet on stationary traffic, loud on a length or rate shift."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from workloads.drift import compare, load_reference
from workloads.errors import WorkloadError
from workloads.profile import profile_trace
from workloads.synthetic import TranslationSpec, translation
from workloads.trace import Trace
from workloads.trace_io import write_trace
from workloads.windows import speedup


def halves(seed: int) -> tuple[Trace, Trace]:
    trace = translation(TranslationSpec(duration_s=1200), seed=seed)
    return trace.slice_time(0, 600_000), trace.slice_time(600_000, 1_200_000)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_drift_between_halves_of_stationary_traffic(seed: int) -> None:
    first, second = halves(seed)
    report = compare(first, second)
    assert not report.drifted, report.format()
    # A profile alone (with its length sample) serves as the reference too.
    assert not compare(profile_trace(first), second).drifted


def test_length_shift_is_drift() -> None:
    first, second = halves(0)
    longer = Trace(second.timestamps_ms, second.input_lengths * 2, second.output_lengths * 2)
    report = compare(profile_trace(first), longer)
    assert report.drifted
    drifted = {t.name for t in report.tests if t.drifted}
    assert drifted == {"input_length", "output_length"}


def test_rate_shift_is_drift() -> None:
    first, second = halves(0)
    report = compare(first, speedup(second, 1.6))
    assert {t.name for t in report.tests if t.drifted} == {"arrival_rate"}
    skipped = next(t for t in report.tests if t.name == "concurrency")
    assert skipped.statistic is None and "skipped" in skipped.detail


def test_reference_from_exported_config(tmp_path: Path) -> None:
    first, _ = halves(0)
    profile = profile_trace(first)
    config = tmp_path / "best.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "max-num-seqs": 32,
                "additional-config": {
                    "vllm_autotune": {"provenance": {"profile": profile.model_dump(mode="json")}}
                },
            }
        )
    )
    loaded = load_reference(config)
    assert loaded.fingerprint == profile.fingerprint
    bare = tmp_path / "bare.yaml"
    bare.write_text("max-num-seqs: 32\n")
    with pytest.raises(WorkloadError, match="additional-config.vllm_autotune.provenance"):
        load_reference(bare)
    trace_ref = tmp_path / "ref.jsonl"
    write_trace(trace_ref, first)
    assert len(load_reference(trace_ref)) == len(first)
