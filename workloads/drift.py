"""Has the traffic changed since the config was tuned? Tests of a current trace against a
reference (a trace, or the TraceProfile stored in an exported config's provenance).

Length distributions: two-sample Kolmogorov-Smirnov. A length test drifts when the KS
statistic (the largest gap between the two CDFs, an effect size) is above its threshold
*and* the p-value is below `ks_pvalue`, so that a small sample cannot drift by chance and a
huge one does not drift on a negligible difference. Rate, burstiness and concurrency: the
relative change of the mean against a threshold.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from scipy import stats

from workloads.errors import WorkloadError
from workloads.profile import TraceProfile, profile_trace
from workloads.trace import Trace
from workloads.trace_io import load_trace


class DriftThresholds(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ks_statistic: float = Field(0.1, gt=0, le=1, description="KS distance that counts as drift")
    ks_pvalue: float = Field(0.01, gt=0, le=1, description="KS p-value below which it is real")
    rate_change: float = Field(0.25, gt=0, description="relative change of mean arrival rate")
    burstiness_change: float = Field(0.3, gt=0, description="relative change of inter-arrival CV")
    concurrency_change: float = Field(0.25, gt=0, description="relative change of mean in flight")


class DriftTest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    statistic: float | None  # None when the test could not run (detail says why)
    threshold: float
    drifted: bool
    reference_value: float | None = None
    current_value: float | None = None
    p_value: float | None = None
    detail: str = ""


class DriftReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reference: str  # fingerprint (and source) of the reference
    current: str
    drifted: bool
    tests: list[DriftTest]

    def format(self) -> str:
        lines = [
            f"reference {self.reference}",
            f"current   {self.current}",
        ]
        for test in self.tests:
            mark = "DRIFT" if test.drifted else "ok"
            stat = "-" if test.statistic is None else f"{test.statistic:.3f}"
            values = ""
            if test.reference_value is not None and test.current_value is not None:
                values = f"  ({test.reference_value:.4g} -> {test.current_value:.4g})"
            extra = f"  p={test.p_value:.2g}" if test.p_value is not None else ""
            detail = f"  {test.detail}" if test.detail else ""
            lines.append(
                f"{mark:<5}  {test.name:<18} {stat:>7} vs {test.threshold:g}{extra}{values}{detail}"
            )
        lines.append("DRIFT: re-tune recommended" if self.drifted else "no drift")
        return "\n".join(lines)


def _ks(
    name: str, reference: np.ndarray, current: np.ndarray, thresholds: DriftThresholds
) -> DriftTest:
    result = stats.ks_2samp(reference, current)
    statistic, p_value = float(result.statistic), float(result.pvalue)
    return DriftTest(
        name=name,
        statistic=statistic,
        threshold=thresholds.ks_statistic,
        drifted=statistic > thresholds.ks_statistic and p_value < thresholds.ks_pvalue,
        reference_value=float(np.mean(reference)),
        current_value=float(np.mean(current)),
        p_value=p_value,
        detail="means shown",
    )


def _relative(
    name: str, reference: float | None, current: float | None, threshold: float
) -> DriftTest:
    if reference is None or current is None or not math.isfinite(reference) or reference <= 0:
        return DriftTest(
            name=name,
            statistic=None,
            threshold=threshold,
            drifted=False,
            reference_value=reference,
            current_value=current,
            detail="not measurable in both traces, skipped",
        )
    change = abs(current - reference) / reference
    return DriftTest(
        name=name,
        statistic=change,
        threshold=threshold,
        drifted=change > threshold,
        reference_value=reference,
        current_value=current,
        detail="relative change",
    )


def compare(
    reference: TraceProfile | Trace,
    current: Trace,
    thresholds: DriftThresholds | None = None,
) -> DriftReport:
    """Test `current` against `reference`; `drifted` if any single test drifted."""
    thresholds = thresholds or DriftThresholds()
    if isinstance(reference, Trace):
        ref_profile = profile_trace(reference)
        ref_inputs, ref_outputs = reference.input_lengths, reference.output_lengths
    else:
        ref_profile = reference
        ref_inputs = np.asarray(reference.length_sample.input_lengths)
        ref_outputs = np.asarray(reference.length_sample.output_lengths)
        if len(ref_inputs) == 0:
            raise WorkloadError("reference profile has an empty length_sample; cannot test lengths")
    cur_profile = profile_trace(current)
    tests = [
        _ks("input_length", ref_inputs, current.input_lengths, thresholds),
        _ks("output_length", ref_outputs, current.output_lengths, thresholds),
        _relative(
            "arrival_rate",
            ref_profile.arrival_rate.mean_rps or None,
            cur_profile.arrival_rate.mean_rps or None,
            thresholds.rate_change,
        ),
        _relative(
            "burstiness_cv",
            ref_profile.burstiness_cv,
            cur_profile.burstiness_cv,
            thresholds.burstiness_change,
        ),
        _relative(
            "concurrency",
            None if ref_profile.concurrency is None else ref_profile.concurrency.mean,
            None if cur_profile.concurrency is None else cur_profile.concurrency.mean,
            thresholds.concurrency_change,
        ),
    ]
    return DriftReport(
        reference=f"{ref_profile.fingerprint} ({ref_profile.source or 'profile'})",
        current=f"{cur_profile.fingerprint} ({cur_profile.source or 'trace'})",
        drifted=any(t.drifted for t in tests),
        tests=tests,
    )


def _profile_from(data: Any, path: Path, where: str) -> TraceProfile:
    try:
        return TraceProfile.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or where
        raise WorkloadError(
            f"{path}: {where}.{loc} is not a valid trace profile: {first['msg']}"
        ) from None


def load_reference(path: str | Path) -> TraceProfile | Trace:
    """A drift reference: a JSONL trace, a profile JSON (`autotune profile --json`), or an
    exported config YAML whose provenance holds the profile."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(
            f"{path}: no such reference file (a trace .jsonl, profile .json or best.yaml)"
        )
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as error:
            raise WorkloadError(f"{path}: not readable YAML ({type(error).__name__})") from None
        node: Any = data
        for spellings in (
            ("additional-config", "additional_config"),
            ("vllm_autotune",),
            ("provenance",),
            ("profile",),
        ):
            node = (
                next((node[k] for k in spellings if k in node), None)
                if isinstance(node, dict)
                else None
            )
        if node is None:
            raise WorkloadError(
                f"{path}: key 'additional-config.vllm_autotune.provenance.profile' is missing; "
                "this config carries no trace profile (pass the tuning trace as --reference)"
            )
        return _profile_from(node, path, "additional-config.vllm_autotune.provenance.profile")
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8-sig"))  # a BOM, as a trace may
        except (ValueError, UnicodeDecodeError) as error:
            raise WorkloadError(f"{path}: not valid JSON ({type(error).__name__})") from None
        return _profile_from(data, path, "profile")
    return load_trace(path)
