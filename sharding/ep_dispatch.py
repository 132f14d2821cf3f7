"""Model-independent pieces of the expert-parallel dispatch (`jaxllm.models.ep_moe`):
the rows each rank may send to one destination through an all_to_all, and
`jax.lax.ragged_all_to_all` emulated by a dense all_to_all for platforms without it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def a2a_capacity(
    tokens_per_rank: int, top_k: int, slots_per_rank: int, ep_size: int, capacity_factor: float | None
) -> int:
    """Rows each rank may send to one destination in one step."""
    dropless = tokens_per_rank * min(top_k, slots_per_rank)
    if capacity_factor is None:
        return dropless
    return max(1, min(dropless, math.ceil(capacity_factor * tokens_per_rank * top_k / ep_size)))


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """`jax.lax.ragged_all_to_all`'s semantics (one slice per peer) from a dense all_to_all:
    every slice is padded to the operand's length on the wire."""
    n = input_offsets.shape[0]
    length = operand.shape[0]
    idx = jnp.arange(length, dtype=jnp.int32)
    blocks = operand[jnp.clip(input_offsets[:, None] + idx[None, :], 0, length - 1)]  # [n, length, ...]
    recv = jax.lax.all_to_all(blocks.reshape((n * length,) + operand.shape[1:]), axis_name, 0, 0, tiled=True)
    starts = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each sender writes here
    pos = jnp.where(idx[None, :] < recv_sizes[:, None], starts[:, None] + idx[None, :], output.shape[0])
    return output.at[pos.reshape(-1)].set(recv, mode="drop")
