"""The config file: what users write by hand and what the tuner exports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.config import (
    CPU_MEMORY_FLOOR_GIB,
    ConfigError,
    ServerConfig,
    ServingSettings,
    cpu_memory_share,
    cpu_node_memory,
    default_engine_settings,
)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_both_spellings_are_read_and_kebab_case_is_written(tmp_path: Path) -> None:
    config = ServerConfig.load(
        write(
            tmp_path / "c.yaml",
            "model: m\nmax-num-seqs: 8\nmax_num_batched_tokens: 512\napi_key: k\n",
        )
    )
    assert config.engine == {"model": "m", "max_num_seqs": 8, "max_num_batched_tokens": 512}
    assert config.api_key == "k"
    config.write(tmp_path / "out.yaml")
    written = yaml.safe_load((tmp_path / "out.yaml").read_text())
    assert written["max-num-seqs"] == 8 and written["max-num-batched-tokens"] == 512
    assert written["api-key"] == "k"
    assert "max_num_seqs" not in written


def test_unknown_key_is_named_with_its_line_and_the_closest_valid_name(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", "model: m\nmax-num-seq: 8\n")
    with pytest.raises(ConfigError) as caught:
        ServerConfig.load(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:2: key 'max-num-seq' = 8:")
    assert "did you mean 'max-num-seqs'?" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("max-num-seqs: lots\n", "max-num-seqs"),
        ("gpu_memory_utilization: high\n", "gpu_memory_utilization"),
        ("dtype: float13\n", "dtype"),
        ("port: 70000\n", "port"),
        ("max-num-seqs: 4\nmax_num_seqs: 8\n", "max_num_seqs"),
        (
            "additional-config:\n  vllm_autotune:\n    serving:\n      max_waiting_requests: -1\n",
            "additional-config.vllm_autotune.serving.max_waiting_requests",
        ),
        (
            "additional-config:\n  vllm_autotune:\n    serving:\n      benchmark: true\n",
            "additional-config.vllm_autotune.serving.benchmark",
        ),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ServerConfig.load(write(tmp_path / "c.yaml", text))
    assert caught.value.key == key
    assert f"key '{key}'" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "reason"),
    [("model: [unclosed\n", "not valid YAML"), ("- a\n- b\n", "expected a mapping")],
)
def test_broken_files_say_what_is_wrong(tmp_path: Path, text: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        ServerConfig.load(write(tmp_path / "c.yaml", text))


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        ServerConfig.load(tmp_path / "absent.yaml")


def test_written_file_loads_back_equal_and_keeps_a_provenance_header(tmp_path: Path) -> None:
    config = ServerConfig(
        engine={
            **default_engine_settings(),
            "max_num_seqs": 16,
            "enable_prefix_caching": False,
            "additional_config": {"other": 1},
        },
        port=8123,
        api_key="secret",
        serving=ServingSettings(benchmark_mode=True, max_waiting_requests=4),
        provenance={"study": "s1", "request_throughput": 12.5},
    )
    path = tmp_path / "best.yaml"
    config.write(path)
    text = path.read_text()
    assert text.startswith('# study: "s1"\n')
    assert ServerConfig.load(path) == config
    # our section never reaches the engine; other plugins' additional-config does
    assert config.engine_args().additional_config == {"other": 1}
    assert list(tmp_path.iterdir()) == [path]  # no temp file left behind


def test_vllm_serve_parses_our_file_to_the_same_values(tmp_path: Path) -> None:
    """`vllm serve --config best.yaml` must accept the exported file unchanged."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    config = ServerConfig(
        engine={
            **default_engine_settings(),
            "max_num_seqs": 7,
            "max_num_batched_tokens": 1024,
            "enable_prefix_caching": False,
            "block_size": 16,
        },
        host="127.0.0.1",
        port=8123,
        api_key="secret",
        serving=ServingSettings(benchmark_mode=True, max_waiting_requests=3),
        provenance={"study": "s1", "vllm": "0.32.0"},
    )
    path = tmp_path / "best.yaml"
    config.write(path)

    parser = FlexibleArgumentParser(prog="vllm")  # built as vllm/entrypoints/cli/main.py does
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", "--config", str(path)])

    theirs = AsyncEngineArgs.from_cli_args(args)
    ours = config.engine_args()
    for name, value in config.engine.items():
        assert getattr(theirs, name) == value == getattr(ours, name), name
    assert (args.host, args.port) == ("127.0.0.1", 8123)
    assert args.api_key in ("secret", ["secret"])
    assert args.additional_config["vllm_autotune"]["serving"]["max_waiting_requests"] == 3


def test_default_settings_use_the_embedded_model_on_cpu() -> None:
    settings = default_engine_settings()
    assert Path(settings["model"]).is_absolute()
    assert (Path(settings["model"]) / "config.json").is_file()
    assert settings["load_format"] == "dummy"
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        assert settings["enforce_eager"] is True
        assert settings["gpu_memory_utilization"] == cpu_memory_share(cpu_node_memory())


def test_the_cpu_memory_share_is_a_tenth_of_the_node_unless_that_is_too_little_to_start() -> None:
    gib = 2**30
    assert cpu_memory_share(20 * gib) == 0.1  # a 24 GB machine: 2 GiB, as before
    # A fresh 2-core VM's node read 7.09 GiB: 0.1 of it was less than the engine-core process
    # held before any KV cache (0.73 GiB) and vLLM refused to start. The share grows to hold
    # CPU_MEMORY_FLOOR_GIB.
    small = int(7.09 * gib)
    assert cpu_memory_share(small) == 0.22 and 0.22 * small >= CPU_MEMORY_FLOOR_GIB * gib
    assert cpu_memory_share(15 * gib) == 0.1 and cpu_memory_share(14 * gib) == 0.11
    assert cpu_memory_share(1 * gib) == 0.5  # never more than half the node


@pytest.mark.slow  # real `python -m server` subprocesses
def test_cli_reports_a_bad_config_in_one_line_and_exits_2(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.yaml", "model: m\nmax-num-seq: 8\n")
    result = subprocess.run(
        [sys.executable, "-m", "server", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("server: error: ") and "max-num-seq" in last


@pytest.fixture(scope="module")
def valid_config_text(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An exported config (engine arguments, serving settings, provenance header) as text."""
    folder = tmp_path_factory.mktemp("valid-config")
    config = ServerConfig(
        engine={**default_engine_settings(), "max_num_seqs": 16, "max_num_batched_tokens": 1024},
        api_key="secret",
        serving=ServingSettings(benchmark_mode=True, max_waiting_requests=4),
        provenance={"study": "s1", "measured": {"request_throughput": 12.5}},
    )
    config.write(folder / "valid.yaml")
    return (folder / "valid.yaml").read_text()


CORRUPTIONS = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1), st.just("")),
    st.tuples(st.just("overwrite"), st.floats(0, 1), st.text(min_size=1, max_size=12)),
    st.tuples(
        st.just("insert"),
        st.floats(0, 1),
        st.sampled_from(
            [":", "- ", "\t", "  ", "\n  x: [", "{", "'", "&a ", "*a", "!!python/object:os.system ",
             "\x00", "\ufeff", "%YAML 9.9\n", "? ", "max-num-seqs: -1\n", "model: 5\n", "\n---\n"]
        ),
    ),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(corruption=CORRUPTIONS, data=st.data())
def test_a_corrupted_config_file_gets_one_clear_line_never_a_traceback(
    tmp_path: Path,
    valid_config_text: str,
    reliability,
    corruption: tuple[str, float, str],
    data: st.DataObject,
) -> None:
    reliability.start(
        "Corrupted YAML config",
        group="Bad input",
        injected=(
            "hypothesis: an exported config file truncated, overwritten, or with YAML syntax, "
            "bad values, NUL bytes, python tags spliced in, and single bytes flipped"
        ),
    )
    text = valid_config_text
    kind, where, piece = corruption
    at = int(where * len(text))
    if kind == "truncate":
        corrupted = text[:at]
    elif kind == "overwrite":
        corrupted = text[:at] + piece + text[at + len(piece):]
    else:
        corrupted = text[:at] + piece + text[at:]
    path = tmp_path / "corrupted.yaml"
    raw = corrupted.encode("utf-8", "surrogatepass")
    if data.draw(st.booleans(), label="flip a byte"):
        index = data.draw(st.integers(0, max(0, len(raw) - 1)), label="byte")
        raw = raw[:index] + bytes([raw[index] ^ 0xFF]) + raw[index + 1:] if raw else raw
    path.write_bytes(raw)
    reliability.count("corrupted files tried")
    try:
        ServerConfig.load(path)
    except ConfigError as error:
        message = str(error)
        assert message.startswith(str(path)), message
        assert "\n" not in message, message
        assert error.reason
        reliability.count("refused with a one-line ConfigError")
    else:
        reliability.count("still a valid config (e.g. a changed comment)")
    reliability.held(
        "no traceback: every file either loaded or was refused with a one-line ConfigError "
        "starting with the file's path (and its line, where YAML knows it)"
    )


def test_yaml_tags_that_run_code_are_refused(tmp_path: Path, reliability) -> None:
    marker = tmp_path / "ran"
    reliability.start(
        "YAML read safely",
        group="Security defaults",
        injected="a config whose values are `!!python/object/apply:os.system` and `subprocess.check_call` tags",
    )
    text = (
        "model: !!python/object/apply:os.system ['touch " + str(marker) + "']\n"
        "max-num-seqs: !!python/object/apply:subprocess.check_call [['touch', '" + str(marker) + "']]\n"
    )
    with pytest.raises(ConfigError, match="not valid YAML") as caught:
        ServerConfig.load(write(tmp_path / "evil.yaml", text))
    assert caught.value.line == 1
    assert not marker.exists()
    reliability.held(
        f"`!!python/object/apply` tags are refused by safe_load (\"{str(caught.value)[-70:]}\"); "
        "the command they name never ran"
    )
