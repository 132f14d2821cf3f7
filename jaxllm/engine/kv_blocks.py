"""Block copies between a paged KV cache and batches of blocks: the host KV tier
(`jaxllm.engine.kv_host_copies`) and the disaggregated hand-over (`jaxllm.engine.kv_transceiver`)
read and write blocks with these programs.

A batch of blocks has the block axis first; each block holds every layer of the cache
(scanned layers: layer l of block b is page l * num_blocks + b). Batch sizes are padded to
powers of two (`padded_block_count`), so few shapes compile; a padding write goes to an
out-of-range block and is dropped.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxllm.kv_cache.spec import MhaLayerCache, MlaLayerCache

NO_BLOCK = 2**30  # destination of a padding write: out of range, so it is dropped
MIN_BATCH = 8


def _layer_leaves(cache: Any) -> list[tuple[jax.Array, int]]:
    if isinstance(cache, MhaLayerCache):
        return [(cache.k, 1), (cache.v, 1)]
    if isinstance(cache, MlaLayerCache):
        return [(cache.latent, 0)]
    raise TypeError(f"the host KV tier cannot move blocks of a {type(cache).__name__}")


def cache_leaves(kv_cache: Any) -> list[tuple[jax.Array, int]]:
    """Every page array of the cache with its block axis (per-layer caches or one pool)."""
    layers = kv_cache if isinstance(kv_cache, list) else [kv_cache]
    return [leaf for layer in layers for leaf in _layer_leaves(layer)]


def _rebuild(kv_cache: Any, arrays: list[jax.Array]) -> Any:
    it = iter(arrays)

    def layer(cache: Any) -> Any:
        if isinstance(cache, MhaLayerCache):
            return MhaLayerCache(next(it), next(it))
        return MlaLayerCache(next(it))

    return [layer(c) for c in kv_cache] if isinstance(kv_cache, list) else layer(kv_cache)


def _page_index(blocks: jax.Array, layers: int, num_blocks: int) -> jax.Array:
    """Pages of `blocks` in every layer, layer-major (scanned layers: layer l owns pages
    [l * num_blocks, (l + 1) * num_blocks))."""
    offsets = jnp.arange(layers, dtype=jnp.int32)[:, None] * num_blocks
    return (blocks[None, :] + offsets).ravel()


def gather_blocks(kv_cache: Any, src: jax.Array, *, num_blocks: int) -> list[jax.Array]:
    """Blocks `src` of every page array, each [len(src), *block shape]."""
    out = []
    n = src.shape[0]
    for pages, axis in cache_leaves(kv_cache):
        layers = pages.shape[axis] // num_blocks
        taken = jnp.take(pages, _page_index(src, layers, num_blocks), axis=axis)
        shape = pages.shape[:axis] + (layers, n) + pages.shape[axis + 1 :]
        out.append(jnp.moveaxis(taken.reshape(shape), axis + 1, 0))
    return out


def scatter_blocks(kv_cache: Any, dst: jax.Array, data: list[jax.Array], *, num_blocks: int) -> Any:
    """Write `data[i]` (from `gather_blocks`'s layout) into blocks `dst` (out of range: dropped)."""
    arrays = []
    for (pages, axis), values in zip(cache_leaves(kv_cache), data):
        layers = pages.shape[axis] // num_blocks
        moved = jnp.moveaxis(values, 0, axis + 1)
        shape = pages.shape[:axis] + (layers * dst.shape[0],) + pages.shape[axis + 1 :]
        index = (slice(None),) * axis + (_page_index(dst, layers, num_blocks),)
        arrays.append(pages.at[index].set(moved.reshape(shape).astype(pages.dtype), mode="drop"))
    return _rebuild(kv_cache, arrays)


def block_bytes(kv_cache: Any, num_blocks: int, num_ranks: int = 1) -> int:
    """Bytes of one logical KV block over all layers (every head, whatever the sharding; one
    rank's block when the cache holds `num_ranks` attention-DP pools)."""
    return sum(pages.nbytes // (num_blocks * num_ranks) for pages, _ in cache_leaves(kv_cache))


def gather_ranked(kv_cache: Any, src: jax.Array, ranks: jax.Array) -> list[jax.Array]:
    """Attention DP ([ranks, heads, blocks, tokens, dim] per layer): block `src[i]` of rank
    `ranks[i]`, each [len(src), heads, 1, tokens, dim] (`gather_blocks`'s layout)."""
    return [pages[ranks, :, src][:, :, None] for pages, _ in cache_leaves(kv_cache)]


def scatter_ranked(kv_cache: Any, dst: jax.Array, ranks: jax.Array, data: list[jax.Array]) -> Any:
    arrays = [
        pages.at[ranks, :, dst].set(values[:, :, 0].astype(pages.dtype), mode="drop")
        for (pages, _), values in zip(cache_leaves(kv_cache), data)
    ]
    return _rebuild(kv_cache, arrays)


def leaf_block_shape(pages: jax.Array, axis: int, num_blocks: int) -> tuple[int, ...]:
    layers = pages.shape[axis] // num_blocks
    return pages.shape[:axis] + (layers,) + pages.shape[axis + 1 :]


def padded_block_count(n: int) -> int:
    return max(MIN_BATCH, 1 << (n - 1).bit_length())
