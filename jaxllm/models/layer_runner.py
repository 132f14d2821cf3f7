"""Every decoder layer of a step, in order, over a paged KV cache: the layer stacks as
`lax.scan`s, the layers stored apart one by one, and one layer's view of a page pool.

The decoders (`jaxllm.models.decoder`, `jaxllm.models.deepseek`) bring their own layer
function; what they share is here: how the layers are walked, how the cache's geometry
is checked against the parameters, and how a layer finds its pages in a pool for all
layers (`MhaKvCacheSpec.init_pool`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp

from jaxllm.models.attention import AttentionMetadata
from jaxllm.models.kv_cache_spec import KVCache
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.weights import LayerStack, Params, stacks_of_params
from sharding.expert_load import MoeStepStats


def layer_metadata(
    md: AttentionMetadata, layer: jax.Array | int, blocks_per_layer: int, tokens_per_block: int, num_layers: int
) -> AttentionMetadata:
    """The step's metadata as layer `layer` of a page pool sees it (see `MhaKvCacheSpec.init_pool`):
    its pages are offset by `layer * blocks_per_layer`; padding slots (== blocks_per_layer *
    tokens_per_block) stay past the end of the whole pool, so the write still drops them."""
    layer_slots = blocks_per_layer * tokens_per_block
    slots = jnp.where(md.slot_mapping < layer_slots, md.slot_mapping + layer * layer_slots, num_layers * layer_slots)
    return replace(
        md,
        slot_mapping=slots.astype(jnp.int32),
        block_tables=(md.block_tables + layer * blocks_per_layer).astype(jnp.int32),
    )


def cache_geometry(config: ModelConfig, params: Params, kv_cache: Any) -> tuple[int | None, int]:
    """(blocks per layer of a page pool, or None for per-layer caches; tokens per block), after
    checking that the cache layout matches the parameters' (stacks need the pool)."""
    stacks = stacks_of_params(config, params)
    if isinstance(kv_cache, list):
        if stacks:
            raise ValueError("stacked layers (scan_layers) need the KV page pool of init_kv_cache with scan_layers")
        if len(kv_cache) != config.num_layers:
            raise ValueError(f"kv_cache has {len(kv_cache)} layers, the model {config.num_layers}")
        pages = jax.tree_util.tree_leaves(kv_cache[0])[0]
        return None, int(pages.shape[-2])
    pages = jax.tree_util.tree_leaves(kv_cache)[0]  # MHA [Hkv, L * B, tpb, D]; MLA latent [L * B, tpb, D]
    total = int(pages.shape[-3])
    if total % config.num_layers:
        raise ValueError(f"a KV page pool of {total} pages does not split over {config.num_layers} layers")
    return total // config.num_layers, int(pages.shape[-2])


LayerFn = Callable[[jax.Array, dict, Any, jax.Array | int], tuple[jax.Array, Any, jax.Array | None, jax.Array | None]]


def run_layers(
    params: Params, kv_cache: KVCache, x: jax.Array, config: ModelConfig, layer_fn: LayerFn, *, lora: dict | None = None
) -> tuple[jax.Array, KVCache, MoeStepStats | None]:
    """Every decoder layer in order: each layer stack as one `lax.scan` (`_scan_stack`), layers
    stored apart one by one. `layer_fn(x, layer_params, cache, index) -> (x, cache, expert
    counts [E] or None, dropped rows [] or None)` is one layer of the model (index static
    for a layer apart, traced in a scan); the cache is the page pool, or with per-layer
    caches that layer's. Returns the residual, the cache and the MoE statistics."""
    stacks = stacks_of_params(config, params)
    pooled = not isinstance(kv_cache, list)
    stack_at = {s.start: (g, s) for g, s in enumerate(stacks)}
    new_cache: list = []
    counts, dropped = [], []
    i = 0
    while i < config.num_layers:
        if i in stack_at:
            g, stack = stack_at[i]
            stacked = params["layer_stacks"][g]
            if lora is not None:
                stacked = {**stacked, "lora": lora["layer_stacks"][g]}
            x, kv_cache, layer_counts, layer_dropped = _scan_stack(x, stacked, kv_cache, stack, layer_fn)
            i = stack.stop
            if layer_counts is not None:
                counts.append(layer_counts)
                dropped.append(layer_dropped)
            continue
        cache = kv_cache if pooled else kv_cache[i]
        layer = params["layers"][i]
        if lora is not None:
            layer = {**layer, "lora": lora["layers"][i]}
        x, cache, layer_counts, layer_dropped = layer_fn(x, layer, cache, i)
        if pooled:
            kv_cache = cache
        else:
            new_cache.append(cache)
        if layer_counts is not None:
            counts.append(layer_counts[None])
            dropped.append(layer_dropped[None])
        i += 1
    stats = MoeStepStats(jnp.concatenate(counts), jnp.concatenate(dropped)) if counts else None
    return x, (kv_cache if pooled else new_cache), stats


def _scan_stack(
    x: jax.Array, stacked: dict, pool: Any, stack: LayerStack, layer_fn: LayerFn
) -> tuple[jax.Array, Any, jax.Array | None, jax.Array | None]:
    """The layers of one stack as one `lax.scan`: the residual and the whole page pool are the
    carry (each layer's KV write is an in-place scatter into the pool), the stacked weights and
    the layer index the scanned inputs; the per-layer MoE statistics its outputs."""

    def body(carry, xs):
        x, pool = carry
        layer, index = xs
        x, pool, counts, dropped = layer_fn(x, layer, pool, index)
        return (x, pool), (counts, dropped)

    indices = jnp.arange(stack.start, stack.stop, dtype=jnp.int32)
    (x, pool), (counts, dropped) = jax.lax.scan(body, (x, pool), (stacked, indices))
    return x, pool, counts, dropped  # per-layer counts [n, E] and dropped rows [n] (None for dense)
