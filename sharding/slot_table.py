"""The slot table of one MoE layer: which expert each slot holds, and which replica a token uses.

Vocabulary (TensorRT-LLM's): the router outputs ExpertIds; a SlotId is a physical place
holding one expert's weights on one EP rank. There are `num_slots >= num_experts` slots,
rank r owning global slots [r * S / ep, (r + 1) * S / ep); a hot expert may hold several
slots (replicas). The slot weights are one stacked array per projection, [S, ...], split
over the `expert` mesh axis, so each rank keeps a fixed buffer [S / ep, ...].

The table lives on the device with shapes fixed by (num_experts, num_slots) alone:
`expert_slots` is [E, S - E + 1], room for the most replicas any expert can have. A new
placement is therefore new values in the same arrays (and new rows written into the
same slot buffers, `write_slots`), never a new shape: nothing recompiles.

Replica choice is deterministic: the n-th (token, k) row routed to expert e (counting in
the flattened token-major order of the step's valid rows) uses replica n mod c_e of e
(round robin by occurrence, as the reference kernel does). Every replica holds the same
weights, so outputs do not depend on the placement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclass
class SlotTable:
    """Device arrays of one layer's placement (replicated on every device)."""

    slot_to_expert: jax.Array  # int32[S]
    expert_slots: jax.Array  # int32[E, S - E + 1]: the replica slots of each expert (first `replica_counts[e]`)
    replica_counts: jax.Array  # int32[E]

    @property
    def num_slots(self) -> int:
        return int(self.slot_to_expert.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.replica_counts.shape[0])


def default_assignment(num_experts: int, num_slots: int, ep_size: int) -> np.ndarray:
    """The placement with no EPLB config: slot j of rank r holds expert (r * E // ep + j) % E
    (with num_slots == num_experts this is slot s -> expert s)."""
    check_slot_count(num_experts, num_slots, ep_size)
    per_rank = num_slots // ep_size
    return np.asarray(
        [(r * num_experts // ep_size + j) % num_experts for r in range(ep_size) for j in range(per_rank)], np.int32
    )


def check_slot_count(num_experts: int, num_slots: int, ep_size: int) -> None:
    if num_slots < num_experts:
        raise ValueError(f"num_slots={num_slots} is smaller than the model's {num_experts} experts")
    if num_slots % ep_size:
        raise ValueError(f"num_slots={num_slots} is not divisible by the expert-parallel size {ep_size}")


def check_assignment(slot_to_expert: Sequence[int], num_experts: int, ep_size: int, where: str = "") -> np.ndarray:
    """The assignment as int32[S] after checking it is a valid placement (ValueError otherwise)."""
    prefix = f"{where}: " if where else ""
    slots = np.asarray(slot_to_expert)
    if slots.ndim != 1 or not np.issubdtype(slots.dtype, np.integer):
        raise ValueError(f"{prefix}a slot table is one list of integer expert ids, got {slots.dtype} {slots.shape}")
    try:
        check_slot_count(num_experts, len(slots), ep_size)
    except ValueError as e:
        raise ValueError(f"{prefix}{e}") from None
    if slots.min() < 0 or slots.max() >= num_experts:
        raise ValueError(f"{prefix}expert ids must lie in [0, {num_experts}), got {slots.min()}..{slots.max()}")
    missing = np.setdiff1d(np.arange(num_experts), slots)
    if missing.size:
        raise ValueError(f"{prefix}experts {missing[:8].tolist()} have no slot (every expert needs one)")
    return slots.astype(np.int32)


def host_slot_table(slot_to_expert: Sequence[int], num_experts: int) -> dict[str, np.ndarray]:
    """The numpy arrays of a `SlotTable` (replica slots of each expert in ascending slot order)."""
    slots = np.asarray(slot_to_expert, np.int32)
    width = len(slots) - num_experts + 1
    expert_slots = np.zeros((num_experts, width), np.int32)
    counts = np.zeros((num_experts,), np.int32)
    for slot, expert in enumerate(slots):
        expert_slots[expert, counts[expert]] = slot
        counts[expert] += 1
    return dict(slot_to_expert=slots, expert_slots=expert_slots, replica_counts=counts)


def make_slot_table(
    slot_to_expert: Sequence[int], num_experts: int, sharding: Optional[jax.sharding.Sharding] = None
) -> SlotTable:
    arrays = host_slot_table(slot_to_expert, num_experts)
    return SlotTable(**{k: jax.device_put(v, sharding) for k, v in arrays.items()})


def make_stacked_slot_table(
    slot_to_expert: Sequence[Sequence[int]], num_experts: int, sharding: Optional[jax.sharding.Sharding] = None
) -> SlotTable:
    """The tables of a stack of slot layers as one `SlotTable` of [n, ...] arrays (row r: layer r
    of the stack); a scan over the stack hands each layer its own [S] / [E, W] / [E] table."""
    rows = [host_slot_table(t, num_experts) for t in slot_to_expert]
    return SlotTable(**{k: jax.device_put(np.stack([r[k] for r in rows]), sharding) for k in rows[0]})


def resolve_assignments(
    num_experts: int,
    moe_layers: Sequence[int],
    ep_size: int,
    assignments: Optional[Mapping[int, Sequence[int]]] = None,
    num_slots: Optional[int] = None,
) -> dict[int, np.ndarray]:
    """Slot -> expert of every MoE layer: the given ones (checked), the default placement for
    the rest (with the same slot count). Layers that are not MoE layers are refused."""
    given = {int(k): v for k, v in (assignments or {}).items()}
    unknown = sorted(set(given) - set(moe_layers))
    if unknown:
        raise ValueError(
            f"the expert placement names layers {unknown}, which are not MoE layers of the model "
            f"(MoE layers: {list(moe_layers)})"
        )
    sizes = {len(v) for v in given.values()}
    if num_slots is None:
        num_slots = sizes.pop() if len(sizes) == 1 else num_experts
    if sizes - {num_slots}:
        raise ValueError(f"every layer of the placement needs num_slots={num_slots} slots")
    return {
        layer: (
            check_assignment(given[layer], num_experts, ep_size, where=f"layer {layer}")
            if layer in given
            else default_assignment(num_experts, num_slots, ep_size)
        )
        for layer in moe_layers
    }


def choose_slots(
    ids: jax.Array, table: SlotTable, valid: Optional[jax.Array] = None, occurrence_offset: Optional[jax.Array] = None
) -> jax.Array:
    """SlotId of every (token, k) choice, int32[T, k]; rows of invalid tokens get `num_slots`.

    The n-th valid row routed to expert e (token-major order) takes replica n mod c_e.
    `occurrence_offset` (int32[E]) counts rows of each expert that come before these ones
    (the rows of earlier attention-DP ranks), so the round robin runs over the global batch.
    """
    num_tokens, top_k = ids.shape
    num_experts, num_slots = table.num_experts, table.num_slots
    flat = ids.reshape(-1)
    ok = jnp.ones_like(flat, dtype=bool) if valid is None else jnp.repeat(valid, top_k)
    key = jnp.where(ok, flat, num_experts)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=num_experts + 1)
    starts = jnp.cumsum(sizes) - sizes
    occurrence_sorted = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[key[order]].astype(jnp.int32)
    occurrence = jnp.zeros_like(flat).at[order].set(occurrence_sorted, unique_indices=True)
    expert = jnp.clip(flat, 0, num_experts - 1)
    if occurrence_offset is not None:
        occurrence = occurrence + occurrence_offset.astype(occurrence.dtype)[expert]
    replica = occurrence % jnp.maximum(table.replica_counts[expert], 1)
    slots = table.expert_slots[expert, replica]
    return jnp.where(ok, slots, num_slots).astype(jnp.int32).reshape(num_tokens, top_k)


def gather_slot_weights(expert_weights: jax.Array, slot_to_expert: jax.Array) -> jax.Array:
    """Slot weights [S, ...] from a stack of all experts [E, ...] (a host pool or a device array)."""
    return jnp.take(expert_weights, slot_to_expert, axis=0)


def _set_rows(buffer: jax.Array, slots: jax.Array, values: jax.Array) -> jax.Array:
    return buffer.at[slots].set(values.astype(buffer.dtype))


_write_rows = jax.jit(_set_rows)
_write_rows_donated = jax.jit(_set_rows, donate_argnums=(0,))


def write_slots(buffer: jax.Array, slots: jax.Array, values: jax.Array, *, donate: bool = True) -> jax.Array:
    """`buffer` [S, ...] with rows `slots` replaced by `values` [len(slots), ...], written in place
    (the buffer is donated: same shape, same sharding, no recompilation for a new placement)."""
    return (_write_rows_donated if donate else _write_rows)(buffer, slots, values)
