"""Every reader of a user's file accepts a UTF-8 byte-order mark (Notepad, Excel's "UTF-8"
export and some converters write one): JSONL traces, the importers, drift references, the
config YAML. A BOM anywhere but the start of a file is still a bad line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from server.config import ServerConfig
from workloads.drift import load_reference
from workloads.errors import TraceError, WorkloadError
from workloads.importers import import_azure, import_burstgpt, import_mooncake
from workloads.profile import profile_trace
from workloads.trace_io import read_trace

BOM = b"\xef\xbb\xbf"
CASES = Path(__file__).parents[2].parent / "shared" / "cases"


def line(timestamp: float, extra: str = "") -> str:
    return f'{{"timestamp": {timestamp}, "input_length": 7, "output_length": 3{extra}}}'


def with_bom(path: Path, text: str) -> Path:
    path.write_bytes(BOM + text.encode("utf-8"))
    return path


FIRST_LINES = [
    line(0),
    line(0.5, ', "source_lang": "en", "target_lang": "de"'),
    line(0, ', "hash_ids": [1, 2]'),
    '  ' + line(0),  # leading blanks after the mark
]


@pytest.mark.parametrize("first", FIRST_LINES)
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
@pytest.mark.parametrize("chunk_lines", [1, 2, 1024])  # the careful path and the fast path
@pytest.mark.parametrize("skip_invalid", [False, True])
def test_jsonl_trace_with_a_bom_keeps_every_request(
    tmp_path: Path, first: str, newline: str, chunk_lines: int, skip_invalid: bool
) -> None:
    path = with_bom(tmp_path / "t.jsonl", newline.join([first, line(10), line(20)]) + newline)
    loaded = read_trace(path, skip_invalid=skip_invalid, chunk_lines=chunk_lines)
    assert (len(loaded.trace), loaded.invalid) == (3, 0)
    assert loaded.trace.input_lengths.tolist() == [7, 7, 7]


def test_a_bom_on_a_later_line_is_still_a_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(BOM + (line(0) + "\n").encode() + BOM + (line(10) + "\n").encode())
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    assert caught.value.line == 2
    loaded = read_trace(path, skip_invalid=True)
    assert (len(loaded.trace), loaded.invalid) == (1, 1)


def test_a_file_holding_only_a_bom_has_no_requests(tmp_path: Path) -> None:
    path = with_bom(tmp_path / "t.jsonl", "\n")
    with pytest.raises(WorkloadError, match="no requests"):
        read_trace(path)


@pytest.mark.parametrize(
    ("importer", "text", "rows"),
    [
        (import_azure, "TIMESTAMP,ContextTokens,GeneratedTokens\n"
         "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n", 2),
        (import_burstgpt, "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
         "5,ChatGPT,472,18,490,Conversation log\n", 1),
        (import_mooncake, line(0, ', "hash_ids": [1]') + "\n" + line(1000) + "\n", 2),
    ],
)
def test_importers_accept_a_bom(
    tmp_path: Path, importer: Callable, text: str, rows: int
) -> None:
    result = importer(with_bom(tmp_path / "in.txt", text), skip_invalid=True)
    assert (len(result.trace), result.invalid) == (rows, 0)


def test_drift_references_accept_a_bom(tmp_path: Path) -> None:
    trace = with_bom(tmp_path / "ref.jsonl", line(0) + "\n" + line(1000) + "\n")
    assert len(load_reference(trace)) == 2
    profile = profile_trace(read_trace(trace).trace).model_dump_json()
    assert load_reference(with_bom(tmp_path / "ref.json", profile)).requests == 2
    yaml_text = "additional-config:\n  vllm_autotune:\n    provenance:\n      profile: "
    reference = with_bom(tmp_path / "best.yaml", yaml_text + json.dumps(json.loads(profile)))
    assert load_reference(reference).requests == 2


def test_config_yaml_accepts_a_bom(tmp_path: Path) -> None:
    config = ServerConfig.load(with_bom(tmp_path / "c.yaml", "max-num-seqs: 8\n"))
    assert config.engine == {"max_num_seqs": 8}


def test_the_shared_bom_trace_profiles_with_every_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from autotune.cli import main

    case = CASES / "trace-with-bom.jsonl"
    if not case.is_file():
        pytest.skip(f"{case} not found (kept outside the repository)")
    lines = sum(1 for raw in case.read_bytes().splitlines() if raw.strip())
    assert read_trace(case).trace.input_lengths.size == lines
    assert main(["profile", str(case), "--skip-invalid", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["requests"] == lines
    assert "skipped" not in captured.err


def test_the_space_file_reader_accepts_a_bom(tmp_path: Path) -> None:
    from autotune.search.space import SearchSpace

    space = with_bom(tmp_path / "space.yaml", "params:\n  max_num_seqs: {type: int, low: 1, high: 8}\n")
    assert SearchSpace.load(space, "cpu").params["max_num_seqs"].high == 8
