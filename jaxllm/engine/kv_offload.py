"""Moves KV blocks between the device pool and the host tier (`jaxllm.kv_cache.host_tier`).

The host buffer holds, per cache array, `[host slots, *one block's logical shape]` in numpy:
the full block of every layer (under tensor parallelism the device -> host read gathers each
device's shard of the sharded pool, and the host -> device write is sharded again by the
cache's own sharding). On a GPU the buffer would live in JAX's `pinned_host` memory kind so
the copies are DMA transfers; `_host_buffer` is the one place that decides where it lives.

Copies are batched: `flush` makes all of a step's offloads with one gather program and all
its onboards with one scatter program (block counts padded to powers of two, so few shapes
compile), on the engine thread before the step is launched. An offload's bytes land in the
host buffer later (`land`), so it does not wait for the step in flight; overlapping the copies
with the running step is not done yet.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kv_cache.events import KvEventRecorder
from jaxllm.kv_cache.host_tier import HostTier
from jaxllm.kv_cache.spec import MhaLayerCache, MlaLayerCache
from jaxllm.llm_args import KvCacheConfig

_NO_BLOCK = 2**30  # destination of a padding write: out of range, so it is dropped
_MIN_BATCH = 8


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


def _gather(kv_cache: Any, src: jax.Array, *, num_blocks: int) -> list[jax.Array]:
    """Blocks `src` of every page array, each [len(src), *block shape]."""
    out = []
    n = src.shape[0]
    for pages, axis in cache_leaves(kv_cache):
        layers = pages.shape[axis] // num_blocks
        taken = jnp.take(pages, _page_index(src, layers, num_blocks), axis=axis)
        shape = pages.shape[:axis] + (layers, n) + pages.shape[axis + 1 :]
        out.append(jnp.moveaxis(taken.reshape(shape), axis + 1, 0))
    return out


def _scatter(kv_cache: Any, dst: jax.Array, data: list[jax.Array], *, num_blocks: int) -> Any:
    """Write `data[i]` (from `_gather`'s layout) into blocks `dst` (out of range: dropped)."""
    arrays = []
    for (pages, axis), values in zip(cache_leaves(kv_cache), data):
        layers = pages.shape[axis] // num_blocks
        moved = jnp.moveaxis(values, 0, axis + 1)
        shape = pages.shape[:axis] + (layers * dst.shape[0],) + pages.shape[axis + 1 :]
        index = (slice(None),) * axis + (_page_index(dst, layers, num_blocks),)
        arrays.append(pages.at[index].set(moved.reshape(shape).astype(pages.dtype), mode="drop"))
    return _rebuild(kv_cache, arrays)


def block_bytes(kv_cache: Any, num_blocks: int) -> int:
    """Bytes of one logical KV block over all layers (every head, whatever the sharding)."""
    return sum(pages.nbytes // num_blocks for pages, _ in cache_leaves(kv_cache))


def _host_buffer(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Host memory for the offloaded blocks. On a GPU this would be a `pinned_host` array
    (`jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")`)."""
    return np.zeros(shape, dtype)


@dataclass
class TransferCounts:
    offloaded_blocks: int = 0
    onboarded_blocks: int = 0
    offloaded_bytes: int = 0
    onboarded_bytes: int = 0
    copy_seconds: float = 0.0


class KvOffloader:
    """Owns the host buffer and makes the host tier's queued copies on the runner's cache."""

    def __init__(self, runner: Any, tier: HostTier, num_blocks: int) -> None:
        self.runner, self.tier, self.num_blocks = runner, tier, num_blocks
        self.buffers = [
            _host_buffer((tier.num_slots,) + _block_shape(pages, axis, num_blocks), np.dtype(pages.dtype))
            for pages, axis in cache_leaves(runner.kv_cache)
        ]
        shardings = jax.tree.map(lambda a: a.sharding, runner.kv_cache)
        self._gather_jit = jax.jit(functools.partial(_gather, num_blocks=num_blocks))
        self._scatter_jit = jax.jit(
            functools.partial(_scatter, num_blocks=num_blocks), donate_argnums=(0,), out_shardings=shardings
        )
        self.counts = TransferCounts()
        # Offloaded blocks read from the device but not yet in `buffers`: (slots, device arrays).
        # Waiting for them right away would wait for the step in flight (the overlap scheduler's).
        self._in_flight: list[tuple[list[int], list[jax.Array]]] = []

    @property
    def num_in_flight(self) -> int:
        """Offloaded blocks whose bytes are still on their way to the host buffer."""
        return sum(len(slots) for slots, _ in self._in_flight)

    def land(self) -> None:
        """Write the offloaded blocks read earlier into the host buffer (waits for their reads)."""
        for slots, arrays in self._in_flight:
            for buffer, values in zip(self.buffers, arrays):
                buffer[slots] = np.asarray(values)[: len(slots)]
        self._in_flight.clear()

    def flush(self) -> None:
        """Make every queued copy: offloads (device reads) first, then onboards. The offloads'
        bytes reach the host buffer at the next flush with onboards (or the one after), so
        this flush does not wait for the step in flight unless a block comes back."""
        offloads, onboards = self.tier.take_transfers()
        if not offloads and not onboards:
            if self._in_flight and all(a.is_ready() for _, arrays in self._in_flight for a in arrays):
                self.land()
            return
        started = time.perf_counter()
        per_block = self.tier.bytes_per_block
        if offloads:
            blocks, slots = zip(*offloads)
            src = np.zeros(_padded(len(blocks)), np.int32)
            src[: len(blocks)] = blocks
            out = self._gather_jit(self.runner.kv_cache, src)
            for values in out:
                values.copy_to_host_async()
            self._in_flight.append((list(slots), out))
            self.counts.offloaded_blocks += len(blocks)
            self.counts.offloaded_bytes += len(blocks) * per_block
        if onboards:
            self.land()  # an onboarded slot may have been offloaded in this or an earlier batch
            slots, blocks = zip(*onboards)
            size = _padded(len(blocks))
            dst = np.full(size, _NO_BLOCK, np.int32)
            dst[: len(blocks)] = blocks
            data = []
            for buffer in self.buffers:
                values = np.zeros((size,) + buffer.shape[1:], buffer.dtype)
                values[: len(slots)] = buffer[list(slots)]
                data.append(values)
            self.runner.kv_cache = self._scatter_jit(self.runner.kv_cache, dst, data)
            self.counts.onboarded_blocks += len(blocks)
            self.counts.onboarded_bytes += len(blocks) * per_block
        self.counts.copy_seconds += time.perf_counter() - started

    def warmup(self, max_blocks: int) -> None:
        """Compile the copy programs for every padded batch size up to `max_blocks` (copies
        nothing: the reads are discarded, every write is dropped)."""
        size = _MIN_BATCH
        while True:
            self._gather_jit(self.runner.kv_cache, np.zeros(size, np.int32))
            data = [np.zeros((size,) + b.shape[1:], b.dtype) for b in self.buffers]
            dst = np.full(size, _NO_BLOCK, np.int32)
            self.runner.kv_cache = self._scatter_jit(self.runner.kv_cache, dst, data)
            if size >= max_blocks:
                break
            size *= 2

    def stats(self) -> dict:
        """Host-tier fields added to the iteration statistics' `kvCacheStats`."""
        tier, c = self.tier, self.counts
        return {
            "hostMaxNumBlocks": tier.num_slots,
            "hostFreeNumBlocks": tier.num_free,
            "hostCachedBlocks": tier.num_cached,
            "hostReusedBlocks": tier.onboarded_blocks,
            "offloadedBlocks": c.offloaded_blocks,
            "onboardedBlocks": c.onboarded_blocks,
            "offloadedBytes": c.offloaded_bytes,
            "onboardedBytes": c.onboarded_bytes,
            "copyTimeMS": c.copy_seconds * 1e3,
        }


def _block_shape(pages: jax.Array, axis: int, num_blocks: int) -> tuple[int, ...]:
    layers = pages.shape[axis] // num_blocks
    return pages.shape[:axis] + (layers,) + pages.shape[axis + 1 :]


def _padded(n: int) -> int:
    return max(_MIN_BATCH, 1 << (n - 1).bit_length())


def build_host_tier(
    kv_cfg: KvCacheConfig,
    kv_cache: Any,
    num_blocks: int,
    *,
    attention_dp: bool,
    events: KvEventRecorder | None,
) -> HostTier | None:
    """The host tier `kv_cfg.host_cache_size` asks for (None when unset or 0); refuses
    what this engine cannot do with the field named."""
    size = kv_cfg.host_cache_size
    if not size:
        return None
    if not kv_cfg.enable_block_reuse:
        raise ValueError("kv_cache_config.host_cache_size needs enable_block_reuse=True (it keeps reusable blocks)")
    if attention_dp:
        raise ValueError("kv_cache_config.host_cache_size is not supported with enable_attention_dp yet")
    if jax.process_count() > 1:
        raise ValueError("kv_cache_config.host_cache_size is not supported on several hosts yet")
    per_block = block_bytes(kv_cache, num_blocks)
    if size < per_block:
        raise ValueError(
            f"kv_cache_config.host_cache_size={size} bytes is smaller than one KV block ({per_block} bytes)"
        )
    return HostTier(size // per_block, per_block, min_priority=kv_cfg.secondary_offload_min_priority, events=events)


# The same block copies serve the disaggregated hand-over (`jaxllm.engine.kv_transceiver`).
gather_blocks, scatter_blocks = _gather, _scatter
padded_block_count, leaf_block_shape = _padded, _block_shape
NO_BLOCK = _NO_BLOCK
