"""A model's KV cache: its layout (`kv_cache_spec`, the one place a `KvCacheSpec` is built
from a `ModelConfig`), the zeroed cache of an engine (a page pool or per-layer caches, one
block pool per rank under attention data parallelism) and the bytes one token takes.

The layouts themselves (MHA/GQA keys and values, the MLA latent cache) are the data types
of `jaxllm.kv_cache.spec`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxllm.kv_cache.spec import KvCacheSpec, MhaKvCacheSpec, MhaLayerCache, MlaKvCacheSpec, MlaLayerCache
from jaxllm.models.kv_quant import FP8_KV, kv_storage_dtype
from jaxllm.models.model_config import ModelConfig, numpy_dtype
from jaxllm.models.partitioning import rules_for
from sharding.dp_ranks import RANK_SPEC, attention_dp_size
from sharding.mesh import tensor_parallel_size
from sharding.rules import kv_head_replicas

# Per-layer caches (scan_layers off), or one page pool for all layers (`init_pool`); MHA or MLA.
KVCache = list[MhaLayerCache] | MhaLayerCache | list[MlaLayerCache] | MlaLayerCache


def cache_dtype(config: ModelConfig, dtype: Any = None) -> np.dtype:
    """The stored dtype: `dtype` (a float dtype or float8_e4m3fn), else `config`'s KV cache dtype
    (float8_e4m3fn for an FP8 KV cache, see `jaxllm.models.kv_quant`, else the model's)."""
    if dtype is None:
        return kv_storage_dtype(config)
    try:
        fp8 = np.dtype(dtype) == FP8_KV
    except TypeError:  # a spelling numpy does not know ("bf16")
        fp8 = False
    return FP8_KV if fp8 else numpy_dtype(dtype)


def kv_cache_spec(config: ModelConfig, dtype: Any = None, kv_replicas: int = 1) -> KvCacheSpec:
    """The cache layout of `config`'s attention: a latent cache for MLA (DeepSeek-V3), else MHA/GQA
    with each KV head stored `kv_replicas` times."""
    dtype = str(cache_dtype(config, dtype))
    if config.is_mla:
        return MlaKvCacheSpec(config.num_layers, config.kv_lora_rank, config.qk_rope_head_dim, dtype)
    return MhaKvCacheSpec(config.num_layers, config.num_kv_heads * kv_replicas, config.head_dim, dtype)


def init_kv_cache(
    config: ModelConfig, num_blocks: int, tokens_per_block: int, dtype: Any, mesh: jax.sharding.Mesh | None = None
) -> KVCache:
    """A zeroed cache of `num_blocks` pages per layer (sharded by KV head over `mesh`, when
    given): one page pool for all layers when the layers run as scans (`config.layer_scan`),
    else one cache per layer."""
    replicas = 1 if mesh is None or config.is_mla else kv_head_replicas(config.num_kv_heads, tensor_parallel_size(mesh))
    rules = None if mesh is None else rules_for(config, mesh)
    spec = kv_cache_spec(config, dtype, replicas)
    if config.layer_scan:
        return spec.init_pool(num_blocks, tokens_per_block, mesh, rules)
    return spec.init(num_blocks, tokens_per_block, mesh, rules)


def kv_cache_bytes_per_token(config: ModelConfig, dtype: Any = None, mesh: jax.sharding.Mesh | None = None) -> int:
    """Bytes of cache one token occupies across all layers on one device."""
    if mesh is None or config.is_mla:
        return kv_cache_spec(config, dtype).bytes_per_token()
    tp = tensor_parallel_size(mesh)
    return kv_cache_spec(config, dtype, kv_head_replicas(config.num_kv_heads, tp)).bytes_per_token(tp)


def init_dp_kv_cache(
    config: ModelConfig, num_blocks: int, tokens_per_block: int, dtype: Any, mesh: jax.sharding.Mesh
) -> list[MhaLayerCache] | list[MlaLayerCache]:
    """Per-layer zeroed caches with a leading rank axis, one block pool of `num_blocks` per
    rank on that rank's device: [D, Hkv, num_blocks, tokens_per_block, head_dim] keys and
    values, or for multi-head latent attention [D, num_blocks, tokens_per_block, latent_dim]."""
    ranks = attention_dp_size(mesh)
    dt = jnp.dtype(cache_dtype(config, dtype))
    sharding = NamedSharding(mesh, RANK_SPEC)
    if config.is_mla:
        latent = (ranks, num_blocks, tokens_per_block, config.kv_lora_rank + config.qk_rope_head_dim)
        zeros_latent = jax.jit(lambda: jnp.zeros(latent, dt), out_shardings=sharding)
        return [MlaLayerCache(zeros_latent()) for _ in range(config.num_layers)]
    shape = (ranks, config.num_kv_heads, num_blocks, tokens_per_block, config.head_dim)
    zeros = jax.jit(lambda: jnp.zeros(shape, dt), out_shardings=sharding)
    return [MhaLayerCache(zeros(), zeros()) for _ in range(config.num_layers)]
