"""The sampler asks TPE again, or takes the nearest config not measured, rather than launch a
config the study measured already (autotune.search.sampler).

What a user would notice: every launch of a small discrete space measures a config not
measured before, until none is left; then the study goes on and measures one again."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from optuna.distributions import CategoricalDistribution, IntDistribution

from autotune.search.sampler import nearest_new
from autotune.search.space import ParamSpec, SearchSpace
from tests.autotune.test_study import FakeRunner, make_study

# 4 x 2 = 8 configs; the baseline (vLLM's 128 sequences) lies outside it.
SMALL = SearchSpace({
    "max_num_seqs": ParamSpec(type="pow2", low=4, high=32),
    "max_num_batched_tokens": ParamSpec(type="pow2", low=1024, high=2048),
})


def launched(runner: FakeRunner) -> list[tuple[int, int]]:
    return [(engine.get("max_num_seqs", 128), engine.get("max_num_batched_tokens", 2048)) for engine in runner.seen]


def test_every_launch_measures_a_new_config_until_the_space_is_spent(tmp_path: Path) -> None:
    runner = FakeRunner()
    # The baseline and every config of the space, once each.
    make_study(tmp_path, runner, n_trials=9, space=SMALL).run_search()
    configs = launched(runner)
    assert len(configs) == 9
    assert len(set(configs)) == 9, f"a config was launched twice: {configs}"


def test_a_spent_space_measures_a_config_again_and_the_study_goes_on(tmp_path: Path) -> None:
    runner = FakeRunner()
    study = make_study(tmp_path, runner, n_trials=11, space=SMALL).run_search()
    configs = launched(runner)
    assert len(configs) == 11 and len(set(configs)) == 9
    assert len(study.trials) == 11


def test_the_nearest_config_not_measured_is_taken_ring_by_ring() -> None:
    space = {"seqs": IntDistribution(0, 10), "prefix": CategoricalDistribution([True, False])}
    start = {"seqs": 5, "prefix": True}
    # Everything within one step of the proposal is measured; two steps away is not.
    measured = [{"seqs": 5, "prefix": True}, {"seqs": 4, "prefix": True}, {"seqs": 6, "prefix": True},
                {"seqs": 5, "prefix": False}]
    found = nearest_new(start, space, lambda c: c not in measured, np.random.default_rng(0))
    assert found in ({"seqs": 3, "prefix": True}, {"seqs": 7, "prefix": True},
                     {"seqs": 4, "prefix": False}, {"seqs": 6, "prefix": False})
    # Bounds hold, and a space with nothing left answers None.
    assert nearest_new({"seqs": 0, "prefix": True}, {"seqs": IntDistribution(0, 1)},
                       lambda c: c == {"seqs": 1, "prefix": True}, np.random.default_rng(0)) == {"seqs": 1, "prefix": True}
    assert nearest_new(start, space, lambda c: False, np.random.default_rng(0)) is None
