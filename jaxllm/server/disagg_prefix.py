"""Which context worker may already hold a prompt's prefix in its KV cache: a router-side index
of the prompts routed to each worker, by chained block hashes (as KV cache blocks are hashed).

The router does not tokenize, so a block is `block_chars` characters of the prompt (the text,
or the chat messages as compact JSON), and block i's hash covers blocks 0..i: two prompts share
their first k block hashes exactly when they share their first k blocks of characters. Each
worker keeps the hashes of the prompts sent to it (least recently used dropped beyond
`capacity`); a new prompt's match on a worker is how many of its leading block hashes that
worker has seen - the longest cached prefix there, as far as the router knows (SGLang's
cache-aware router keeps a character radix tree the same way; TensorRT-LLM's KV-cache-aware
router learns the blocks from the workers' KV events instead).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any, Optional

BLOCK_CHARS = 64
MAX_BLOCKS = 512  # a prompt's first 32 KiB of characters are indexed


def prompt_text(body: dict) -> Optional[str]:
    """A request's prompt as text (a string prompt, token ids or chat messages)."""
    prompt: Any = body.get("prompt", body.get("messages"))
    if prompt is None:
        return None
    return prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"), default=str)


def block_hashes(text: str, block_chars: int = BLOCK_CHARS) -> list[bytes]:
    """The chained hash of each full block of `text` (a partial last block is left out)."""
    hashes = []
    previous = b""
    for start in range(0, min(len(text), block_chars * MAX_BLOCKS) - block_chars + 1, block_chars):
        previous = hashlib.blake2b(previous + text[start : start + block_chars].encode(), digest_size=16).digest()
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Per worker, the block hashes of the prompts routed to it (most recent last)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._seen: dict[str, OrderedDict[bytes, None]] = {}

    def match(self, worker: str, hashes: list[bytes]) -> int:
        """How many leading blocks of the prompt were sent to `worker` (its cached prefix)."""
        seen = self._seen.get(worker)
        if not seen:
            return 0
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def insert(self, worker: str, hashes: list[bytes]) -> None:
        """Remember that the prompt's blocks went to `worker`."""
        seen = self._seen.setdefault(worker, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def forget(self, worker: str) -> None:
        """Drop what `worker` was sent (it went down: its cache is gone or unknown)."""
        self._seen.pop(worker, None)
