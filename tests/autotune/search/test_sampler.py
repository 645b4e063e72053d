"""The sampler asks TPE again, or takes the nearest config not measured, rather than launch a
config the study measured already (autotune.search.sampler).

What a user would notice: every launch of a small discrete space measures a config not
measured before, until none is left; then the study goes on and measures one again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.samplers import BaseSampler
from optuna.search_space import IntersectionSearchSpace
from optuna.trial import FrozenTrial

from autotune.search.sampler import FreshConfigSampler, nearest_new
from autotune.search.space import ParamSpec, SearchSpace
from tests.autotune.search.test_study import FakeRunner, make_study

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


class RandomStart(BaseSampler):
    """TPE during its random start, made predictable: nothing jointly (`sample_relative` gives
    {}), and every parameter on its own at its lowest value."""

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return IntersectionSearchSpace().calculate(study)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        assert isinstance(param_distribution, CategoricalDistribution)
        return param_distribution.choices[0]


def test_the_random_start_moves_any_knob_to_a_new_config() -> None:
    # Every config with 4 sequences is measured. Drawn one knob at a time, 4 sequences came
    # first and the last knob had no new value left: the random start measured a config again.
    seqs = CategoricalDistribution([4, 8])
    batched = CategoricalDistribution([1024, 2048])
    sampler = FreshConfigSampler(RandomStart(), lambda params: dict(params) if len(params) == 2 else None)
    study = optuna.create_study(sampler=sampler, direction="maximize")
    for measured in ({"seqs": 4, "batched": 1024}, {"seqs": 4, "batched": 2048}):
        study.add_trial(optuna.trial.create_trial(
            params=measured, distributions={"seqs": seqs, "batched": batched}, value=1.0,
            user_attrs={"engine_params": measured}))
    trial = study.ask({"seqs": seqs, "batched": batched})
    assert trial.params["seqs"] == 8, trial.params
