"""Plain-XLA grouped expert FFN over tokens sorted by expert (the `xla` MoE backend).

Rows `[offset_e, offset_e + group_sizes[e])` belong to expert (or slot) `e`; rows past
`sum(group_sizes)` are padding and come out as zeros. Routing weights are applied by
the caller when combining, so this function is the pure per-expert SwiGLU FFN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def moe_grouped_ffn_reference(
    x_sorted: jax.Array,  # [M, H]
    group_sizes: jax.Array,  # int32[E]
    w_gate: jax.Array,  # [E, H, I]
    w_up: jax.Array,  # [E, H, I]
    w_down: jax.Array,  # [E, I, H]
) -> jax.Array:
    f32 = jnp.float32
    group_sizes = group_sizes.astype(jnp.int32)
    gate = jax.lax.ragged_dot(x_sorted, w_gate, group_sizes, preferred_element_type=f32)
    up = jax.lax.ragged_dot(x_sorted, w_up, group_sizes, preferred_element_type=f32)
    hidden = (jax.nn.silu(gate) * up).astype(x_sorted.dtype)
    out = jax.lax.ragged_dot(hidden, w_down, group_sizes, preferred_element_type=f32)
    valid = jnp.arange(x_sorted.shape[0]) < group_sizes.sum()
    return jnp.where(valid[:, None], out, 0.0).astype(x_sorted.dtype)
