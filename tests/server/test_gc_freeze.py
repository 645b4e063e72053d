"""Once its engine is ready the server exempts its start-up heap (vLLM, torch) from full
garbage collections, which would otherwise stall every request for a third of a second
(workloads.gc_pauses); before that, nothing is frozen."""

from __future__ import annotations

import gc

import pytest

from tests.server.test_security import started_app, wait_ready


def test_the_heap_is_frozen_once_the_engine_is_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    gc.unfreeze()
    client, _engines = started_app(monkeypatch, benchmark_mode=True)
    try:
        assert gc.get_freeze_count() == 0
        with client:
            wait_ready(client)
            assert gc.get_freeze_count() > 0
            answer = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
            assert answer.status_code == 200
    finally:
        gc.unfreeze()
