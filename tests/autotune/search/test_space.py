"""Search space: the YAML a user writes, the relations, what Optuna is asked for."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from autotune.errors import AutotuneError
from autotune.search.relations import parse_relation
from autotune.search.space import SearchSpace
from server.vllm_facts import FactsCache


@pytest.fixture(scope="module")
def known() -> frozenset[str]:
    return FactsCache().engine_arg_names()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path


def test_defaults_follow_the_device() -> None:
    cpu, gpu = SearchSpace.default("cpu"), SearchSpace.default("gpu")
    assert cpu.params["gpu_memory_utilization"].high <= 0.35  # share of RAM on CPU
    assert gpu.params["gpu_memory_utilization"].low == 0.80
    assert cpu.params["max_num_seqs"].low == 1 and cpu.params["max_num_seqs"].high == 32


def test_space_file_widens_drops_and_adds(tmp_path: Path, known: frozenset[str]) -> None:
    path = write(tmp_path, """
params:
  max_num_seqs: {type: int, low: 2, high: 64, log: true}
  gpu_memory_utilization: null
  enable_prefix_caching: {type: categorical, choices: [true, false]}
relations:
  - "max_num_batched_tokens >= 256 if enable_prefix_caching"
  - {left: max_num_seqs, op: "<=", right: 48}
""")
    space = SearchSpace.load(path, "cpu", known_names=known)
    assert set(space.params) == {"max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching"}
    assert space.params["max_num_seqs"].high == 64
    assert len(space.relations) == 4  # two built-ins + two from the file


def test_unknown_engine_argument_is_named(tmp_path: Path, known: frozenset[str]) -> None:
    path = write(tmp_path, "params:\n  max_num_partial_prefils: {type: int, low: 1, high: 4}\n")
    with pytest.raises(AutotuneError, match="max_num_partial_prefils.*not an engine argument"):
        SearchSpace.load(path, "cpu", known_names=known)


def test_bad_param_spec_names_file_and_field(tmp_path: Path) -> None:
    path = write(tmp_path, "params:\n  max_num_batched_tokens: {type: pow2, low: 100, high: 4096}\n")
    with pytest.raises(AutotuneError, match=r"space.yaml: field 'params.max_num_batched_tokens.*power of two"):
        SearchSpace.load(path, "cpu")


def test_bad_relation_is_rejected_not_evaluated(tmp_path: Path) -> None:
    path = write(tmp_path, "relations:\n  - \"__import__('os').system('x')\"\n")
    with pytest.raises(AutotuneError, match="relations.0"):
        SearchSpace.load(path, "cpu")


def test_relations_hold_break_or_abstain() -> None:
    conditional = parse_relation("max_num_batched_tokens >= max_model_len if not enable_chunked_prefill")
    assert conditional.check({"max_num_batched_tokens": 512, "max_model_len": 2048,
                              "enable_chunked_prefill": False}) is False
    assert conditional.check({"max_num_batched_tokens": 512, "max_model_len": 2048,
                              "enable_chunked_prefill": True}) is True
    # Unknown chunked-prefill setting: the tuner does not guess, vLLM decides.
    assert conditional.check({"max_num_batched_tokens": 512, "max_model_len": 2048}) is None
    space = SearchSpace.default("cpu")
    assert space.broken_relations({"max_num_seqs": 32, "max_num_batched_tokens": 16}) == [
        "max_num_batched_tokens >= max_num_seqs"
    ]


def test_suggest_gives_engine_values_and_baseline_is_representable(large_numa_node) -> None:
    space = SearchSpace.default("cpu")
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(20):
        values = space.suggest(study.ask())
        assert values["max_num_batched_tokens"] & (values["max_num_batched_tokens"] - 1) == 0
        assert 32 <= values["max_num_batched_tokens"] <= 4096
        assert 1 <= values["max_num_seqs"] <= 32
    # vLLM's CPU defaults: 128 seqs is outside 1-32, so it is not enqueued as a parameter.
    fixed = space.fixed_params({"max_num_seqs": 128, "max_num_batched_tokens": 2048,
                                "gpu_memory_utilization": 0.1})
    assert fixed == {"log2_max_num_batched_tokens": 11, "gpu_memory_utilization": 0.1}


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[3] / "scripts" / "gpu").glob("space-*.yaml")),
                         ids=lambda path: path.name)
def test_every_committed_space_file_loads_and_proposes_configs_vllm_takes(path: Path, known: frozenset[str]) -> None:
    """The space files the GPU runs and the README point to: every name an engine argument (or our
    server's setting), every proposal a config our server's settings accept."""
    from server.config import ServerConfig

    space = SearchSpace.load(path, "gpu", known_names=known)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=2))
    for _ in range(10):
        values = space.suggest(study.ask())
        assert set(values) == set(space.params)
        # Validated as a trial's config is when it is read back (engine types, serving settings).
        ServerConfig.model_validate(ServerConfig(engine={"model": "m"}).with_overrides(values).model_dump())
    if path.name == "space-long-prefill.yaml":  # the default space plus vLLM's per-request prefill cap
        assert set(space.params) == {*SearchSpace.default("gpu").params, "long_prefill_token_threshold"}


# -- the space contains the baseline (issue 58) ---------------------------------------------

H200_DEFAULTS = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.92}


@pytest.mark.parametrize("accelerator", ["gpu", "cpu"])
@pytest.mark.parametrize("resolved", [
    H200_DEFAULTS,  # vLLM's defaults as an H200 resolved them
    {"max_num_seqs": 8, "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.3},  # a small config
    {"max_num_seqs": 8, "max_num_batched_tokens": 16384, "gpu_memory_utilization": 0.5},
    {"max_num_seqs": 256, "max_num_batched_tokens": 5000, "gpu_memory_utilization": 0.98},  # not a power of two
])
def test_the_default_space_contains_the_resolved_baseline(accelerator: str, resolved: dict) -> None:
    """On an H200 the card's 1-32 sequences could not hold vLLM's 1024: every first move then
    changed two knobs at once and the search never measured a config near the defaults."""
    space = SearchSpace.default(accelerator, baseline=resolved)  # type: ignore[arg-type]
    for name, value in resolved.items():
        assert space.params[name].contains(value), (name, value, space.params[name].describe())
    assert space.clamps(resolved) == {}
    # The baseline is enqueued whole: every knob of it is a value the sampler knows.
    assert len(space.fixed_params(resolved)) == len(resolved)
    # Still the card's ranges around it: small batches and the card's top stay reachable.
    assert space.params["max_num_seqs"].contains(1) and space.params["max_num_seqs"].contains(32)
    assert space.params["max_num_batched_tokens"].contains(32)


def test_a_space_file_that_excludes_the_baseline_says_which_knob_is_clamped(tmp_path: Path) -> None:
    path = tmp_path / "space.yaml"
    path.write_text("params:\n  max_num_seqs: {type: int, low: 1, high: 64, log: true}\n")
    space = SearchSpace.load(path, "gpu", baseline=H200_DEFAULTS)
    assert space.clamps(H200_DEFAULTS) == {"max_num_seqs": (1024, 64)}  # the file's range is kept
    [line] = space.describe_clamps(H200_DEFAULTS)
    assert line.startswith("max_num_seqs: the baseline's 1024 is outside the space (int 1..64")
    assert str(path) in line and "clamped to 64" in line


@pytest.mark.parametrize("seqs", [1024, 8])
def test_autotune_runs_space_contains_the_baseline_vllm_resolves(tmp_path: Path, seqs: int) -> None:
    """Through `autotune run`'s preparation (vLLM resolves the baseline's defaults): the space
    the study searches holds the baseline's every knob, so no move has to clamp one."""
    from autotune.cli import build_parser
    from autotune.cli.run import run_request
    from autotune.prepare import prepare_plan

    baseline = tmp_path / "baseline.yaml"
    baseline.write_text(f"max_num_seqs: {seqs}\n")
    sample = Path(__file__).resolve().parents[3] / "workloads" / "samples" / "translation_trace.jsonl"
    args = build_parser().parse_args(["run", "--workload", str(sample), "--baseline", str(baseline),
                                      "--output-dir", str(tmp_path / "out")])
    plan = prepare_plan(run_request(args))
    resolved = plan.baseline.searchable_values(plan.effective_defaults)
    assert resolved["max_num_seqs"] == seqs
    for name, param in plan.space.params.items():
        assert param.contains(resolved[name]), (name, resolved[name], param.describe())
    assert plan.space.describe_clamps(resolved) == []
