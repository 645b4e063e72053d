"""Knobs that change the model's numerics (issue 58): opt-in with `autotune run --allow fp8`,
refused where FP8 cannot run, marked wherever a config using them is shown."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.cli import main
from autotune.errors import AutotuneError
from autotune.search.numerics import (
    NUMERICS_NOTE,
    check_supported,
    describe_changes,
    numerics_changes,
    numerics_params,
)
from autotune.search.space import SearchSpace

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = str(ROOT / "workloads" / "samples" / "translation_trace.jsonl")


def test_the_fp8_opt_in_is_refused_on_cpu_before_any_engine_starts(tmp_path: Path, capsys) -> None:
    code = main(["run", "--workload", SAMPLE, "--allow", "fp8", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("autotune: error: --allow fp8: FP8 needs a GPU of compute capability 8.9")
    assert "\n" not in err and "CPU" in err
    assert not (tmp_path / "out" / "trials").exists()


def test_the_opt_in_is_refused_on_a_gpu_older_than_8_9_and_taken_on_a_hopper() -> None:
    with pytest.raises(AutotuneError, match=r"compute capability 8\.0; FP8 needs 8\.9 or newer"):
        check_supported(["fp8"], "gpu", capability=lambda: (8, 0))  # A100
    with pytest.raises(AutotuneError, match="cannot read this GPU's compute capability"):
        check_supported(["fp8"], "gpu", capability=lambda: None)
    check_supported(["fp8"], "gpu", capability=lambda: (9, 0))  # H100 / H200
    check_supported(["fp8"], "gpu", capability=lambda: (8, 9))  # L4, L40S
    check_supported([], "cpu", capability=lambda: None)  # off by default: nothing to check


def test_fp8_adds_weights_and_kv_cache_to_the_space_beside_the_baseline() -> None:
    assert numerics_params([], {}) == {}  # off by default
    space = SearchSpace.default("gpu").extended(numerics_params(["fp8"], {}))
    assert space.params["quantization"].choices == [None, "fp8"]
    assert space.params["kv_cache_dtype"].choices == [None, "fp8"]
    # A baseline that sets its own value keeps it as the other choice.
    assert numerics_params(["fp8"], {"kv_cache_dtype": "auto"})["kv_cache_dtype"].choices == ["auto", "fp8"]


def test_a_config_changes_numerics_only_where_it_differs_from_the_baseline() -> None:
    assert numerics_changes({"quantization": None, "kv_cache_dtype": "auto"}, {}) == {}
    changes = numerics_changes({"quantization": "fp8", "kv_cache_dtype": None, "max_num_seqs": 8}, {})
    assert changes == {"quantization": "fp8"}
    assert describe_changes(changes) == f"{NUMERICS_NOTE} (quantization=fp8)"
    assert numerics_changes({"quantization": "fp8"}, {"quantization": "fp8"}) == {}


def _study_of(scored: list[tuple[float, dict]]):  # (capacity, changes_numerics) per trial
    import optuna
    from optuna.distributions import FloatDistribution
    from optuna.trial import create_trial

    study = optuna.create_study(direction="maximize")
    for number, (score, changes) in enumerate(scored):
        attrs = {"score": score, "overrides": {"max_num_seqs": number + 1}}
        if changes:
            attrs["changes_numerics"] = changes
        study.add_trial(create_trial(value=score, params={"x": float(number)},
                                     distributions={"x": FloatDistribution(0, 100)}, user_attrs=attrs))
    return study


def test_the_gate_validates_the_best_numerics_free_config_when_the_top_k_all_change_numerics() -> None:
    from types import SimpleNamespace

    from autotune.search.gate_runner import GateRunner
    from autotune.search.objective import parse_objective
    from workloads.slo import parse_slo

    gate = GateRunner(SimpleNamespace(), SimpleNamespace(objective=parse_objective("capacity", [parse_slo("ttft_p95_ms=500")])),  # type: ignore[arg-type]
                      runner=None, say=print, clock=lambda: 0.0)  # type: ignore[arg-type]
    fp8 = {"quantization": "fp8"}
    study = _study_of([(20.0, {}), (36.0, fp8), (29.0, fp8), (22.0, {}), (21.0, {})])
    top = gate.best_trials(study, 2)
    assert [t.number for t in top] == [1, 2]
    assert [t.number for t in gate.numerics_free(study, top)] == [3]  # the best without fp8
    top3 = gate.best_trials(study, 3)  # trial 3 is among the top K already: nothing added
    assert gate.numerics_free(study, top3) == []


def test_the_report_shows_the_mark_and_the_numerics_free_config_beside_the_winner() -> None:
    from autotune.decide.report import numerics_lines
    from autotune.search.gate import CandidateStats
    from autotune.search.numerics import numerics_record
    from autotune.search.objective import parse_objective
    from workloads.slo import parse_slo

    def stats(name: str, median: float, eligible: bool = True) -> CandidateStats:
        return CandidateStats(candidate=name, values=[median], median=median, relative_spread=0.0, eligible=eligible)

    gate = [stats("baseline", 20.0), stats("trial-0001", 36.0), stats("trial-0003", 22.0)]
    overrides = {"baseline": {}, "trial-0001": None, "trial-0003": {"max_num_batched_tokens": 1024}}
    objective = parse_objective("capacity", [parse_slo("ttft_p95_ms=500")])
    record = numerics_record({"quantization": "fp8"}, gate, "trial-0001", overrides.get, objective.rank_key)
    assert record is not None and record["numerics_free"]["candidate"] == "trial-0003"
    text = "\n".join(numerics_lines(record, objective))
    assert f"**The emitted config {NUMERICS_NOTE}** (`quantization=fp8`)" in text
    assert "Without such knobs, validated in the same gate: **trial-0003** (`max_num_batched_tokens=1024`)" in text
    assert "+10.0% vs the baseline, every SLO in every repeat" in text
    assert numerics_record({}, gate, "trial-0001", overrides.get, objective.rank_key) is None


def test_best_yaml_says_the_config_changes_numerics_and_names_the_alternative() -> None:
    from autotune.decide.export import header_text

    provenance = {
        "date": "2026-12-01T22:00:00+00:00", "study": {"name": "s"}, "objective": "capacity",
        "slos": ["ttft_p95_ms=1000"], "model": "m", "vllm_version": "0.24.0",
        "hardware": {"gpus": ["NVIDIA H200"], "cpu": "x", "cpu_count": 16},
        "workload": {"source": "t.jsonl", "fingerprint": "f"},
        "decision": {"kept_baseline": False, "emitted": "trial-0004", "reason": "beats the baseline"},
        "numerics": {"note": NUMERICS_NOTE, "changes": {"quantization": "fp8"},
                     "numerics_free": {"candidate": "trial-0002", "overrides": {"max_num_batched_tokens": 1024},
                                       "median": 22.3, "eligible": True}},
    }
    header = header_text(provenance)
    assert "CHANGES NUMERICS: CHECK OUTPUT QUALITY BEFORE DEPLOYING (quantization=fp8)" in header
    assert "without such knobs: trial-0002 max_num_batched_tokens=1024, gate median 22.3" in header
    del provenance["numerics"]
    assert "NUMERICS" not in header_text(provenance)


@pytest.mark.parametrize("flag, text, refused", [
    ("--space", "params:\n  quantization: {type: categorical, choices: [null, fp8]}\n",
     "quantization may be fp8: FP8 needs a GPU of compute capability 8.9 or newer"),
    ("--space", "params:\n  kv_cache_dtype: {type: categorical, choices: [auto, fp8_e4m3]}\n",
     "kv_cache_dtype may be fp8: FP8 needs a GPU"),
    ("--baseline", "max-num-seqs: 8\nquantization: fp8\n", "quantization: fp8: FP8 needs a GPU"),
    ("--compare", "kv-cache-dtype: fp8\n", "kv_cache_dtype: fp8: FP8 needs a GPU"),
])
def test_fp8_in_a_file_is_refused_on_cpu_as_the_opt_in_is(flag: str, text: str, refused: str,
                                                           tmp_path: Path, capsys) -> None:
    """Without --allow, FP8 can still come from a file: a deployed fp8 config as the baseline or
    a comparison, a space file listing it. vLLM would fail at load on this CPU: refused first."""
    path = tmp_path / "given.yaml"
    path.write_text(text)
    code = main(["run", "--workload", SAMPLE, flag, str(path), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err.startswith(f"autotune: error: {flag} {path}") and refused in err
    assert not (tmp_path / "out" / "trials").exists()


def test_the_opt_in_with_a_space_file_that_leaves_fp8_out_is_refused(tmp_path: Path) -> None:
    """A space file keeps its parameters as written: `quantization: [null]` beside --allow fp8
    would make the opt-in do nothing, silently."""
    from autotune.search.numerics import check_allowed_in_space

    path = tmp_path / "space.yaml"
    path.write_text("params:\n  quantization: {type: categorical, choices: [null]}\n"
                    "  kv_cache_dtype: {type: categorical, choices: [auto]}\n")
    space = SearchSpace.load(path, "gpu")
    with pytest.raises(AutotuneError, match=rf"^--allow fp8: the space \({path}\) leaves fp8 out of quantization "
                                            r"and kv_cache_dtype; add fp8 to their choices there or drop --allow fp8$"):
        check_allowed_in_space(["fp8"], space.extended(numerics_params(["fp8"], {})))
    check_allowed_in_space([], space)  # no opt-in: nothing to check
    check_allowed_in_space(["fp8"], SearchSpace.default("gpu").extended(numerics_params(["fp8"], {})))


def test_a_knob_the_space_file_stops_varying_stays_out_beside_the_opt_in(tmp_path: Path) -> None:
    """`quantization: null` is "stop varying it": --allow fp8 then searches fp8 in the KV cache
    only, and with both knobs mapped to null it is refused (it would do nothing)."""
    from autotune.search.numerics import check_allowed_in_space

    path = tmp_path / "space.yaml"
    path.write_text("params:\n  quantization: null\n")
    space = SearchSpace.load(path, "gpu").extended(numerics_params(["fp8"], {}))
    assert "quantization" not in space.params
    assert space.params["kv_cache_dtype"].choices == [None, "fp8"]
    check_allowed_in_space(["fp8"], space)
    path.write_text("params:\n  quantization: null\n  kv_cache_dtype: null\n")
    both = SearchSpace.load(path, "gpu").extended(numerics_params(["fp8"], {}))
    assert not {"quantization", "kv_cache_dtype"} & set(both.params)
    with pytest.raises(AutotuneError, match=r"leaves fp8 out of quantization and kv_cache_dtype"):
        check_allowed_in_space(["fp8"], both)
