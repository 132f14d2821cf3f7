"""KV cache events: what entered and left the prefix-reuse cache, for KV-aware routers.

The shapes are TensorRT-LLM's serialized `KVCacheEvent`s (`LLM.get_kv_cache_events()`):

    {"event_id": 7, "window_size": 256, "data": {...}}   (+ "attention_dp_rank" under attention DP)

with `data` one of

    {"type": "created", "num_blocks_per_cache_level": [num_blocks]}
    {"type": "stored", "parent_hash": int | None, "blocks": [
        {"type": "stored_block", "block_hash": int, "tokens": [{"type": "unique_token",
         "token_id": t, "token_extra_id": 0}, ...], "lora_id": int | None, "cache_level": 0,
         "priority": int}, ...]}
    {"type": "removed", "block_hashes": [int, ...]}
    {"type": "updated", "block_hash": int, "cache_level": None,
     "priority": {"type": "event_diff", "old_value": int, "new_value": int}}
    {"type": "updated", "block_hash": int, "priority": None,
     "cache_level": {"type": "event_diff", "old_value": 0, "new_value": 1}}   (host tier)

A block hash is the block's prefix-node id (`BlockPool`): unique for the engine's life and
exact (two different prefixes never share one), so `parent_hash` chains identify a prefix;
the first block of a prefix has `parent_hash` None. Blocks of requests with a LoRA adapter
form the adapter's own prefix tree and carry its `lora_id`. A stored event lists a run of
consecutive blocks of one sequence that entered the cache together; a block is removed when
it is evicted (or withdrawn before its KV was written); an `updated` event reports a
priority change: a request reusing the block with its own retention priority, or a
priority duration running out (applied lazily, at the latest when a block is next evicted).
With a host tier (`jaxllm.kv_cache.host_tier`) `created` lists [device blocks, host blocks];
an evicted block kept on the host is not removed but `updated` with `cache_level` 0 -> 1
(1 -> 0 when it comes back); a block dropped from the host is `removed`.

The engine thread records events; any thread takes them (`KvCacheEventBuffer.get`). The
buffer is bounded: when full, the oldest events are dropped (and counted). With
`event_buffer_max_size=0` no buffer exists and the KV manager records nothing.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable


class KvCacheEventBuffer:
    """Thread-safe bounded queue of KV cache events, shared by the engine's block managers
    (one per attention-DP rank). The engine thread appends compact records; the dicts are
    built by `get`, on the caller's thread, so recording costs the step loop little."""

    def __init__(self, max_size: int, window_size: int) -> None:
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"event_buffer_max_size must be a positive int for an event buffer, got {max_size!r}")
        self.max_size = max_size
        self.window_size = window_size
        self._events: collections.deque = collections.deque(maxlen=max_size)
        self._cond = threading.Condition()
        self._next_id = 0
        self.num_dropped = 0

    def record(self, kind: str, payload: tuple, rank: int | None = None) -> None:
        """Append one event (engine thread): `kind` and its fields, serialized by `get`."""
        with self._cond:
            if len(self._events) == self.max_size:
                self.num_dropped += 1
            self._events.append((self._next_id, kind, payload, rank))
            self._next_id += 1
            self._cond.notify_all()

    def get(self, timeout: float | None = None, max_events: int | None = None) -> list[dict]:
        """The buffered events, oldest first, taking them from the buffer: all of them, or the
        oldest `max_events` (the rest stay for the next call). Waits up to `timeout` seconds
        for one when there is none (None or 0: do not wait)."""
        with self._cond:
            if not self._events and timeout:
                self._cond.wait(timeout)
            if max_events is None or max_events >= len(self._events):
                records = list(self._events)
                self._events.clear()
            else:
                records = [self._events.popleft() for _ in range(max(max_events, 0))]
        return [self._serialize(*record) for record in records]

    def __len__(self) -> int:
        return len(self._events)

    def _serialize(self, event_id: int, kind: str, payload: tuple, rank: int | None) -> dict:
        if kind == "stored":
            parent_hash, blocks, lora_id = payload
            data = {
                "type": "stored",
                "parent_hash": parent_hash,
                "blocks": [
                    {
                        "type": "stored_block",
                        "block_hash": block_hash,
                        "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens],
                        "lora_id": lora_id,
                        "cache_level": 0,
                        "priority": priority,
                    }
                    for block_hash, tokens, priority in blocks
                ],
            }
        elif kind == "removed":
            data = {"type": "removed", "block_hashes": list(payload[0])}
        elif kind == "updated":
            block_hash, old, new = payload
            data = {
                "type": "updated",
                "block_hash": block_hash,
                "cache_level": None,
                "priority": {"type": "event_diff", "old_value": old, "new_value": new},
            }
        elif kind == "level":
            block_hash, old, new = payload
            data = {
                "type": "updated",
                "block_hash": block_hash,
                "cache_level": {"type": "event_diff", "old_value": old, "new_value": new},
                "priority": None,
            }
        else:  # created
            levels = [payload[0]] if not payload[1] else [payload[0], payload[1]]
            data = {"type": "created", "num_blocks_per_cache_level": levels}
        event = {"event_id": event_id, "data": data, "window_size": self.window_size}
        if rank is not None:
            event["attention_dp_rank"] = rank
        return event


class KvEventRecorder:
    """What one block pool reports into a shared buffer (tags its attention-DP rank)."""

    __slots__ = ("buffer", "rank")

    def __init__(self, buffer: KvCacheEventBuffer, rank: int | None = None) -> None:
        self.buffer = buffer
        self.rank = rank

    def created(self, num_blocks: int, num_secondary_blocks: int = 0) -> None:
        self.buffer.record("created", (num_blocks, num_secondary_blocks), self.rank)

    def stored(
        self, parent_hash: int | None, blocks: list[tuple[int, tuple[int, ...], int]], lora_id: int | None = None
    ) -> None:
        """`blocks`: (block_hash, token ids, priority) of consecutive newly cached blocks."""
        self.buffer.record("stored", (parent_hash, blocks, lora_id), self.rank)

    def removed(self, block_hashes: Iterable[int]) -> None:
        self.buffer.record("removed", (block_hashes,), self.rank)

    def priority_updated(self, block_hash: int, old: int, new: int) -> None:
        self.buffer.record("updated", (block_hash, old, new), self.rank)

    def cache_level_updated(self, block_hash: int, old: int, new: int) -> None:
        """The block moved between tiers (0: device, 1: host)."""
        self.buffer.record("level", (block_hash, old, new), self.rank)
