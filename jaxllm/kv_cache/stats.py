"""KV cache statistics, reported per step under the names TensorRT-LLM uses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvCacheStats:
    max_num_blocks: int  # pool size
    free_num_blocks: int  # free + evictable cached blocks (a new allocation can take them)
    used_num_blocks: int  # blocks owned by at least one sequence
    tokens_per_block: int
    alloc_total_blocks: int  # blocks handed to sequences so far, new or reused
    alloc_new_blocks: int  # of those, freshly taken from the pool
    reused_blocks: int  # of those, found in the prefix cache
    missed_blocks: int  # prompt blocks looked up in the prefix cache and not found
    cache_hit_rate: float  # reused / (reused + missed), 0.0 before any lookup

    def to_dict(self) -> dict:
        """The `kvCacheStats` dict of the iteration stats (camelCase keys)."""
        return {
            "maxNumBlocks": self.max_num_blocks,
            "freeNumBlocks": self.free_num_blocks,
            "usedNumBlocks": self.used_num_blocks,
            "tokensPerBlock": self.tokens_per_block,
            "allocTotalBlocks": self.alloc_total_blocks,
            "allocNewBlocks": self.alloc_new_blocks,
            "reusedBlocks": self.reused_blocks,
            "missedBlocks": self.missed_blocks,
            "cacheHitRate": self.cache_hit_rate,
        }


@dataclass
class AllocationCounts:
    """Cumulative block counts of a KV cache manager, the counting side of `KvCacheStats`."""

    alloc_total: int = 0  # blocks handed to sequences, new or reused
    alloc_new: int = 0  # of those, freshly taken from the pool
    reused: int = 0  # of those, found in the prefix cache
    missed: int = 0  # prompt blocks looked up in the prefix cache and not found

    def stats(self, num_blocks: int, num_available: int, tokens_per_block: int) -> KvCacheStats:
        """The statistics of a pool of `num_blocks` of which `num_available` are free or evictable."""
        lookups = self.reused + self.missed
        return KvCacheStats(
            max_num_blocks=num_blocks,
            free_num_blocks=num_available,
            used_num_blocks=num_blocks - num_available,
            tokens_per_block=tokens_per_block,
            alloc_total_blocks=self.alloc_total,
            alloc_new_blocks=self.alloc_new,
            reused_blocks=self.reused,
            missed_blocks=self.missed,
            cache_hit_rate=(self.reused / lookups) if lookups else 0.0,
        )
