"""Knobs that change the model's numerics: opt-in with `autotune run --allow fp8`.

The scheduler knobs leave every output token as it was; these do not. `quantization: fp8`
(weights quantized to FP8 at load, dynamic per-tensor scales) and `kv_cache_dtype: fp8` (the
KV cache stored in FP8) are vLLM engine arguments of those names. On an H200 (Llama-3.1-8B
shape, Azure conversation traffic) fp8 weights carried 1.41x vLLM's defaults, and fp8 with a
1024-token chunk budget 1.77x: the largest lever measured on a big GPU (issue 58). They
change what the model answers, so they are never searched unless asked for, and a config
that uses one says so wherever it is shown (`NUMERICS_NOTE`), beside the best config
without them, validated in the same gate.

FP8 needs hardware support: NVIDIA compute capability 8.9 or newer (Ada, Hopper,
Blackwell); `check_supported` refuses anything else before any engine starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autotune.errors import AutotuneError
from autotune.search.space import ParamSpec, SearchSpace

ALLOW_CHOICES = ("fp8",)
# The engine arguments that change numerics, and vLLM's value that leaves them as they are.
NUMERICS_KNOBS: dict[str, Any] = {"quantization": None, "kv_cache_dtype": "auto"}
NUMERICS_NOTE = "changes numerics: check output quality before deploying"
FP8_MIN_CAPABILITY = (8, 9)


def device_capability() -> tuple[int, int] | None:
    """The first GPU's compute capability as vLLM's platform reads it (NVML on CUDA, so the
    tuner holds no CUDA context and none of the memory the trials' engines need), or None
    where vLLM cannot tell."""
    try:
        from vllm.platforms import current_platform

        capability = current_platform.get_device_capability()
    except Exception:  # noqa: BLE001 - an unreadable device is refused by the caller, in one line
        return None
    return None if capability is None else (int(capability.major), int(capability.minor))


def check_supported(
    allow: Sequence[str],
    accelerator: str,
    capability: Callable[[], tuple[int, int] | None] = device_capability,
) -> None:
    """Refuse `--allow fp8` (AutotuneError, one line) on a CPU or a GPU older than compute
    capability 8.9; nothing to check without it. `capability` is asked only on a GPU."""
    if "fp8" in allow:
        check_fp8_hardware("--allow fp8", "drop --allow fp8", accelerator, capability)


def check_fp8_hardware(
    what: str,
    fix: str,
    accelerator: str,
    capability: Callable[[], tuple[int, int] | None] = device_capability,
) -> None:
    """Refuse FP8 (`what`: where the user asked for it, e.g. "--allow fp8" or "--space s.yaml:
    quantization fp8"; `fix`: what to change) in one line on a CPU or a GPU older than compute
    capability 8.9 (FP8_MIN_CAPABILITY): vLLM would fail at load, after seconds to minutes."""
    need = f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}"
    if accelerator != "gpu":
        raise AutotuneError(
            f"{what}: FP8 needs a GPU of compute capability {need} or newer (Ada, Hopper, "
            f"Blackwell); vLLM runs on the CPU here; {fix}"
        )
    found = capability()
    if found is None:
        raise AutotuneError(
            f"{what}: cannot read this GPU's compute capability (vLLM's platform); FP8 "
            f"needs {need} or newer; {fix}"
        )
    if found < FP8_MIN_CAPABILITY:
        raise AutotuneError(
            f"{what}: this GPU has compute capability {found[0]}.{found[1]}; FP8 needs "
            f"{need} or newer (Ada, Hopper, Blackwell); {fix}"
        )


def is_fp8(value: Any) -> bool:
    """vLLM's FP8 spellings: quantization `fp8`, kv_cache_dtype `fp8`, `fp8_e4m3`, `fp8_e5m2`."""
    return isinstance(value, str) and value.lower().startswith("fp8")


def check_fp8_config(
    where: str,
    engine: Mapping[str, Any],
    accelerator: str,
    capability: Callable[[], tuple[int, int] | None] = device_capability,
) -> None:
    """Refuse a config file (`where`, e.g. "--baseline deployed.yaml") whose engine arguments
    set a numerics knob to FP8, where the hardware has none: the rule of `--allow fp8`, in one
    line naming the file, the knob and the fix (AutotuneError)."""
    for name in NUMERICS_KNOBS:
        if is_fp8(engine.get(name)):
            check_fp8_hardware(f"{where}: {name}: {engine[name]}", f"remove {name} from {where}",
                               accelerator, capability)


def check_fp8_space(
    space: SearchSpace,
    accelerator: str,
    capability: Callable[[], tuple[int, int] | None] = device_capability,
) -> None:
    """Refuse a space (a --space file) whose choices for a numerics knob hold FP8, where the
    hardware has none (AutotuneError, one line naming the file and the knob)."""
    for name in NUMERICS_KNOBS:
        param = space.params.get(name)
        if param is not None and any(is_fp8(choice) for choice in param.choices or []):
            check_fp8_hardware(f"--space {space.source}: {name} may be fp8",
                               f"take fp8 out of {name}'s choices", accelerator, capability)


def check_allowed_in_space(allow: Sequence[str], space: SearchSpace) -> None:
    """AutotuneError (one line) where `--allow fp8` is given but the space leaves fp8 out of
    every numerics knob: a space file's parameters are kept as written, so one with
    `quantization: {type: categorical, choices: [null]}`, or one that maps both knobs to null
    (stop varying them), would make the opt-in do nothing."""
    if "fp8" not in allow:
        return
    if not any(is_fp8(choice) for name in NUMERICS_KNOBS if name in space.params
               for choice in space.params[name].choices or []):
        raise AutotuneError(f"--allow fp8: the space ({space.source}) leaves fp8 out of "
                            f"{' and '.join(NUMERICS_KNOBS)}; add fp8 to their choices there or drop --allow fp8")


def numerics_params(allow: Sequence[str], baseline: Mapping[str, Any]) -> dict[str, ParamSpec]:
    """The parameters `--allow` adds to the space: for fp8, `quantization` and
    `kv_cache_dtype`, each between the baseline's value (None: vLLM's default, which a config
    file then leaves out) and "fp8". Empty without `--allow`."""
    if "fp8" not in allow:
        return {}
    return {name: ParamSpec(type="categorical", choices=list(dict.fromkeys([baseline.get(name), "fp8"])))
            for name in NUMERICS_KNOBS}


def numerics_changes(values: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, Any]:
    """The numerics knobs whose value in `values` differs from the baseline's (a value left
    unset, None, is vLLM's default): name -> value. Empty: the config computes what the
    baseline computes."""
    def value(source: Mapping[str, Any], name: str) -> Any:
        found = source.get(name)
        return NUMERICS_KNOBS[name] if found is None else found

    return {name: value(values, name) for name in NUMERICS_KNOBS
            if value(values, name) != value(baseline, name)}


def describe_changes(changes: Mapping[str, Any]) -> str:
    """"changes numerics: check output quality before deploying (quantization=fp8)"; "" for none."""
    if not changes:
        return ""
    return f"{NUMERICS_NOTE} ({', '.join(f'{k}={v}' for k, v in changes.items())})"


def numerics_record(
    winner_changes: Mapping[str, Any],
    stats: Sequence[Any],
    winner: str,
    overrides_of: Callable[[str], dict[str, Any] | None],
    rank_key: Callable[[float], float],
) -> dict[str, Any] | None:
    """best.yaml's and the report's `numerics` entry when the emitted config changes numerics
    (`winner_changes`), else None: the note, the changes, and the best config of the gate
    (`stats`: the gate's CandidateStats) whose values compute what the baseline computes
    (`overrides_of(label)`: a candidate's overrides, None for one that changes numerics),
    every SLO in every repeat preferred; the baseline where no searched one is."""
    if not winner_changes:
        return None
    free = [s for s in stats if s.candidate != winner and overrides_of(s.candidate) is not None]
    free.sort(key=lambda s: (not s.eligible, rank_key(s.median)))
    base = next((s.median for s in stats if s.candidate == "baseline"), None)
    alternative = None
    if free:
        best = free[0]
        alternative = {
            "candidate": best.candidate,
            # None is vLLM's default, which the config file leaves out: not a change to show.
            "overrides": {k: v for k, v in (overrides_of(best.candidate) or {}).items() if v is not None},
            "median": best.median,
            "vs_baseline": (best.median - base) / base if base else None,
            "eligible": best.eligible,
            "why_not": best.why_not,
        }
    return {"note": NUMERICS_NOTE, "changes": dict(winner_changes), "numerics_free": alternative}
