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

A stack of slot layers (`layer=l`: buffer [n, num_slots, ...], the layer axis unsplit, the
slot axis split over the expert axis) is written the same way at row l of the stack, l
being a traced argument of the program: one program per (stack shape, m) serves every
layer of the stack, and the rest of the stack is left where it is (donated, in place).

A slot weight that is a pytree of buffers sharing the slot axis (a quantized weight: values,
block scales and offsets, each split by slot over the expert axis) is rewritten leaf by leaf
from the same pytree on the host (`write_slot_weight`), so a slot's scales always hold its
expert's.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def row_buckets(slots_per_rank: int) -> list[int]:
    """Rows per rank an update program is compiled for: powers of two below slots_per_rank, and it."""
    rungs = [1 << i for i in range(max(1, math.ceil(math.log2(max(slots_per_rank, 1)))))]
    return sorted({r for r in rungs if r < slots_per_rank} | {slots_per_rank})


def bucket_for(rows: int, slots_per_rank: int) -> int:
    return next(b for b in row_buckets(slots_per_rank) if b >= rows)


def _row_groups(sharding: NamedSharding, axis: int = 0) -> int:
    """How many pieces dimension `axis` is split into (the EP size for a slot axis)."""
    name = sharding.spec[axis] if len(sharding.spec) > axis else None
    names = () if name is None else ((name,) if isinstance(name, str) else tuple(name))
    return int(np.prod([sharding.mesh.shape[n] for n in names])) if names else 1


def _named_sharding(buffer: jax.Array) -> NamedSharding:
    sharding = buffer.sharding
    if not isinstance(sharding, NamedSharding):
        raise ValueError(f"slot buffers must carry a NamedSharding, got {type(sharding).__name__}")
    return sharding


def _spec_axis(spec: P, axis: int):
    return spec[axis] if len(spec) > axis else None


@functools.cache
def _writer(mesh: jax.sharding.Mesh, spec: P):
    def body(buffer, local_slots, rows):
        return buffer.at[local_slots].set(rows.astype(buffer.dtype), mode="drop")

    index_spec = P(_spec_axis(spec, 0))
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(spec, index_spec, spec), out_specs=spec, check_vma=False),
        donate_argnums=(0,),
    )


@functools.cache
def _stacked_writer(mesh: jax.sharding.Mesh, spec: P):
    """Row `layer` of a stack [n, S, ...]: the same per-rank write at a traced layer index."""

    def body(buffer, layer, local_slots, rows):
        return buffer.at[layer, local_slots].set(rows.astype(buffer.dtype), mode="drop")

    row_spec = P(*tuple(spec)[1:])
    return jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(spec, P(), P(_spec_axis(spec, 1)), row_spec), out_specs=spec, check_vma=False
        ),
        donate_argnums=(0,),
    )


def write_slot_rows(
    buffer: jax.Array,
    slots: np.ndarray,
    source: np.ndarray,
    experts: np.ndarray,
    rows_per_rank: Optional[int] = None,
    layer: Optional[int] = None,
) -> jax.Array:
    """`buffer` with global slot `slots[i]` rewritten to `source[experts[i]]` (source: host [E, ...]),
    in place (the buffer is donated; use the returned array). Each rank receives only its slots' rows.
    With `layer`, `buffer` is a stack of slot layers [n, S, ...] and only its row `layer` is written."""
    sharding = _named_sharding(buffer)
    slot_axis = 0 if layer is None else 1
    if layer is not None and not 0 <= layer < buffer.shape[0]:
        raise ValueError(f"layer {layer} is outside the stack of {buffer.shape[0]} slot layers")
    num_slots = buffer.shape[slot_axis]
    groups = _row_groups(sharding, slot_axis)
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
        local[r, : mine.size] = slots[mine] - r * per_rank
        src[r, : mine.size] = experts[mine]
    src_rows = src.reshape(-1)
    row_shape = buffer.shape[slot_axis + 1 :]
    row_sharding = sharding if layer is None else NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))

    def piece(index: tuple) -> np.ndarray:
        return np.ascontiguousarray(source[src_rows[index[0]]][(slice(None),) + tuple(index[1:])])

    # jax types the callback's index Optional, but always passes one
    rows = jax.make_array_from_callback((groups * m, *row_shape), row_sharding, piece)  # type: ignore[arg-type]
    local_slots = jax.device_put(
        local.reshape(-1), NamedSharding(sharding.mesh, P(_spec_axis(sharding.spec, slot_axis)))
    )
    if layer is None:
        return _writer(sharding.mesh, sharding.spec)(buffer, local_slots, rows)
    index = jax.device_put(np.int32(layer), NamedSharding(sharding.mesh, P()))
    return _stacked_writer(sharding.mesh, sharding.spec)(buffer, index, local_slots, rows)


def warm_up(buffer: jax.Array, source: np.ndarray, stacked: bool = False) -> jax.Array:
    """Run every row bucket once with nothing to write (compiles them; the buffer is unchanged).
    `stacked`: `buffer` is a stack of slot layers (compiles the programs every layer shares)."""
    slot_axis = 1 if stacked else 0
    per_rank = buffer.shape[slot_axis] // _row_groups(_named_sharding(buffer), slot_axis)
    nothing = np.zeros((0,), np.int64)
    for m in row_buckets(per_rank):
        buffer = write_slot_rows(buffer, nothing, source, nothing, rows_per_rank=m, layer=0 if stacked else None)
    return buffer


def write_slot_weight(
    weight: Any, slots: np.ndarray, source: Any, experts: np.ndarray, layer: Optional[int] = None
) -> Any:
    """`write_slot_rows` on every buffer of a slot weight (a pytree whose arrays all have the slot
    axis, e.g. quantized values with their scales), `source` being the same pytree of host rows."""
    return jax.tree.map(lambda b, s: write_slot_rows(b, slots, s, experts, layer=layer), weight, source)
