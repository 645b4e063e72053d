"""Request checks that are our own logic and need no engine.

The benchmark-only fields are checked here rather than over HTTP: the session's server runs in
benchmark mode (the load tests need exact output lengths), and a second engine only to see a
400 would add ~30 s of start-up to every CI run. The HTTP path that calls this check is the
same for both modes (server/app.py: Handlers.completions).
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from server.protocol import (
    LANGUAGES,
    CompletionRequest,
    RequestError,
    TranslateRequest,
    check_benchmark_fields,
    check_translate,
    translation_prompt,
)


@pytest.mark.parametrize(("field", "value"), [("ignore_eos", True), ("min_tokens", 5)])
def test_benchmark_only_fields_are_refused_outside_benchmark_mode(
    field: str, value: object
) -> None:
    request = CompletionRequest(prompt=[1, 2, 3], max_tokens=8, **{field: value})
    with pytest.raises(RequestError) as caught:
        check_benchmark_fields(request, benchmark_mode=False)
    assert caught.value.status == 400
    assert caught.value.field == field
    assert field in caught.value.message
    check_benchmark_fields(request, benchmark_mode=True)  # accepted there


def test_default_values_of_benchmark_fields_are_accepted_anywhere() -> None:
    request = CompletionRequest(prompt=[1], ignore_eos=False, min_tokens=0)
    check_benchmark_fields(request, benchmark_mode=False)


def test_every_language_pair_gets_a_prompt_naming_both_languages() -> None:
    for source in LANGUAGES:
        for target in LANGUAGES:
            if source == target:
                continue
            check_translate(
                TranslateRequest(text="x", source_lang=source, target_lang=target),
                max_input_chars=10,
            )
            prompt = translation_prompt("Hallo Welt", source, target)
            assert LANGUAGES[source] in prompt and LANGUAGES[target] in prompt
            assert prompt.endswith(f"{LANGUAGES[target]}:")


def test_same_source_and_target_language_is_refused() -> None:
    with pytest.raises(RequestError) as caught:
        check_translate(
            TranslateRequest(text="Hallo", source_lang="de", target_lang="de"), max_input_chars=100
        )
    assert caught.value.field == "target_lang"


@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty"])
@pytest.mark.parametrize("value", [False, True, "0.5"])
def test_sampling_numbers_are_not_coerced_from_bools_or_strings(field: str, value: object) -> None:
    # Found by the OpenAPI fuzz (test_openapi_fuzz.py): `"temperature": false` was read as 0.0.
    with pytest.raises(ValidationError, match=field):
        CompletionRequest(prompt=[1], **{field: value})
    assert getattr(CompletionRequest(prompt=[1], **{field: 1}), field) == 1.0  # ints are numbers
