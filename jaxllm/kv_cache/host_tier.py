"""The host (secondary) KV tier: reusable blocks evicted from the device wait here and come
back ("onboarding") on a prefix hit instead of being recomputed (TensorRT-LLM's
`KvCacheConfig.host_cache_size`).

This module keeps the bookkeeping only; the bytes are moved by `jaxllm.engine.kv_offload`.
When the device pool evicts a full, indexed block whose retention priority is at least
`secondary_offload_min_priority`, `offload` gives it a host slot under the *same* prefix
key and node id (so device blocks that continue the prefix stay reachable through it) and
queues a device -> host copy. `match_and_onboard` walks a new prompt through both tiers;
each host hit takes a device block, is indexed there again under its node and queues a
host -> device copy. The queued copies are taken in one batch right before the next step
is launched (`take_transfers`): every offload's read of the device is ordered before that
step, so a device block evicted and reused in the same step is read before it is
overwritten. Host slots left by onboarding stay unused until their bytes were read
(`release_slots`), so no offload writes over a slot an onboard still has to read.

Onboarding is asynchronous: a request whose prompt hit the host waits (`waiting_ids`, which
the micro-batch scheduler skips like a request still in flight) until every block it needs
has arrived on the device (`arrived`), while the other requests run. A device hit on a block
that is still arriving makes the new request wait for it too. An arriving block that is
evicted (its request was freed meanwhile) is dropped and its copy is not written.

The host tier has its own eviction order: the lowest retention priority first, then the
least recently offloaded. A block keeps its priority and what was left of its duration: once
that runs out on the host too, it falls back to the default priority (an `updated` event),
as on the device; an onboarded block takes the rest of its duration back with it. Events: an
offload or onboard is an `updated` event whose `cache_level` goes 0 -> 1 or 1 -> 0, as
TensorRT-LLM reports them; a block dropped from the host is `removed`.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable

from jaxllm.kv_cache.block_pool import ROOT_NODE, BlockKey, BlockPool
from jaxllm.kv_cache.events import KvEventRecorder
from jaxllm.kv_cache.prefix_reuse import prefix_root
from jaxllm.kv_cache.retention import DEFAULT_RETENTION_PRIORITY, MAX_RETENTION_PRIORITY
from jaxllm.kv_cache.sequence import KvSequence
from jaxllm.llm_request import LlmRequest

PRIMARY_LEVEL, SECONDARY_LEVEL = 0, 1  # TensorRT-LLM's cache levels


class HostTier:
    """Host slots holding offloaded blocks: prefix index, eviction order and queued copies."""

    def __init__(
        self,
        num_slots: int,
        bytes_per_block: int,
        *,
        min_priority: int | None = None,
        events: KvEventRecorder | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: the device pool's, on which retention durations run out."""
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        self.bytes_per_block = bytes_per_block
        self.min_priority = min_priority
        self.events = events
        self._free = list(range(num_slots - 1, -1, -1))
        self._released: list[int] = []  # onboarded this batch: free once the copies ran
        self._buckets: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(MAX_RETENTION_PRIORITY + 1)]
        self._key_of: list[BlockKey | None] = [None] * num_slots
        self._node_of: list[int] = [ROOT_NODE] * num_slots
        self._priority: list[int] = [0] * num_slots
        self._expiry: list[float] = [0.0] * num_slots  # when the priority lapses (0: never)
        self._expiring: list[tuple[float, int]] = []  # heap of (expiry, slot); stale entries skipped
        self.clock = clock
        self._slot_of_key: dict[BlockKey, int] = {}
        self._offloads: dict[int, int] = {}  # host slot -> device block to read
        self._onboards: dict[int, int] = {}  # device block -> host slot to read
        # Device blocks whose bytes are on their way from the host: block -> ticket of its copy
        # (a stale copy, whose block was evicted and given out again, is not written).
        self._arriving: dict[int, int] = {}
        self._tickets = 0
        self._waits: dict[int, set[int]] = {}  # request id -> arriving blocks it needs
        self.waiting_ids: set[int] = set()  # requests waiting for onboarded blocks (live set)
        self.waited_requests = 0  # requests that had to wait for onboarded blocks
        self.offloaded_blocks = 0
        self.onboarded_blocks = 0
        self.dropped_blocks = 0  # evicted from the host (or not offloaded: no room, low priority)

    # ----------------------------------------------------------------- counts
    @property
    def num_cached(self) -> int:
        return len(self._slot_of_key)

    @property
    def num_free(self) -> int:
        """Slots holding nothing (free now or once the queued copies ran)."""
        return len(self._free) + len(self._released)

    @property
    def num_pending(self) -> int:
        """Copies queued, not yet taken, and blocks still arriving on the device."""
        return len(self._offloads) + len(self._onboards) + len(self._arriving)

    # -------------------------------------------------------------- offload
    def offload(self, block: int, key: BlockKey, node: int, priority: int, expiry: float = 0.0) -> bool:
        """Keep the device block being evicted in a host slot; False when it is dropped
        (priority below the minimum, no slot, the prefix already on the host, or its own
        onboarding has not run yet)."""
        if block in self._arriving:  # its bytes are not on the device yet: drop it
            del self._arriving[block]
            self._onboards.pop(block, None)
            self.dropped_blocks += 1
            return False
        if key in self._slot_of_key:  # the host holds this prefix already (computed again meanwhile)
            self.dropped_blocks += 1
            return False
        if self.min_priority is not None and priority < self.min_priority:
            self.dropped_blocks += 1
            return False
        slot = self._take_slot()
        if slot is None:
            self.dropped_blocks += 1
            return False
        self._key_of[slot], self._node_of[slot], self._priority[slot] = key, node, priority
        self._expiry[slot] = expiry
        if expiry:
            heapq.heappush(self._expiring, (expiry, slot))
        self._slot_of_key[key] = slot
        self._buckets[priority][slot] = None
        self._offloads[slot] = block
        self.offloaded_blocks += 1
        if self.events is not None:
            self.events.cache_level_updated(node, PRIMARY_LEVEL, SECONDARY_LEVEL)
        return True

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._expiring:
            self._expire()
        for bucket in self._buckets:  # lowest priority first, then the oldest
            if bucket:
                slot, _ = bucket.popitem(last=False)
                node = self._node_of[slot]
                self._unindex(slot)
                self.dropped_blocks += 1
                if self.events is not None:
                    self.events.removed([node])
                return slot
        return None

    def _expire(self) -> None:
        """Give slots whose priority duration ran out the default priority (newest end)."""
        now = self.clock()
        while self._expiring and self._expiring[0][0] <= now:
            when, slot = heapq.heappop(self._expiring)
            if self._expiry[slot] != when:  # onboarded or evicted since
                continue
            self._expiry[slot] = 0.0
            old = self._priority[slot]
            if old == DEFAULT_RETENTION_PRIORITY:
                continue
            del self._buckets[old][slot]
            self._priority[slot] = DEFAULT_RETENTION_PRIORITY
            self._buckets[DEFAULT_RETENTION_PRIORITY][slot] = None
            if self.events is not None:
                self.events.priority_updated(self._node_of[slot], old, DEFAULT_RETENTION_PRIORITY)

    def _unindex(self, slot: int) -> None:
        self._expiry[slot] = 0.0
        key = self._key_of[slot]
        if key is not None:
            del self._slot_of_key[key]
        self._key_of[slot], self._node_of[slot] = None, ROOT_NODE

    # -------------------------------------------------------------- onboard
    def lookup(self, parent_node: int, tokens: tuple[int, ...]) -> int | None:
        return self._slot_of_key.get((parent_node, tokens))

    def node_of(self, slot: int) -> int:
        return self._node_of[slot]

    def take(self, slot: int) -> tuple[BlockKey, int, int, float | None]:
        """Remove a matched slot from the index (it is being onboarded): its key, node,
        priority and what is left of the priority's duration (None: no duration)."""
        key, node, priority = self._key_of[slot], self._node_of[slot], self._priority[slot]
        expiry = self._expiry[slot]
        left = None if not expiry else max(0.0, expiry - self.clock())
        assert key is not None
        del self._buckets[priority][slot]
        self._unindex(slot)
        self._released.append(slot)
        return key, node, priority, left

    def queue_onboard(self, slot: int, block: int, node: int) -> None:
        self._onboards[block] = slot
        self._tickets += 1
        self._arriving[block] = self._tickets
        self.onboarded_blocks += 1
        if self.events is not None:
            self.events.cache_level_updated(node, SECONDARY_LEVEL, PRIMARY_LEVEL)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
        """The queued copies, emptied: (device block, host slot) offloads, to be read before
        the next step, and (host slot, device block, ticket) onboards. Call `release_slots`
        once the onboards' host bytes were read."""
        offloads = [(block, slot) for slot, block in self._offloads.items()]
        onboards = [(slot, block, self._arriving[block]) for block, slot in self._onboards.items()]
        self._offloads.clear()
        self._onboards.clear()
        return offloads, onboards

    def release_slots(self, slots: list[int]) -> None:
        """Host slots whose onboarding copy read them: free for new offloads."""
        released = set(slots)
        self._free.extend(s for s in self._released if s in released)
        self._released = [s for s in self._released if s not in released]

    # ---------------------------------------------------------------- waiting
    def is_current(self, block: int, ticket: int) -> bool:
        """True while the onboarding copy `ticket` is still the one `block` waits for."""
        return self._arriving.get(block) == ticket

    def wait_for(self, request_id: int, blocks: list[int]) -> None:
        """Hold the request back until those of `blocks` still arriving are on the device."""
        pending = {b for b in blocks if b in self._arriving}
        if pending:
            self._waits[request_id] = pending
            self.waiting_ids.add(request_id)
            self.waited_requests += 1

    def arrived(self, copies: list[tuple[int, int]]) -> None:
        """The (device block, ticket) copies were written on the device (in program order
        before any later step): requests waiting for nothing else may run."""
        landed = {block for block, ticket in copies if self._arriving.get(block) == ticket}
        for block in landed:
            del self._arriving[block]
        if not landed:
            return
        for rid in list(self._waits):
            blocks = self._waits[rid]
            blocks -= landed
            if not blocks:
                del self._waits[rid]
                self.waiting_ids.discard(rid)

    def forget(self, request_id: int) -> None:
        """The request was freed (finished, aborted, paused): it waits for nothing."""
        if self._waits.pop(request_id, None) is not None:
            self.waiting_ids.discard(request_id)

    # ------------------------------------------------------------- inspection
    def cached_prefixes(self) -> dict[int, tuple[int | None, tuple[int, ...], int]]:
        """Every host block as {node: (parent node or None, token ids, priority)} (tests)."""
        return {
            self._node_of[s]: (key[0] if key[0] > ROOT_NODE else None, key[1], self._priority[s])
            for s, key in enumerate(self._key_of)
            if key is not None
        }

    def check_invariants(self) -> None:
        """Raise AssertionError unless each slot is free, released or cached exactly once."""
        place = [0] * self.num_slots
        for s in self._free + self._released:
            place[s] += 1
            if self._key_of[s] is not None:
                raise AssertionError(f"host slot {s} is free but still indexed")
        for priority, bucket in enumerate(self._buckets):
            for s in bucket:
                place[s] += 1
                if self._priority[s] != priority or self._key_of[s] is None:
                    raise AssertionError(f"host slot {s} is listed under the wrong priority or without a key")
        if any(p != 1 for p in place):
            raise AssertionError(f"host slots lost or doubled: {[s for s, p in enumerate(place) if p != 1][:10]}")
        for key, s in self._slot_of_key.items():
            if self._key_of[s] != key:
                raise AssertionError(f"host index points at slot {s} which holds another key")


def match_and_onboard(
    pool: BlockPool, host: HostTier, request: LlmRequest, tokens_per_block: int, max_blocks_per_seq: int
) -> list[int]:
    """The longest prefix of the prompt cached in either tier (leaving >= 1 token), as device
    blocks: device hits are acquired, host hits get a new device block (indexed under their
    node, the copy queued). Returns the blocks, owned by the caller."""
    prompt = request.prompt_token_ids
    limit = min((len(prompt) - 1) // tokens_per_block, max_blocks_per_seq)
    node = prefix_root(request)
    found: list[tuple[int, bool]] = []  # (device block or host slot, on the host)
    for i in range(limit):
        tokens = tuple(prompt[i * tokens_per_block : (i + 1) * tokens_per_block])
        block = pool.lookup(node, tokens)
        if block is not None:
            found.append((block, False))
            node = pool.node_of(block)
            continue
        slot = host.lookup(node, tokens)
        if slot is None:
            break
        found.append((slot, True))
        node = host.node_of(slot)
    # Own the device hits and unindex the host hits before allocating: the allocation may
    # evict (and offload), and must not take a block or slot of this very prefix.
    taken = []
    for index, on_host in found:
        if on_host:
            taken.append(host.take(index))
        else:
            pool.acquire(index)
    fresh = iter(pool.allocate_many(len(taken)) if taken else ())
    moved = iter(taken)
    blocks = []
    for index, on_host in found:
        if not on_host:
            blocks.append(index)
            continue
        block = next(fresh)
        key, node, priority, left = next(moved)
        pool.register_onboarded(block, key, node, priority, left)
        host.queue_onboard(index, block, node)
        blocks.append(block)
    host.wait_for(request.request_id, blocks)  # host hits, and device hits still arriving
    return blocks


def claim_matched(pool: BlockPool, seq: KvSequence, blocks: list[int], tokens_per_block: int) -> None:
    """Make owned matched blocks the start of the sequence (with the request's retention)."""
    request = seq.request
    config = request.kv_cache_retention_config
    if config is not None:
        plen = request.orig_prompt_len
        for i, block in enumerate(blocks):
            priority, duration = config.block_retention(i, tokens_per_block, plen)
            if priority is not None:
                pool.set_retention(block, priority, duration)
    seq.blocks = blocks
    seq.nodes = [pool.node_of(b) for b in blocks]
