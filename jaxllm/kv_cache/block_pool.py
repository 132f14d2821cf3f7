"""The physical KV blocks: who owns them, which are free, and which hold reusable prefixes.

Every block is in exactly one of three places:

* **free**: holds nothing worth keeping; handed out first.
* **cached** (evictable): owned by nobody but holds a full, computed block of some prompt
  that a later request may reuse; kept in least-recently-released order and evicted
  (oldest first) only when the free list is empty.
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

from collections import OrderedDict
from typing import Optional

BlockKey = tuple[int, tuple[int, ...]]
ROOT_NODE = 0


class BlockPool:
    """Reference counts, the free list, the evictable cache and the prefix index."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_count: list[int] = [0] * num_blocks
        # Popped from the end, so blocks are handed out 0, 1, 2, ... on a fresh pool.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._key_of: list[Optional[BlockKey]] = [None] * num_blocks
        self._node_of: list[int] = [ROOT_NODE] * num_blocks
        self._block_of_key: dict[BlockKey, int] = {}
        self._next_node = ROOT_NODE + 1
        self.num_evictions = 0

    # ----------------------------------------------------------------- counts
    @property
    def num_free(self) -> int:
        """Blocks on the free list (never holding reusable content)."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Unowned blocks that still hold reusable content."""
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks a new allocation can take: free plus evictable."""
        return len(self._free) + len(self._evictable)

    # ------------------------------------------------------------- ownership
    def allocate(self) -> int:
        """Take a block for exclusive use: a free one, else evict the oldest cached one."""
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._unregister(block)
            self.num_evictions += 1
        else:
            raise RuntimeError("KV cache pool exhausted: no free or evictable block left")
        self.ref_count[block] = 1
        return block

    def allocate_many(self, count: int) -> list[int]:
        """`count` blocks for exclusive use (free ones first, then evicted cached ones)."""
        if count > len(self._free) + len(self._evictable):
            raise RuntimeError(f"KV cache pool exhausted: {count} blocks requested, "
                               f"{len(self._free) + len(self._evictable)} left")
        free = self._free
        take = min(count, len(free))
        blocks = free[len(free) - take:]
        del free[len(free) - take:]
        blocks.reverse()  # same order as repeated allocate()
        ref = self.ref_count
        for block in blocks:
            ref[block] = 1
        for _ in range(count - take):
            blocks.append(self.allocate())
        return blocks

    def acquire(self, block: int) -> None:
        """Add an owner to a cached block found by `lookup` (prefix reuse)."""
        if self.ref_count[block] == 0:
            del self._evictable[block]
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
            self._evictable[block] = None  # newest end: evicted last
        else:
            self._free.append(block)
        return True

    # ---------------------------------------------------------- prefix index
    def lookup(self, parent_node: int, tokens: tuple[int, ...]) -> Optional[int]:
        """The cached block holding `tokens` right after the prefix `parent_node`, if any."""
        return self._block_of_key.get((parent_node, tokens))

    def node_of(self, block: int) -> int:
        return self._node_of[block]

    def register(self, block: int, parent_node: int, tokens: tuple[int, ...]) -> int:
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
        return node

    def is_registered(self, block: int) -> bool:
        return self._key_of[block] is not None

    def unregister(self, block: int) -> None:
        """Remove `block` from the prefix index if it is the indexed copy of its prefix."""
        key = self._key_of[block]
        if key is not None and self._block_of_key.get(key) == block:
            self._unregister(block)

    def _unregister(self, block: int) -> None:
        key = self._key_of[block]
        if key is not None:
            del self._block_of_key[key]
            self._key_of[block] = None
            self._node_of[block] = ROOT_NODE

    # ------------------------------------------------------------- checking
    def check_invariants(self, owner_counts: list[int]) -> None:
        """Raise AssertionError unless free + cached + owned == pool, each block is in
        exactly one place, and `ref_count` equals the number of sequences listing it."""
        n = self.num_blocks
        if owner_counts != self.ref_count:
            bad = [b for b in range(n) if owner_counts[b] != self.ref_count[b]][:5]
            raise AssertionError(
                f"block reference counts disagree with the block tables for blocks {bad}: "
                f"counted {[owner_counts[b] for b in bad]}, recorded {[self.ref_count[b] for b in bad]}")
        place = [0] * n
        for b in self._free:
            place[b] += 1
            if self.ref_count[b]:
                raise AssertionError(f"block {b} is on the free list but owned")
            if self._key_of[b] is not None:
                raise AssertionError(f"block {b} is on the free list but still indexed as a prefix")
        for b in self._evictable:
            place[b] += 1
            if self.ref_count[b]:
                raise AssertionError(f"block {b} is in the evictable cache but owned")
            if self._key_of[b] is None:
                raise AssertionError(f"block {b} is in the evictable cache without a prefix key")
        for b in range(n):
            if self.ref_count[b] > 0:
                place[b] += 1
                if self.ref_count[b] > 1 and self._key_of[b] is None:
                    raise AssertionError(f"block {b} is shared by {self.ref_count[b]} sequences "
                                         "but holds no cached prefix")
        lost = [b for b in range(n) if place[b] == 0]
        doubled = [b for b in range(n) if place[b] > 1]
        if lost:
            raise AssertionError(f"blocks lost (neither free, cached nor owned): {lost[:10]}")
        if doubled:
            raise AssertionError(f"blocks in more than one place: {doubled[:10]}")
        if len(self._free) + len(self._evictable) + sum(1 for c in self.ref_count if c) != n:
            raise AssertionError("free + cached + owned blocks != pool size")
        for key, b in self._block_of_key.items():
            if self._key_of[b] != key:
                raise AssertionError(f"prefix index points at block {b} which holds another key")
