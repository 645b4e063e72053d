"""Synthetic prompts: exact lengths, valid ids, deterministic, real prefix sharing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workloads.errors import WorkloadError
from workloads.prompts import PromptFactory, synthetic_prompt


@given(index=st.integers(0, 10**6), length=st.integers(1, 3000))
def test_exact_length_and_ids_in_range(index: int, length: int) -> None:
    prompt = PromptFactory().prompt(index, length)
    assert len(prompt) == length
    assert all(isinstance(t, int) and 100 <= t < 4000 for t in prompt)


def test_vocab_size_bounds_the_ids() -> None:
    prompt = PromptFactory(vocab_size=120, low=5).prompt(0, 2000)
    assert min(prompt) >= 5 and max(prompt) < 120
    assert len(set(prompt)) > 100  # the whole range is used, not a constant


def test_same_request_same_ids_across_factories_different_requests_differ() -> None:
    assert PromptFactory().prompt(7, 300) == PromptFactory().prompt(7, 300)
    assert synthetic_prompt(7, 300) == PromptFactory().prompt(7, 300)
    assert PromptFactory().prompt(7, 300) != PromptFactory().prompt(8, 300)
    assert PromptFactory(seed=1).prompt(7, 300) != PromptFactory().prompt(7, 300)
    # One request's ids are one stream: changing only its length keeps the head.
    assert PromptFactory().prompt(7, 100) == PromptFactory().prompt(7, 300)[:100]


def test_shared_leading_hash_ids_give_identical_leading_tokens() -> None:
    factory = PromptFactory(block_size=512)
    a = factory.prompt(0, 1300, [11, 12, 13])
    b = factory.prompt(1, 1400, [11, 12, 99])
    c = factory.prompt(2, 1300, [11, 12, 13])
    assert a[:1024] == b[:1024]  # two shared blocks
    assert a[1024:1100] != b[1024:1100]  # third block differs
    assert a == c  # same blocks and the last (partial) block is hashed too
    alone = factory.prompt(3, 1300)
    assert alone[:512] != a[:512]


def test_tokens_past_the_hashed_blocks_are_unique_per_request() -> None:
    factory = PromptFactory(block_size=4)
    a = factory.prompt(0, 10, [1, 2])
    b = factory.prompt(1, 10, [1, 2])
    assert a[:8] == b[:8] and a[8:] != b[8:]


def test_block_content_does_not_depend_on_the_cache() -> None:
    cached = PromptFactory(cache_blocks=2)
    ids = [[1, 2, 3], [4, 1], [3, 2, 1]]
    first = [cached.prompt(i, 3 * 512, h) for i, h in enumerate(ids)]
    again = [PromptFactory(cache_blocks=0).prompt(i, 3 * 512, h) for i, h in enumerate(ids)]
    assert first == again


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 100, "low": 100}, "low < vocab_size"),
        ({"block_size": 0}, "block size"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_settings_are_workload_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        PromptFactory(**kwargs)


def test_zero_length_prompt_is_rejected() -> None:
    with pytest.raises(WorkloadError, match="input_length 0"):
        PromptFactory().prompt(3, 0)
