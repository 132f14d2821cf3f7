"""Rewriting some slots of a slot buffer in place: a jitted, donated, per-rank row write.

A slot buffer [num_slots, ...] is split over the expert axis by slot (rank r owns rows
[r S/ep, (r+1) S/ep)) and possibly over the tensor axis by columns. An update of one
layer replaces the rows of the slots whose expert changes:

- each rank gets only its own changed rows, straight from the host pool
  (`jax.make_array_from_callback`: one host-to-device copy per device, of exactly the
  columns that device keeps), padded to a fixed row count `m` per rank;
- a shard_map program writes them into the rank's local buffer at local slot indices
  (padding rows carry an out-of-range index and are dropped), with the buffer donated:
  the result has the same shape, sharding and, where XLA keeps the alias (it does on
  CPU and GPU), the same device memory.

Programs are compiled per (buffer shape, m) with m from a short ladder (1, 2, 4, ...,
slots per rank), so warming up every rung (`warm_up`) leaves nothing to compile while
serving, whatever the placement.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


def row_buckets(slots_per_rank: int) -> list[int]:
    """Rows per rank an update program is compiled for: powers of two below slots_per_rank, and it."""
    rungs = [1 << i for i in range(max(1, math.ceil(math.log2(max(slots_per_rank, 1)))))]
    return sorted({r for r in rungs if r < slots_per_rank} | {slots_per_rank})


def bucket_for(rows: int, slots_per_rank: int) -> int:
    return next(b for b in row_buckets(slots_per_rank) if b >= rows)


def _row_groups(sharding: NamedSharding) -> int:
    """How many pieces dimension 0 is split into (the EP size for a slot buffer)."""
    axis = sharding.spec[0] if len(sharding.spec) else None
    names = () if axis is None else ((axis,) if isinstance(axis, str) else tuple(axis))
    return int(np.prod([sharding.mesh.shape[n] for n in names])) if names else 1


@functools.lru_cache(maxsize=None)
def _writer(mesh: jax.sharding.Mesh, spec: P):
    def body(buffer, local_slots, rows):
        return buffer.at[local_slots].set(rows.astype(buffer.dtype), mode="drop")

    index_spec = P(spec[0] if len(spec) else None)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, index_spec, spec), out_specs=spec,
                                 check_vma=False), donate_argnums=(0,))


def write_slot_rows(buffer: jax.Array, slots: np.ndarray, source: np.ndarray, experts: np.ndarray,
                    rows_per_rank: Optional[int] = None) -> jax.Array:
    """`buffer` with global slot `slots[i]` rewritten to `source[experts[i]]` (source: host [E, ...]),
    in place (the buffer is donated; use the returned array). Each rank receives only its slots' rows."""
    sharding = buffer.sharding
    if not isinstance(sharding, NamedSharding):
        raise ValueError(f"slot buffers must carry a NamedSharding, got {type(sharding).__name__}")
    num_slots = buffer.shape[0]
    groups = _row_groups(sharding)
    per_rank = num_slots // groups
    slots, experts = np.asarray(slots, np.int64), np.asarray(experts, np.int64)
    rank = slots // per_rank
    need = int(np.bincount(rank, minlength=groups).max()) if slots.size else 0
    m = rows_per_rank if rows_per_rank is not None else bucket_for(max(need, 1), per_rank)
    if need > m:
        raise ValueError(f"{need} rows for one rank do not fit {m} rows per rank")
    local = np.full((groups, m), per_rank, np.int32)  # out of range: dropped
    src = np.zeros((groups, m), np.int64)
    for r in range(groups):
        mine = np.flatnonzero(rank == r)
        local[r, :mine.size] = slots[mine] - r * per_rank
        src[r, :mine.size] = experts[mine]
    src = src.reshape(-1)

    def piece(index: tuple) -> np.ndarray:
        return np.ascontiguousarray(source[src[index[0]]][(slice(None),) + tuple(index[1:])])

    rows = jax.make_array_from_callback((groups * m, *buffer.shape[1:]), sharding, piece)
    local_slots = jax.device_put(local.reshape(-1), NamedSharding(sharding.mesh, P(sharding.spec[0])))
    return _writer(sharding.mesh, sharding.spec)(buffer, local_slots, rows)


def warm_up(buffer: jax.Array, source: np.ndarray) -> jax.Array:
    """Run every row bucket once with nothing to write (compiles them; the buffer is unchanged)."""
    per_rank = buffer.shape[0] // _row_groups(buffer.sharding)
    for m in row_buckets(per_rank):
        buffer = write_slot_rows(buffer, np.zeros((0,), np.int64), source, np.zeros((0,), np.int64), rows_per_rank=m)
    return buffer
