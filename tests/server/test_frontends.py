"""Front-end processes without an engine: the setting, the flag, the refusals, vLLM's arguments.

tests/server/test_frontends_engine.py serves real requests with two processes on one engine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from server.__main__ import load_config, parse_args
from server.config import (
    ConfigError,
    RecorderSettings,
    ServerConfig,
    ServingSettings,
    default_engine_settings,
)
from server.frontends import vllm_serve_args


def config(**serving: object) -> ServerConfig:
    return ServerConfig(engine=default_engine_settings(), serving=ServingSettings(**serving))


def test_one_process_is_the_default_and_the_count_round_trips_through_yaml(tmp_path: Path) -> None:
    assert ServingSettings().api_processes == 1
    path = tmp_path / "config.yaml"
    config(api_processes=3).write(path)
    section = yaml.safe_load(path.read_text())["additional-config"]["vllm_autotune"]
    assert section["serving"]["api_processes"] == 3
    assert ServerConfig.load(path).serving.api_processes == 3


def test_a_bad_count_in_the_file_names_file_key_and_value(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model: m\nadditional-config:\n  vllm_autotune:\n"
                    "    serving: {api_processes: 0}\n")
    with pytest.raises(ConfigError) as caught:
        ServerConfig.load(path)
    message = str(caught.value)
    assert str(path) in message and "serving.api_processes' = 0" in message
    assert "greater than or equal to 1" in message and "\n" not in message


def test_the_recorder_is_refused_with_several_processes(tmp_path: Path) -> None:
    recorder = RecorderSettings(directory=str(tmp_path / "traffic"))
    with pytest.raises(ValueError, match="the recorder needs api_processes 1"):
        ServingSettings(api_processes=2, recorder=recorder)
    assert ServingSettings(api_processes=1, recorder=recorder).recorder == recorder


def test_the_flag_overrides_the_config_and_is_checked_like_it(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    config(max_waiting_requests=4).write(path)
    loaded = load_config(parse_args(["--config", str(path), "--api-processes", "3"]))
    assert loaded.serving.api_processes == 3
    assert loaded.serving.max_waiting_requests == 4  # the rest of the file's settings stay
    assert load_config(parse_args(["--config", str(path)])).serving.api_processes == 1

    with pytest.raises(ConfigError, match=r"serving.api_processes' = 0: Input should be greater"):
        load_config(parse_args(["--config", str(path), "--api-processes", "0"]))
    recording = tmp_path / "recording.yaml"
    config(recorder=RecorderSettings(directory=str(tmp_path / "t"))).write(recording)
    with pytest.raises(ConfigError, match=r"recording.yaml: key 'serving.recorder'.*needs api_processes 1"):
        load_config(parse_args(["--config", str(recording), "--api-processes", "2"]))


@pytest.mark.slow  # a real `python -m server` subprocess (imports vLLM)
def test_the_cli_refuses_a_conflict_in_one_line_and_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "recording.yaml"
    config(recorder=RecorderSettings(directory=str(tmp_path / "t"))).write(path)
    result = subprocess.run(
        [sys.executable, "-m", "server", "--config", str(path), "--api-processes", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("server: error: "), result.stderr
    assert "serving.recorder" in errors[0] and str(path) in errors[0]


def test_vllm_gets_our_engine_settings_and_the_count() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    ours = ServerConfig(
        engine={**default_engine_settings(), "max_num_seqs": 7, "max_num_batched_tokens": 512,
                "enable_prefix_caching": False},
        host="127.0.0.2", port=18123, api_key="secret",
        serving=ServingSettings(api_processes=2, benchmark_mode=True),
    )
    args = vllm_serve_args(ours)
    assert (args.api_server_count, args.host, args.port) == (2, "127.0.0.2", 18123)
    assert args.api_key is None  # our app checks the token; vLLM's app never runs
    built = AsyncEngineArgs.from_cli_args(args)
    direct = ours.engine_args()  # what the one-process server builds
    for name in ("model", "load_format", "dtype", "max_model_len", "max_num_seqs",
                 "max_num_batched_tokens", "enable_prefix_caching", "enforce_eager",
                 "gpu_memory_utilization"):
        assert getattr(built, name) == getattr(direct, name), name
    assert not built.disable_log_stats  # stats on: vLLM's Prometheus metrics come from them
