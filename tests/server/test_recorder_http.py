"""The recorder inside the real server (the session server of conftest.py records its traffic)."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.recorder import read_recording
from workloads.profile import profile_trace
from workloads.trace import Trace
from workloads.trace_io import TraceWarning

pytestmark = pytest.mark.engine

RunningServer = Any  # conftest.RunningServer (conftest is not importable by name)


def recording(server: RunningServer) -> Trace | None:
    settings = server.config.serving.recorder
    assert settings is not None
    if not any(Path(settings.directory).glob("traffic-*.jsonl")):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("error", TraceWarning)  # whole lines, in arrival order
        return read_recording(settings.directory)


def test_served_requests_are_recorded_as_a_trace(server: RunningServer) -> None:
    started = time.monotonic()
    payload = {"prompt": list(range(200, 229)), "max_tokens": 13, "ignore_eos": True}
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={**payload, "stream": True},
        headers=server.headers,
        timeout=60,
    ) as response:
        assert response.status_code == 200
        list(response.iter_lines())
    translated = httpx.post(
        server.url + "/translate",
        json={"text": "Dobryi den, yak spravy?", "source_lang": "uk", "target_lang": "pl"},
        headers=server.headers,
        timeout=60,
    )
    assert translated.status_code == 200, translated.text
    usage = translated.json()["usage"]
    elapsed_ms = (time.monotonic() - started) * 1000

    deadline = time.monotonic() + 10
    while True:
        trace = recording(server)
        requests = [] if trace is None else list(trace)
        completion = [r for r in requests if (r.input_length, r.output_length) == (29, 13)]
        translation = [r for r in requests if (r.source_lang, r.target_lang) == ("uk", "pl")]
        if (completion and translation) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert completion, f"streamed completion not in the recording:\n{server.log_tail()}"
    assert translation, "translation not in the recording"
    assert completion[-1].source_lang is None
    assert 0 < completion[-1].latency_ms <= elapsed_ms
    assert translation[-1].input_length == usage["prompt_tokens"]
    assert translation[-1].output_length == max(1, usage["completion_tokens"])
    assert profile_trace(trace).requests == len(trace)
    # The text is not recorded (record_text is off): no file holds it.
    directory = Path(server.config.serving.recorder.directory)
    assert all("Dobryi" not in f.read_text() for f in directory.iterdir())
