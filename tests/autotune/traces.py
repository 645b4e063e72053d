"""Traces shaped like the ones users bring, written in the public formats they come in.

`conversation_trace` writes a Mooncake-format JSONL (what `autotune convert --from mooncake`
reads) shaped like the public Mooncake conversation trace that failed a new user (issue 20):
multi-turn conversations sharing prefix blocks (`hash_ids`, 512 tokens each, block 0 common
to every request), prompts of median ~11.6k tokens and up to 191k, outputs of a few hundred
tokens, arrivals batched on a 3-second grid at ~1.3 requests/s.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 512
LONGEST_PROMPT = 191_000


def conversation_trace(path: Path, *, duration_s: float = 900.0, rate_rps: float = 1.3,
                       seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    lines: list[str] = []
    next_block = 1
    conversations: list[list[int]] = []  # the blocks each open conversation has so far
    for tick_ms in range(0, int(duration_s * 1000), 3000):
        for _ in range(rng.poisson(rate_rps * 3)):
            if conversations and rng.random() < 0.5:  # a later turn: the history is its prefix
                history = conversations[int(rng.integers(len(conversations)))]
            else:
                history = []
                conversations.append(history)
            prompt = int(np.clip(rng.lognormal(math.log(11_600), 1.1), 200, LONGEST_PROMPT))
            blocks = max(1, math.ceil(prompt / BLOCK_TOKENS))
            while len(history) < blocks - 1:
                history.append(next_block)
                next_block += 1
            output = int(np.clip(rng.lognormal(math.log(350), 0.8), 1, 1000))
            record = {"timestamp": tick_ms, "input_length": prompt, "output_length": output,
                      "hash_ids": [0, *history[: blocks - 1]]}
            lines.append(json.dumps(record))
    # The longest prompt of the real trace, once, so the figures a user saw are all there.
    longest = json.loads(lines[len(lines) // 2])
    longest["input_length"] = LONGEST_PROMPT
    longest["hash_ids"] = [0, *range(next_block, next_block + LONGEST_PROMPT // BLOCK_TOKENS)]
    lines[len(lines) // 2] = json.dumps(longest)
    path.write_text("\n".join(lines) + "\n")
    return path
