"""One rule for a config without `model:`: the embedded tiny model with its settings under the
file's, under `python -m server --config` as under `autotune run --baseline/--compare`, and
said in both --help texts. A model that cannot be had here (a folder that does not exist; a hub
model neither cached nor downloadable on an offline host) is one line and exit 2 at once, not
~30 s of download retries."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.cli import main as autotune_main
from autotune.measure.server_start import free_port
from autotune.prepare import prepare_plan
from autotune.request import TuningRequest
from server.config import (
    DEFAULT_MODEL_DIR,
    NO_MODEL_RULE,
    ConfigError,
    ServerConfig,
    check_model_available,
)
from tests.server.server_process import config_server

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = str(ROOT / "workloads" / "samples" / "translation_trace.jsonl")


def offline_env(tmp_path: Path) -> dict[str, str]:
    """An empty Hugging Face cache and a hub nobody answers at (a closed local port)."""
    env = {k: v for k, v in os.environ.items() if "PROXY" not in k.upper() and not k.startswith("HF_")}
    return {**env, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}


def help_text(args: list[str]) -> str:
    done = subprocess.run([sys.executable, *args, "--help"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, check=True)
    return " ".join(done.stdout.split())


def test_both_commands_state_the_one_rule_in_their_help() -> None:
    assert NO_MODEL_RULE in help_text(["-m", "server"])
    assert NO_MODEL_RULE in help_text(["-m", "autotune", "run"])


@pytest.mark.parametrize("text", ["max-num-seqs: 8\n", "max_model_len: 1024\nmax-num-seqs: 4\n", ""])
def test_a_config_without_model_means_the_embedded_model_everywhere(tmp_path: Path, text: str) -> None:
    from server.__main__ import load_config, parse_args

    path = tmp_path / "deployed.yaml"
    path.write_text(text)
    served = load_config(parse_args(["--config", str(path)])).engine
    written = ServerConfig.load(path).engine
    assert served["model"] == str(DEFAULT_MODEL_DIR)
    assert served == {**ServerConfig.default().engine, **written}
    plan = prepare_plan(TuningRequest(workload=SAMPLE, baseline=path, compare=[path], study_name="s",
                                      output_dir=tmp_path / "out", command_line=[]))
    assert plan.baseline.engine == served
    assert next(iter(plan.comparisons.values())).engine == served


@pytest.mark.parametrize("model", ["Qwen/Qwen3-0.6B", "someone/a-model-nobody-cached", "gpt2"])
def test_python_m_server_on_an_offline_host_says_so_in_one_line(tmp_path: Path, model: str) -> None:
    path = tmp_path / "deployed.yaml"
    path.write_text(f"model: {model}\nmax-num-seqs: 8\n")
    env = offline_env(tmp_path)
    done = subprocess.run([sys.executable, "-m", "server", "--config", str(path), "--port", str(free_port())],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"server: error: {path}: key 'model' = '{model}': not in the Hugging Face cache, "
                      f"and {env['HF_ENDPOINT']} cannot be reached (Connection refused; an offline host?): "
                      f"give a local model folder, or download it where the hub is reachable "
                      f"(huggingface-cli download {model}) into {tmp_path / 'hf' / 'hub'}"]


def test_autotune_run_with_an_unreachable_model_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    for name, value in offline_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "ENDPOINT", os.environ["HF_ENDPOINT"])
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    path = tmp_path / "deployed.yaml"
    path.write_text("model: someone/not-here\n")
    out = tmp_path / "out"
    assert autotune_main(["run", "--workload", SAMPLE, "--baseline", str(path), "--workers-only",
                          "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("autotune: error:")]
    assert len(lines) == 1 and lines[0].startswith(
        f"autotune: error: {path}: key 'model' = 'someone/not-here': not in the Hugging Face cache, and ")
    assert not out.joinpath("study.db").exists()


def test_a_model_folder_that_does_not_exist_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        check_model_available(str(tmp_path / "gone"), "deployed.yaml")
    assert str(caught.value) == f"deployed.yaml: key 'model' = '{tmp_path / 'gone'}': no such model folder"
    check_model_available(str(DEFAULT_MODEL_DIR), "deployed.yaml")  # a folder: fine


@pytest.mark.engine
def test_python_m_server_serves_the_embedded_model_from_a_config_without_model(tmp_path: Path) -> None:
    path = tmp_path / "deployed.yaml"
    path.write_text("max-num-seqs: 4\nmax-model-len: 512\n")
    with config_server(path, tmp_path / "server.log", cwd=ROOT, env=offline_env(tmp_path)) as client:
        info = client.get("/info").json()
        answer = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}).json()
    assert info["model"] == str(DEFAULT_MODEL_DIR)
    assert info["engine"]["max_num_seqs"] == 4 and info["engine"]["max_model_len"] == 512
    assert answer["usage"]["completion_tokens"] == 2


def test_a_model_that_is_no_folder_nor_hub_id_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        check_model_available("my model", "deployed.yaml")
    assert str(caught.value).startswith("deployed.yaml: key 'model' = 'my model': neither a model "
                                        "folder nor a Hugging Face model id (Repo id must use")
