"""`python fake_server_tuner.py BEHAVIOUR.json autotune-args...`: the real `autotune` CLI in a
real process (its signal handling, launcher, trial runner, study, gate, export), with every
trial server replaced by tests/autotune/fake_server.py behaving as BEHAVIOUR.json says.

For tests about the tuner's own processes (SIGTERM, SIGHUP, exit codes) where a vLLM engine
start (~40 s on 2 cores) would add nothing but time.
"""

from __future__ import annotations

import sys
from pathlib import Path

from autotune.cli import main
from autotune.measure import trial

FAKE_SERVER = Path(__file__).with_name("fake_server.py")


def use_fake_server(behaviour: str) -> None:
    original = trial.TrialRunner.__init__

    def init(self: trial.TrialRunner, *args: object, **kwargs: object) -> None:
        kwargs["server_command"] = [sys.executable, str(FAKE_SERVER), "--behaviour", behaviour]
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    trial.TrialRunner.__init__ = init  # type: ignore[method-assign]


if __name__ == "__main__":
    use_fake_server(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
