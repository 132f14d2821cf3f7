"""On-device expert load of a step: tokens per expert per MoE layer, and its decayed sum.

Counts are taken from the router's top-k choices over the step's whole (global) batch,
before any replica or rank is chosen, so they are per ExpertId and independent of the
placement. They cost one bincount per layer and only reach the output when the caller asks
for them (`forward_with_moe_stats`); the plain forward traces them too, but drops them, so
XLA removes them from its compiled program.

The online balancer keeps `load = decay * load + counts` per step (decay 0.95, as
TensorRT-LLM does) and resets a layer's row after its placement changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp

LOAD_DECAY = 0.95


@jax.tree_util.register_dataclass
@dataclass
class MoeStepStats:
    """Per-step MoE figures, stacked over the model's MoE layers (in layer order)."""

    expert_counts: jax.Array  # int32[num_moe_layers, num_experts]: (token, k) rows routed to each expert
    dropped_rows: jax.Array  # int32[num_moe_layers]: rows dropped by a capacity-limited dispatch


def count_experts(ids: jax.Array, num_experts: int, valid: Optional[jax.Array] = None) -> jax.Array:
    """int32[num_experts]: how many valid (token, k) rows chose each expert."""
    flat = ids.reshape(-1)
    if valid is not None:
        flat = jnp.where(jnp.repeat(valid, ids.shape[1]), flat, num_experts)
    return jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def decay_expert_load(
    load: jax.Array, counts: jax.Array, decay: float = LOAD_DECAY, reset_layers: Optional[jax.Array] = None
) -> jax.Array:
    """float32 load [L, E] after one step: decay * load + counts; rows where `reset_layers`
    (bool [L]) is set start again from this step's counts."""
    kept = decay * load.astype(jnp.float32)
    if reset_layers is not None:
        kept = jnp.where(reset_layers[:, None], 0.0, kept)
    return kept + counts.astype(jnp.float32)
