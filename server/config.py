"""The server's configuration file: a `vllm serve --config` YAML file with our settings inside.

Layout (what `ServerConfig.write` produces and `ServerConfig.load` reads):

    # comment header: human-readable provenance
    model: /path/to/model           # top level: vLLM engine arguments (AsyncEngineArgs fields),
    max-num-seqs: 64                #   kebab-case on write, either spelling on read
    host: 127.0.0.1                 # host, port, api-key: `vllm serve` knows them too
    port: 8000
    additional-config:              # vLLM passes this dict to platform plugins and otherwise
      vllm_autotune:                #   ignores it, so the file works unchanged with vLLM
        serving: {benchmark_mode: false, max_waiting_requests: null, ...}
        provenance: {...}

vLLM's loader (`FlexibleArgumentParser.load_config_file`) turns every top-level key into
`--key value`, so an unknown top-level key would break `vllm serve --config`: every key is
checked here against `vllm serve`'s own parser (server.vllm_facts.serve_options) before anything
runs. Its API-server options (log level, chat template, tool calls ...) are kept apart from the
engine arguments (`ServerConfig.api_server`) and written back, as a deployed file has them.

One module over ~400 lines because the file format has one owner: the engine-argument
checks, the type messages and the negated flags all serve `ServerConfig.load`/`write`;
split, one format would be spread over several files.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from server.vllm_facts import (
    EngineArgFacts,
    FactsCache,
    ServeOption,
    decode_annotation,
    vllm_annotation,
)
from workloads.errors import VllmAutotuneError
from workloads.files import write_text_atomic

if TYPE_CHECKING:  # importing vLLM takes seconds; only the functions that need it do
    from vllm.engine.arg_utils import AsyncEngineArgs

# Keys of the file that are not engine arguments (snake_case spelling).
SERVER_KEYS = ("host", "port", "api_key")
ADDITIONAL_CONFIG = "additional_config"
OUR_SECTION = "vllm_autotune"  # key inside additional-config
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "models" / "tiny-multilingual"
# The embedded model's context as served (its config allows 32768; short keeps the KV cache small).
DEFAULT_MAX_MODEL_LEN = 2048
# On CPU: the embedded model's share of the NUMA node's RAM, and the least it may get in GiB.
# The engine-core process (the model worker runs inside it) held 0.68-0.73 GiB besides its KV
# cache; 1.5 GiB leaves a KV cache of ~0.8 GiB (~400,000 tokens of the tiny model).
CPU_MEMORY_SHARE = 0.1
CPU_MEMORY_FLOOR_GIB = 1.5
PROGRAMMATIC = "<config>"  # the `path` of errors about a config built in code
# The one rule for a config file without `model:`, wherever one is read (python -m server
# --config, autotune run --baseline/--compare): said in each command's --help.
NO_MODEL_RULE = (
    "a config without 'model:' serves the embedded tiny model (server/models/tiny-multilingual, "
    "random weights) with its settings under the file's, as python -m server without --config does"
)


class ConfigError(VllmAutotuneError, ValueError):
    """A configuration the user wrote (or passed) that cannot be used.

    `str()` is `"{path}[:{line}]: key '{key}' = {value!r}: {reason}"`, or
    `"{path}[:{line}]: {reason}"` for whole-file problems (unreadable file, YAML syntax).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        key: str | None,
        value: Any,
        reason: str,
        *,
        line: int | None = None,
    ) -> None:
        self.path = str(path)
        self.key = key
        self.value = value
        self.reason = reason
        self.line = line
        where = self.path if line is None else f"{self.path}:{line}"
        if key is None:
            message = f"{where}: {reason}"
        else:
            message = f"{where}: key '{key}' = {value!r}: {reason}"
        super().__init__(message)


class EngineSettingsRefused(ConfigError):
    """vLLM refused a config's engine settings while building its engine config (no engine
    started). `str()` is `"{path}: vLLM rejected the engine settings (k=v, ...): {reason}"`:
    the settings the reason names, and vLLM's whole reason on one line (`vllm_reason`)."""

    def __init__(
        self, path: str | os.PathLike[str], settings: Mapping[str, Any], error: BaseException
    ) -> None:
        self.vllm_reason = vllm_reason(error)
        self.settings = {k: v for k, v in settings.items()
                         if re.search(rf"\b{re.escape(k)}\b", self.vllm_reason)}
        named = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        super().__init__(
            path, None, None,
            f"vLLM rejected the engine settings{f' ({named})' if named else ''}: {self.vllm_reason}",
        )


def vllm_reason(error: BaseException) -> str:
    """vLLM's whole message for a refused setting, on one line. A pydantic error (vLLM's configs
    are pydantic dataclasses) keeps its header and every error's message, not its input echo or
    link: "1 validation error for SchedulerConfig: max_num_batched_tokens (256) must be greater
    than or equal to max_num_seqs (512)."; anything else is its text with the lines joined."""
    if isinstance(error, ValidationError):
        header = str(error).strip().splitlines()[0]
        reasons = [_field_reason(item) for item in error.errors()]
        return f"{header}: {'; '.join(' '.join(r.split()) for r in reasons)}"
    return " ".join(str(error).split()) or type(error).__name__


def _field_reason(item: Mapping[str, Any]) -> str:
    """One pydantic error: "max_num_seqs = -4: Input should be greater than or equal to 1" where
    it is about one field (vLLM's field checks), its message alone where it is about the whole
    config (vLLM's own checks across fields, which name their settings themselves)."""
    message = str(item["msg"]).removeprefix("Value error, ")
    loc = ".".join(str(part) for part in item.get("loc", ()))
    if not loc:
        return message
    return f"{loc} = {item.get('input')!r}: {message}"


def refused_by_vllm(error: BaseException) -> bool:
    """Whether an error raised while vLLM built its engine config is about the values given (a
    pydantic validation error, a ValueError or TypeError of vLLM's), not about the install or the
    host: a missing module, an unreachable or missing download (huggingface_hub's and
    transformers' errors are often ValueErrors too)."""
    if isinstance(error, ImportError | OSError):
        return False
    if type(error).__module__.split(".")[0] in ("huggingface_hub", "transformers", "requests", "httpx"):
        return False
    return isinstance(error, ValueError | TypeError)


def check_model_available(model: str, path: str | os.PathLike[str]) -> None:
    """ConfigError, in one line and at once, for a model vLLM could not load here: a folder
    path that does not exist, or a Hugging Face model that is neither in the local cache nor
    downloadable because the hub cannot be reached (an offline host, where the download would be
    retried for ~30 s before vLLM fails). A hub that answers, a proxy (not probed) or ModelScope
    is left to vLLM."""
    if Path(model).expanduser().is_dir():
        return
    if model.startswith(("/", ".", "~")):
        raise ConfigError(path, "model", model, "no such model folder")
    if os.environ.get("VLLM_USE_MODELSCOPE", "").lower() in ("1", "true"):
        return
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(model, "config.json")
    except ValueError as error:  # huggingface_hub's HFValidationError: not a repository id
        raise ConfigError(path, "model", model, f"neither a model folder nor a Hugging Face model "
                          f"id ({' '.join(str(error).split())})") from None
    if isinstance(cached, str):
        return
    fix = (f"give a local model folder, or download it where the hub is reachable "
           f"(huggingface-cli download {model}) into {constants.HF_HUB_CACHE}")
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(path, "model", model, f"not in the Hugging Face cache and HF_HUB_OFFLINE "
                          f"is set: {fix}")
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return
    endpoint = urlsplit(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname or "", port), timeout=5).close()
    except OSError as error:
        raise ConfigError(path, "model", model, f"not in the Hugging Face cache, and "
                          f"{constants.ENDPOINT} cannot be reached ({error.strerror or error}; an "
                          f"offline host?): {fix}") from None


class RecorderSettings(BaseModel):
    """The traffic recorder (`serving.recorder`): the server writes its own requests as a trace
    (see `server.recorder`). Sizes are bytes; the oldest files go once the total is exceeded."""

    model_config = ConfigDict(extra="forbid")

    directory: str
    """Where the trace files go (created if missing); one directory per server process."""
    max_file_bytes: int = Field(default=16 * 2**20, ge=4096)
    """A file is closed and a new one started before it would grow past this."""
    max_total_bytes: int = Field(default=1 * 2**30, ge=4096)
    """Disk budget for the directory's trace files; the oldest files are deleted beyond it."""
    record_text: bool = False
    """Also keep each /translate text (and /v1/completions text prompt) in a `.text.jsonl` file
    beside each trace file. Off by default: traces hold token counts, never what users wrote."""
    flush_interval_s: float = Field(default=1.0, gt=0, le=60)
    """Buffered records are written at least this often, off the request path."""
    flush_lines: int = Field(default=1000, ge=1)
    """... or as soon as this many are waiting."""

    @model_validator(mode="after")
    def _budget_holds_a_file(self) -> RecorderSettings:
        if self.max_total_bytes < self.max_file_bytes:
            raise ValueError(
                f"max_total_bytes ({self.max_total_bytes}) must be at least max_file_bytes "
                f"({self.max_file_bytes})"
            )
        return self


class ServingSettings(BaseModel):
    """Our server's own settings (not vLLM's): `additional-config.vllm_autotune.serving`."""

    model_config = ConfigDict(extra="forbid")

    benchmark_mode: bool = False
    """Allow `ignore_eos` / `min_tokens` on /v1/completions (exact output lengths for load tests)."""
    max_waiting_requests: int | None = Field(default=None, ge=0)
    """Admission limit: with this many requests already waiting, answer 503 + Retry-After."""
    max_input_chars: int = Field(default=8000, ge=1)
    """Longest /translate text accepted."""
    api_processes: int = Field(default=1, ge=1)
    """Front-end (HTTP) processes sharing one engine core, as `vllm serve --api-server-count`
    (server.frontends). 1: FastAPI and AsyncLLM in one process, one event loop."""
    recorder: RecorderSettings | None = None
    """Record the served traffic as a trace (for `autotune drift` / `autotune retune`).
    One front-end process only: each of several would record only its share of the traffic."""

    @field_validator("recorder")
    @classmethod
    def _recorder_needs_one_process(
        cls, recorder: RecorderSettings | None, info: ValidationInfo
    ) -> RecorderSettings | None:
        processes = info.data.get("api_processes", 1)
        if recorder is not None and processes > 1:
            raise ValueError(
                f"the recorder needs api_processes 1 (got {processes}): each front-end "
                "process would record only its share of the traffic; drop one or the other"
            )
        return recorder


# Our server's settings a search space may vary beside the engine's arguments
# (autotune.search.space): the front-end count matters where one event loop cannot keep up
# with a small model on a GPU (results/benchmarks/frontend_capacity.md).
SEARCHABLE_SERVING_SETTINGS = frozenset({"api_processes"})
# vLLM's default for each parallel size (EngineArgs), known without asking vLLM: a config that
# sets none runs one engine on one device, and a searched topology starts from 1 x 1 x 1.
PARALLEL_DEFAULTS = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1}


def snake(key: str) -> str:
    return key.replace("-", "_")


def kebab(key: str) -> str:
    return key.replace("_", "-")


def check_engine_settings(
    engine: Mapping[str, Any],
    *,
    path: str | os.PathLike[str] = PROGRAMMATIC,
    lines: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Returns `engine` with snake_case keys; ConfigError on an unknown key or a wrong type.

    `lines` maps a key as written to its line in the file, for the error message.
    """
    facts = FactsCache().facts().engine_args
    checked: dict[str, Any] = {}
    written_as: dict[str, str] = {}
    for key, value in engine.items():
        line = (lines or {}).get(key)
        if not isinstance(key, str):
            raise ConfigError(path, str(key), value, "keys must be strings", line=line)
        name = snake(key)
        if name in SERVER_KEYS:
            raise ConfigError(path, key, value, "not an engine argument", line=line)
        if name == ADDITIONAL_CONFIG and isinstance(value, dict) and OUR_SECTION in value:
            raise ConfigError(
                path, key, value, f"'{OUR_SECTION}' is ServerConfig.serving/provenance", line=line
            )
        if name not in facts:
            raise ConfigError(path, key, value, unknown_key_reason(key, value), line=line)
        if name in checked:
            raise ConfigError(
                path, key, value, f"given twice (also as '{written_as[name]}')", line=line
            )
        problem = type_problem(declared_type(name, facts[name], value), value)
        if problem is not None:
            raise ConfigError(path, key, value, problem, line=line)
        checked[name] = value
        written_as[name] = key
    return checked


def unknown_key_reason(key: str, value: Any) -> str:
    """Why `key` is refused, with a "did you mean" only for a near spelling (a typo: 85% alike)
    of an option of the same kind (a switch for true/false, else one that takes a value) that
    does not mean the opposite (`enable-x` is no hint for `disable-x`)."""
    flag = isinstance(value, bool)
    names = sorted(name for name, option in FactsCache().serve_options().items()
                   if option.flag == flag and option.dest not in ("config", "model_tag"))
    close = [name for name in difflib.get_close_matches(kebab(key), names, n=3, cutoff=0.85)
             if _negative(name) == _negative(kebab(key))]
    spelled = snake if "_" in key else kebab
    hint = f"; did you mean '{spelled(close[0])}'?" if close else ""
    return f"not an option of `vllm serve` (an engine argument or an API-server setting of the installed vLLM){hint}"


def _negative(name: str) -> bool:
    """Whether an option's name turns something off (`no-`, `disable-`): two names alike but
    for that mean opposite things (`enable-log-requests`, `disable-log-request`)."""
    return name.startswith(("no-", "disable-"))


def server_option(option: ServeOption | None) -> bool | None:
    """Whether a `vllm serve` option is one of the API server's settings a config file may carry
    (True), an engine argument (False), or none of those: no such option, or `config` itself,
    or host, port and api-key, which ServerConfig holds as fields (None)."""
    if option is None or option.dest in ("config", "model_tag", *SERVER_KEYS):
        return None
    return not option.engine


def declared_type(name: str, facts: EngineArgFacts, value: Any) -> Any:
    """The type vLLM declares for engine argument `name`: from the facts cache, or (a type only
    vLLM can check, given a value) from vLLM itself."""
    if facts.opaque:
        return None if value is None else vllm_annotation(name)
    return None if facts.annotation is None else decode_annotation(facts.annotation)


def type_problem(annotation: Any, value: Any) -> str | None:
    """Checks `value` against the engine argument's annotation where pydantic can.

    Some annotations (torch types, vLLM classes) have no pydantic schema; those values are
    left to vLLM, which checks them when the engine config is created.
    """
    if annotation is None or value is None:
        return None
    try:
        adapter = TypeAdapter(annotation)
    except Exception:  # no schema for this annotation: vLLM checks it later
        return None
    try:
        adapter.validate_python(value)
    except ValidationError as error:
        return "expected " + describe(annotation) + f" ({error.errors()[0]['msg']})"
    except Exception:  # a validator of vLLM's own raised: leave the value to vLLM
        return None
    return None


def describe(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "")


class ServerConfig(BaseModel):
    """Everything `python -m server` needs: engine arguments, address, our serving settings."""

    model_config = ConfigDict(extra="forbid")

    engine: dict[str, Any]
    """AsyncEngineArgs fields, snake_case (either spelling accepted, stored snake_case)."""
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    api_key: str | None = None
    api_server: dict[str, Any] = {}
    """`vllm serve`'s other API-server settings (log level, served model name, chat template,
    tool calls, SSL ...: the options of its parser that are no engine argument), kebab-case as
    `vllm serve --config` takes them. Our server does not apply them; the file keeps them, so
    best.yaml deploys with them under `vllm serve`."""
    serving: ServingSettings = Field(default_factory=ServingSettings)
    provenance: dict[str, Any] | None = None

    @field_validator("engine")
    @classmethod
    def _engine_keys_are_engine_args(cls, engine: dict[str, Any]) -> dict[str, Any]:
        return check_engine_settings(engine)

    @field_validator("provenance")
    @classmethod
    def _provenance_is_json(cls, provenance: dict[str, Any] | None) -> dict[str, Any] | None:
        # vLLM passes additional-config through `json.dumps`; non-JSON values would break it.
        if provenance is not None:
            json.dumps(provenance)
        return provenance

    @classmethod
    def default(cls) -> ServerConfig:
        """The embedded tiny model on the CPU-friendly defaults."""
        return cls(engine=default_engine_settings())

    def with_default_model(self) -> ServerConfig:
        """This config, or without a `model` the embedded one with its settings under this
        config's (NO_MODEL_RULE): never vLLM's own default model, which would be downloaded."""
        if "model" in self.engine:
            return self
        return self.model_copy(update={"engine": {**default_engine_settings(), **self.engine}})

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ServerConfig:
        """Reads a config file; ConfigError (file, line, key, value, reason) on bad input."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as error:
            raise ConfigError(path, None, None, f"cannot read the file: {error.strerror}") from None
        except UnicodeDecodeError as error:
            raise ConfigError(path, None, None, f"not UTF-8 text ({error.reason})") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            line = mark.line + 1 if mark is not None else None
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            raise ConfigError(path, None, None, f"not valid YAML: {problem}", line=line) from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(
                path, None, None, f"expected a mapping of keys to values, got {type(data).__name__}"
            )
        return cls.from_mapping(data, path=path, lines=top_level_lines(text))

    @classmethod
    def from_mapping(
        cls,
        data: Mapping[str, Any],
        *,
        path: str | os.PathLike[str] = PROGRAMMATIC,
        lines: Mapping[str, int] | None = None,
    ) -> ServerConfig:
        """Builds a config from the file's top-level mapping (either key spelling)."""
        lines = lines or {}
        server: dict[str, Any] = {}
        api_server: dict[str, Any] = {}
        engine: dict[str, Any] = {}
        ours: Any = {}
        ours_key = kebab(ADDITIONAL_CONFIG)
        options = FactsCache().serve_options()
        for key, value in data.items():
            name = snake(key) if isinstance(key, str) else key
            if name in SERVER_KEYS:
                if name in server:
                    raise ConfigError(path, key, value, "given twice", line=lines.get(key))
                server[name] = value
            elif isinstance(key, str) and server_option(options.get(kebab(key))):
                if kebab(key) in api_server:
                    raise ConfigError(path, key, value, "given twice", line=lines.get(key))
                api_server[kebab(key)] = value
            elif name == ADDITIONAL_CONFIG:
                if not isinstance(value, dict):
                    raise ConfigError(path, key, value, "expected a mapping", line=lines.get(key))
                rest = dict(value)
                ours = rest.pop(OUR_SECTION, {})
                ours_key = key
                if rest:  # other plugins' settings: they belong to the engine
                    engine[key] = rest
            else:
                engine[key] = value
        engine = resolve_negated_flags(engine, path=path, lines=lines)
        engine = check_engine_settings(engine, path=path, lines=lines)

        section = f"{ours_key}.{OUR_SECTION}"
        line = lines.get(ours_key)
        if not isinstance(ours, dict):
            raise ConfigError(path, section, ours, "expected a mapping", line=line)
        unknown = sorted(set(ours) - {"serving", "provenance"})
        if unknown:
            raise ConfigError(
                path,
                f"{section}.{unknown[0]}",
                ours[unknown[0]],
                "unknown key (expected 'serving' or 'provenance')",
                line=line,
            )
        serving = validated(
            ServingSettings, ours.get("serving") or {}, path, f"{section}.serving", line
        )
        provenance = ours.get("provenance")
        if provenance is not None and not isinstance(provenance, dict):
            raise ConfigError(
                path, f"{section}.provenance", provenance, "expected a mapping", line=line
            )
        fields = {"engine": engine, "api_server": api_server, "serving": serving,
                  "provenance": provenance}
        for name, value in server.items():
            fields[name] = value
        key_of = {snake(k): k for k in data if isinstance(k, str)}
        try:
            return cls(**fields)
        except ValidationError as error:
            first = error.errors()[0]
            name = str(first["loc"][0]) if first["loc"] else "?"
            key = key_of.get(name, name)
            raise ConfigError(
                path, key, first.get("input"), first["msg"], line=lines.get(key)
            ) from None

    def to_mapping(self) -> dict[str, Any]:
        """The file's top-level mapping, in `vllm serve --config` spelling."""
        data: dict[str, Any] = {}
        for name, value in self.engine.items():
            # vLLM's loader writes `--key None` for a null, which argparse then rejects;
            # a null means "vLLM's default", which leaving the key out gives too.
            if value is None or name == ADDITIONAL_CONFIG:
                continue
            if value is False and negatable(name):
                # vLLM's loader drops `key: false` unless the top-level parser knows
                # `--no-key`, which under `vllm serve` it does not; `no-key: true` works.
                data[f"no-{kebab(name)}"] = True
                continue
            data[kebab(name)] = value
        data["host"] = self.host
        data["port"] = self.port
        if self.api_key is not None:
            data["api-key"] = self.api_key
        data.update(self.api_server)
        ours: dict[str, Any] = {"serving": self.serving.model_dump(mode="json")}
        if self.provenance is not None:
            ours["provenance"] = self.provenance
        additional = dict(self.engine.get(ADDITIONAL_CONFIG) or {})
        additional[OUR_SECTION] = ours
        data[kebab(ADDITIONAL_CONFIG)] = additional
        return data

    def vllm_serve_mapping(self) -> dict[str, Any]:
        """Engine arguments only, in `vllm serve --config` spelling: the file a tuner gives
        stock `vllm serve`, which takes host and port on its command line and has no use for
        our section (other plugins' additional-config stays). The API-server settings stay out
        too: a trial measures the engine, on the address and logging the tuner gives it."""
        data = self.to_mapping()
        for name in [*SERVER_KEYS, *self.api_server]:
            data.pop(kebab(name), None)
        additional = dict(data.pop(kebab(ADDITIONAL_CONFIG)))
        additional.pop(OUR_SECTION, None)
        if additional:
            data[kebab(ADDITIONAL_CONFIG)] = additional
        return data

    def write_vllm_serve(self, path: str | os.PathLike[str]) -> None:
        """Writes `vllm_serve_mapping()` as YAML, atomically."""
        text = yaml.safe_dump(self.vllm_serve_mapping(), sort_keys=False, allow_unicode=True)
        write_text_atomic(Path(path), text)

    def write(self, path: str | os.PathLike[str], *, header: str | None = None) -> None:
        """Writes the YAML file atomically; `header` (or the provenance) as a comment on top."""
        path = Path(path)
        if header is None and self.provenance:
            header = "\n".join(
                f"{key}: {json.dumps(value)}" for key, value in self.provenance.items()
            )
        lines = [f"# {line}".rstrip() for line in (header or "").splitlines()]
        body = yaml.safe_dump(self.to_mapping(), sort_keys=False, allow_unicode=True)
        text = "\n".join(lines + [body]) if lines else body
        write_text_atomic(path, text)  # owner-only (0600): a config may hold an API token

    def with_overrides(self, overrides: Mapping[str, Any]) -> ServerConfig:
        """This config with searched values on top: engine arguments into `engine`, our server's
        searchable settings (SEARCHABLE_SERVING_SETTINGS) into `serving`. ConfigError where the
        serving settings refuse a value (e.g. several front ends beside the recorder)."""
        engine = {k: v for k, v in overrides.items() if k not in SEARCHABLE_SERVING_SETTINGS}
        serving = {k: v for k, v in overrides.items() if k in SEARCHABLE_SERVING_SETTINGS}
        update: dict[str, Any] = {"engine": {**self.engine, **engine}}
        if serving:
            update["serving"] = validated(ServingSettings, {**self.serving.model_dump(), **serving},
                                          "the search space", "serving", None)
        return self.model_copy(update=update)

    def searchable_values(self, effective_defaults: Mapping[str, Any]) -> dict[str, Any]:
        """What a search space reads of this config: vLLM's `effective_defaults` (and its
        parallel sizes of 1), the engine arguments it sets on top, and our server's searchable
        settings."""
        engine = {k: v for k, v in self.engine.items() if v is not None}
        serving = {name: getattr(self.serving, name) for name in sorted(SEARCHABLE_SERVING_SETTINGS)}
        return {**PARALLEL_DEFAULTS, **effective_defaults, **engine, **serving}

    def engine_settings(self) -> dict[str, Any]:
        """The engine arguments as given (snake_case), our `vllm_autotune` section left out."""
        engine = dict(self.engine)
        additional = dict(engine.get(ADDITIONAL_CONFIG) or {})
        additional.pop(OUR_SECTION, None)
        if additional:
            engine[ADDITIONAL_CONFIG] = additional
        else:
            engine.pop(ADDITIONAL_CONFIG, None)
        return engine

    def engine_args(self) -> AsyncEngineArgs:
        """The vLLM engine arguments (our `vllm_autotune` section is never part of them)."""
        from vllm.engine.arg_utils import AsyncEngineArgs

        return AsyncEngineArgs(**self.engine_settings())


def negatable(name: str) -> bool:
    """A boolean engine argument whose default is not False (so `false` must be spelled out)."""
    facts = FactsCache().engine_arg(name)
    return facts is not None and facts.negatable


def resolve_negated_flags(
    engine: Mapping[str, Any],
    *,
    path: str | os.PathLike[str],
    lines: Mapping[str, int],
) -> dict[str, Any]:
    """Reads `no-enable-prefix-caching: true` (vLLM's `--no-...` flags) as `enable_prefix_caching: false`."""
    resolved: dict[str, Any] = {}
    for key, value in engine.items():
        name = snake(key) if isinstance(key, str) else key
        flag = name[3:] if isinstance(name, str) and name.startswith("no_") else None
        if flag is None or not negatable(flag):
            resolved[key] = value
            continue
        if not isinstance(value, bool):
            raise ConfigError(path, key, value, "expected true or false", line=lines.get(key))
        if any(snake(other) == flag for other in engine if isinstance(other, str)):
            raise ConfigError(
                path, key, value, f"contradicts '{kebab(flag)}' given too", line=lines.get(key)
            )
        resolved[flag] = not value
    return resolved


def validated(
    model: type[BaseModel], data: Any, path: str | os.PathLike[str], key: str, line: int | None
) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join([key, *(str(part) for part in first["loc"])])
        raise ConfigError(path, where, first.get("input"), first["msg"], line=line) from None


def top_level_lines(text: str) -> dict[str, int]:
    """Line number (1-based) of each top-level key, for error messages."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {
        key.value: key.start_mark.line + 1
        for key, _ in node.value
        if isinstance(key, yaml.ScalarNode)
    }


def default_engine_settings() -> dict[str, Any]:
    """Engine arguments for the embedded tiny model, chosen to work on a CPU-only machine.

    Random (dummy) weights: the output is gibberish but compute and memory use are real.
    """
    settings: dict[str, Any] = {
        "model": str(DEFAULT_MODEL_DIR),
        "load_format": "dummy",
        "dtype": "bfloat16",  # measured: works on vLLM's CPU backend and on GPUs
        "max_model_len": DEFAULT_MAX_MODEL_LEN,
    }
    if FactsCache().device_type() == "cpu":
        # torch.compile at start costs ~20 s on 2 cores; eager mode serves the tiny model fine.
        settings["enforce_eager"] = True
        # On CPU this is the share of the NUMA node's RAM the worker may use, KV cache included
        # (0.9 fails on small hosts). vLLM fills the KV cache at start at ~2.5 s per GiB here:
        # 0.3 of 24 GB took 18 s of a 39 s start, 0.1 took 4 s of 23 s. 0.1 still leaves the
        # tiny model a 1.2 GiB KV cache on a 19 GiB node (the demo's trials peaked at < 0.1% of
        # 0.3's); on a smaller node the share grows to keep CPU_MEMORY_FLOOR_GIB.
        settings["gpu_memory_utilization"] = cpu_memory_share(cpu_node_memory())
    return settings


def cpu_memory_share(node_bytes: int) -> float:
    """The embedded model's `gpu_memory_utilization` on a CPU whose NUMA node has `node_bytes`:
    CPU_MEMORY_SHARE, or on a node too small for that to hold CPU_MEMORY_FLOOR_GIB, the share that
    does (rounded up to hundredths, at most half the node). 0.1 of a 7 GiB node (a fresh VM whose
    memory grows later, or an 8 GB laptop) is less than the process holds before any KV cache,
    and vLLM refused to start with it."""
    needed = CPU_MEMORY_FLOOR_GIB * 2**30 / max(node_bytes, 1)
    if needed <= CPU_MEMORY_SHARE:
        return CPU_MEMORY_SHARE
    return min(0.5, math.ceil(round(needed * 100, 6)) / 100)


def cpu_node_memory() -> int:
    """Bytes of RAM of the NUMA node vLLM's CPU worker sizes its memory from (the node of the
    first CPU this process may run on, as vLLM picks it; the node is cached, its size read now:
    a VM's memory may grow)."""
    node = FactsCache().first_cpu_node(first_allowed_cpu_node)
    meminfo = Path(f"/sys/devices/system/node/node{node}/meminfo")
    try:
        for line in meminfo.read_text(encoding="utf-8").splitlines():
            parts = line.split()  # "Node 0 MemTotal: 97421888 kB", as vLLM reads it
            if len(parts) >= 4 and parts[2] == "MemTotal:":
                return int(parts[3]) * 1024
    except OSError:
        pass
    import psutil  # no per-node figures (not NUMA, or not Linux): the machine's, as vLLM does

    return int(psutil.virtual_memory().total)


def first_allowed_cpu_node() -> int:
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list

    cpus = get_allowed_cpu_list()
    return cpus[0].numa_node if cpus else 0
