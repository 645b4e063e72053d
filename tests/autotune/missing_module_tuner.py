"""`python missing_module_tuner.py COUNT_FILE HEALTHY BEHAVIOUR.json autotune-args...`: the real
`autotune` CLI in a real process, every trial server from tests/autotune/missing_module_server.py
(the first HEALTHY launches a fake server behaving as BEHAVIOUR.json says, later ones die on a
missing module)."""

from __future__ import annotations

import sys
from pathlib import Path

from autotune.cli import main
from autotune.measure import trial

SERVER = Path(__file__).with_name("missing_module_server.py")


def use_server(count_file: str, healthy: str, behaviour: str) -> None:
    original = trial.TrialRunner.__init__

    def init(self: trial.TrialRunner, *args: object, **kwargs: object) -> None:
        kwargs["server_command"] = [sys.executable, str(SERVER), count_file, healthy, "--behaviour", behaviour]
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    trial.TrialRunner.__init__ = init  # type: ignore[method-assign]


if __name__ == "__main__":
    use_server(*sys.argv[1:4])
    sys.exit(main(sys.argv[4:]))
