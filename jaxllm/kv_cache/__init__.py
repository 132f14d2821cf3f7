"""Paged KV cache: block pool with prefix reuse and retention priorities, per-request block
tables, statistics and KV cache events."""

from jaxllm.kv_cache.block_pool import BlockPool
from jaxllm.kv_cache.block_table import StepPlacement
from jaxllm.kv_cache.events import KvCacheEventBuffer, KvEventRecorder
from jaxllm.kv_cache.manager import KVCacheManager
from jaxllm.kv_cache.retention import KvCacheRetentionConfig, TokenRangeRetentionConfig
from jaxllm.kv_cache.stats import KvCacheStats
from jaxllm.kv_cache.steady_decode import DecodeRows

__all__ = [
    "BlockPool",
    "DecodeRows",
    "KVCacheManager",
    "KvCacheEventBuffer",
    "KvCacheRetentionConfig",
    "KvCacheStats",
    "KvEventRecorder",
    "StepPlacement",
    "TokenRangeRetentionConfig",
]
