"""One process's half of the host KV tier's copies: the host buffer of its own devices' shards
of every offloaded block, and the device programs that move blocks between the cache and it.

The host tier's decisions (which block goes to which host slot, when an onboard may start, when
an arrived one is written) are the leader's (`jaxllm.engine.kv_offload.KvOffloader`). In a
multi-host run every process holds a `HostBlockCopier` for its own devices and makes the same
calls in the same order (the leader's are sent to the followers, `jaxllm.engine.followers`), so
each process offloads and onboards the shards of its own devices: a block's bytes never cross
the process boundary (one exception: under attention DP the read gathers a block onto every
process's devices, so each keeps every rank's block; the cache is sharded by rank).

Host layout: per cache array, per distinct shard of this process's devices, `[rows, *shard
shape]` in numpy; row r is host slot r (attention DP: rank r // slots). A batch of blocks on
the devices has the block axis first and unsharded (`_batch_shardings`), every other axis
sharded as the cache is.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.engine.device_reads import blocking_read
from jaxllm.engine.host_transfer import put_on_mesh
from jaxllm.engine.kv_blocks import (
    MIN_BATCH,
    NO_BLOCK,
    cache_leaves,
    gather_blocks,
    gather_ranked,
    leaf_block_shape,
    scatter_blocks,
    scatter_ranked,
)

ShardKey = tuple[tuple[int, int], ...]


def host_memory_kind(device: Any) -> Optional[str]:
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


def _shard_key(index: tuple, shape: tuple[int, ...]) -> ShardKey:
    """A shard's place in a block batch, without the block axis (slices are not hashable)."""
    return tuple(s.indices(n)[:2] for s, n in zip(index[1:], shape[1:]))


def _batch_sharding(pages: jax.Array, axis: int, attention_dp: bool) -> Any:
    """Where a batch of blocks of `pages` lives: block axis first and replicated, the others
    sharded as the cache is (the layer axis takes the place of the pages axis)."""
    sharding = pages.sharding
    if not isinstance(sharding, NamedSharding):
        return None  # one device: the compiler's choice is that device
    spec = tuple(sharding.spec) + (None,) * (pages.ndim - len(sharding.spec))
    if attention_dp:  # [ranks, heads, blocks, tokens, dim] -> [n, heads, 1, tokens, dim]
        rest = (spec[1], None) + spec[3:]
    else:  # [..., layers * blocks, ...] -> [n, ..., layers, ...]
        rest = spec[:axis] + (None,) + spec[axis + 1 :]
    return NamedSharding(sharding.mesh, PartitionSpec(None, *rest))


def _from_shards(shape: tuple[int, ...], sharding: Any, shards: dict[ShardKey, np.ndarray]) -> jax.Array:
    """The array of `shape` whose shard on each of this process's devices is `shards[key]`."""
    return jax.make_array_from_callback(shape, sharding, lambda index: shards[_shard_key(index, shape)])


def _zero_batch(shards: dict[ShardKey, np.ndarray], size: int) -> dict[ShardKey, np.ndarray]:
    return {key: np.zeros((size,) + buffer.shape[1:], buffer.dtype) for key, buffer in shards.items()}


@dataclass
class _Copy:
    """A batch of copies on its way: device -> host reads of buffer `rows`, or host -> device
    writes (`rows` empty)."""

    arrays: list[jax.Array]
    rows: list[int]

    def ready(self) -> bool:
        return all(a.is_ready() for a in self.arrays)


class HostBlockCopier:
    """This process's host buffer and block copies. `read` starts device -> host copies of a
    batch of blocks into buffer rows, `start` the host -> device copies of buffer rows, `write`
    scatters the oldest started batch into the cache. Reads land in the buffer oldest first
    (`land`; a row read twice keeps the later bytes); `start` lands the reads of its rows first."""

    def __init__(self, runner: Any, rows: int, num_blocks: int, attention_dp: bool) -> None:
        self.runner, self.rows, self.num_blocks, self.attention_dp = runner, rows, num_blocks, attention_dp
        leaves = cache_leaves(runner.kv_cache)
        out = [_batch_sharding(pages, axis, attention_dp) for pages, axis in leaves]
        out_shardings = None if None in out else out
        shardings = jax.tree.map(lambda a: a.sharding, runner.kv_cache)
        if attention_dp:
            self._gather_jit = jax.jit(gather_ranked, out_shardings=out_shardings)
            self._scatter_jit = jax.jit(scatter_ranked, donate_argnums=(0,), out_shardings=shardings)
        else:
            self._gather_jit = jax.jit(
                lambda cache, src, ranks: gather_blocks(cache, src, num_blocks=num_blocks), out_shardings=out_shardings
            )
            self._scatter_jit = jax.jit(
                lambda cache, dst, ranks, data: scatter_blocks(cache, dst, data, num_blocks=num_blocks),
                donate_argnums=(0,),
                out_shardings=shardings,
            )
        self.memory_kind = host_memory_kind(next(iter(leaves[0][0].sharding.device_set)))
        cache_sharding = leaves[0][0].sharding
        # Several processes: each puts its own devices' piece of the block ids (no collective).
        self._ids_sharding = (
            NamedSharding(cache_sharding.mesh, PartitionSpec())
            if jax.process_count() > 1 and isinstance(cache_sharding, NamedSharding)
            else None
        )
        zeros = np.zeros(MIN_BATCH, np.int32)
        compiled = self._gather_jit.lower(runner.kv_cache, zeros, zeros).compile()
        self.shardings: list[Any] = list(compiled.output_shardings)  # of a batch of blocks
        self.block_shapes = [_leaf_shape(pages, axis, num_blocks, attention_dp) for pages, axis in leaves]
        # Per cache array: this process's distinct shards of a block, each `[rows, *shard shape]`.
        self.buffers: list[dict[ShardKey, np.ndarray]] = []
        for (pages, _), sharding, block in zip(leaves, self.shardings, self.block_shapes):
            shape = (MIN_BATCH,) + block
            shards: dict[ShardKey, np.ndarray] = {}
            for index in sharding.addressable_devices_indices_map(shape).values():
                key = _shard_key(index, shape)
                if key not in shards:
                    shards[key] = np.zeros((rows,) + tuple(b - a for a, b in key), pages.dtype)
            self.buffers.append(shards)
        self._reads: list[_Copy] = []  # on their way to the buffer, oldest first
        self._reading: collections.Counter = collections.Counter()  # buffer row -> reads in flight
        self._writes: list[_Copy] = []  # on their way to the device, oldest first

    @property
    def host_bytes(self) -> int:
        """Bytes of this process's host buffer."""
        return sum(b.nbytes for shards in self.buffers for b in shards.values())

    @property
    def reads_in_flight(self) -> int:
        return sum(len(c.rows) for c in self._reads)

    def reading(self, row: int) -> bool:
        """Whether a read into buffer `row` has not landed yet."""
        return self._reading[row] > 0

    def read(self, src: np.ndarray, ranks: np.ndarray, rows: list[int]) -> None:
        """Copy blocks `src[:len(rows)]` (of attention-DP `ranks`) into buffer `rows`: one gather
        program, ordered before the next step (which may overwrite them), then an asynchronous
        device -> host copy."""
        out = self._gather_jit(self.runner.kv_cache, *self._ids(src, ranks))
        if self.memory_kind is not None:
            out = [jax.device_put(a, a.sharding.with_memory_kind(self.memory_kind)) for a in out]
        else:
            for a in out:
                a.copy_to_host_async()
        self._reads.append(_Copy(out, rows))
        self._reading.update(rows)
        self.land(wait=False)

    def land(self, wait: bool) -> None:
        """Write finished reads into the buffer, oldest first; without `wait`, stop at the first
        not finished."""
        while self._reads and (wait or self._reads[0].ready()):
            self._land_oldest()

    def _land_oldest(self) -> None:
        copy = self._reads.pop(0)
        n = len(copy.rows)
        with blocking_read():  # one batch of blocks, its copies started when it was read
            for shards, values in zip(self.buffers, copy.arrays):
                done = set()
                for shard in values.addressable_shards:
                    key = _shard_key(shard.index, values.shape)
                    if key not in done:
                        shards[key][copy.rows] = np.asarray(shard.data)[:n]
                        done.add(key)
        self._reading.subtract(copy.rows)
        self._reading += collections.Counter()  # drop zero counts

    def start(self, rows: list[int], size: int) -> None:
        """Start the host -> device copy of buffer `rows` as a batch of `size` blocks (padded
        with zeros), after the reads into those rows landed."""
        while any(self._reading[row] for row in rows):
            self._land_oldest()
        arrays = []
        n = len(rows)
        for shards, sharding, block in zip(self.buffers, self.shardings, self.block_shapes):
            shape = (size,) + block
            values = _zero_batch(shards, size)
            for key, buffer in shards.items():
                values[key][:n] = buffer[rows]
            if self.memory_kind is not None:
                staged = _from_shards(shape, sharding.with_memory_kind(self.memory_kind), values)
                arrays.append(jax.device_put(staged, sharding))  # asynchronous
            else:
                arrays.append(_from_shards(shape, sharding, values))
        self._writes.append(_Copy(arrays, []))
        self.land(wait=False)

    def oldest_write_ready(self) -> bool:
        return bool(self._writes) and self._writes[0].ready()

    def write(self, dst: np.ndarray, ranks: np.ndarray) -> None:
        """Scatter the oldest started batch into the cache's blocks `dst` (of `ranks`; a block
        out of range is dropped): one program, ordered before the next step."""
        copy = self._writes.pop(0)
        self.runner.kv_cache = self._scatter_jit(self.runner.kv_cache, *self._ids(dst, ranks), copy.arrays)

    def _ids(self, *arrays: np.ndarray) -> tuple:
        return arrays if self._ids_sharding is None else tuple(put_on_mesh(list(arrays), self._ids_sharding))

    def warmup(self, max_blocks: int) -> None:
        """Compile the copy programs for every padded batch size up to `max_blocks` (copies
        nothing: the reads are discarded, every write is dropped)."""
        size = MIN_BATCH
        while True:
            zeros = np.zeros(size, np.int32)
            self._gather_jit(self.runner.kv_cache, zeros, zeros)
            data = [
                _from_shards((size,) + block, sharding, _zero_batch(shards, size))
                for block, sharding, shards in zip(self.block_shapes, self.shardings, self.buffers)
            ]
            dst = np.full(size, NO_BLOCK, np.int32)
            self.runner.kv_cache = self._scatter_jit(self.runner.kv_cache, dst, zeros, data)
            if size >= max_blocks:
                break
            size *= 2


def _leaf_shape(pages: jax.Array, axis: int, num_blocks: int, attention_dp: bool) -> tuple[int, ...]:
    """One block of a page array ([heads, 1, tokens, dim] under attention DP)."""
    if attention_dp:
        return (pages.shape[1], 1) + pages.shape[3:]
    return leaf_block_shape(pages, axis, num_blocks)
