"""One error root with a subtree per area (workloads, server, autotune)."""

from __future__ import annotations


def test_every_error_area_hangs_from_one_root() -> None:
    from autotune.errors import AutotuneError, NothingMeasured
    from server.config import ConfigError
    from server.protocol import RequestError
    from workloads.errors import TraceError, VllmAutotuneError, WorkloadError

    for area in (WorkloadError, TraceError, ConfigError, RequestError, AutotuneError, NothingMeasured):
        assert issubclass(area, VllmAutotuneError), area
