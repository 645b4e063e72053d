"""The search space: which engine arguments the tuner varies, over which ranges, under which rules.

A space is a set of parameters (each an `AsyncEngineArgs` field, or one of our server's
searchable settings: `api_processes`, the front-end processes on one engine core) plus
relations between them.
Defaults follow the product card (max_num_seqs 1-32, batched tokens a power of two,
gpu_memory_utilization a band that suits the device); `--space FILE.yaml` widens, narrows,
drops or adds parameters and relations:

    params:
      max_num_seqs: {type: int, low: 1, high: 64, log: true}
      enable_prefix_caching: {type: categorical, choices: [true, false]}
      api_processes: {type: int, low: 1, high: 4}   # our server's front ends (not in the defaults)
      gpu_memory_utilization: null          # stop varying it (the baseline's value stays)
    relations:
      - "max_num_batched_tokens >= 2048 if not enable_chunked_prefill"
      - {left: max_num_batched_tokens, op: ">=", right: max_model_len, when: "not enable_chunked_prefill"}

Relations use a tiny grammar (`A OP B [if [not] NAME [OP VALUE]]`, operands are parameter or
engine-argument names, numbers, true/false or a product `A * B`): parsed, never evaluated as
Python (`autotune.search.relations`).

On a host with two GPUs or more the built-in space also searches the topology,
`tensor_parallel_size` and `data_parallel_size`, and any space that searches a parallel size
holds `tensor_parallel_size * pipeline_parallel_size * data_parallel_size <= host_gpus`
(`autotune.search.topology`): only topologies that fit the host are proposed.

Over 400 lines in one module because a parameter's range, its Optuna name and its engine value
are read together by every use of the space (suggest, the baseline's fixed values, clamps, the study's
stored fingerprint); the relations' grammar is `autotune.search.relations`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from autotune.errors import AutotuneError
from autotune.measure.gpus import count_gpus
from autotune.search.relations import (
    BUILTIN_RELATIONS,
    Relation,
    RelationSpec,
    Scalar,
    parse_relation,
)
from autotune.search.topology import (
    HOST_GPUS,
    PARALLEL_SIZES,
    TOPOLOGY_RELATION,
    check_fits,
    host_devices,
    with_parallel_defaults,
)
from server.config import SEARCHABLE_SERVING_SETTINGS

if TYPE_CHECKING:
    import optuna

Accelerator = Literal["cpu", "gpu"]
# Prefix of the Optuna parameter that holds a power-of-two argument's exponent; the engine
# value is 2**exponent, so TPE models the ordered exponent rather than unordered categories.
POW2_PREFIX = "log2_"


class ParamSpec(BaseModel):
    """One engine argument the tuner varies."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["int", "pow2", "float", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    # A null choice is vLLM's default for that argument (a config file then leaves it out).
    choices: list[Scalar | None] | None = None

    @model_validator(mode="after")
    def _check(self) -> ParamSpec:
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("a categorical parameter needs a non-empty 'choices' list")
            return self
        if self.low is None or self.high is None:
            raise ValueError(f"a {self.type} parameter needs 'low' and 'high'")
        if self.low > self.high:
            raise ValueError(f"low {self.low:g} is above high {self.high:g}")
        if self.type in ("int", "pow2") and (self.low != int(self.low) or self.high != int(self.high)):
            raise ValueError(f"an {self.type} parameter needs whole-number bounds")
        if self.type == "pow2":
            for bound in (self.low, self.high):
                if bound < 1 or not _is_pow2(int(bound)):
                    raise ValueError(f"pow2 bound {bound:g} is not a power of two")
        if self.log and self.low <= 0:
            raise ValueError("a log-scale parameter needs low > 0")
        return self

    def contains(self, value: Any) -> bool:
        """True when `value` is one the space can propose (so the baseline can be enqueued)."""
        if self.type == "categorical":
            assert self.choices is not None
            return any(type(value) is type(choice) and value == choice for choice in self.choices)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        assert self.low is not None and self.high is not None
        if not self.low <= value <= self.high:
            return False
        if self.type == "int":
            return float(value).is_integer()
        if self.type == "pow2":
            return float(value).is_integer() and _is_pow2(int(value))
        return True

    def clamp(self, value: Any) -> Any:
        """`value` if the space can propose it, else the nearest bound (a number outside the
        range), else None (a value of another kind, a choice not listed)."""
        if self.contains(value):
            return value
        if self.type == "categorical" or self.low is None or self.high is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        clamped = min(max(float(value), self.low), self.high)
        return int(clamped) if self.type in ("int", "pow2") else clamped

    def lowest(self) -> Any:
        """The smallest value the space can propose (None for choices that are not numbers)."""
        if self.type != "categorical":
            return self.low
        numbers = [c for c in self.choices or [] if isinstance(c, int | float) and not isinstance(c, bool)]
        return min(numbers) if numbers else None

    def describe(self) -> str:
        if self.type == "categorical":
            return "one of " + ", ".join(str(c) for c in self.choices or [])
        assert self.low is not None and self.high is not None
        if self.type == "pow2":
            return f"powers of two {int(self.low)}..{int(self.high)}"
        kind = "int" if self.type == "int" else "float"
        scale = ", log scale" if self.log else ""
        if self.step:
            scale += f", step {self.step:g}"
        low, high = (int(self.low), int(self.high)) if kind == "int" else (self.low, self.high)
        return f"{kind} {low}..{high}{scale}"


class SpaceFile(BaseModel):
    """The `--space` YAML file."""

    model_config = ConfigDict(extra="forbid")

    # Start from the built-in parameters (true) or from nothing (false).
    extend_defaults: bool = True
    # A parameter mapped to null is dropped from the defaults.
    params: dict[str, ParamSpec | None] = {}
    relations: list[str | RelationSpec] = []


# ---------------------------------------------------------------------------------------------
# Defaults and engine-argument names


def default_params(
    accelerator: Accelerator,
    *,
    wide_memory: bool = False,
    baseline: Mapping[str, Any] | None = None,
) -> dict[str, ParamSpec]:
    """The product card's space, widened to contain the baseline's resolved values
    (`baseline`: engine argument -> value, vLLM's defaults resolved; `covering`).

    On CPU `gpu_memory_utilization` is the share of CPU memory vLLM's worker may use, KV cache
    included (0.92 fails on a 24 GB machine). Its band stays near the embedded default (0.1 of
    a node of 15 GiB or more): the CPU demo's trials used < 0.1% of 0.3's KV cache
    (results/cpu-2026-11-23/run10), and each GiB more costs ~2.5 s of every start.

    `wide_memory` (the min-memory objective): memory from 0.05 up, in steps of 0.05, so that a
    model sharing a GPU with others can be given a small slice."""
    if wide_memory:
        high = 0.95 if accelerator == "gpu" else 0.35
        memory = ParamSpec(type="float", low=0.05, high=high, step=0.05)
    elif accelerator == "gpu":
        memory = ParamSpec(type="float", low=0.80, high=0.95)
    else:
        # 0.8x-1.6x the embedded default's share: 0.08-0.16 on a node of 15 GiB or more; higher
        # on a smaller node, where 0.08 could not hold the engine process (server.config).
        from server.config import cpu_memory_share, cpu_node_memory

        share = cpu_memory_share(cpu_node_memory())
        memory = ParamSpec(type="float", low=round(0.8 * share, 4), high=round(min(1.6 * share, 0.9), 4))
    params = {
        "max_num_seqs": ParamSpec(type="int", low=1, high=32, log=True),
        "max_num_batched_tokens": ParamSpec(
            type="pow2", low=32, high=8192 if accelerator == "gpu" else 4096
        ),
        "gpu_memory_utilization": memory,
    }
    return {name: covering(param, (baseline or {}).get(name)) for name, param in params.items()}


def topology_params(accelerator: Accelerator, gpus: int) -> dict[str, ParamSpec]:
    """The topology the built-in space searches on a host of `gpus` GPUs: one engine split
    across GPUs (`tensor_parallel_size`, powers of two: it must divide the model's attention
    heads, which are powers of two in the common shapes) or replicas behind one API server
    (`data_parallel_size`, any count); TOPOLOGY_RELATION keeps their product within the host.
    Nothing on a CPU or with one GPU: the space stays as it was. Pipeline parallelism is left
    out (it serves models too big for the GPUs a stage holds and adds a bubble to every step);
    a space file may add it."""
    if accelerator != "gpu" or gpus < 2:
        return {}
    return {
        "tensor_parallel_size": ParamSpec(type="pow2", low=1, high=2 ** int(math.log2(gpus))),
        "data_parallel_size": ParamSpec(type="int", low=1, high=gpus),
    }


def covering(param: ParamSpec, value: Any) -> ParamSpec:
    """`param` widened so that it contains `value` (a baseline's resolved value; None or a
    non-number: `param` as it is). A space that cannot reach the baseline wastes every trial:
    on an H200 vLLM resolved 1024 sequences, the card's range was 1-32, and every first move
    changed two knobs at once (issue 58).

    - a count (int): its range stretched to the value (`max_num_seqs` 1..max(32, baseline));
    - a power of two: stretched to the value's power of two when it is one, else an int range
      on the same (log) scale, 2**k values and the baseline's both reachable;
    - a fraction (memory): a band as wide as the card's, centred on the value, within (0, 1]
      (a stepped band: a bound moved by whole steps to the value)."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return param
    if param.type == "categorical" or param.contains(value):
        return param
    assert param.low is not None and param.high is not None
    if param.type == "int":
        if float(value).is_integer() and value >= 1:
            return param.model_copy(update={"low": min(param.low, value), "high": max(param.high, value)})
        return param
    if param.type == "pow2":
        if not float(value).is_integer() or value < 1:
            return param
        whole = int(value)
        if _is_pow2(whole):
            return param.model_copy(update={"low": min(param.low, whole), "high": max(param.high, whole)})
        return ParamSpec(type="int", low=min(param.low, whole), high=max(param.high, whole), log=True)
    if not 0 < value <= 1:
        return param
    if param.step:
        # Bounds moved by whole steps: the grid keeps its step (Optuna would cut a bound off it).
        step = param.step
        low, high = param.low, param.high
        if value > high:
            high = low + math.ceil((value - low) / step - 1e-9) * step
        else:
            low = high - math.ceil((high - value) / step - 1e-9) * step
        return param.model_copy(update={"low": round(max(low, step), 10), "high": round(min(high, 1.0), 10)})
    half = (param.high - param.low) / 2
    low, high = max(value - half, 0.01), min(value + half, 1.0)
    return param.model_copy(update={"low": round(min(low, value), 4), "high": round(max(high, value), 4)})


# ---------------------------------------------------------------------------------------------
# The space


class SearchSpace:
    """Parameters and relations; proposes configs through an Optuna trial."""

    def __init__(
        self,
        params: Mapping[str, ParamSpec],
        relations: list[Relation] | None = None,
        *,
        source: str = "built-in defaults",
        host_gpus: int | None = None,
        dropped: frozenset[str] = frozenset(),
    ) -> None:
        """`host_gpus`: the GPUs this host gives the engines; None: counted when a relation
        first needs it (autotune.measure.gpus.count_gpus), so a space rebuilt from a stored
        study on another host checks that host's. `dropped`: the names a space file maps to
        null ("stop varying it"), which `extended` does not add back."""
        if not params:
            raise AutotuneError(f"{source}: the search space has no parameters; add one under 'params:'")
        self.params = dict(params)
        self.relations = list(relations) if relations is not None else [
            parse_relation(text) for text in BUILTIN_RELATIONS
        ]
        if any(name in PARALLEL_SIZES for name in self.params) and TOPOLOGY_RELATION not in {
            relation.text for relation in self.relations
        }:
            self.relations.append(parse_relation(TOPOLOGY_RELATION))
        self.source = source
        self._host_gpus = host_gpus
        self.dropped = dropped

    @property
    def host_gpus(self) -> int:
        """The GPUs this host gives the engines (0 without any), counted once when first asked."""
        if self._host_gpus is None:
            self._host_gpus = count_gpus()
        return self._host_gpus

    @classmethod
    def default(
        cls,
        accelerator: Accelerator,
        *,
        wide_memory: bool = False,
        baseline: Mapping[str, Any] | None = None,
        host_gpus: int | None = None,
    ) -> SearchSpace:
        """The built-in space, containing `baseline`'s values (`default_params`), with the
        topology on a host of two GPUs or more (`topology_params`; `host_gpus` None: counted)."""
        gpus = count_gpus() if host_gpus is None else host_gpus
        params = {**default_params(accelerator, wide_memory=wide_memory, baseline=baseline),
                  **topology_params(accelerator, gpus)}
        return cls(params, host_gpus=gpus)

    @classmethod
    def load(
        cls,
        path: str | Path,
        accelerator: Accelerator,
        *,
        known_names: frozenset[str] | None = None,
        wide_memory: bool = False,
        baseline: Mapping[str, Any] | None = None,
        host_gpus: int | None = None,
    ) -> SearchSpace:
        """Read `--space FILE.yaml` on top of the defaults (which contain `baseline`'s values);
        names are checked against `known_names` (AsyncEngineArgs fields) when given. A range
        the file sets is kept as written, even where it excludes the baseline (`clamps`).
        AutotuneError (one line) when no topology the file allows fits the host's `host_gpus`
        (None: counted here; `autotune.search.topology.check_fits`)."""
        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text())
        except OSError as error:
            raise AutotuneError(f"{path}: cannot read the space file: {error.strerror}") from None
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
            raise AutotuneError(f"{where}: not valid YAML: {getattr(error, 'problem', error)}") from None
        try:
            spec = SpaceFile.model_validate(raw or {})
        except ValidationError as error:
            first = error.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            raise AutotuneError(
                f"{path}: field '{field}' = {first.get('input')!r}: {first['msg']}"
            ) from None
        gpus = count_gpus() if host_gpus is None else host_gpus
        params = ({**default_params(accelerator, wide_memory=wide_memory, baseline=baseline),
                   **topology_params(accelerator, gpus)} if spec.extend_defaults else {})
        for name, param in spec.params.items():
            if param is None:
                params.pop(name, None)
            else:
                params[name] = param
        relations = [parse_relation(text) for text in BUILTIN_RELATIONS]
        for index, item in enumerate(spec.relations):
            try:
                relations.append(parse_relation(item))
            except ValueError as error:
                raise AutotuneError(f"{path}: field 'relations.{index}' = {item!r}: {error}") from None
        dropped = frozenset(name for name, param in spec.params.items() if param is None)
        space = cls(params, relations, source=str(path), host_gpus=gpus, dropped=dropped)
        if known_names is not None:
            space.check_names(known_names)
        space.check_fits(baseline or {})
        return space

    def check_fits(self, baseline: Mapping[str, Any]) -> None:
        """AutotuneError (one line, naming the file and the parameter) when even the smallest
        topology this space proposes needs more GPUs than the host has; a parallel size it does
        not search counts at `baseline`'s value (1 when unset)."""
        searched = {name: self.params[name].describe() for name in PARALLEL_SIZES if name in self.params}
        if not searched:
            return
        least = with_parallel_defaults({name: baseline.get(name) for name in PARALLEL_SIZES})
        for name in searched:
            lowest = self.params[name].lowest()
            least[name] = int(lowest) if lowest is not None else 1
        check_fits(self.source, least, searched, self.host_gpus)

    def extended(self, params: Mapping[str, ParamSpec]) -> SearchSpace:
        """This space with `params` added where it has no parameter of that name (one the
        space file sets is kept as written, one it maps to null stays out); the same
        relations and source."""
        added = {name: param for name, param in params.items()
                 if name not in self.params and name not in self.dropped}
        if not added:
            return self
        return SearchSpace({**self.params, **added}, self.relations, source=self.source,
                           host_gpus=self._host_gpus, dropped=self.dropped)

    def check_names(self, known: frozenset[str]) -> None:
        """Every parameter and relation operand must be an engine argument of this vLLM (or one
        of our server's searchable settings)."""
        known = known | SEARCHABLE_SERVING_SETTINGS
        for name, param in self.params.items():
            if name in SEARCHABLE_SERVING_SETTINGS and not _whole_from_one(param):
                raise AutotuneError(
                    f"{self.source}: field 'params.{name}' = {param.describe()}: a count of "
                    f"processes: type int or pow2 with low >= 1, or whole-number choices >= 1"
                )
            if name not in known:
                raise AutotuneError(
                    f"{self.source}: field 'params.{name}': not an engine argument of the installed "
                    f"vLLM (AsyncEngineArgs); check the spelling (snake_case)"
                )
        for relation in self.relations:
            for name in relation.names():
                if name not in known and name != HOST_GPUS:
                    raise AutotuneError(
                        f"{self.source}: relation {relation.text!r}: {name!r} is not an engine "
                        f"argument of the installed vLLM (AsyncEngineArgs)"
                    )

    # -- proposing -------------------------------------------------------------------------

    def suggest(self, trial: optuna.Trial, only: set[str] | None = None) -> dict[str, Any]:
        """Ask `trial` for a value of every parameter (or of those in `only`);
        returns engine argument values (power-of-two exponents already raised)."""
        values: dict[str, Any] = {}
        for name, param in self.params.items():
            if only is not None and name not in only:
                continue
            key = _optuna_name(name, param)
            if param.type == "categorical":
                raw = trial.suggest_categorical(key, param.choices)  # type: ignore[arg-type]
            elif param.type == "pow2":
                assert param.low is not None and param.high is not None
                raw = trial.suggest_int(key, int(math.log2(param.low)), int(math.log2(param.high)))
            elif param.type == "int":
                assert param.low is not None and param.high is not None
                step = int(param.step) if param.step else 1
                raw = trial.suggest_int(key, int(param.low), int(param.high), step=step, log=param.log)
            else:
                assert param.low is not None and param.high is not None
                raw = trial.suggest_float(key, param.low, param.high, step=param.step, log=param.log)
            values[name] = _engine_value(param, raw)
        return values

    def engine_values(self, optuna_params: Mapping[str, Any]) -> dict[str, Any] | None:
        """The engine values of a config given as Optuna parameters (`suggest`'s names and
        representation); None when a parameter of the space is missing from them."""
        keys = {name: _optuna_name(name, param) for name, param in self.params.items()}
        if any(key not in optuna_params for key in keys.values()):
            return None
        return {name: _engine_value(param, optuna_params[keys[name]]) for name, param in self.params.items()}

    def drawn_values(self, optuna_params: Mapping[str, Any]) -> dict[str, Any]:
        """The engine values of the parameters `optuna_params` holds (some of a config's, while
        a sampler draws them one by one)."""
        values = {}
        for name, param in self.params.items():
            key = _optuna_name(name, param)
            if key in optuna_params:
                values[name] = _engine_value(param, optuna_params[key])
        return values

    def fixed_params(self, engine_values: Mapping[str, Any]) -> dict[str, Any]:
        """Optuna parameter values for the engine values the space can represent (used to
        enqueue the baseline so the sampler learns from it); others are left out."""
        fixed: dict[str, Any] = {}
        for name, param in self.params.items():
            value = engine_values.get(name)
            # None is a value only as a listed choice (vLLM's default, e.g. quantization: null).
            if name not in engine_values or not param.contains(value):
                continue
            fixed[_optuna_name(name, param)] = int(math.log2(int(value))) if param.type == "pow2" else value
        return fixed

    def clamps(self, values: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """The parameters whose value in `values` (the baseline's) the space cannot propose:
        name -> (that value, what a move from it starts from: the nearest bound, or None when
        the parameter is left to the sampler). A move then changes these knobs too."""
        found: dict[str, tuple[Any, Any]] = {}
        for name, param in self.params.items():
            if name in values and values[name] is not None and not param.contains(values[name]):
                found[name] = (values[name], param.clamp(values[name]))
        return found

    def describe_clamps(self, values: Mapping[str, Any]) -> list[str]:
        """One line per clamped knob (`clamps`), for the live line and the report."""
        lines = []
        for name, (value, clamped) in self.clamps(values).items():
            to = (f"first moves start from it clamped to {clamped}" if clamped is not None
                  else "first moves leave it to the sampler")
            lines.append(f"{name}: the baseline's {value} is outside the space ({self.params[name].describe()}, "
                         f"{self.source}); {to}, so each also changes {name}")
        return lines

    def broken_relations(self, values: Mapping[str, Any]) -> list[str]:
        """The texts of the relations `values` breaks (unknown operands do not count; an unset
        parallel size is vLLM's 1, `host_gpus` this host's count)."""
        context = self._context(values, self.relations)
        return [relation.text for relation in self.relations if relation.check(context) is False]

    def fits_host(self, values: Mapping[str, Any]) -> bool:
        """Whether `values` keep every relation against `host_gpus` (the topology fits the
        host); a config that breaks one could not start, so the sampler never proposes it."""
        host = [relation for relation in self.relations if HOST_GPUS in relation.names()]
        context = self._context(values, host)
        return not any(relation.check(context) is False for relation in host)

    def _context(self, values: Mapping[str, Any], relations: list[Relation]) -> dict[str, Any]:
        """What `relations` read: `values`, unset parallel sizes at 1, and `host_gpus` (counted
        only when one of them names it)."""
        context = with_parallel_defaults(values)
        if any(HOST_GPUS in relation.names() for relation in relations):
            context[HOST_GPUS] = host_devices(self.host_gpus)
        return context

    def describe(self) -> dict[str, str]:
        return {name: param.describe() for name, param in self.params.items()}

    def fingerprint(self) -> dict[str, Any]:
        """A JSON-able form stored with the study, so --resume can refuse a changed space."""
        return {
            "params": {name: param.model_dump(exclude_none=True) for name, param in self.params.items()},
            "relations": [relation.text for relation in self.relations],
        }


def _optuna_name(name: str, param: ParamSpec) -> str:
    """The Optuna parameter that holds `name`: a power of two's exponent has its own name."""
    return POW2_PREFIX + name if param.type == "pow2" else name


def _engine_value(param: ParamSpec, raw: Any) -> Any:
    """The engine value of an Optuna parameter's value: 2**exponent for a power of two, a
    stepped float without its float noise, anything else as it is."""
    if param.type == "pow2":
        return 2 ** int(raw)
    if param.type == "float":
        return _on_step(float(raw), param)
    return raw


def _on_step(value: float, param: ParamSpec) -> float:
    """`value` without the float noise of Optuna's low + k * step (0.15000000000000002), which
    would reach the config file and the report; 10 decimals outlast any step a space uses."""
    return round(value, 10) if param.step else value


def _whole_from_one(param: ParamSpec) -> bool:
    """Whether every value `param` can propose is a whole number >= 1."""
    if param.type == "categorical":
        return all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in param.choices or [])
    return param.type in ("int", "pow2") and (param.low or 0) >= 1


def _is_pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0
