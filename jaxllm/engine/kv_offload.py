"""Moves KV blocks between the device pool and the host tier (`jaxllm.kv_cache.host_tier`).

The host buffer holds, per cache array, `[host slots, *one block's logical shape]` in numpy
(`_host_buffer`): the full block of every layer (under tensor parallelism the device -> host
read gathers each device's shard of the sharded pool, and the host -> device write is
sharded again like the gather's output). The copies go through JAX's `pinned_host` memory
kind where the backend has it (`host_memory_kind`), so they are asynchronous DMA transfers
that overlap the running step; neither direction makes the engine thread wait for a device.

Copies are batched (block counts padded to powers of two, so few shapes compile): one gather
program reads every offload of a step, one scatter program writes every onboard batch that
arrived (see `KvOffloader`).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kv_cache.events import KvEventRecorder
from jaxllm.kv_cache.host_tier import HostTier
from jaxllm.kv_cache.spec import MhaLayerCache, MlaLayerCache
from jaxllm.llm_args import KvCacheConfig, physical_memory_bytes

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


def _host_buffer(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Host memory of the tier: the copies themselves go through pinned memory
    (`host_memory_kind`); this buffer only keeps the blocks between them."""
    return np.zeros(shape, dtype)


def block_bytes(kv_cache: Any, num_blocks: int, num_ranks: int = 1) -> int:
    """Bytes of one logical KV block over all layers (every head, whatever the sharding; one
    rank's block when the cache holds `num_ranks` attention-DP pools)."""
    return sum(pages.nbytes // (num_blocks * num_ranks) for pages, _ in cache_leaves(kv_cache))


def _gather_ranked(kv_cache: Any, src: jax.Array, ranks: jax.Array) -> list[jax.Array]:
    """Attention DP ([ranks, heads, blocks, tokens, dim] per layer): block `src[i]` of rank
    `ranks[i]`, each [len(src), heads, 1, tokens, dim] (`_gather`'s layout)."""
    return [pages[ranks, :, src][:, :, None] for pages, _ in cache_leaves(kv_cache)]


def _scatter_ranked(kv_cache: Any, dst: jax.Array, ranks: jax.Array, data: list[jax.Array]) -> Any:
    arrays = [
        pages.at[ranks, :, dst].set(values[:, :, 0].astype(pages.dtype), mode="drop")
        for (pages, _), values in zip(cache_leaves(kv_cache), data)
    ]
    return _rebuild(kv_cache, arrays)


def host_memory_kind(device: Any) -> str | None:
    """The memory kind the host tier's copies go through: `pinned_host` where the backend has
    it (GPUs, TPUs and, in recent jax, the CPU backend), so device <-> host copies are
    asynchronous DMA transfers; else `unpinned_host`; None: plain `copy_to_host_async`."""
    try:
        kinds = {memory.kind for memory in device.addressable_memories()}
    except Exception:  # a backend without memory spaces
        return None
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            return kind
    return None


@dataclass
class TransferCounts:
    offloaded_blocks: int = 0
    onboarded_blocks: int = 0
    offloaded_bytes: int = 0
    onboarded_bytes: int = 0
    copy_seconds: float = 0.0  # engine-thread time spent starting copies and landing them


@dataclass
class _Copy:
    """One batch of copies on its way: device -> host reads (`slots` of the host buffer) or
    host -> device writes (`blocks`: (tier, device block, ticket))."""

    arrays: list[jax.Array]
    slots: list[int]
    blocks: list[tuple[int, int, int]]

    def ready(self) -> bool:
        return all(a.is_ready() for a in self.arrays)


class KvOffloader:
    """Owns the host buffer and makes the host tiers' queued copies on the runner's cache,
    off the step's critical path.

    * Before a launch (`flush`): the step's offloads are read from the device by one gather
      program ordered before the step, then copied to host memory asynchronously; they land
      in the buffer at a later `poll`, once ready. Onboards whose host bytes are in the
      buffer start their host -> device transfer (one batch); the others start once their
      own offload landed.
    * Before scheduling (`poll`): transfers that arrived are written into the cache (one
      scatter program, ordered before the next step) and their requests may run; a request
      whose blocks are still arriving waits, the others are scheduled.

    `tiers`: one host tier per attention-DP rank (one without attention DP); rank r's host
    slot s is row r * slots + s of the buffer."""

    def __init__(self, runner: Any, tiers: list[HostTier], num_blocks: int, *, attention_dp: bool = False) -> None:
        self.runner, self.tiers, self.num_blocks = runner, tiers, num_blocks
        self.attention_dp = attention_dp
        self.num_slots = tiers[0].num_slots
        rows = len(tiers) * self.num_slots
        self.buffers = [
            _host_buffer((rows,) + _leaf_shape(pages, axis, num_blocks, attention_dp), pages.dtype)
            for pages, axis in cache_leaves(runner.kv_cache)
        ]
        shardings = jax.tree.map(lambda a: a.sharding, runner.kv_cache)
        if attention_dp:
            self._gather_jit = jax.jit(_gather_ranked)
            self._scatter_jit = jax.jit(_scatter_ranked, donate_argnums=(0,), out_shardings=shardings)
        else:
            self._gather_jit = jax.jit(lambda cache, src, ranks: _gather(cache, src, num_blocks=num_blocks))
            self._scatter_jit = jax.jit(
                lambda cache, dst, ranks, data: _scatter(cache, dst, data, num_blocks=num_blocks),
                donate_argnums=(0,),
                out_shardings=shardings,
            )
        leaf = cache_leaves(runner.kv_cache)[0][0]
        self.memory_kind = host_memory_kind(next(iter(leaf.sharding.device_set)))
        self._block_shardings: Any = None  # the gather's output shardings (the onboards' too)
        self.counts = TransferCounts()
        self._reads: list[_Copy] = []  # offloads on their way to the host buffer, oldest first
        self._reading: collections.Counter = collections.Counter()  # buffer row -> reads in flight
        self._onboards: list[tuple[int, int, int, int]] = []  # (tier, slot, block, ticket) not started
        self._writes: list[_Copy] = []  # onboards on their way to the device, oldest first

    @property
    def num_in_flight(self) -> int:
        """Offloaded blocks whose bytes are still on their way to the host buffer."""
        return sum(len(c.slots) for c in self._reads)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for onboarded blocks."""
        return sum(len(t.waiting_ids) for t in self.tiers)

    @property
    def num_arriving(self) -> int:
        """Onboarded blocks not yet written into the device cache (queued or in transit)."""
        return len(self._onboards) + sum(len(c.blocks) for c in self._writes)

    def flush(self) -> None:
        """Right before a launch: read this step's offloads (ordered before the step, which may
        overwrite the evicted blocks) and start the onboards' transfers."""
        started = time.perf_counter()
        offloads = []
        for rank, tier in enumerate(self.tiers):
            taken, onboards = tier.take_transfers()
            offloads += [(rank, block, slot) for block, slot in taken]
            self._onboards += [(rank, slot, block, ticket) for slot, block, ticket in onboards]
        if offloads:
            self._read(offloads)
        self._land(wait=False)
        self._start_onboards()
        self.counts.copy_seconds += time.perf_counter() - started

    def poll(self, wait: bool = False) -> None:
        """Before scheduling: land finished reads, start onboards whose bytes landed, and write
        arrived onboards into the cache, releasing their requests. `wait`: finish everything
        in flight (nothing else can run)."""
        if wait:
            self.flush()  # onboards queued since the last launch
        if not (self._reads or self._onboards or self._writes):
            return
        started = time.perf_counter()
        self._land(wait)
        self._start_onboards()  # with `wait`, every read landed: all of them
        self._write_arrived(wait)
        self.counts.copy_seconds += time.perf_counter() - started

    def _read(self, offloads: list[tuple[int, int, int]]) -> None:
        n = len(offloads)
        src, ranks = np.zeros(_padded(n), np.int32), np.zeros(_padded(n), np.int32)
        src[:n] = [block for _, block, _ in offloads]
        ranks[:n] = [rank for rank, _, _ in offloads]
        out = self._gather_jit(self.runner.kv_cache, src, ranks)
        if self.memory_kind is not None:  # an asynchronous device -> host copy
            out = [jax.device_put(a, a.sharding.with_memory_kind(self.memory_kind)) for a in out]
        else:
            for a in out:
                a.copy_to_host_async()
        rows = [rank * self.num_slots + slot for rank, _, slot in offloads]
        self._reads.append(_Copy(out, rows, []))
        self._reading.update(rows)
        self.counts.offloaded_blocks += n
        self.counts.offloaded_bytes += n * self.tiers[0].bytes_per_block

    def _land(self, wait: bool) -> None:
        """Write finished reads into the host buffer, oldest first (a row read twice keeps the
        later bytes); without `wait`, stop at the first not finished."""
        while self._reads and (wait or self._reads[0].ready()):
            copy = self._reads.pop(0)
            for buffer, values in zip(self.buffers, copy.arrays):
                buffer[copy.slots] = np.asarray(values)[: len(copy.slots)]
            self._reading.subtract(copy.slots)
            self._reading += collections.Counter()  # drop zero counts

    def _start_onboards(self) -> None:
        """Start the host -> device transfer of every onboard whose host bytes are in the buffer."""
        ready, later = [], []
        for onboard in self._onboards:
            rank, slot, _, _ = onboard
            (later if self._reading[rank * self.num_slots + slot] else ready).append(onboard)
        self._onboards = later
        if not ready:
            return
        n = len(ready)
        size = _padded(n)
        rows = [rank * self.num_slots + slot for rank, slot, _, _ in ready]
        shardings = self._data_shardings()
        arrays = []
        for buffer, sharding in zip(self.buffers, shardings):
            values = np.zeros((size,) + buffer.shape[1:], buffer.dtype)
            values[:n] = buffer[rows]
            if self.memory_kind is not None:
                values = jax.device_put(values, sharding.with_memory_kind(self.memory_kind))
            arrays.append(jax.device_put(values, sharding))  # asynchronous
        for rank, tier in enumerate(self.tiers):
            tier.release_slots([slot for r, slot, _, _ in ready if r == rank])
        self._writes.append(_Copy(arrays, [], [(rank, block, ticket) for rank, _, block, ticket in ready]))
        self.counts.onboarded_blocks += n
        self.counts.onboarded_bytes += n * self.tiers[0].bytes_per_block

    def _write_arrived(self, wait: bool) -> None:
        """Scatter the transfers that arrived into the cache (one program), oldest first."""
        arrived: list[_Copy] = []
        while self._writes and (wait or self._writes[0].ready()):
            arrived.append(self._writes.pop(0))
        for copy in arrived:
            size = copy.arrays[0].shape[0]
            dst, ranks = np.full(size, _NO_BLOCK, np.int32), np.zeros(size, np.int32)
            for i, (rank, block, ticket) in enumerate(copy.blocks):
                if self.tiers[rank].is_current(block, ticket):  # else evicted meanwhile: dropped
                    dst[i], ranks[i] = block, rank
            self.runner.kv_cache = self._scatter_jit(self.runner.kv_cache, dst, ranks, copy.arrays)
            for rank, tier in enumerate(self.tiers):
                tier.arrived([(block, ticket) for r, block, ticket in copy.blocks if r == rank])

    def _data_shardings(self) -> list[Any]:
        """Where a batch of blocks lives on the devices: the gather's output shardings."""
        if self._block_shardings is None:
            size = _MIN_BATCH
            zeros = np.zeros(size, np.int32)
            compiled = self._gather_jit.lower(self.runner.kv_cache, zeros, zeros).compile()
            self._block_shardings = list(compiled.output_shardings)
        return self._block_shardings

    def warmup(self, max_blocks: int) -> None:
        """Compile the copy programs for every padded batch size up to `max_blocks` (copies
        nothing: the reads are discarded, every write is dropped)."""
        size = _MIN_BATCH
        shardings = self._data_shardings()
        while True:
            zeros = np.zeros(size, np.int32)
            self._gather_jit(self.runner.kv_cache, zeros, zeros)
            data = [
                jax.device_put(np.zeros((size,) + b.shape[1:], b.dtype), sharding)
                for b, sharding in zip(self.buffers, shardings)
            ]
            dst = np.full(size, _NO_BLOCK, np.int32)
            self.runner.kv_cache = self._scatter_jit(self.runner.kv_cache, dst, zeros, data)
            if size >= max_blocks:
                break
            size *= 2

    def stats(self) -> dict:
        """Host-tier fields added to the iteration statistics' `kvCacheStats` (summed over ranks)."""
        tiers, c = self.tiers, self.counts
        return {
            "hostMaxNumBlocks": sum(t.num_slots for t in tiers),
            "hostFreeNumBlocks": sum(t.num_free for t in tiers),
            "hostCachedBlocks": sum(t.num_cached for t in tiers),
            "hostReusedBlocks": sum(t.onboarded_blocks for t in tiers),
            "offloadedBlocks": c.offloaded_blocks,
            "onboardedBlocks": c.onboarded_blocks,
            "offloadedBytes": c.offloaded_bytes,
            "onboardedBytes": c.onboarded_bytes,
            "copyTimeMS": c.copy_seconds * 1e3,
            "onboardingRequests": self.num_waiting,
        }


def _leaf_shape(pages: jax.Array, axis: int, num_blocks: int, attention_dp: bool) -> tuple[int, ...]:
    """One block of a page array in the host buffer ([heads, 1, tokens, dim] under attention DP)."""
    if attention_dp:
        return (pages.shape[1], 1) + pages.shape[3:]
    return _block_shape(pages, axis, num_blocks)


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
    if jax.process_count() > 1:
        # The copies run on the leader's engine thread; the followers would have to mirror
        # them and keep their own devices' shards (not done).
        raise ValueError("kv_cache_config.host_cache_size is not supported on several hosts yet")
    ranks = kv_cache[0].k.shape[0] if attention_dp else 1  # each attention-DP rank has its own tier
    per_block = block_bytes(kv_cache, num_blocks, ranks)
    ram = physical_memory_bytes()
    if ranks > 1 and ram is not None and size * ranks > ram:
        raise ValueError(
            f"kv_cache_config.host_cache_size={size} bytes per attention-DP rank, {ranks} ranks: "
            f"more than this machine's memory ({ram} bytes)"
        )
    if size < per_block:
        raise ValueError(
            f"kv_cache_config.host_cache_size={size} bytes is smaller than one KV block ({per_block} bytes)"
        )
    return HostTier(size // per_block, per_block, min_priority=kv_cfg.secondary_offload_min_priority, events=events)


# The same block copies serve the disaggregated hand-over (`jaxllm.engine.kv_transceiver`).
gather_blocks, scatter_blocks = _gather, _scatter
padded_block_count, leaf_block_shape = _padded, _block_shape
NO_BLOCK = _NO_BLOCK
