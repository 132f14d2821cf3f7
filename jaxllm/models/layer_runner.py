"""Every decoder layer of a step, in order, over a paged KV cache: the layer stacks as
`lax.scan`s, the layers stored apart one by one, and one layer's view of a page pool.

The decoders (`jaxllm.models.decoder`, `jaxllm.models.deepseek`) bring their own layer
function; what they share is here: how the layers are walked, how the cache's geometry
is checked against the parameters, and how a layer finds its pages in a pool for all
layers (`MhaKvCacheSpec.init_pool`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Optional

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


@dataclass(frozen=True)
class LayerCapture:
    """Which residual rows `run_layers` returns besides its output: the residual stream entering
    each of `layers` (static; layer i's input is layer i - 1's output, the "hidden state of
    layer i" EAGLE-3 fuses), at the packed tokens `rows` int32[E]. Without one the traced
    program is exactly the plain forward's."""

    rows: jax.Array
    layers: tuple[int, ...]

    def check(self, num_layers: int) -> None:
        bad = [i for i in self.layers if not 0 <= i < num_layers]
        if bad or not self.layers:
            raise ValueError(f"captured layers {list(self.layers)} must be non-empty and in [0, {num_layers})")


LayerFn = Callable[[jax.Array, dict, Any, jax.Array | int], tuple[jax.Array, Any, jax.Array | None, jax.Array | None]]


def run_layers(
    params: Params,
    kv_cache: KVCache,
    x: jax.Array,
    config: ModelConfig,
    layer_fn: LayerFn,
    *,
    lora: dict | None = None,
    capture: Optional[LayerCapture] = None,
) -> tuple[jax.Array, KVCache, MoeStepStats | None, jax.Array | None]:
    """Every decoder layer in order: each layer stack as one `lax.scan` (`_scan_stack`), layers
    stored apart one by one. `layer_fn(x, layer_params, cache, index) -> (x, cache, expert
    counts [E] or None, dropped rows [] or None)` is one layer of the model (index static
    for a layer apart, traced in a scan); the cache is the page pool, or with per-layer
    caches that layer's. Returns the residual, the cache, the MoE statistics and, with
    `capture`, the captured residual rows [E, len(capture.layers), H] (else None)."""
    stacks = stacks_of_params(config, params)
    pooled = not isinstance(kv_cache, list)
    stack_at = {s.start: (g, s) for g, s in enumerate(stacks)}
    wanted = set(capture.layers) if capture is not None else set()
    if capture is not None:
        capture.check(config.num_layers)
    captured: dict[int, jax.Array] = {}
    new_cache: list = []
    counts, dropped = [], []
    i = 0
    while i < config.num_layers:
        if i in stack_at:
            g, stack = stack_at[i]
            stacked = params["layer_stacks"][g]
            if lora is not None:
                stacked = {**stacked, "lora": lora["layer_stacks"][g]}
            rows = capture.rows if capture is not None and wanted & set(range(stack.start, stack.stop)) else None
            x, kv_cache, layer_counts, layer_dropped, inputs = _scan_stack(x, stacked, kv_cache, stack, layer_fn, rows)
            for j in wanted & set(range(stack.start, stack.stop)):
                captured[j] = inputs[j - stack.start]
            i = stack.stop
            if layer_counts is not None:
                counts.append(layer_counts)
                dropped.append(layer_dropped)
            continue
        if i in wanted:
            captured[i] = x[capture.rows]
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
    rows_out = jnp.stack([captured[j] for j in capture.layers], axis=1) if capture is not None else None
    return x, (kv_cache if pooled else new_cache), stats, rows_out


def _scan_stack(
    x: jax.Array, stacked: dict, pool: Any, stack: LayerStack, layer_fn: LayerFn, rows: Optional[jax.Array] = None
) -> tuple[jax.Array, Any, jax.Array | None, jax.Array | None, jax.Array | None]:
    """The layers of one stack as one `lax.scan`: the residual and the whole page pool are the
    carry (each layer's KV write is an in-place scatter into the pool), the stacked weights and
    the layer index the scanned inputs; the per-layer MoE statistics its outputs, and with
    `rows` each layer's input residual at those rows ([n, E, H])."""

    def body(carry, xs):
        x, pool = carry
        layer, index = xs
        captured = x[rows] if rows is not None else None
        x, pool, counts, dropped = layer_fn(x, layer, pool, index)
        return (x, pool), (counts, dropped, captured)

    indices = jnp.arange(stack.start, stack.stop, dtype=jnp.int32)
    (x, pool), (counts, dropped, inputs) = jax.lax.scan(body, (x, pool), (stacked, indices))
    return x, pool, counts, dropped, inputs  # per-layer counts [n, E] and dropped rows [n] (None for dense)
