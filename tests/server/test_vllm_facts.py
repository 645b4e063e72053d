"""The vLLM facts cache (server.vllm_facts): config checks and `autotune` commands answer from it
without importing vLLM, exactly as vLLM would, and a cache that cannot be trusted is rebuilt."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.config import (
    ConfigError,
    ServerConfig,
    cpu_node_memory,
    default_engine_settings,
    type_problem,
)
from server.vllm_facts import CACHE_DIR_ENV, FactsCache, decode_annotation, field_annotation

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "workloads" / "samples" / "translation_trace.jsonl"
# Values a user may write for any engine argument: each field's check must say what vLLM's says.
VALUES = [1, 0, -3, 2.5, "auto", "8", "", True, False, None, [1, 2], ["a"], {"a": 1}, {}]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FactsCache:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "facts"))
    return FactsCache()


def test_every_cached_type_checks_values_as_vllms_own_annotation_does(cache: FactsCache) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    facts = cache.facts().engine_args
    fields = dataclasses.fields(AsyncEngineArgs)
    assert set(facts) == {field.name for field in fields}
    cached = 0
    for field in fields:
        declared = field_annotation(AsyncEngineArgs, field)
        entry = facts[field.name]
        if entry.opaque:
            continue
        cached += 1
        ours = None if entry.annotation is None else decode_annotation(entry.annotation)
        assert ours == declared, field.name
        for value in VALUES:
            assert type_problem(ours, value) == type_problem(declared, value), (field.name, value)
    assert cached >= 0.8 * len(fields)  # vLLM's config classes and enums are the rest


def test_a_value_for_a_type_only_vllm_knows_is_checked_by_vllm(cache: FactsCache) -> None:
    opaque = [name for name, entry in cache.facts().engine_args.items() if entry.opaque]
    assert "compilation_config" in opaque
    with pytest.raises(ConfigError, match="compilation-config.*expected CompilationConfig"):
        ServerConfig.from_mapping({"compilation-config": 5})
    ServerConfig.from_mapping({"compilation-config": {"mode": 0}})


def test_a_damaged_or_stale_cache_file_is_rebuilt_and_never_trusted(cache: FactsCache) -> None:
    good = cache.facts()
    path = cache.path
    assert path is not None and path.exists()
    path.write_text("{not json")
    assert cache.facts() == good
    assert json.loads(path.read_text())["engine_args"]  # written again, whole
    stale = json.loads(path.read_text())
    stale["install"]["arg_utils_size"] += 1  # another build of the same version
    stale["engine_args"] = {"max_num_seqs": {"annotation": "str"}}
    path.write_text(json.dumps(stale))
    assert cache.facts() == good


def test_resolved_defaults_are_remembered_per_settings_model_files_and_environment(
    cache: FactsCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 4096}')
    asked: list[int] = []

    def resolve() -> dict[str, int]:
        asked.append(1)
        return {"max_model_len": 4096 + len(asked)}

    engine = {"model": str(model), "max_num_seqs": 8}
    first = cache.resolved_defaults(engine, resolve)
    remembered = cache.device_type() == "cpu"  # on a GPU host vLLM is asked every time
    assert cache.resolved_defaults(engine, resolve) == first
    assert len(asked) == (1 if remembered else 2)
    cache.resolved_defaults({**engine, "max_num_seqs": 16}, resolve)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    cache.resolved_defaults(engine, resolve)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    (model / "config.json").write_text('{"max_position_embeddings": 8192}')
    cache.resolved_defaults(engine, resolve)
    assert len(asked) == (4 if remembered else 5)
    assert cache.resolved_defaults({"model": str(model)}, dict) == {}  # vLLM could not tell
    cache.resolved_defaults({"model": str(model)}, resolve)
    assert len(asked) == (5 if remembered else 7)


def test_the_cpu_node_and_its_memory_are_the_ones_vllms_cpu_worker_sizes_from(cache: FactsCache) -> None:
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    cpus = get_allowed_cpu_list()
    node = cpus[0].numa_node if cpus else 0
    assert cpu_node_memory() == get_memory_node_info(node).total_memory  # asks vLLM, then caches
    assert cpu_node_memory() == get_memory_node_info(node).total_memory  # from the cache


def warm_child_env(cache: FactsCache) -> dict[str, str]:
    """A child's environment whose cache already holds this host's answers."""
    cache.facts()
    cache.device_type()
    default_engine_settings()  # the CPU node, on a CPU host
    return {**os.environ, CACHE_DIR_ENV: str(cache.directory),
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def test_a_warm_cache_checks_a_config_without_importing_vllm_and_says_what_vllm_would(
    cache: FactsCache, tmp_path: Path
) -> None:
    env = warm_child_env(cache)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: m\nmax-num-seqs: many\nenable-prefix-caching: false\n")
    with pytest.raises(ConfigError) as here:
        ServerConfig.load(bad)
    script = (
        "import sys\nfrom server.config import ServerConfig, ConfigError, default_engine_settings\n"
        f"default_engine_settings()\ntry:\n    ServerConfig.load({str(bad)!r})\n"
        "except ConfigError as error:\n    print(error)\n"
        "print('vllm imported' if 'vllm' in sys.modules else 'vllm not imported')\n"
    )
    child = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                           timeout=120, check=True)
    assert child.stdout.splitlines() == [str(here.value), "vllm not imported"]


def test_autotune_refuses_a_bad_space_file_without_importing_vllm(cache: FactsCache, tmp_path: Path) -> None:
    env = warm_child_env(cache)
    space = tmp_path / "space.yaml"
    space.write_text("params:\n  max_num_seqz: {type: int, low: 1, high: 8}\n")
    child = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "autotune", "run", "--workload", str(SAMPLE),
         "--space", str(space), "--output-dir", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert child.returncode == 2
    lines = child.stderr.splitlines()
    refusal = [line for line in lines if not line.startswith("import time:")]
    assert "max_num_seqz" in refusal[-1]
    imported = {line.split("|")[-1].strip() for line in lines if line.startswith("import time:")}
    assert imported and not any(name.split(".")[0] == "vllm" for name in imported)
