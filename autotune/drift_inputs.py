"""The drift check's inputs for `autotune retune`: the current traffic (a trace or the
recorder's folder), the reference it is compared with, and the thresholds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from autotune.errors import AutotuneError
from server.config import ServerConfig
from server.recorder import read_recording
from workloads.trace_io import load_trace

# SciPy (drift, profiles) is imported inside the functions: `autotune --help` imports this module.


def load_current(path: Path) -> Any:
    """The current traffic: a trace file, or a recorder folder (all its files, one time line)."""
    if path.is_dir():
        return read_recording(path)
    return load_trace(path)


def load_drift_reference(reference: Path | None, config_path: Path, deployed: ServerConfig) -> tuple[Any, str]:
    """(reference, where it came from): `reference` (--reference), else the stored profile of
    the deployed config (`deployed`, read from `config_path`), else the trace it was tuned on
    if that is still there."""
    from workloads.drift import load_reference
    from workloads.profile import TraceProfile

    if reference is not None:
        return load_reference(reference), str(reference)
    provenance = deployed.provenance or {}
    if isinstance(provenance.get("profile"), dict):
        profile = TraceProfile.model_validate(provenance["profile"])
        if profile.length_sample.input_lengths:
            return profile, f"{config_path} (provenance.profile)"
    source = (provenance.get("workload") or {}).get("source")
    if source and Path(source).is_file():
        return load_trace(source), f"{source} (the trace {config_path} was tuned on)"
    raise AutotuneError(
        f"{config_path}: key 'additional-config.vllm_autotune.provenance.profile' is missing "
        f"and the tuning trace {source!r} is not readable; pass --reference TRACE"
    )


def drift_thresholds(*, ks_statistic: float | None = None, rate_change: float | None = None,
                     burstiness_change: float | None = None,
                     concurrency_change: float | None = None) -> Any:
    """workloads.drift.DriftThresholds with the given ones (None: its default); a bad value is
    refused in one line."""
    from workloads.drift import DriftThresholds

    given = {
        "ks_statistic": ks_statistic,
        "rate_change": rate_change,
        "burstiness_change": burstiness_change,
        "concurrency_change": concurrency_change,
    }
    try:
        return DriftThresholds(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as error:
        first = error.errors()[0]
        raise AutotuneError(
            f"drift threshold {first['loc'][0]} = {first.get('input')!r}: {first['msg']}"
        ) from None
