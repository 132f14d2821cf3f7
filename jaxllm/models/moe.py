"""Mixture-of-experts layer: routing, sort by expert, grouped FFN, unsort, weighted combine.

The pieces stay separate so they can be rearranged: `route_topk` gives each token its
top-k ids and weights; `grouped_expert_ffn` takes ids as they should address the
stacked weights (an expert-parallel layout maps ExpertIds to SlotIds in between) and
calls `moe_fn(x_sorted, group_sizes, w_gate, w_up, w_down)`, the grouped GEMM backend.
Shapes are static: every (token, k) pair is one row, M = T * top_k; padding tokens are
sorted past the last group so the backend sees them as padding rows and skips them.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jaxllm.models.config import ModelConfig

MoeFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def route_topk(router_logits: jax.Array, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax over all experts, keep the top k (optionally renormalised to sum to 1).

    Returns (weights float32 [T, k], expert ids int32 [T, k]). With renormalisation this
    equals Mixtral's softmax over the top-k logits.
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def sort_by_expert(ids: jax.Array, num_groups: int, valid: Optional[jax.Array] = None
                   ) -> tuple[jax.Array, jax.Array]:
    """Order of the flattened (token, k) rows grouped by id, and the row count of each group.

    Rows of invalid tokens get the id `num_groups`, so they sort last and are not counted.
    """
    if valid is not None:
        ids = jnp.where(valid[:, None], ids, num_groups)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_groups).astype(jnp.int32)
    return order, group_sizes


def grouped_expert_ffn(x: jax.Array, ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
                       w_up: jax.Array, w_down: jax.Array, *, moe_fn: MoeFn,
                       valid: Optional[jax.Array] = None) -> jax.Array:
    """sum_k weights[t, k] * FFN_{ids[t, k]}(x[t]); the combine runs in float32."""
    num_tokens, top_k = ids.shape
    order, group_sizes = sort_by_expert(ids, w_gate.shape[0], valid)
    x_sorted = x[order // top_k]
    y_sorted = moe_fn(x_sorted, group_sizes, w_gate, w_up, w_down)
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)
    if valid is not None:
        weights = jnp.where(valid[:, None], weights, 0.0)
    out = jnp.einsum("tkh,tk->th", y.reshape(num_tokens, top_k, -1).astype(jnp.float32),
                     weights.astype(jnp.float32))
    return out.astype(x.dtype)


def moe_block(x: jax.Array, p: dict, *, config: ModelConfig, moe_fn: MoeFn,
              valid: Optional[jax.Array] = None) -> jax.Array:
    """The sparse FFN of one layer. p: router [H, E], w_gate/w_up [E, H, I], w_down [E, I, H]."""
    router_logits = jnp.einsum("th,he->te", x, p["router"], preferred_element_type=jnp.float32)
    weights, ids = route_topk(router_logits, config.num_experts_per_tok, config.norm_topk_prob)
    return grouped_expert_ffn(x, ids, weights, p["w_gate"], p["w_up"], p["w_down"], moe_fn=moe_fn, valid=valid)
