"""The baseline and every --compare file get the checks a searched config gets, before any
server starts: vLLM's own engine-argument checks and the built-in relations. A refused file is
exit 2 and one line naming the file, the settings and vLLM's whole reason, under `autotune run`
and `--workers-only` alike; `python -m server --config` keeps vLLM's whole reason too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError, field_validator

import server.engine
from autotune.cli import main
from autotune.measure.server_start import free_port
from server.config import refused_by_vllm, vllm_reason

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = str(ROOT / "workloads" / "samples" / "translation_trace.jsonl")
CASES = ROOT.parent / "shared" / "cases"
MODEL = ROOT / "server" / "models" / "tiny-multilingual"

# Configs vLLM refuses, each with the settings the refusal must name and words of its reason.
REFUSED = {
    "seqs-over-batched": ("max-num-seqs: 512\nmax-num-batched-tokens: 256\n",
                          ["max_num_seqs=512", "max_num_batched_tokens=256"],
                          "max_num_batched_tokens (256) must be greater than or equal to max_num_seqs (512)."),
    "seqs-over-batched-snake": ("max_num_seqs: 100\nmax_num_batched_tokens: 64\n",
                                ["max_num_seqs=100", "max_num_batched_tokens=64"],
                                "max_num_batched_tokens (64) must be greater than or equal to max_num_seqs (100)."),
    "no-chunked-prefill": ("enable-chunked-prefill: false\nmax-num-batched-tokens: 512\nmax-model-len: 1024\n",
                           ["max_num_batched_tokens=512", "max_model_len=1024"],
                           "max_num_batched_tokens (512) is smaller than max_model_len (1024). This "
                           "effectively limits the maximum sequence length to max_num_batched_tokens "
                           "and makes vLLM reject longer sequences. Please increase "
                           "max_num_batched_tokens or decrease max_model_len."),
}


def run_args(out: Path, *extra: str) -> list[str]:
    return ["run", "--workload", SAMPLE, "--trials", "2", "--study-name", "s",
            "--output-dir", str(out), *extra]


def one_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("autotune: error:")]
    # (vLLM's log handler may still hold an earlier test's captured stream: no Traceback check)
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("flag", ["--baseline", "--compare"])
@pytest.mark.parametrize("workers_only", [False, True])
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_config_vllm_refuses_is_refused_before_any_server(
    tmp_path: Path, capsys, name: str, flag: str, workers_only: bool
) -> None:
    text, settings, reason = REFUSED[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    out = tmp_path / "out"
    extra = [flag, str(path), *(["--workers-only"] if workers_only else [])]
    assert main(run_args(out, *extra)) == 2
    line = one_error(capsys)
    assert line.startswith(f"autotune: error: {path}: vLLM rejected the engine settings (")
    assert all(setting in line for setting in settings)
    assert line.endswith(f"1 validation error for SchedulerConfig: {reason}")
    assert not (out / "trials").exists() and not (out / "study.db").exists()


def test_a_field_vllm_refuses_is_named_with_its_value(tmp_path: Path, capsys) -> None:
    path = tmp_path / "baseline.yaml"
    path.write_text("gpu_memory_utilization: 2.5\n")
    out = tmp_path / "out"
    assert main(run_args(out, "--baseline", str(path))) == 2
    line = one_error(capsys)
    assert line.startswith(f"autotune: error: {path}: vLLM rejected the engine settings (gpu_memory_utilization=2.5): ")
    assert line.endswith("CacheConfig: gpu_memory_utilization = 2.5: Input should be less than or equal to 1")
    assert not (out / "trials").exists()


@pytest.mark.parametrize(("param", "value", "reason"), [
    ("gpu_memory_utilization: {type: float, low: 0.1, high: 3.0}", "3.0",
     "vLLM refuses this end of the range (Input should be less than or equal to 1)"),
    ("max_num_seqs: {type: int, low: -5, high: 10}", "-5",
     "vLLM refuses this end of the range (Input should be greater than or equal to 1)"),
    ("max_num_seqs: {type: categorical, choices: [abc, 4]}", "'abc'",
     "not a value vLLM takes: expected int | None"),
])
def test_a_space_file_whose_range_ends_vllm_refuses_is_refused_before_any_server(
    tmp_path: Path, capsys, param: str, value: str, reason: str
) -> None:
    """A range is checked at its ends (and a choice list at each choice) on the baseline: a
    space that would spend launches on configs vLLM refuses is one line naming the file, the
    parameter, the value and the reason."""
    space = tmp_path / "space.yaml"
    space.write_text(f"params:\n  {param}\n")
    out = tmp_path / "out"
    assert main(run_args(out, "--space", str(space))) == 2
    line = one_error(capsys)
    name = param.split(":")[0]
    assert line.startswith(f"autotune: error: {space}: key 'params.{name}' = {value}: {reason}"), line
    assert not (out / "trials").exists() and not (out / "study.db").exists()


def test_a_relation_is_checked_where_vllm_could_not_tell(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unresolvable(config):  # as on a host missing a module vLLM imports for this config
        raise ModuleNotFoundError("No module named 'loguru'")

    monkeypatch.setattr(server.engine, "resolve_engine_config", unresolvable)
    path = tmp_path / "deployed.yaml"
    path.write_text("enable-chunked-prefill: false\nmax-num-batched-tokens: 512\nmax-model-len: 1024\n")
    assert main(run_args(tmp_path / "out", "--baseline", str(path), "--workers-only")) == 2
    line = one_error(capsys)
    assert line == (f"autotune: error: {path}: breaks max_num_batched_tokens >= max_model_len if not "
                    "enable_chunked_prefill (enable_chunked_prefill=False, max_model_len=1024, "
                    "max_num_batched_tokens=512); vLLM refuses such a config: change one of these settings")


@pytest.mark.parametrize("name", ["baseline-seqs-over-batched", "baseline-no-chunked-prefill"])
def test_the_shared_cases_are_refused_as_baseline_and_comparison(tmp_path: Path, capsys, name: str) -> None:
    case = CASES / f"{name}.yaml"
    if not case.is_file():
        pytest.skip(f"{case} not found (kept outside the repository)")
    for extra in (["--baseline", str(case)], ["--compare", str(case), "--workers-only"]):
        assert main(run_args(tmp_path / "out", *extra)) == 2
        line = one_error(capsys)
        assert f"{case}: vLLM rejected the engine settings (" in line
        assert "1 validation error for SchedulerConfig: max_num_batched_tokens (" in line


def test_python_m_server_keeps_vllms_whole_reason(tmp_path: Path) -> None:
    path = tmp_path / "deployed.yaml"
    path.write_text(f"model: {MODEL}\nload-format: dummy\n" + REFUSED["no-chunked-prefill"][0])
    done = subprocess.run([sys.executable, "-m", "server", "--config", str(path), "--port", str(free_port())],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("server: error:")]
    assert errors == [f"server: error: {path}: vLLM rejected the engine settings "
                      "(max_num_batched_tokens=512, max_model_len=1024): 1 validation error for "
                      f"SchedulerConfig: {REFUSED['no-chunked-prefill'][2]}"]


class _Scheduler(BaseModel):
    seqs: int
    tokens: int

    @field_validator("seqs", "tokens")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be positive,\n  got {value}")
        return value


def test_vllm_reason_keeps_every_pydantic_message_on_one_line() -> None:
    with pytest.raises(ValidationError) as caught:
        _Scheduler(seqs=0, tokens=-1)
    # Each field's error names the field and the value given.
    assert vllm_reason(caught.value) == ("2 validation errors for _Scheduler: seqs = 0: must be positive, got 0; "
                                         "tokens = -1: must be positive, got -1")
    assert vllm_reason(ValueError("first line\nsecond line")) == "first line second line"


def test_only_errors_about_the_values_count_as_refusals() -> None:
    from huggingface_hub.errors import LocalEntryNotFoundError

    assert refused_by_vllm(ValueError("max_model_len too large"))
    assert refused_by_vllm(TypeError("expected int"))
    assert not refused_by_vllm(ModuleNotFoundError("No module named 'loguru'"))
    assert not refused_by_vllm(OSError("We couldn't connect to 'https://huggingface.co'"))
    assert not refused_by_vllm(LocalEntryNotFoundError("offline and not in the cache"))


def test_a_trial_servers_refusal_is_kept_whole_in_its_failure() -> None:
    from autotune.measure.server_start import classify_exit, headline

    refusal = ("server: error: trial-0001/config.yaml: vLLM rejected the engine settings "
               "(max_num_seqs=512, max_num_batched_tokens=256): 1 validation error for "
               "SchedulerConfig: max_num_batched_tokens (256) must be greater than or equal to "
               "max_num_seqs (512).")
    tail = ["(MainProcess pid=7) INFO 12-01 21:31:07 [model.py:733] Resolved architecture",
            refusal, "(MainProcess pid=7) INFO 12-01 21:31:08 [shutdown.py:12] bye", ""]
    assert headline(tail) == refusal
    assert classify_exit(2, tail) == "invalid_config"
