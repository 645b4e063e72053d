"""Which server runs the trials: ours (`python -m server`) or stock `vllm serve`.

Users whose deployment is `vllm serve` want the configs measured on `vllm serve`, with its
front end (and its `--api-server-count`), not on our FastAPI app. Both read the same
`vllm serve --config` YAML (server.config), so a study's best.yaml is the same file either
way; what differs is the command, the file each one is given and what it may be asked:

- ours: `python -m server --config config.yaml --port P --benchmark-mode [--api-processes N]`
  (the trial's config.yaml as written, our serving settings inside; `--api-server-count N`
  becomes our `serving.api_processes: N`, in the trial's config.yaml and so in best.yaml, and
  is also passed on the command line so that server.log shows it);
- vLLM's: `python -m server.vllm_serve serve --config vllm-serve.yaml --port P --host H
  [--api-server-count N]`, which is vLLM's own CLI run unchanged with our lifeline around it
  (server.vllm_serve says why). The file holds engine arguments only: host and port come on
  the command line, and our `vllm_autotune` section (our server's settings, provenance) is
  left out, since `vllm serve` would only hand it to platform plugins. The one setting of
  ours `vllm serve` has is the front-end count: a config's `serving.api_processes` (a
  searched one, or the baseline's) is passed as `--api-server-count`, unless the flag fixes
  the count for the whole study.

Stock vLLM accepts what the replayer sends (token-id prompts, `ignore_eos` / `min_tokens`,
`stream_options.include_usage`, `return_token_ids`) on any request, so it needs no
benchmark-mode switch.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from autotune.errors import AutotuneError
from server.config import ConfigError, ServerConfig, ServingSettings, validated

ServerKind = Literal["autotune", "vllm"]
SERVER_CHOICES: tuple[ServerKind, ...] = ("autotune", "vllm")
# The module our wrapper runs: where `vllm serve` lives in vLLM 0.8 and later (0.24, 0.32).
VLLM_CLI_MODULE = "vllm.entrypoints.cli.serve"
VLLM_SERVE_CONFIG = "vllm-serve.yaml"  # beside the trial's config.yaml
# Our serving settings `vllm serve` has too (as --api-server-count), or does not need.
VLLM_SERVE_HAS = frozenset({"benchmark_mode", "api_processes"})


class TrialServer(BaseModel):
    """The server every trial of a study is measured on (stored in the study's plan)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: ServerKind = "autotune"
    # Front-end processes sharing one engine core: `vllm serve --api-server-count`, or our
    # server's `--api-processes` (None: vLLM's default, one without data parallelism; ours:
    # the config's serving.api_processes).
    api_server_count: int | None = Field(default=None, ge=1)

    @property
    def is_vllm(self) -> bool:
        return self.kind == "vllm"

    def describe(self, config: ServerConfig | None = None) -> str:
        """One line for logs, outcome.json and the report (of one trial: with its `config`)."""
        if not self.is_vllm:
            count = f" --api-processes {self.api_server_count}" if self.api_server_count else ""
            return f"python -m server{count} (vllm-autotune's server)"
        front_ends = self.front_ends(config)
        count = f" --api-server-count {front_ends}" if front_ends else ""
        return f"vllm serve{count} (stock vLLM)"

    def command(self, python: str) -> list[str]:
        """What the launcher starts; it appends `--config FILE --port P` and `extra_args`."""
        if self.is_vllm:
            return [python, "-m", "server.vllm_serve", "serve"]
        return [python, "-m", "server"]

    def extra_args(self, host: str, config: ServerConfig | None = None) -> list[str]:
        """The arguments after `--config FILE --port P` for a trial of `config`."""
        if not self.is_vllm:
            args = ["--benchmark-mode"]  # lets the replayer force output lengths
            if self.api_server_count is not None:
                args += ["--api-processes", str(self.api_server_count)]
            return args
        args = ["--host", host]
        count = self.front_ends(config)
        if count is not None:
            args += ["--api-server-count", str(count)]
        return args

    def front_ends(self, config: ServerConfig | None) -> int | None:
        """`vllm serve`'s `--api-server-count` for `config`: the flag's, else the config's
        `serving.api_processes` where it is not the default of one (None: vLLM's default)."""
        if self.api_server_count is not None:
            return self.api_server_count
        if config is not None and config.serving.api_processes != ServingSettings().api_processes:
            return config.serving.api_processes
        return None

    def served(self, config: ServerConfig) -> ServerConfig:
        """`config` as this server runs it: ours with `serving.api_processes` set from
        `--api-server-count` (so that a trial's config.yaml, and best.yaml, reproduce it).

        Raises ConfigError where the serving settings refuse the count (the recorder)."""
        if self.is_vllm or self.api_server_count is None:
            return config
        data = {**config.serving.model_dump(), "api_processes": self.api_server_count}
        serving = validated(ServingSettings, data, "--api-server-count", "serving", None)
        return config.model_copy(update={"serving": serving})

    def write_config(self, config: ServerConfig, trial_dir: Path) -> Path:
        """Write the file this server is started with; return its path.

        The trial's config.yaml (our format, what best.yaml is made from) is written by the
        runner for both servers; `vllm serve` gets a file of engine arguments beside it.
        """
        path = trial_dir / "config.yaml"
        if self.is_vllm:
            path = trial_dir / VLLM_SERVE_CONFIG
            config.write_vllm_serve(path)
        return path

    def check(self, configs: Iterable[tuple[str, ServerConfig]]) -> None:
        """Refuse, in one line, what this server cannot run (AutotuneError: exit 2)."""
        if not self.is_vllm:
            for label, config in configs:
                try:
                    self.served(config)
                except ConfigError as error:
                    raise AutotuneError(
                        f"--api-server-count {self.api_server_count}: {label}: {error.reason}"
                    ) from None
            return
        if not _importable(VLLM_CLI_MODULE):
            raise AutotuneError(
                f"--server vllm: vLLM's `vllm serve` entry point ({VLLM_CLI_MODULE}) is not "
                "installed in this Python; install vLLM here, or use --server autotune"
            )
        for label, config in configs:
            ours = our_server_settings(config)
            if ours:
                raise AutotuneError(
                    f"--server vllm: {label} sets our server's own "
                    f"{', '.join(ours)} (additional-config.vllm_autotune.serving), which "
                    "`vllm serve` does not have; remove it, or use --server autotune"
                )


def _importable(module: str) -> bool:
    """Whether `module` (a dotted name) is installed, looked up as a file under its top-level
    package's folder: find_spec of a submodule imports its packages (vLLM's: seconds)."""
    head, _, rest = module.partition(".")
    try:
        spec = importlib.util.find_spec(head)
    except (ImportError, ValueError):
        return False
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        base = Path(folder, *rest.split(".")) if rest else Path(folder)
        if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
            return True
    return False


def our_server_settings(config: ServerConfig) -> list[str]:
    """The serving settings `config` changes from their defaults that `vllm serve` lacks.

    `benchmark_mode` does not count: the tuner turns it on for its own trials anyway, and
    stock vLLM always accepts what it allows; nor does `api_processes`, which is
    `--api-server-count` there."""
    defaults = ServingSettings()
    changed = []
    for name in ServingSettings.model_fields:
        if name in VLLM_SERVE_HAS:
            continue
        if getattr(config.serving, name) != getattr(defaults, name):
            changed.append(name)
    return changed


def trial_server(
    kind: str | None, api_server_count: int | None, *, default: ServerKind = "autotune"
) -> TrialServer:
    """The flags as a TrialServer; AutotuneError for a count below 1."""
    if api_server_count is not None and api_server_count < 1:
        raise AutotuneError(f"--api-server-count {api_server_count}: must be at least 1")
    chosen: ServerKind = default if kind is None else kind  # type: ignore[assignment]
    server = TrialServer(kind=chosen, api_server_count=api_server_count)
    server.check(())  # flag-level refusals now, before any trace is read
    return server


def deployed_server(provenance: dict[str, Any] | None) -> ServerKind:
    """The server a deployed best.yaml's trials ran on (retune keeps measuring on it)."""
    stored = (provenance or {}).get("trial_server") or {}
    kind = stored.get("kind") if isinstance(stored, dict) else None
    return kind if kind in SERVER_CHOICES else "autotune"


def labelled(
    baseline: ServerConfig, comparisons: dict[str, ServerConfig], baseline_source: str
) -> Sequence[tuple[str, ServerConfig]]:
    """Every config a study will launch as written by the user, named for `check`'s message."""
    return [(f"the baseline ({baseline_source})", baseline), *comparisons.items()]
