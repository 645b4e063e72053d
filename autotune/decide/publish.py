"""Publishing a re-tune's winner: versioned `best-v{N}.yaml` and, atomically, `best.yaml`
beside it, only when the gate chose a config over the deployed one."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from autotune.decide.export import export_best, header_text
from autotune.plan import TuningPlan
from autotune.progress import say
from autotune.search.warm_start import WarmStart
from server.config import ServerConfig
from workloads.files import atomic_file

# SciPy (profiles) is imported inside publish: `autotune --help` imports this module.
VERSION = re.compile(r"^best-v(\d+)\.yaml$")


def existing_versions(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(m[1]) for p in directory.iterdir() if (m := VERSION.match(p.name)))


def next_version(directory: Path) -> int:
    versions = existing_versions(directory)
    return (versions[-1] if versions else 0) + 1


def atomic_copy(source: Path, target: Path) -> None:
    """`target` becomes a copy of `source` in one step (temp file in its folder + rename)."""
    with atomic_file(target, "wb", shared=True) as out, open(source, "rb") as src:
        shutil.copyfileobj(src, out)


def publish(
    previous_config: Path,
    deployed: ServerConfig,
    current: Any,
    report: Any,
    plan: TuningPlan,
    warm: list[WarmStart],
    out_dir: Path,
    version: int,
) -> bool:
    """Writes best-v{N}.yaml and best.yaml if the gate chose a config over the deployed one
    (`previous_config`: the deployed file); True when it did, False when the deployed one stays."""
    from workloads.profile import profile_trace

    work_dir = plan.output_dir
    result = ServerConfig.load(work_dir / "best.yaml")
    provenance = dict(result.provenance or {})
    decision = provenance.get("decision") or {}
    if decision.get("kept_baseline", True):
        say(f"the deployed config stays: {decision.get('reason', 'no winner')}")
        say(f"study and report: {work_dir}")
        return False
    provenance["profile"] = profile_trace(current).model_dump(mode="json")
    provenance["retune"] = {
        "version": version,
        "previous_config": str(previous_config),
        "previous_date": (deployed.provenance or {}).get("date"),
        "trigger": "drift" if report.drifted else "forced",
        "drift": report.model_dump(mode="json"),
        "warm_start": [start.why for start in warm],
        "study_dir": str(work_dir),
    }
    # Serving settings as deployed (the recorder included), engine settings as tuned; the
    # front-end process count as measured (`--api-server-count` with our server).
    config = plan.trial_server.served(
        result.model_copy(update={"serving": deployed.serving, "provenance": None}))
    versioned = out_dir / f"best-v{version}.yaml"
    export_best(versioned, config, provenance)
    current_path = out_dir / "best.yaml"
    if current_path.exists() and version == 1:
        atomic_copy(current_path, out_dir / "best-v0.yaml")  # keep what ran before, for rollback
    atomic_copy(versioned, current_path)
    overrides = decision.get("overrides") or {}
    say(header_text(provenance, versioned.name).splitlines()[1])
    say("changed: " + ", ".join(f"{k}={v}" for k, v in overrides.items()))
    say(f"wrote {versioned} and {current_path}; restart the servers to use it")
    return True
