"""Plain-XLA ragged paged attention: the reference every attention kernel is checked against.

It is also the engine's `xla` attention backend (the default on CPU), so it must be
jittable with static shapes and must not materialise a [tokens, max_seq_len] key tensor:
it walks the KV blocks with an online softmax, gathering one block per token per step.

Metadata (see `jaxllm.step_batch.StepBatch`): sequence `s` owns query tokens
`cu_q_lens[s]:cu_q_lens[s+1]`; its KV length after this step is `kv_lens[s]`, so its
query token `i` sits at position `kv_lens[s] - q_len(s) + i` and sees keys at positions
`<= ` its own (and `> pos - sliding_window` when a window is set). Tokens past
`cu_q_lens[num_seqs]` are padding and get zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import jax
import jax.numpy as jnp

_MASK_VALUE = -1e30


def token_metadata(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, num_tokens: int):
    """Per-token (sequence id, absolute position, valid) derived from the ragged metadata."""
    num_slots = kv_lens.shape[0]
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_id = jnp.searchsorted(cu_q_lens[1:], tok, side="right").astype(jnp.int32)
    seq_id = jnp.minimum(seq_id, num_slots - 1)
    valid = tok < cu_q_lens[num_seqs[0]]
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]
    position = kv_lens[seq_id] - q_len[seq_id] + (tok - cu_q_lens[seq_id])
    return seq_id, jnp.where(valid, position, -1), valid


def init_online_softmax(rows_shape: tuple[int, ...], head_dim: int):
    """(running max, denominator, accumulator) before any key has been seen."""
    return (
        jnp.full(rows_shape, _MASK_VALUE, jnp.float32),
        jnp.zeros(rows_shape, jnp.float32),
        jnp.zeros(rows_shape + (head_dim,), jnp.float32),
    )


def online_softmax_update(
    carry, scores: jax.Array, allowed: jax.Array, weigh_values: Callable, *, soft_cap: Optional[float]
):
    """Fold one block of keys (`scores[..., keys]`, masked by `allowed`) into the running
    softmax; `weigh_values(probs)` contracts the probabilities with that block's values."""
    running_max, denom, acc = carry
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(allowed, scores, _MASK_VALUE)
    new_max = jnp.maximum(running_max, scores.max(axis=-1))
    probs = jnp.where(allowed, jnp.exp(scores - new_max[..., None]), 0.0)
    correction = jnp.exp(running_max - new_max)
    denom = denom * correction + probs.sum(axis=-1)
    acc = acc * correction[..., None] + weigh_values(probs)
    return new_max, denom, acc


def finish_online_softmax(denom: jax.Array, acc: jax.Array) -> jax.Array:
    """Normalised output; rows that saw no key come out as zeros."""
    return jnp.where(denom[..., None] > 0, acc / jnp.maximum(denom[..., None], 1e-30), 0.0)


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [Hkv, num_blocks, tokens_per_block, D]
    v_cache: jax.Array,  # [Hkv, num_blocks, tokens_per_block, D]
    kv_lens: jax.Array,  # int32[S]
    block_tables: jax.Array,  # int32[S, max_blocks_per_seq]
    cu_q_lens: jax.Array,  # int32[S + 1]
    num_seqs: jax.Array,  # int32[1]
    *,
    sm_scale: float,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
) -> jax.Array:
    kv_lens, block_tables, cu_q_lens, num_seqs = (
        jnp.asarray(a, jnp.int32) for a in (kv_lens, block_tables, cu_q_lens, num_seqs)
    )
    q, k_cache, v_cache = jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_blocks, tokens_per_block, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    block_tables = jnp.clip(block_tables, 0, num_blocks - 1)  # a bad id never leaves the cache
    group = num_q_heads // num_kv_heads
    if group * num_kv_heads != num_q_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")

    seq_id, position, valid = token_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens)
    qg = (q.astype(jnp.float32) * sm_scale).reshape(num_tokens, num_kv_heads, group, head_dim)
    first_block = jnp.zeros_like(position)
    if sliding_window is not None:
        first_block = jnp.maximum(position - sliding_window + 1, 0) // tokens_per_block
    last_block = jnp.where(valid, position // tokens_per_block, -1)
    start = jnp.min(jnp.where(valid, first_block, max_blocks))
    stop = jnp.minimum(jnp.max(last_block) + 1, max_blocks)
    key_offsets = jnp.arange(tokens_per_block, dtype=jnp.int32)

    def visit_block(j, carry):
        block_ids = block_tables[seq_id, j]  # [T]
        k = jnp.swapaxes(k_cache[:, block_ids], 0, 1).astype(jnp.float32)  # [T, Hkv, tpb, D]
        v = jnp.swapaxes(v_cache[:, block_ids], 0, 1).astype(jnp.float32)
        scores = jnp.einsum("thgd,thkd->thgk", qg, k)
        key_pos = j * tokens_per_block + key_offsets  # [tpb]
        allowed = key_pos[None, :] <= position[:, None]
        if sliding_window is not None:
            allowed &= key_pos[None, :] > position[:, None] - sliding_window
        return online_softmax_update(
            carry,
            scores,
            allowed[:, None, None, :],
            lambda probs: jnp.einsum("thgk,thkd->thgd", probs, v),
            soft_cap=soft_cap,
        )

    init = init_online_softmax((num_tokens, num_kv_heads, group), head_dim)
    _, denom, acc = jax.lax.fori_loop(start, stop, visit_block, init)
    out = finish_online_softmax(denom, acc)
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def ragged_paged_latent_attention_reference(
    q: jax.Array,  # [T, Hq, L]
    latent_cache: jax.Array,  # [num_blocks, tokens_per_block, L]
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    value_dim: int,
) -> jax.Array:
    """Multi-head latent attention's absorbed form: the latent rows are the keys of one KV head
    shared by all query heads, their first `value_dim` columns its values. [T, Hq, value_dim]."""
    kv = jnp.asarray(latent_cache)[None]
    return ragged_paged_attention_reference(q, kv, kv, kv_lens, block_tables, cu_q_lens, num_seqs, sm_scale=sm_scale)[
        ..., :value_dim
    ]
