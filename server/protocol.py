"""Request and response shapes of the HTTP API, and the checks that need no engine."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from workloads.errors import VllmAutotuneError

# ISO 639-1 codes the /translate prompt templates know, with the names the prompt uses.
LANGUAGES: dict[str, str] = {
    "en": "English",
    "de": "German",
    "fr": "French",
    "es": "Spanish",
    "it": "Italian",
    "pt": "Portuguese",
    "nl": "Dutch",
    "pl": "Polish",
    "ru": "Russian",
    "uk": "Ukrainian",
    "zh": "Chinese",
    "ja": "Japanese",
    "ko": "Korean",
    "ar": "Arabic",
    "tr": "Turkish",
}


class RequestError(VllmAutotuneError):
    """A request the client must change: answered 4xx as {"error": {"message", "field"}}."""

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        status: int = 400,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.status = status
        self.headers = headers


class ErrorBody(BaseModel):
    message: str
    field: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TranslateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: StrictStr
    source_lang: StrictStr
    target_lang: StrictStr


class TranslateResponse(BaseModel):
    translation: str
    source_lang: str
    target_lang: str
    usage: Usage


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class CompletionRequest(BaseModel):
    """The subset of OpenAI's /v1/completions that load-test clients send.

    Unknown fields are refused (400 naming them) rather than silently ignored: a client that
    sends `n: 4` or `echo: true` would otherwise measure something other than it asked for.
    """

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr | list[StrictInt]
    max_tokens: StrictInt = Field(default=16, ge=1)
    # Strict: numbers only (ints too); a bool or a numeric string is refused, not coerced.
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    repetition_penalty: StrictFloat = Field(default=1.0, gt=0.0)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    logprobs: None = None
    user: StrictStr | None = None
    # vLLM's switch for `token_ids` in each streamed chunk; ours always sends them, so it is
    # accepted (either value) and changes nothing: one request body fits both servers.
    return_token_ids: StrictBool | None = None
    # Benchmark mode only (exact output lengths for load tests):
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(default=0, ge=0)


BENCHMARK_ONLY_FIELDS = ("ignore_eos", "min_tokens")


def check_benchmark_fields(request: CompletionRequest, *, benchmark_mode: bool) -> None:
    """Outside benchmark mode a request may not force its output length."""
    if benchmark_mode:
        return
    for name in BENCHMARK_ONLY_FIELDS:
        if getattr(request, name):  # false / 0 are the defaults and change nothing
            raise RequestError(
                f"'{name}' is only accepted when the server runs with --benchmark-mode",
                field=name,
            )


def check_token_ids(ids: list[int], *, vocab_size: int, field: str = "prompt") -> None:
    if not ids:
        raise RequestError("the prompt is empty", field=field)
    for position, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise RequestError(
                f"token id {token} at position {position} is outside the vocabulary "
                f"(0..{vocab_size - 1})",
                field=field,
            )


def check_context(prompt_tokens: int, max_tokens: int, *, max_model_len: int, field: str) -> None:
    if prompt_tokens + max_tokens > max_model_len:
        raise RequestError(
            f"{prompt_tokens} prompt tokens + max_tokens {max_tokens} exceed the model's "
            f"context of {max_model_len} tokens",
            field=field,
        )


def check_translate(request: TranslateRequest, *, max_input_chars: int) -> None:
    if not request.text.strip():
        raise RequestError("text is empty", field="text")
    if len(request.text) > max_input_chars:
        raise RequestError(
            f"text has {len(request.text)} characters; at most {max_input_chars} are accepted",
            field="text",
            status=413,
        )
    for name in ("source_lang", "target_lang"):
        code = getattr(request, name)
        if code not in LANGUAGES:
            raise RequestError(
                f"unknown language code {code!r}; supported: {', '.join(sorted(LANGUAGES))}",
                field=name,
            )
    if request.source_lang == request.target_lang:
        raise RequestError("source_lang and target_lang are the same", field="target_lang")


def translation_prompt(text: str, source_lang: str, target_lang: str) -> str:
    """The prompt for one language pair (completion style: the model continues the last line)."""
    source, target = LANGUAGES[source_lang], LANGUAGES[target_lang]
    return (
        f"Translate the following text from {source} to {target}. "
        f"Answer with the {target} translation only.\n"
        f"{source}: {text.strip()}\n"
        f"{target}:"
    )


def translation_max_tokens(text_tokens: int) -> int:
    """Output budget from the input length: translations run up to ~1.5x the source's tokens
    (more for languages the tokenizer splits finely), plus room for short inputs."""
    return int(text_tokens * 1.5) + 16


def error_body(message: str, field: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorBody(message=message, field=field)).model_dump()
