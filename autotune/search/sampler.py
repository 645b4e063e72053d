"""The sampler: Optuna's TPE, asked again when it proposes a config already measured.

In a small discrete space (powers of two of two knobs) TPE often proposes the config it
already believes best, and a launch (40-80 s on a GPU) then measures it a second time as if
it were new: in the replay of the recorded grids, 5 of 18 launches (2-7) went to configs
measured before. Like Ray Tune's `skip_duplicate` for Bayesian optimisation, the proposal is
drawn again instead, a few times (each draw advances TPE's random state). TPE's favourite
often stays the favourite, so then the config nearest to it that is not measured yet is taken
(one step in one knob, then two, ...): a local step around what TPE believes best. Only a space
with nothing left near the proposal measures it again. In the replay this took the launches
on measured configs to 0 (results/benchmarks/search_fresh_configs.md). During TPE's random
start the whole config is drawn at once too (TPE would draw one knob at a time, and then only
the last knob could move: 0-2 launches of a replayed run still went to measured configs; none
since). Repeats the search asks for on purpose (the gate's, queued moves) do not pass here.

A config the host cannot hold (a topology of more GPUs than it has: `admits` is False,
autotune.search.topology) is never proposed: it is drawn again like a measured one, then the
nearest config that fits is taken, measured or not. Such a config is no measurement at all,
and on a 2-GPU host one of the four TP x DP pairs is one. The fit is judged on every draw,
also one that fixes only some parameters (TPE draws the ones the baseline set together, the
rest one by one after): the topology it fixes must fit already, or no later draw could.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.samplers import BaseSampler
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState

logger = logging.getLogger(__name__)

MAX_DRAWS = 4  # TPE's proposals looked at per trial before the nearest new config is taken
MAX_VISITED = 10_000  # configs the search for the nearest new one looks at


class FreshConfigSampler(BaseSampler):
    """Delegates to `inner` (TPE); draws again when a draw completes a config measured or being
    measured, then takes the nearest config not measured. `engine_values` turns Optuna
    parameters into the engine values stored on each trial (`engine_params`); None while the
    parameters do not fix a config yet, and such a draw is kept as it is. Both of TPE's ways
    of sampling pass here: jointly (`sample_relative`, once TPE models the space) and one
    parameter at a time (`sample_independent`, its random start), where the parameter that
    completes the config is the one drawn again."""

    def __init__(
        self,
        inner: BaseSampler,
        engine_values: Callable[[Mapping[str, Any]], dict[str, Any] | None],
        admits: Callable[[Mapping[str, Any]], bool] | None = None,
    ):
        """`admits(parameters)`: False for Optuna parameters (all of a config's, or some) that
        no config can run with on this host (None: every config can)."""
        self.inner = inner
        self.engine_values = engine_values
        self.admits = admits

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return self.inner.infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        def draw() -> dict[str, Any]:
            drawn = self.inner.sample_relative(study, trial, search_space)
            if drawn or not search_space:
                return drawn
            # TPE's random start leaves every parameter to sample_independent, one at a time, where
            # only the last one could still be drawn again: with no new value left for it, a config
            # was measured twice. Drawn here together, every knob can move to a new config.
            return {name: self.inner.sample_independent(study, trial, name, distribution)
                    for name, distribution in search_space.items()}

        return self._fresh(study, trial, draw, lambda params: params,
                           lambda params, is_new, rng: nearest_new(params, search_space, is_new, rng))

    def sample_independent(
        self, study: Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        def draw() -> Any:
            return self.inner.sample_independent(study, trial, param_name, param_distribution)

        def with_value(value: Any) -> dict[str, Any]:
            return {**trial.params, param_name: value}

        def nearest(value: Any, is_new: Callable[[dict[str, Any]], bool], rng: np.random.Generator) -> Any:
            found = nearest_new(with_value(value), {param_name: param_distribution}, is_new, rng)
            return None if found is None else found[param_name]

        return self._fresh(study, trial, draw, with_value, nearest)

    def _fresh(
        self,
        study: Study,
        trial: FrozenTrial,
        draw: Callable[[], Any],
        as_config: Callable[[Any], dict[str, Any]],
        nearest: Callable[[Any, Callable[[dict[str, Any]], bool], np.random.Generator], Any],
    ) -> Any:
        """A draw that completes neither a measured config nor one the host cannot hold: up to
        MAX_DRAWS of them, then the nearest new config that fits to the last, else the nearest
        that fits (measured again); the last draw itself when none is left. A queued config's
        values are given, not sampled: its draw is kept as it is."""
        sample = draw()
        if trial.system_attrs.get("fixed_params"):
            return sample

        def fits(config: dict[str, Any]) -> bool:
            return self.admits is None or self.admits(config)

        if self.engine_values(as_config(sample)) is None and fits(as_config(sample)):
            return sample  # not a whole config yet, and one that fits can still follow
        measured = measured_configs(study, exclude=trial.number)

        def is_new(config: dict[str, Any]) -> bool:
            values = self.engine_values(config)
            return fits(config) and (values is None or not any(_same(values, other) for other in measured))

        for _ in range(MAX_DRAWS - 1):
            if is_new(as_config(sample)):
                return sample
            sample = draw()
        if is_new(as_config(sample)):
            return sample
        rng = np.random.default_rng(trial.number)
        other = nearest(sample, is_new, rng)
        if other is not None:
            logger.info("trial %d: TPE drew configs measured before or not fitting this host %d times; "
                        "taking the nearest new one, %s", trial.number, MAX_DRAWS, as_config(other))
            return other
        if not fits(as_config(sample)):
            other = nearest(sample, fits, rng)
            if other is not None:
                logger.info("trial %d: no new config fits this host near %s; measuring %s again",
                            trial.number, as_config(sample), as_config(other))
                return other
        logger.info("trial %d: TPE drew configs measured before %d times and none near %s is left; "
                    "measuring it again", trial.number, MAX_DRAWS, as_config(sample))
        return sample

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        self.inner.before_trial(study, trial)

    def after_trial(
        self, study: Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None
    ) -> None:
        self.inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.inner.reseed_rng()


def measured_configs(study: optuna.Study, *, exclude: int) -> list[dict[str, Any]]:
    """The engine values of every trial measured or being measured (FAIL says nothing about
    its config: an interrupted trial may be measured again)."""
    return [
        trial.user_attrs["engine_params"]
        for trial in study.get_trials(deepcopy=False)
        if trial.number != exclude and trial.state != TrialState.FAIL and trial.user_attrs.get("engine_params")
    ]


def neighbours(
    params: Mapping[str, Any], search_space: Mapping[str, BaseDistribution], rng: np.random.Generator
) -> list[dict[str, Any]]:
    """The configs one step from `params` in one parameter (an integer or stepped float by its
    step, a category to another choice), in a random order; continuous floats have none."""
    found: list[dict[str, Any]] = []
    for name, value in params.items():
        distribution = search_space.get(name)
        others: list[Any] = []
        if isinstance(distribution, CategoricalDistribution):
            others = [c for c in distribution.choices if c != value]
        elif isinstance(distribution, IntDistribution) and not distribution.log:
            others = [value + d for d in (-distribution.step, distribution.step)]
        elif isinstance(distribution, IntDistribution):  # log: the next whole numbers a factor 2 away
            others = [max(int(value) // 2, int(value) - 1), int(value) * 2]
        elif isinstance(distribution, FloatDistribution) and distribution.step is not None:
            others = [value - distribution.step, value + distribution.step]
        for other in others:
            if isinstance(distribution, CategoricalDistribution) or distribution.low <= other <= distribution.high:
                found.append({**params, name: other})
    order = rng.permutation(len(found))
    return [found[i] for i in order]


def nearest_new(
    params: dict[str, Any],
    search_space: Mapping[str, BaseDistribution],
    is_new: Callable[[dict[str, Any]], bool],
    rng: np.random.Generator,
) -> dict[str, Any] | None:
    """The config fewest steps from `params` (`neighbours`, breadth first; ties in random order)
    that `is_new` accepts; None when none within MAX_VISITED configs is."""
    seen = {_key(params)}
    ring = [params]
    while ring and len(seen) < MAX_VISITED:
        following: list[dict[str, Any]] = []
        for config in ring:
            for neighbour in neighbours(config, search_space, rng):
                if _key(neighbour) in seen:
                    continue
                if is_new(neighbour):
                    return neighbour
                seen.add(_key(neighbour))
                following.append(neighbour)
        ring = following
    return None


def _key(params: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((name, repr(value)) for name, value in params.items()))


def _same(values: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    return all(other.get(name) == value for name, value in values.items())
