"""Ragged paged attention in plain XLA over query tiles (the engine's `xla` backend).

The reference gathers one KV block per *token* per step, so a 1024-token prefill chunk
copies every key 1024 times. Here the query tokens are grouped into tiles of
`block_q` consecutive tokens of one sequence (built on device from `cu_q_lens`), and a
KV block is gathered once per tile. Decode tokens get tiles of their own, so the tile
size is picked from the bucket: about tokens per sequence, a power of two up to 64.
Same contract as `ragged_paged_attention_reference`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.reference import (
    finish_online_softmax, init_online_softmax, online_softmax_update, ragged_paged_attention_reference)


def default_block_q(num_tokens: int, max_seqs: int) -> int:
    per_seq = max(1, num_tokens // max(max_seqs, 1))
    return int(min(64, 1 << (per_seq.bit_length() - 1)))


def ragged_paged_attention_tiled(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [Hkv, num_blocks, tokens_per_block, D]
    v_cache: jax.Array,
    kv_lens: jax.Array,  # int32[S]
    block_tables: jax.Array,  # int32[S, max_blocks_per_seq]
    cu_q_lens: jax.Array,  # int32[S + 1]
    num_seqs: jax.Array,  # int32[1]
    *,
    sm_scale: float,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    block_q: Optional[int] = None,
) -> jax.Array:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_blocks, tokens_per_block, _ = k_cache.shape
    max_seqs, max_blocks = block_tables.shape
    block_tables = jnp.clip(block_tables, 0, num_blocks - 1)  # as the reference
    group = num_q_heads // num_kv_heads
    bq = block_q or default_block_q(num_tokens, max_seqs)
    if bq == 1:  # one token per tile: the reference's per-token walk is exactly that
        return ragged_paged_attention_reference(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
                                                sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    i32 = jnp.int32

    # Tile table: tile t covers tokens [first[t], first[t] + valid[t]) of sequence seq[t].
    live = jnp.arange(max_seqs) < num_seqs[0]
    q_len = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    tiles_per_seq = (q_len + bq - 1) // bq
    tile_end = jnp.cumsum(tiles_per_seq)
    tile_start = tile_end - tiles_per_seq
    max_tiles = -(-num_tokens // bq) + min(max_seqs, num_tokens)
    t = jnp.arange(max_tiles, dtype=i32)
    seq = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), max_seqs - 1).astype(i32)
    within = (t - tile_start[seq]) * bq
    tile_live = t < tile_end[-1]
    n_valid = jnp.where(tile_live, jnp.clip(q_len[seq] - within, 0, bq), 0)
    b = jnp.arange(bq, dtype=i32)
    token = cu_q_lens[seq][:, None] + within[:, None] + b[None, :]  # [NT, bq]
    token_valid = b[None, :] < n_valid[:, None]
    position = jnp.where(token_valid, (kv_lens[seq] - q_len[seq] + within)[:, None] + b[None, :], -1)

    qt = q[jnp.clip(token, 0, num_tokens - 1)].astype(jnp.float32) * sm_scale
    qt = qt.reshape(max_tiles, bq, num_kv_heads, group, head_dim)
    last_block = jnp.where(token_valid, position // tokens_per_block, -1).max()
    first_block = 0
    if sliding_window is not None:
        first_pos = jnp.where(token_valid, jnp.maximum(position - sliding_window + 1, 0), jnp.iinfo(i32).max)
        first_block = jnp.minimum(first_pos.min() // tokens_per_block, max_blocks)
    offsets = jnp.arange(tokens_per_block, dtype=i32)

    def visit_block(j, carry):
        blocks = block_tables[seq, j]  # [NT]
        k = jnp.swapaxes(k_cache[:, blocks], 0, 1).astype(jnp.float32)  # [NT, Hkv, tpb, D]
        v = jnp.swapaxes(v_cache[:, blocks], 0, 1).astype(jnp.float32)
        scores = jnp.einsum("tbhgd,thkd->tbhgk", qt, k)
        key_pos = j * tokens_per_block + offsets
        allowed = key_pos[None, None, :] <= position[:, :, None]
        if sliding_window is not None:
            allowed &= key_pos[None, None, :] > position[:, :, None] - sliding_window
        return online_softmax_update(carry, scores, allowed[:, :, None, None, :],
                                     lambda probs: jnp.einsum("tbhgk,thkd->tbhgd", probs, v), soft_cap=soft_cap)

    init = init_online_softmax((max_tiles, bq, num_kv_heads, group), head_dim)
    _, denom, acc = jax.lax.fori_loop(first_block, jnp.minimum(last_block + 1, max_blocks), visit_block, init)
    out = finish_online_softmax(denom, acc)
    out = out.reshape(max_tiles * bq, num_q_heads, head_dim).astype(q.dtype)
    dest = jnp.where(token_valid, token, num_tokens).reshape(-1)
    return jnp.zeros_like(q).at[dest].set(out, mode="drop")
