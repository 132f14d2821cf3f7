"""What the GPU attention kernels' wrappers (Triton `kernel`, `mosaic_gpu`) share around
their launches: the input checks and int32 step metadata going in, and the flash-decoding
merge of split partials coming out (both kernels split the key range the same way)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

FP8_CACHE = jnp.dtype(jnp.float8_e4m3fn)


def check_shapes(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, value_dim: Optional[int] = None) -> None:
    """q [T, Hq, D] against caches [Hkv, num_blocks, tokens_per_block, D] of q's dtype, or of
    float8_e4m3fn (an FP8 cache: the kernels widen each loaded page to q's dtype; a per-tensor
    scale is the caller's, folded into q and the output)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, tokens_per_block, kd = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    if kd != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and cache ({kd}) differ")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if value_dim is not None and not 0 < value_dim <= kd:
        raise ValueError(f"value_dim={value_dim} must be in [1, head_dim={kd}]")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, FP8_CACHE):
        raise ValueError(
            f"k_cache and v_cache must both be q's dtype or float8_e4m3fn: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )


def int32_metadata(kv_lens, block_tables, cu_q_lens, num_seqs) -> tuple[jax.Array, ...]:
    """The step's sequence metadata as the int32 arrays the tile schedule and kernels index with."""
    return tuple(jnp.asarray(a, jnp.int32) for a in (kv_lens, block_tables, cu_q_lens, num_seqs))


def merge_splits(o_part: jax.Array, m_part: jax.Array, l_part: jax.Array) -> jax.Array:
    """Flash-decoding epilogue: per-split f32 (acc [S, ..., D], running max [S, ...], denominator
    [S, ...]) merged into normalised rows [..., D]; rows no split saw a key of are zeros."""
    global_max = jnp.max(m_part, axis=0)
    weight = jnp.exp(m_part - global_max[None])
    denom = jnp.sum(l_part * weight, axis=0)
    acc = jnp.sum(o_part * weight[..., None], axis=0)
    safe = jnp.where(denom > 0, denom, 1.0)
    return jnp.where(denom[..., None] > 0, acc / safe[..., None], 0.0)
