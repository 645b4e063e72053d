"""Synthetic prompts of exact token lengths, as token-id lists.

A trace records lengths, not text. The replayer sends token ids (`"prompt": [ids]`), so the
server sees exactly `input_length` prompt tokens without a tokenizer round trip.

- Deterministic: the same (seed, request index, hash_ids) gives the same ids on every run,
  so two trials of a study send byte-identical traffic.
- Valid for any model: ids are drawn from `[low, vocab_size)`; the defaults (100..3999) sit
  inside every vocabulary we serve and stay clear of the low ids where special tokens live.
- Prefix sharing is real: a request's `hash_ids` name its 512-token blocks (Mooncake
  convention), and a block's tokens depend only on its hash id. Requests whose `hash_ids`
  share leading blocks therefore share identical leading token ids, and prefix caching
  sees exactly the sharing the trace recorded. Tokens past the hashed blocks are unique to
  the request (seeded by its index).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from workloads.errors import WorkloadError

DEFAULT_LOW = 100
DEFAULT_VOCAB_SIZE = 4000
DEFAULT_BLOCK_SIZE = 512
# Domains of the seed sequence, so a block id and a request index never give the same stream.
_REQUEST_STREAM = 0
_BLOCK_STREAM = 1


class PromptFactory:
    """Builds the token ids of request `index` with `input_length` tokens.

    Keeps the most recently used blocks (`cache_blocks`), because a Mooncake-style trace
    reuses the same leading blocks across thousands of requests.
    """

    def __init__(
        self,
        *,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        low: int = DEFAULT_LOW,
        block_size: int = DEFAULT_BLOCK_SIZE,
        seed: int = 0,
        cache_blocks: int = 1024,
    ) -> None:
        if not 0 <= low < vocab_size:
            raise WorkloadError(
                f"prompt token ids: low={low}, vocab_size={vocab_size}: need 0 <= low < vocab_size"
            )
        if block_size < 1:
            raise WorkloadError(f"prompt block size {block_size}: must be >= 1 token")
        if seed < 0:
            raise WorkloadError(f"prompt seed {seed}: must be >= 0")
        self.vocab_size = vocab_size
        self.low = low
        self.block_size = block_size
        self.seed = seed
        self._cache_blocks = cache_blocks
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()

    def _random(self, stream: int, key: int, size: int) -> np.ndarray:
        # Hash ids may be negative or huge; fold them into a non-negative seed word.
        rng = np.random.default_rng([self.seed, stream, key & 0xFFFFFFFFFFFFFFFF])
        return rng.integers(self.low, self.vocab_size, size=size, dtype=np.int64)

    def _block(self, hash_id: int) -> np.ndarray:
        block = self._blocks.get(hash_id)
        if block is None:
            block = self._random(_BLOCK_STREAM, hash_id, self.block_size)
            self._blocks[hash_id] = block
            if len(self._blocks) > self._cache_blocks:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(hash_id)
        return block

    def prompt(
        self, index: int, input_length: int, hash_ids: Sequence[int] | None = None
    ) -> list[int]:
        """Exactly `input_length` token ids for request `index`."""
        if input_length < 1:
            raise WorkloadError(f"request {index}: input_length {input_length}: must be >= 1")
        parts: list[np.ndarray] = []
        filled = 0
        for hash_id in hash_ids or ():
            if filled >= input_length:
                break
            block = self._block(int(hash_id))
            parts.append(block[: input_length - filled])
            filled += len(parts[-1])
        if filled < input_length:
            parts.append(self._random(_REQUEST_STREAM, index, input_length - filled))
        return np.concatenate(parts).tolist()


def synthetic_prompt(
    index: int,
    input_length: int,
    hash_ids: Sequence[int] | None = None,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    low: int = DEFAULT_LOW,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
) -> list[int]:
    """One prompt without keeping a factory (no block cache)."""
    factory = PromptFactory(
        vocab_size=vocab_size, low=low, block_size=block_size, seed=seed, cache_blocks=0
    )
    return factory.prompt(index, input_length, hash_ids)
