"""The vLLM engine behind the server: AsyncLLM in this process, one event loop.

Written against vLLM 0.32 (CPU build, tested) and 0.24 (the GPU kit): only the API the two
share is used (`AsyncLLM.from_vllm_config`, `generate` with a token-id prompt dict, `abort`,
`shutdown`, `SamplingParams` with `RequestOutputKind`).
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from server.config import ServerConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# vLLM renamed metrics between versions; the first name of each pair is the current one.
KV_CACHE_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
TTFT_METRICS = ("vllm:time_to_first_token_seconds",)
ITL_METRICS = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
RUNNING_METRICS = ("vllm:num_requests_running",)
WAITING_METRICS = ("vllm:num_requests_waiting",)

# vLLM's switch between a model worker in a process of its own (1) and one inside the engine
# core's process (0); its CPU platform allows the second only when this reads 0.
WORKER_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# How vLLM starts its engine core (and worker) processes: "fork" (its default) or "spawn".
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
OMP_THREADS_ENV = "OMP_NUM_THREADS"

logger = logging.getLogger(__name__)


class EngineSettings(BaseModel):
    """What the engine actually runs with, defaults resolved (for reports and /info)."""

    vllm_version: str
    usage_context: str
    model: str
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    max_model_len: int
    block_size: int | None
    enforce_eager: bool
    skip_tokenizer_init: bool
    vocab_size: int
    num_kv_cache_blocks: int | None = None
    """Known once the engine has started (the KV cache is sized at start)."""
    executor_backend: str | None = None
    """vLLM's executor: "uni" runs the model worker inside the engine core's process, "mp" in
    processes of its own (see keep_cpu_worker_in_engine_core)."""
    engine_core_start: str | None = None
    """How the engine core's process was started: "fork" or "spawn" (choose_engine_core_start);
    known once the engine has started."""
    torch_threads: int | None = None
    """torch's CPU threads in the server's process as the engine started (a forked engine core
    starts with them): on the CPU platform one fewer than its CPUs (leave_a_cpu_to_the_front_end),
    elsewhere as many, unless OMP_NUM_THREADS says otherwise."""


def usage_context() -> Any:
    from vllm.usage.usage_lib import UsageContext

    # `vllm serve`'s context: its defaults for max_num_seqs / max_num_batched_tokens differ
    # from a bare AsyncLLM's (e.g. 1024 / 8192 vs 128 / 2048 on an H100).
    return UsageContext.OPENAI_API_SERVER


def keep_cpu_worker_in_engine_core() -> bool:
    """On vLLM's CPU platform, runs the model worker inside the engine core's process.

    Left to itself, vLLM's CPU platform starts the worker as a process of its own, and the
    engine core and the worker busy-poll one shared-memory queue: on 2 cores the two held ~1.9
    CPUs between them, and whatever the front end used came out of the worker's share. With the
    worker inside the engine core (AsyncLLM still runs the engine core in its own process) the
    embedded default started in 31-34 s instead of 40-44 s and 32 sequences decoded 742 instead of
    477 tokens/s (benchmarks/worker_layout.py, 2026-11-26, 2-core VM). Call it before vLLM's config is built
    (the platform decides then); a value the caller set for VLLM_ENABLE_V1_MULTIPROCESSING
    wins. Returns whether the worker stays in the engine core.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    os.environ.setdefault(WORKER_PROCESS_ENV, "0")
    inside = os.environ[WORKER_PROCESS_ENV] == "0"
    logger.info("CPU platform: model worker %s", "inside the engine core" if inside else
                "in its own process")
    return inside


def leave_a_cpu_to_the_front_end() -> int | None:
    """On vLLM's CPU platform, gives the engine one torch (OpenMP) thread fewer than the CPUs this
    process may use (at least one), so that the front end, the detokenizer and a load client on
    the same CPUs are not taken from the engine's threads at every parallel region. vLLM's own CPU
    backend reserves a core per rank for its scheduler the same way (vllm/utils/
    ompmultiprocessing.py); it does not apply with the worker inside the engine core
    (keep_cpu_worker_in_engine_core). On the 2-core VM our server served 88.5 req/s with one
    thread against 70.7 with two: the second thread spun, 23.8 against 11.2 ms of engine CPU a
    request (results/benchmarks/serving_overhead_threads.md). Sets
    OMP_NUM_THREADS too, for an engine core that is spawned rather than forked. OMP_NUM_THREADS,
    where the caller set it, wins. Returns the thread count set (None: left as it was)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or os.environ.get(OMP_THREADS_ENV):
        return None
    import torch  # imported with vLLM

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cpus - 1)
    torch.set_num_threads(threads)
    os.environ[OMP_THREADS_ENV] = str(threads)
    logger.info("CPU platform: %d engine thread(s), one CPU left to the front end", threads)
    return threads


def resolve_engine_config(config: ServerConfig) -> VllmConfig:
    """Builds vLLM's full engine config (all defaults resolved) without starting anything.

    Raises whatever vLLM raises for values it rejects (ValueError, pydantic errors ...).
    On vLLM's CPU platform, leaves the process environment as it found it: building the config,
    that platform writes VLLM_WORKER_MULTIPROC_METHOD=spawn into it, which a process that only
    checks a config (the tuner) would pass on to every server it starts. The process that starts
    the engine chooses the method (choose_engine_core_start). Other platforms' writes stand.
    """
    from vllm.platforms import current_platform

    caller_start_method = os.environ.get(START_METHOD_ENV)
    try:
        return config.engine_args().create_engine_config(usage_context=usage_context())
    finally:
        if current_platform.is_cpu():
            if caller_start_method is None:
                os.environ.pop(START_METHOD_ENV, None)
            else:
                os.environ[START_METHOD_ENV] = caller_start_method


def choose_engine_core_start(config: ServerConfig, vllm_config: VllmConfig) -> str:
    """How AsyncLLM will start the engine core's process ("fork" or "spawn"), set in the
    environment vLLM reads; call it in the process that starts the engine, before it starts.

    On vLLM's CPU platform the engine core is forked, not spawned as the platform asks: a spawned
    engine core imports vLLM and torch again, a forked one starts with what this process
    imported. The embedded default was ready in 22-24 s instead of 37-39 s, 32 sequences decoding
    625-660 against 653-689 tokens/s (results/benchmarks/engine_core_fork.log, 2026-11-26, 2-core
    VM). Only where the method starts nothing but the engine core: the model worker inside it and
    one front end (vLLM's multi-API-server path starts processes of its own); elsewhere spawn,
    as vLLM's CPU platform asks. A method the caller set wins. Off the CPU, vLLM decides (fork,
    unless CUDA is initialized).
    """
    from vllm.platforms import current_platform

    caller = os.environ.get(START_METHOD_ENV)
    if caller is not None:
        return caller
    if not current_platform.is_cpu():
        return "fork"
    backend = executor_name(vllm_config.parallel_config.distributed_executor_backend)
    if backend == "uni" and config.serving.api_processes == 1:
        return "fork"  # vLLM's own default, the variable unset
    os.environ[START_METHOD_ENV] = "spawn"
    return "spawn"


def effective_settings(vllm_config: VllmConfig) -> EngineSettings:
    import vllm

    scheduler = vllm_config.scheduler_config
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    return EngineSettings(
        vllm_version=vllm.__version__,
        usage_context=usage_context().name,
        model=str(model.model),
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        gpu_memory_utilization=cache.gpu_memory_utilization,
        max_model_len=model.max_model_len,
        block_size=getattr(cache, "block_size", None),
        enforce_eager=bool(model.enforce_eager),
        skip_tokenizer_init=bool(model.skip_tokenizer_init),
        vocab_size=model.get_vocab_size(),
        num_kv_cache_blocks=getattr(cache, "num_gpu_blocks", None),
        executor_backend=executor_name(vllm_config.parallel_config.distributed_executor_backend),
    )


def executor_name(backend: Any) -> str | None:
    """vLLM's executor setting as text (it may be a class)."""
    if backend is None or isinstance(backend, str):
        return backend
    return getattr(backend, "__name__", str(backend))


@dataclass(frozen=True)
class Generation:
    """What to generate for one request."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    repetition_penalty: float = 1.0
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    min_tokens: int = 0


@dataclass(frozen=True)
class Delta:
    """New output of one request since the previous Delta (or all of it, when not streaming)."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str | None


class Engine:
    """One AsyncLLM and what the server needs to know about it."""

    def __init__(self, llm: Any, vllm_config: VllmConfig, tokenizer: Any | None) -> None:
        self._llm = llm
        self.vllm_config = vllm_config
        self.tokenizer = tokenizer
        self.settings = effective_settings(vllm_config)

    @classmethod
    def start(cls, config: ServerConfig, vllm_config: VllmConfig | None = None) -> Engine:
        """Starts the engine (blocking: tens of seconds). Safe to call from a worker thread.

        AsyncLLM built outside the event loop starts its output handler on the first request
        (vLLM does this on purpose so that start-up can happen before the loop runs).
        """
        try:
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError:  # older layouts
            from vllm.engine.async_llm_engine import AsyncLLMEngine as AsyncLLM

        if vllm_config is None:
            keep_cpu_worker_in_engine_core()
            vllm_config = resolve_engine_config(config)
        choose_engine_core_start(config, vllm_config)
        leave_a_cpu_to_the_front_end()
        import torch  # imported with vLLM

        torch_threads = torch.get_num_threads()
        llm = AsyncLLM.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=usage_context(),
            # Stats on: vLLM's Prometheus metrics (TTFT, KV-cache usage ...) come from them.
            disable_log_stats=False,
        )
        engine = cls.attach(llm, vllm_config)
        # vLLM's own default is fork; where it had to spawn, it wrote that into the variable.
        engine.settings.engine_core_start = os.environ.get(START_METHOD_ENV, "fork")
        engine.settings.torch_threads = torch_threads
        return engine

    @classmethod
    def attach(cls, llm: Any, vllm_config: VllmConfig | None = None) -> Engine:
        """Wraps an engine client started elsewhere (vLLM's `EngineClient`: an AsyncLLM,
        e.g. one front-end process's client of a shared engine core, server.frontends).

        Whoever started it shuts it down; `shutdown()` here is for engines `start` made.
        """
        if vllm_config is None:
            vllm_config = llm.vllm_config
        tokenizer = None
        if not vllm_config.model_config.skip_tokenizer_init:
            tokenizer = llm.get_tokenizer()
        return cls(llm, vllm_config, tokenizer)

    async def finish_start(self) -> None:
        """Resolves what older vLLM versions return as awaitables (their get_tokenizer)."""
        if inspect.isawaitable(self.tokenizer):
            self.tokenizer = await self.tokenizer

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None

    @property
    def errored(self) -> bool:
        return bool(getattr(self._llm, "errored", False))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RuntimeError("this model has no tokenizer")
        return list(self.tokenizer.encode(text))

    async def generate(
        self, prompt_token_ids: list[int], generation: Generation, request_id: str, *, stream: bool
    ) -> AsyncIterator[Delta]:
        """Yields the new tokens as they come (stream) or everything once at the end.

        Cancelling the consumer (client gone) aborts the request inside vLLM: AsyncLLM's
        generate() catches the cancellation and frees the sequence's slot and KV blocks.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=generation.max_tokens,
            temperature=generation.temperature,
            top_p=generation.top_p,
            top_k=generation.top_k if generation.top_k is not None else 0,
            seed=generation.seed,
            repetition_penalty=generation.repetition_penalty,
            stop=list(generation.stop) or None,
            ignore_eos=generation.ignore_eos,
            min_tokens=generation.min_tokens,
            detokenize=self.has_tokenizer,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )
        prompt = {"prompt_token_ids": prompt_token_ids}
        async for output in self._llm.generate(prompt, params, request_id):
            completion = output.outputs[0]
            yield Delta(
                text=completion.text or "",
                token_ids=list(completion.token_ids),
                prompt_tokens=len(output.prompt_token_ids or prompt_token_ids),
                finish_reason=completion.finish_reason if output.finished else None,
            )

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    def shutdown(self) -> None:
        self._llm.shutdown()
