"""A deployed `vllm serve --config` file is understood as vLLM reads it: its API-server keys
(address, logging, API key, chat template, tool calls ...) are recognised from the installed
vLLM's own parser, kept out of the engine settings and written back to best.yaml; a "did you
mean" is given only for a near spelling of an option of the same kind, never an opposite."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from autotune.cli import main as autotune_main
from autotune.decide.export import final_config
from autotune.prepare import prepare_plan
from autotune.request import TuningRequest
from server.config import ConfigError, ServerConfig
from tests.server.server_process import config_server

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = str(ROOT / "workloads" / "samples" / "translation_trace.jsonl")
CASE = ROOT.parent / "shared" / "cases" / "vllm-serve-config-with-server-keys.yaml"

# Deployed files as users have them: API-server keys beside engine keys (engine keys last).
DEPLOYED = {
    "address-and-logging": ('host: "127.0.0.1"\nport: 6379\nuvicorn-log-level: "info"\n'
                            "disable-uvicorn-access-log: true\nmax-log-len: 100\n",
                            {"uvicorn-log-level": "info", "disable-uvicorn-access-log": True,
                             "max-log-len": 100}),
    "tools-and-templates": ("enable-auto-tool-choice: true\ntool-call-parser: hermes\n"
                            "chat-template: ./template.jinja\nresponse-role: assistant\n",
                            {"enable-auto-tool-choice": True, "tool-call-parser": "hermes",
                             "chat-template": "./template.jinja", "response-role": "assistant"}),
    "snake-case-and-negated": ("api_key: secret\nssl_keyfile: /etc/llm/key.pem\n"
                               "no-enable-log-outputs: true\nroot_path: /llm\n",
                               {"ssl-keyfile": "/etc/llm/key.pem", "no-enable-log-outputs": True,
                                "root-path": "/llm"}),
}
ENGINE = "max-num-seqs: 16\nenable-prefix-caching: false\nserved-model-name: translator\n"


@pytest.mark.parametrize("name", sorted(DEPLOYED))
def test_api_server_keys_are_kept_apart_and_written_back(tmp_path: Path, name: str) -> None:
    text, api_server = DEPLOYED[name]
    path = tmp_path / "deployed.yaml"
    path.write_text(text + ENGINE)
    config = ServerConfig.load(path)
    assert config.api_server == api_server
    assert config.engine == {"max_num_seqs": 16, "enable_prefix_caching": False,
                             "served_model_name": "translator"}
    best = tmp_path / "best.yaml"
    final_config(config, {"max_num_seqs": 32}).write(best)  # as export_best writes it
    written = yaml.safe_load(best.read_text())
    assert {key: written[key] for key in api_server} == api_server
    assert written["max-num-seqs"] == 32
    assert ServerConfig.load(best).api_server == api_server  # read back alike
    assert not set(api_server) & set(config.vllm_serve_mapping())  # a trial measures the engine


@pytest.mark.parametrize("name", sorted(DEPLOYED))
def test_vllms_own_parser_reads_the_exported_file_with_those_settings(tmp_path: Path, name: str) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    text, api_server = DEPLOYED[name]
    path = tmp_path / "deployed.yaml"
    path.write_text(f"model: {ROOT / 'server' / 'models' / 'tiny-multilingual'}\n" + text + ENGINE)
    best = tmp_path / "best.yaml"
    ServerConfig.load(path).write(best)
    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers())
    args = parser.parse_args(["serve", "--config", str(best)])
    for key, value in api_server.items():
        dest = key.removeprefix("no-").replace("-", "_")
        assert getattr(args, dest) == (not value if key.startswith("no-") else value), key


@pytest.mark.parametrize("flag", ["--baseline", "--compare"])
def test_autotune_run_takes_a_deployed_file(tmp_path: Path, flag: str) -> None:
    text, api_server = DEPLOYED["address-and-logging"]
    path = tmp_path / "deployed.yaml"
    path.write_text(text + ENGINE)
    plan = prepare_plan(TuningRequest(workload=SAMPLE, study_name="s", output_dir=tmp_path / "out",
                                      command_line=[], **{flag[2:]: path if flag == "--baseline" else [path]}))
    config = plan.baseline if flag == "--baseline" else next(iter(plan.comparisons.values()))
    assert config.api_server == api_server and config.engine["max_num_seqs"] == 16


def test_the_shared_case_works_under_run_and_workers_only(tmp_path: Path) -> None:
    if not CASE.is_file():
        pytest.skip(f"{CASE} not found (kept outside the repository)")
    assert autotune_main(["run", "--workload", SAMPLE, "--baseline", str(CASE), "--compare", str(CASE),
                          "--workers-only", "--output-dir", str(tmp_path / "out")]) == 0
    assert ServerConfig.load(CASE).api_server == {"uvicorn-log-level": "info"}


@pytest.mark.parametrize(
    ("line", "hint"),
    [
        ("max-num-seq: 8", "max-num-seqs"),  # a typo of an engine argument
        ("max_num_seq: 8", "max_num_seqs"),
        ("uvicorn-log-levle: info", "uvicorn-log-level"),  # of an API-server setting
        ("max-log-length: 100", "max-log-len"),  # not max-model-len
        ("enable-prefix-cachin: true", "enable-prefix-caching"),
        ("disable-log-requests: true", None),  # never its opposite, enable-log-requests
        ("disable-log-request: true", None),
        ("log-everything: true", None),
        ("max-num-seqs-per-user: 4", None),
    ],
)
def test_a_hint_only_for_a_near_spelling_of_the_same_kind(tmp_path: Path, line: str, hint: str | None) -> None:
    path = tmp_path / "deployed.yaml"
    path.write_text(f"max-num-seqs: 8\n{line}\n" if not line.startswith("max") else f"{line}\n")
    with pytest.raises(ConfigError) as caught:
        ServerConfig.load(path)
    message = str(caught.value)
    key = line.split(":")[0]
    assert f"key '{key}'" in message and "not an option of `vllm serve`" in message
    if hint is None:
        assert "did you mean" not in message
    else:
        assert message.endswith(f"did you mean '{hint}'?")


@pytest.mark.engine
def test_python_m_server_serves_a_deployed_vllm_serve_file(tmp_path: Path) -> None:
    path = tmp_path / "deployed.yaml"
    path.write_text(DEPLOYED["address-and-logging"][0] + "max-num-seqs: 4\nmax-model-len: 512\n")
    log = tmp_path / "server.log"
    with config_server(path, log, cwd=ROOT) as client:
        info = client.get("/info").json()
    assert info["engine"]["max_num_seqs"] == 4
    assert ("server: note: " f"{path}: not applied here, kept for `vllm serve`: uvicorn-log-level, "
            "disable-uvicorn-access-log, max-log-len") in log.read_text()
