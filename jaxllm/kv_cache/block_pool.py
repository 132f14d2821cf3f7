"""The physical KV blocks: who owns them, which are free, and which hold reusable prefixes.

Every block is in exactly one of three places:

* **free**: holds nothing worth keeping; handed out first.
* **cached** (evictable): owned by nobody but holds a full, computed block of some prompt
  that a later request may reuse; evicted only when the free list is empty: the lowest
  retention priority first (`jaxllm.kv_cache.retention`), the least recently released
  first within a priority. A block whose priority came with a duration falls back to the
  default priority that long after its release. One ordered bucket per priority and a bit
  mask of the non-empty ones keep every operation O(1) (expiries: a heap, O(log n)).
* **owned**: referenced by one or more sequences (`ref_count > 0`). Only cached-content
  blocks are ever shared, and nobody writes into a full block again, so sharing is safe.

Prefix index: a full block is keyed by `(parent_node, token_ids)`, where `parent_node`
identifies the block before it in the sequence (`ROOT_NODE` for the first block) and
`token_ids` is the tuple of its tokens. The chain of keys identifies the whole prefix.
Node ids come from a counter and are never reused, so keys are exact: two different
prefixes can never collide (unlike a plain hash), and when a block is evicted its node id
dies with it, which makes any cached descendants unreachable rather than wrong.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable

from jaxllm.kv_cache.events import KvEventRecorder
from jaxllm.kv_cache.retention import DEFAULT_RETENTION_PRIORITY, MAX_RETENTION_PRIORITY

BlockKey = tuple[int, tuple[int, ...]]
ROOT_NODE = 0


class BlockPool:
    """Reference counts, the free list, the evictable cache and the prefix index."""

    def __init__(
        self,
        num_blocks: int,
        *,
        events: KvEventRecorder | None = None,
        clock: Callable[[], float] = time.monotonic,
        num_secondary_blocks: int = 0,
    ) -> None:
        """`num_secondary_blocks`: slots of a host tier, reported in the `created` event; the
        tier sets `offload`, called with (block, key, node, priority, expiry) of each evicted
        indexed block (expiry: when its priority lapses on the clock, 0 never), True when it
        kept the block (then no `removed` event is reported)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_count: list[int] = [0] * num_blocks
        # Popped from the end, so blocks are handed out 0, 1, 2, ... on a fresh pool.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Evictable blocks: one least-recently-released-first bucket per retention priority.
        self._buckets: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(MAX_RETENTION_PRIORITY + 1)]
        self._nonempty = 0  # bit p set <=> bucket p holds a block
        self._num_evictable = 0
        self.priority: list[int] = [DEFAULT_RETENTION_PRIORITY] * num_blocks
        self._duration: list[float | None] = [None] * num_blocks  # seconds at priority after release
        self._expiry: list[float] = [0.0] * num_blocks  # when a released block's priority lapses (0: never)
        self._expiring: list[tuple[float, int]] = []  # heap of (expiry, block); stale entries skipped
        self._clock = clock
        self._key_of: list[BlockKey | None] = [None] * num_blocks
        self._node_of: list[int] = [ROOT_NODE] * num_blocks
        self._block_of_key: dict[BlockKey, int] = {}
        self._next_node = ROOT_NODE + 1
        self.num_evictions = 0
        self.events = events
        if events is not None:
            events.created(num_blocks, num_secondary_blocks)
        self.offload: Callable[[int, BlockKey, int, int, float], bool] | None = None

    # ----------------------------------------------------------------- counts
    @property
    def num_free(self) -> int:
        """Blocks on the free list (never holding reusable content)."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Unowned blocks that still hold reusable content."""
        return self._num_evictable

    @property
    def num_available(self) -> int:
        """Blocks a new allocation can take: free plus evictable."""
        return len(self._free) + self._num_evictable

    @property
    def num_pending_expiries(self) -> int:
        """Entries in the heap of retention-duration expiries, stale ones included."""
        return len(self._expiring)

    # ------------------------------------------------------------- ownership
    def allocate(self) -> int:
        """Take a block for exclusive use: a free one, else evict a cached one."""
        if self._free:
            block = self._free.pop()
        elif self._num_evictable:
            block, node = self._evict()
            if self.events is not None and node is not None:
                self.events.removed([node])
        else:
            raise RuntimeError("KV cache pool exhausted: no free or evictable block left")
        self.ref_count[block] = 1
        return block

    def allocate_many(self, count: int) -> list[int]:
        """`count` blocks for exclusive use (free ones first, then evicted cached ones)."""
        if count > len(self._free) + self._num_evictable:
            raise RuntimeError(
                f"KV cache pool exhausted: {count} blocks requested, {len(self._free) + self._num_evictable} left"
            )
        free = self._free
        take = min(count, len(free))
        blocks = free[len(free) - take :]
        del free[len(free) - take :]
        blocks.reverse()  # same order as repeated allocate()
        ref = self.ref_count
        for block in blocks:
            ref[block] = 1
        if count > take:
            removed = []
            for _ in range(count - take):
                block, node = self._evict()
                if node is not None:
                    removed.append(node)
                ref[block] = 1
                blocks.append(block)
            if self.events is not None and removed:
                self.events.removed(removed)
        return blocks

    def _evict(self) -> tuple[int, int | None]:
        """Unindex the evictable block to reuse (lowest priority, then oldest); returns it and
        the prefix node it held (None when the host tier took that node over)."""
        if self._expiring:
            self._expire()
        nonempty = self._nonempty
        priority = (nonempty & -nonempty).bit_length() - 1
        bucket = self._buckets[priority]
        block, _ = bucket.popitem(last=False)
        if not bucket:
            self._nonempty = nonempty & ~(1 << priority)
        self._num_evictable -= 1
        expiry, self._expiry[block] = self._expiry[block], 0.0
        node = self._node_of[block]
        offload = self.offload
        key = self._key_of[block]
        kept = offload is not None and key is not None and offload(block, key, node, self.priority[block], expiry)
        self._unregister(block)
        self.num_evictions += 1
        return block, None if kept else node

    def _expire(self) -> None:
        """Move released blocks whose priority duration has passed to the default priority."""
        heap = self._expiring
        now = self._clock()
        expiry = self._expiry
        while heap and heap[0][0] <= now:
            when, block = heapq.heappop(heap)
            if expiry[block] != when:  # reacquired, evicted or re-released since
                continue
            expiry[block] = 0.0
            old = self.priority[block]
            self._unlist(block)
            self._duration[block] = None
            self.priority[block] = DEFAULT_RETENTION_PRIORITY
            self._list(block)
            if self.events is not None and old != DEFAULT_RETENTION_PRIORITY:
                self.events.priority_updated(self._node_of[block], old, DEFAULT_RETENTION_PRIORITY)

    def _list(self, block: int) -> None:
        """Put an unowned cached block at the newest end of its priority's bucket."""
        priority = self.priority[block]
        self._buckets[priority][block] = None
        self._nonempty |= 1 << priority
        self._num_evictable += 1

    def _unlist(self, block: int) -> None:
        priority = self.priority[block]
        bucket = self._buckets[priority]
        del bucket[block]
        if not bucket:
            self._nonempty &= ~(1 << priority)
        self._num_evictable -= 1

    def acquire(self, block: int) -> None:
        """Add an owner to a cached block found by `lookup` (prefix reuse)."""
        if self.ref_count[block] == 0:
            self._unlist(block)
            self._expiry[block] = 0.0
        self.ref_count[block] += 1

    def release(self, block: int) -> bool:
        """Drop one owner. Returns True when the block went back to the pool."""
        count = self.ref_count[block] - 1
        if count < 0:
            raise RuntimeError(f"block {block} released more often than acquired")
        self.ref_count[block] = count
        if count:
            return False
        if self._key_of[block] is not None:
            self._list(block)  # newest end of its priority: evicted last among them
            duration = self._duration[block]
            if duration is not None and self.priority[block] != DEFAULT_RETENTION_PRIORITY:
                when = self._clock() + duration
                self._expiry[block] = when
                heapq.heappush(self._expiring, (when, block))
                if len(self._expiring) > 2 * self.num_blocks:  # mostly stale: reacquired meanwhile
                    expiry = self._expiry
                    self._expiring = [(t, b) for t, b in self._expiring if expiry[b] == t]
                    heapq.heapify(self._expiring)
        else:
            self._free.append(block)
        return True

    def set_retention(self, block: int, priority: int, duration: float | None) -> None:
        """Give an owned, indexed block a new retention priority (and duration after release);
        reported as an `updated` event when the priority changes."""
        if self.ref_count[block] <= 0 or self._key_of[block] is None:
            raise RuntimeError(f"block {block}: retention can only be set on an owned cached block")
        old = self.priority[block]
        self._duration[block] = duration
        if old != priority:
            self.priority[block] = priority
            if self.events is not None:
                self.events.priority_updated(self._node_of[block], old, priority)

    # ---------------------------------------------------------- prefix index
    def lookup(self, parent_node: int, tokens: tuple[int, ...]) -> int | None:
        """The cached block holding `tokens` right after the prefix `parent_node`, if any."""
        return self._block_of_key.get((parent_node, tokens))

    def node_of(self, block: int) -> int:
        return self._node_of[block]

    def register(
        self,
        block: int,
        parent_node: int,
        tokens: tuple[int, ...],
        priority: int = DEFAULT_RETENTION_PRIORITY,
        duration: float | None = None,
    ) -> int:
        """Record that `block` now holds the computed full block `tokens` after
        `parent_node`. Returns the node id that identifies this prefix.

        If an identical prefix is already indexed (two requests computed the same tokens
        at the same time), the existing block stays the canonical copy and `block` stays
        private; the returned node is the canonical one so the caller's chain continues.
        """
        key = (parent_node, tokens)
        existing = self._block_of_key.get(key)
        if existing is not None:
            return self._node_of[existing]
        if self._key_of[block] is not None:
            raise RuntimeError(f"block {block} is already registered under another prefix")
        node = self._next_node
        self._next_node += 1
        self._key_of[block] = key
        self._node_of[block] = node
        self._block_of_key[key] = block
        self.priority[block] = priority
        self._duration[block] = duration
        return node

    def register_chain(
        self,
        blocks: list[int],
        parent_node: int,
        token_blocks: list[tuple[int, ...]],
        retentions: list[tuple[int, float | None]] | None = None,
        lora_id: int | None = None,
    ) -> list[int]:
        """`register` consecutive blocks of one sequence after `parent_node`; returns their
        nodes. Each run of newly indexed blocks is reported as one `stored` event."""
        nodes = []
        node = parent_node
        events = self.events
        run: list[tuple[int, tuple[int, ...], int]] = []
        run_parent = parent_node
        for i, block in enumerate(blocks):
            priority, duration = (DEFAULT_RETENTION_PRIORITY, None) if retentions is None else retentions[i]
            tokens = token_blocks[i]
            known = self._key_of[block] is not None
            new = self.register(block, node, tokens, priority, duration)
            if events is not None:
                if not known and self._node_of[block] == new:
                    if not run:
                        run_parent = node
                    run.append((new, tokens, priority))
                elif run:
                    events.stored(run_parent if run_parent > ROOT_NODE else None, run, lora_id)
                    run = []
            node = new
            nodes.append(node)
        if events is not None and run:
            events.stored(run_parent if run_parent > ROOT_NODE else None, run, lora_id)
        return nodes

    def register_onboarded(
        self, block: int, key: BlockKey, node: int, priority: int, duration: float | None = None
    ) -> None:
        """Index an owned block coming back from the host tier under its old key and node
        (`duration`: what is left of its priority's duration, counted again from its release)."""
        if self._key_of[block] is not None or key in self._block_of_key:
            raise RuntimeError(f"block {block}: onboarding a prefix that is already on the device")
        self._key_of[block] = key
        self._node_of[block] = node
        self._block_of_key[key] = block
        self.priority[block] = priority
        self._duration[block] = duration

    def is_registered(self, block: int) -> bool:
        return self._key_of[block] is not None

    def unregister(self, block: int) -> None:
        """Remove an owned `block` from the prefix index if it is the indexed copy of its prefix."""
        key = self._key_of[block]
        if key is not None and self._block_of_key.get(key) == block:
            if self.events is not None:
                self.events.removed([self._node_of[block]])
            self._unregister(block)

    def _unregister(self, block: int) -> None:
        key = self._key_of[block]
        if key is not None:
            del self._block_of_key[key]
            self._key_of[block] = None
            self._node_of[block] = ROOT_NODE
            self.priority[block] = DEFAULT_RETENTION_PRIORITY
            self._duration[block] = None

    def cached_prefixes(self) -> dict[int, tuple[int | None, tuple[int, ...], int]]:
        """Every indexed block as {node: (parent node or None, token ids, priority)} (for tests and
        inspection; O(n))."""
        return {
            self._node_of[b]: (key[0] if key[0] > ROOT_NODE else None, key[1], self.priority[b])
            for b, key in enumerate(self._key_of)
            if key is not None
        }

    # ------------------------------------------------------------- checking
    def check_invariants(self, owner_counts: list[int], beam_blocks: frozenset = frozenset()) -> None:
        """Raise AssertionError unless free + cached + owned == pool, each block is in
        exactly one place, and `ref_count` equals the number of sequences listing it.
        `beam_blocks`: blocks of beam-search beams, which may share full blocks of generated
        tokens that are not in the prefix index."""
        n = self.num_blocks
        if owner_counts != self.ref_count:
            bad = [b for b in range(n) if owner_counts[b] != self.ref_count[b]][:5]
            raise AssertionError(
                f"block reference counts disagree with the block tables for blocks {bad}: "
                f"counted {[owner_counts[b] for b in bad]}, recorded {[self.ref_count[b] for b in bad]}"
            )
        place = [0] * n
        for b in self._free:
            place[b] += 1
            if self.ref_count[b]:
                raise AssertionError(f"block {b} is on the free list but owned")
            if self._key_of[b] is not None:
                raise AssertionError(f"block {b} is on the free list but still indexed as a prefix")
        for priority, bucket in enumerate(self._buckets):
            if bool(bucket) != bool(self._nonempty >> priority & 1):
                raise AssertionError(f"non-empty mask disagrees with the bucket of priority {priority}")
            for b in bucket:
                if self.priority[b] != priority:
                    raise AssertionError(f"block {b} of priority {self.priority[b]} is in bucket {priority}")
        evictable = [b for bucket in self._buckets for b in bucket]
        if len(evictable) != self._num_evictable:
            raise AssertionError(f"evictable count is {self._num_evictable}, buckets hold {len(evictable)}")
        for b in evictable:
            place[b] += 1
            if self.ref_count[b]:
                raise AssertionError(f"block {b} is in the evictable cache but owned")
            if self._key_of[b] is None:
                raise AssertionError(f"block {b} is in the evictable cache without a prefix key")
        for b in range(n):
            if self.ref_count[b] > 0:
                place[b] += 1
                if self.ref_count[b] > 1 and self._key_of[b] is None and b not in beam_blocks:
                    raise AssertionError(
                        f"block {b} is shared by {self.ref_count[b]} sequences but holds no cached prefix"
                    )
        lost = [b for b in range(n) if place[b] == 0]
        doubled = [b for b in range(n) if place[b] > 1]
        if lost:
            raise AssertionError(f"blocks lost (neither free, cached nor owned): {lost[:10]}")
        if doubled:
            raise AssertionError(f"blocks in more than one place: {doubled[:10]}")
        if len(self._free) + self._num_evictable + sum(1 for c in self.ref_count if c) != n:
            raise AssertionError("free + cached + owned blocks != pool size")
        for key, b in self._block_of_key.items():
            if self._key_of[b] != key:
                raise AssertionError(f"prefix index points at block {b} which holds another key")
