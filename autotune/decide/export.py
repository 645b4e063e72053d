"""`best.yaml`: the chosen config as a `vllm serve --config` file, with where it came from.

The engine arguments are the baseline's with the winner's overrides on top; serving settings
are the baseline's as the user runs them (benchmark mode off unless the baseline had it on).
Provenance goes under `additional-config.vllm_autotune.provenance` (vLLM ignores it) and a
short comment header says the decision in words. When the gate keeps the baseline the file is
still written, holding the baseline, and both say so.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autotune.measure.kv_cache import kv_cache_note
from autotune.measure.servers import TrialServer
from autotune.search.gate import GateDecision
from autotune.search.objective import Objective
from server.config import ServerConfig
from workloads.slo import SLO


def vllm_version() -> str:
    """The installed vLLM's version, read from its package metadata (importing it takes seconds)."""
    from server.vllm_facts import VllmInstall

    install = VllmInstall.find()
    return "not installed" if install is None else install.version


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_names() -> list[str]:
    """GPU names via torch when it sees CUDA, else nvidia-smi, else none."""
    try:
        import torch

        if torch.cuda.is_available():
            return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a broken torch install should not stop the export
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        done = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def hardware() -> dict[str, Any]:
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpus": gpu_names(),
        "platform": platform.platform(),
    }


def final_config(baseline: ServerConfig, overrides: dict[str, Any]) -> ServerConfig:
    """What to deploy: the baseline as the user runs it, plus the winner's overrides."""
    return baseline.with_overrides(overrides).model_copy(update={"provenance": None})


def build_provenance(
    *,
    decision: GateDecision,
    winner_overrides: dict[str, Any],
    objective: Objective,
    slos: Sequence[SLO],
    study_name: str,
    storage_url: str,
    command_line: Sequence[str],
    model: str,
    workload: dict[str, Any],
    baseline_source: str,
    effective_defaults: dict[str, Any],
    validation: list[dict[str, Any]],
    search: dict[str, Any],
    now: dt.datetime | None = None,
    baseline_standing: str | None = None,
    trial_server: TrialServer | None = None,
    deployed: ServerConfig | None = None,
) -> dict[str, Any]:
    """Everything needed to judge and reproduce the result, JSON-able. `deployed`: the
    exported config, whose front-end count `vllm serve` takes as a flag."""
    server = trial_server or TrialServer()
    return {
        "tool": "vllm-autotune",
        "date": (now or dt.datetime.now(dt.timezone.utc)).isoformat(timespec="seconds"),
        "decision": {
            "emitted": decision.winner,
            "kept_baseline": decision.keep_baseline,
            "reason": decision.reason,
            "overrides": winner_overrides,
            "effect": decision.effect,
            "ci_low": decision.ci_low,
            "ci_high": decision.ci_high,
            "confidence": decision.confidence,
            "baseline_noise": decision.noise,
            "baseline_median": decision.baseline_median,
            "candidate_median": decision.candidate_median,
            "baseline_standing": baseline_standing,
        },
        "objective": objective.spec(),
        "objective_unit": objective.unit,
        "slos": [slo.spec() for slo in slos],
        "validation": validation,
        "baseline": {"source": baseline_source, "effective_defaults": effective_defaults},
        "vllm_version": vllm_version(),
        # Which server the figures were measured on (the file serves on either).
        "trial_server": {**server.model_dump(mode="json"), "ran": server.describe(deployed)},
        "hardware": hardware(),
        "model": model,
        "workload": workload,
        "study": {"name": study_name, "storage": storage_url, **search},
        "command_line": shlex.join(command_line),
    }


def header_text(provenance: dict[str, Any], path_hint: str = "best.yaml", front_ends: int = 1) -> str:
    """The comment block on top of an exported config; `front_ends`: its serving.api_processes,
    which `vllm serve` takes as a flag, not from the file."""
    decision = provenance["decision"]
    if decision["kept_baseline"]:
        verdict = f"KEPT THE BASELINE: {decision['reason']}"
        if decision.get("baseline_standing"):
            verdict += f"\nbaseline measured: {decision['baseline_standing']}"
    else:
        verdict = f"emitted {decision['emitted']}: {decision['reason']}"
        numerics = provenance.get("numerics")
        if numerics:  # fp8 and the like change what the model answers (autotune.search.numerics)
            changes = ", ".join(f"{k}={v}" for k, v in numerics["changes"].items())
            verdict += f"\n{numerics['note'].upper()} ({changes})"
            free = numerics.get("numerics_free")
            if free:
                verdict += (f"\nwithout such knobs: {free['candidate']} "
                            + (", ".join(f"{k}={v}" for k, v in free["overrides"].items()) or "(the baseline)")
                            + f", gate median {free['median']:.4g}; see report.md")
    hw = provenance["hardware"]
    device = ", ".join(hw["gpus"]) if hw["gpus"] else f"{hw['cpu']} ({hw['cpu_count']} cores)"
    workload = provenance["workload"]
    return "\n".join(
        [
            f"vllm-autotune {provenance['date']}  study {provenance['study']['name']}",
            verdict,
            f"objective {provenance['objective']} under SLOs {', '.join(provenance['slos']) or 'none'}",
            *_memory_lines(provenance.get("memory")),
            f"model {provenance['model']}  vLLM {provenance['vllm_version']}  on {device}",
            *trial_server_lines(provenance),
            f"workload {workload.get('source')} (fingerprint {workload.get('fingerprint')})",
            *preflight_lines(workload),
            f"use: python -m server --config {path_hint}   or   {vllm_serve_command(path_hint, front_ends)}",
            "full provenance: additional-config.vllm_autotune.provenance below",
        ]
    )


def vllm_serve_command(path_hint: str, front_ends: int) -> str:
    """How `vllm serve` runs an exported config: the front-end count is a flag there, not read
    from the file (our section of it)."""
    return f"vllm serve --config {path_hint}" + (f" --api-server-count {front_ends}" if front_ends > 1 else "")


def trial_server_lines(provenance: dict[str, Any]) -> list[str]:
    """The server the trials ran on, one line (none in provenance written before it was kept)."""
    server = provenance.get("trial_server")
    return [f"measured on: {server['ran']}"] if isinstance(server, dict) and server.get("ran") else []


def _memory_lines(memory: dict[str, Any] | None) -> list[str]:
    """min-memory: the memory this file's config needs, one line (all figures in provenance)."""
    if not memory:
        return []
    who = "winner" if memory.get("winner_gpu_memory_utilization") is not None else "baseline"
    met = "meets" if who == "winner" or memory.get("baseline_meets_slos") else "misses"
    return [f"memory: gpu_memory_utilization {memory[f'{who}_gpu_memory_utilization']:g}"
            + kv_cache_note(memory, who)
            + f" {met} every SLO at {memory['headroom']:g}x the recorded rate"
            + (f"; the baseline's was {memory['baseline_gpu_memory_utilization']:g}" if who == "winner" else "")]


def preflight_lines(workload: dict[str, Any]) -> list[str]:
    """What the pre-flight checks changed in the traffic (dropped or capped requests,
    lengthened windows), one line each; none when nothing changed."""
    checks = workload.get("preflight") or {}
    lines = []
    context = checks.get("context") or {}
    if context.get("dropped") or context.get("capped"):
        done = (f"{context['dropped']:,} dropped" if context.get("dropped")
                else f"{context['capped']:,} capped (prompts cut to fit)")
        lines.append(
            f"{context['over']:,} of {context['requests']:,} requests exceed the model's context of "
            f"{context['context_tokens']:,} tokens: {done} (--over-context {context['policy']})"
        )
    windows = checks.get("windows") or {}
    if windows and list(windows.get("used_s", [])) != list(windows.get("asked_s", [])):
        asked, used = windows["asked_s"], windows["used_s"]
        lines.append(
            f"windows lengthened for the SLO percentiles: tuning {asked[0]:g} -> {used[0]:g} s, "
            f"held-out {asked[1]:g} -> {used[1]:g} s ({windows.get('rule', '')})"
        )
    return lines


def export_best(path: Path, config: ServerConfig, provenance: dict[str, Any]) -> ServerConfig:
    """Write `config` with `provenance` to `path` atomically; returns what was written."""
    final = config.model_copy(update={"provenance": provenance})
    final.write(path, header=header_text(provenance, path.name, final.serving.api_processes))
    return final
