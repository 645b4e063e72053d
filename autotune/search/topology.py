"""Topology on a multi-GPU host: one engine split across GPUs (tensor parallelism) or one replica
per GPU (data parallelism, vLLM's `data_parallel_size` behind one API server), and the rule
that every proposed topology fits the host.

One engine of a config holds `tensor_parallel_size x pipeline_parallel_size x
data_parallel_size` GPUs (vLLM's default for each is 1). A space that searches any of them
holds `TOPOLOGY_RELATION`, written in the relation grammar (autotune.search.relations) against
`host_gpus`, the GPUs this host gives the engines (autotune.measure.gpus.count_gpus, at least 1:
on a host without GPUs the engine's one device is the CPU). A space file may name `host_gpus`
in its own relations too (`tensor_parallel_size * data_parallel_size <= host_gpus`). Relations
against `host_gpus` are the host's: the sampler never proposes a config that breaks one
(autotune.search.sampler), since such a config cannot even start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autotune.errors import AutotuneError
from autotune.measure.gpus import VISIBLE_ENV

PARALLEL_SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
HOST_GPUS = "host_gpus"
TOPOLOGY_RELATION = "tensor_parallel_size * pipeline_parallel_size * data_parallel_size <= host_gpus"


def host_devices(gpus: int) -> int:
    """The `host_gpus` a relation reads: the GPUs counted, at least one (the CPU's engine)."""
    return max(int(gpus), 1)


def with_parallel_defaults(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` (engine argument -> value, None: unknown) with each parallel size vLLM's
    default of 1 where it is unset, so that a product of them is known for every config."""
    known = {name: value for name, value in values.items() if value is not None}
    return {**dict.fromkeys(PARALLEL_SIZES, 1), **known}


def engine_gpus(values: Mapping[str, Any]) -> int:
    """GPUs one engine of a config with `values` holds (TP x PP x DP, unset ones 1)."""
    sizes = with_parallel_defaults({name: values.get(name) for name in PARALLEL_SIZES})
    devices = 1
    for name in PARALLEL_SIZES:
        devices *= max(1, int(sizes[name]))
    return devices


def check_fits(source: str, least: Mapping[str, int], searched: Mapping[str, str], gpus: int) -> None:
    """AutotuneError (one line) when even the smallest topology a space proposes holds more
    GPUs than the host has. `least`: each parallel size's smallest value in the space (or the
    baseline's, for one not searched); `searched`: the searched sizes -> their ranges as
    described; `gpus`: counted on this host."""
    if not searched:
        return
    devices = host_devices(gpus)
    smallest = engine_gpus(least)
    if smallest <= devices:
        return
    # Name the searched size whose smallest value asks the most: the one to lower first.
    name = max(searched, key=lambda n: (least.get(n, 1), n))
    product = " x ".join(f"{n} {least.get(n, 1)}" for n in PARALLEL_SIZES)
    raise AutotuneError(
        f"{source}: field 'params.{name}' = {searched[name]}: no topology fits this host's "
        f"{gpus} GPU{'' if gpus == 1 else 's'} (counted from {VISIBLE_ENV} or nvidia-smi -L): the "
        f"smallest one the space proposes ({product}) holds {smallest}; lower its 'low' or drop it"
    )
