"""Before a re-tune: does the deployed config still carry the current traffic?

`autotune retune` under the capacity objective launches the deployed config once and measures
its capacity on the current traffic's tuning window with the load ladder: a TrialRunner trial,
the very measurement `autotune run` makes of its baseline. The config stays when its headroom
(capacity over the window's recorded rate) is at least H (`--headroom`); otherwise the study
re-tunes, and this measurement is its trial 0, the baseline (`PremeasuredRunner` hands it over
instead of launching the same config again). Either way the figures and every ladder step are
written to `deployed-capacity.json` in the re-tune's folder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from autotune.measure.ladder import CapacityResult, recorded_rate
from autotune.measure.trial import TrialOutcome
from server.config import ServerConfig
from workloads.files import write_text_atomic
from workloads.trace import Trace

logger = logging.getLogger(__name__)

__all__ = ["CHECK_FILE", "CapacityCheck", "DeployedCapacityCheck", "PremeasuredRunner"]

CHECK_FILE = "deployed-capacity.json"


class CapacityCheck(BaseModel):
    """The deployed config's capacity on the current traffic and the verdict; written to
    `deployed-capacity.json` in the re-tune's folder."""

    config: str  # the deployed config file
    trial_dir: str  # the launch's files: config, server.log, ladder.json, requests
    window: str  # the trace window it was measured on
    window_requests: int
    needed_headroom: float  # H
    recorded_rps: float  # the window's own rate
    capacity_rps: float  # 0 when no step met the SLOs, or the launch failed before one did
    headroom: float  # capacity / recorded
    bracketed: bool  # False: the capacity is a lower bound (the ladder ended below the cliff)
    keep: bool
    reason: str  # one line
    failure: str | None = None
    failure_detail: str | None = None
    ladder: CapacityResult | None = None  # every step measured

    def line(self) -> str:
        """What the command prints: the verdict with its figures."""
        figures = (
            f"capacity {self.capacity_rps:.3g} req/s, recorded {self.recorded_rps:.3g} req/s, "
            f"needs {self.needed_headroom:g}x"
        )
        if self.keep:
            least = "" if self.bracketed else "at least "
            return (
                f"traffic drifted, but the deployed config still carries {least}"
                f"{self.headroom:.3g}x it ({figures}): keeping it"
            )
        return f"the deployed config must be re-tuned: {self.reason} ({figures})"

    def write(self, path: Path) -> None:
        write_text_atomic(path, self.model_dump_json(indent=2) + "\n")


def verdict(outcome: TrialOutcome, needed_headroom: float) -> tuple[bool, str]:
    """(keep, why): keep only a launch that worked and carries `needed_headroom` x the traffic."""
    capacity = outcome.capacity
    if not outcome.ok:
        return False, f"measuring it failed ({outcome.failure}: {outcome.failure_detail})"
    if capacity is None:
        return False, "the launch produced no capacity figure"
    if capacity.capacity_rps <= 0:
        return False, capacity.describe()
    if capacity.headroom >= needed_headroom:
        return True, f"it carries {capacity.headroom:.3g}x the current traffic"
    return False, f"it carries {capacity.headroom:.3g}x the current traffic, under {needed_headroom:g}x"


class DeployedCapacityCheck:
    """Launches the deployed config once on the current traffic, measures its capacity and
    decides keep or re-tune. `runner` is a TrialRunner built with the capacity ladder."""

    def __init__(
        self,
        runner: Any,
        *,
        needed_headroom: float,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.runner = runner
        self.needed_headroom = needed_headroom
        self.say = say or logger.info

    def run(
        self, config: ServerConfig, window: Trace, trial_dir: Path, *, source: str
    ) -> tuple[CapacityCheck, TrialOutcome]:
        """The check and the trial's outcome (for the study to reuse as its baseline)."""
        self.say(
            f"measuring the deployed config's capacity on the current traffic "
            f"({len(window)} requests, {recorded_rate(window):.3g} req/s recorded) in {trial_dir}"
        )
        # Started where the study's own baseline trial starts (no hint): the same measurement.
        outcome = self.runner.run(config, window, trial_dir, start_speedup=None)
        keep, reason = verdict(outcome, self.needed_headroom)
        capacity = outcome.capacity
        check = CapacityCheck(
            config=source,
            trial_dir=str(trial_dir),
            window=window.source,
            window_requests=len(window),
            needed_headroom=self.needed_headroom,
            recorded_rps=capacity.recorded_rps if capacity else recorded_rate(window),
            capacity_rps=capacity.capacity_rps if capacity else 0.0,
            headroom=capacity.headroom if capacity else 0.0,
            bracketed=capacity.bracketed if capacity else False,
            keep=keep,
            reason=reason,
            failure=outcome.failure,
            failure_detail=outcome.failure_detail,
            ladder=capacity,
        )
        return check, outcome


class PremeasuredRunner:
    """A runner that answers the first run of `config` into `trial_dir` with a measurement
    already made (the capacity check's launch), and hands every other run to `runner`."""

    def __init__(
        self, runner: Any, *, config: ServerConfig, trial_dir: Path, outcome: TrialOutcome
    ) -> None:
        self.runner = runner
        self.config = config
        self.trial_dir = Path(trial_dir)
        self.outcome: TrialOutcome | None = outcome

    def run(self, config: ServerConfig, window: Trace, trial_dir: Path, **kwargs: Any) -> Any:
        if self.outcome is not None and Path(trial_dir) == self.trial_dir and config == self.config:
            outcome, self.outcome = self.outcome, None
            logger.info("%s: the capacity check's measurement, not launched again", trial_dir)
            return outcome
        return self.runner.run(config, window, trial_dir, **kwargs)
