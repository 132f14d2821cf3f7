"""Plain-XLA grouped expert FFN over tokens sorted by expert (the `xla` MoE backend).

Rows `[offset_e, offset_e + group_sizes[e])` belong to expert (or slot) `e`; rows past
`sum(group_sizes)` are padding and come out as zeros. Routing weights are applied by
the caller when combining, so `moe_grouped_ffn_reference` is the pure per-expert SwiGLU
FFN; `moe_fused_ffn_reference` is the whole sort, FFN, unsort and weighted combine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import jax
import jax.numpy as jnp


def moe_grouped_ffn_reference(
    x_sorted: jax.Array,  # [M, H]
    group_sizes: jax.Array,  # int32[E]
    w_gate: jax.Array,  # [E, H, I]
    w_up: jax.Array,  # [E, H, I]
    w_down: jax.Array,  # [E, I, H]
    *,
    hidden_fn: Optional[Callable[[jax.Array], jax.Array]] = None,
) -> jax.Array:
    """`hidden_fn` (row-wise) transforms the SwiGLU output before the down projection."""
    f32 = jnp.float32
    group_sizes = group_sizes.astype(jnp.int32)
    gate = jax.lax.ragged_dot(x_sorted, w_gate, group_sizes, preferred_element_type=f32)
    up = jax.lax.ragged_dot(x_sorted, w_up, group_sizes, preferred_element_type=f32)
    hidden = (jax.nn.silu(gate) * up).astype(x_sorted.dtype)
    if hidden_fn is not None:
        hidden = hidden_fn(hidden)
    out = jax.lax.ragged_dot(hidden, w_down, group_sizes, preferred_element_type=f32)
    valid = jnp.arange(x_sorted.shape[0]) < group_sizes.sum()
    return jnp.where(valid[:, None], out, 0.0).astype(x_sorted.dtype)


def moe_fused_ffn_reference(
    x: jax.Array,  # [T, H]
    expert_ids: jax.Array,  # int32[T, top_k]; ids outside [0, E) are skipped
    routing_weights: jax.Array,  # [T, top_k]
    w_gate: jax.Array,  # [E, H, I]
    w_up: jax.Array,  # [E, H, I]
    w_down: jax.Array,  # [E, I, H]
) -> jax.Array:
    """`sum_k routing_weights[t, k] * FFN_{expert_ids[t, k]}(x[t])`, combined in f32: [T, H]."""
    num_tokens, top_k = expert_ids.shape
    num_groups = w_gate.shape[0]
    ids = expert_ids.reshape(-1).astype(jnp.int32)
    ids = jnp.where((ids >= 0) & (ids < num_groups), ids, num_groups)
    order = jnp.argsort(ids, stable=True)
    group_sizes = jnp.bincount(ids, length=num_groups).astype(jnp.int32)
    y_sorted = moe_grouped_ffn_reference(x[order // top_k], group_sizes, w_gate, w_up, w_down)
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
    out = jnp.einsum(
        "tkh,tk->th", y.reshape(num_tokens, top_k, -1).astype(jnp.float32), routing_weights.astype(jnp.float32)
    )
    return out.astype(x.dtype)
