"""Paged KV cache: block pool with prefix reuse, per-request block tables, statistics."""

from jaxllm.kv_cache.block_pool import BlockPool
from jaxllm.kv_cache.manager import KVCacheManager, StepPlacement
from jaxllm.kv_cache.stats import KvCacheStats

__all__ = ["BlockPool", "KVCacheManager", "KvCacheStats", "StepPlacement"]
