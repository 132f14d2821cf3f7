"""Ragged paged attention in plain XLA over a work list of (query tile, KV block) pairs (the
engine's `xla` backend).

The reference walks KV blocks for every token up to the step's longest sequence, gathering
one block per token per step: a 1024-token prefill chunk copies every key 1024 times, and a
decode step of short and long sequences reads the long ones' length for all of them. Here
the query tokens are grouped into tiles of `block_q` consecutive tokens of one sequence
(one token per tile for decode buckets), and each tile lists only the KV blocks it sees
(causal prefix, sliding window): the work list. The loop takes `items_per_step` pairs at a
time, each iteration a few large gathers and two batched matmuls (XLA:CPU runs many tiny
ones poorly); each pair's softmax partial (max, denominator, weighted values) is merged
into its tile's running state by scatter. Same contract as `ragged_paged_attention_reference`.

The loop's trip count comes from the shapes (`max_work_items`: every tile seeing every
block of its table, or of its sliding window), never from the step's data: XLA on a GPU
runs a `while` whose trip count lives on the device by reading its predicate back to the
host on every iteration. Items past the step's real work are masked, so a step costs its
shapes' worst case: every token at the longest context. A caller that knows the step's
real work on the host passes a smaller static bound (`max_items`, from the ladder of
`work_tiers`, counted by `step_work_items`): one program per rung, chosen per step.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

_MASK_VALUE = -1e30


def default_block_q(num_tokens: int, max_seqs: int) -> int:
    """About tokens per sequence, as a power of two up to 64 (1 for decode buckets)."""
    per_seq = max(1, num_tokens // max(max_seqs, 1))
    return int(min(64, 1 << (per_seq.bit_length() - 1)))


def default_items_per_step(num_kv_heads: int, tokens_per_block: int, head_dim: int) -> int:
    """(tile, block) pairs per loop iteration: about 128K gathered key elements, a power of two."""
    per_item = num_kv_heads * tokens_per_block * head_dim
    return int(max(4, min(256, 1 << max(0, (131072 // per_item).bit_length() - 1))))


def max_work_items(
    max_tiles: int, max_blocks: int, tokens_per_block: int, block_q: int, sliding_window: Optional[int]
) -> int:
    """(tile, KV block) pairs a step of these shapes can list: each tile sees at most every block
    of its table, and with a sliding window at most the blocks its window and tokens span."""
    per_tile = max_blocks
    if sliding_window is not None:
        per_tile = min(max_blocks, (sliding_window + block_q - 2) // tokens_per_block + 2)
    return max_tiles * per_tile


def tile_size(num_tokens: int, max_seqs: int, block_q: Optional[int] = None) -> int:
    """The query tile of a step of these shapes (`block_q`, else `default_block_q`)."""
    return block_q or default_block_q(num_tokens, max_seqs)


def max_tiles_of(num_tokens: int, max_seqs: int, block_q: int) -> int:
    """Query tiles a step of these shapes can hold: one per token for decode buckets, else a
    tile per `block_q` tokens plus one partial tile per sequence."""
    return num_tokens if block_q == 1 else -(-num_tokens // block_q) + min(max_seqs, num_tokens)


def step_work_items(
    q_lens: np.ndarray, kv_lens: np.ndarray, num_tokens: int, max_seqs: int, tokens_per_block: int
) -> int:
    """On the host: the (tile, KV block) pairs the kernel lists for a step (no sliding window,
    which only removes pairs), from each live sequence's query and KV lengths."""
    bq = tile_size(num_tokens, max_seqs)
    q = np.asarray(q_lens, np.int64)
    live = q > 0
    q, first = q[live], np.asarray(kv_lens, np.int64)[live] - q[live]  # first: the chunk's first position
    tiles = (q + bq - 1) // bq
    seq = np.repeat(np.arange(q.size), tiles)
    j = np.arange(seq.size) - np.repeat(np.cumsum(tiles) - tiles, tiles)  # tile index within its chunk
    end = np.minimum((j + 1) * bq, q[seq])  # one past each tile's last token, within the chunk
    return int(((first[seq] + end - 1) // tokens_per_block + 1).sum())


def work_tiers(bound: int, per_step: int) -> tuple[int, ...]:
    """Smaller static bounds worth a program of their own below the shapes' `bound`: per_step
    times powers of two, each at most a quarter of `bound` (empty when the bound is a few
    loop iterations anyway). A step runs at most twice its real loop iterations."""
    tiers, tier = [], per_step
    while tier * 4 <= bound:
        tiers.append(tier)
        tier *= 2
    return tuple(tiers)


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
    items_per_step: Optional[int] = None,
    max_items: Optional[int] = None,
) -> jax.Array:
    """`max_items`: a static bound on the step's (tile, KV block) pairs that the caller
    guarantees (`step_work_items` <= max_items); pairs past it would be dropped."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_blocks, tokens_per_block, _ = k_cache.shape
    max_seqs, max_blocks = block_tables.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    block_tables = jnp.clip(block_tables, 0, num_blocks - 1)  # as the reference
    group = num_q_heads // num_kv_heads
    bq = tile_size(num_tokens, max_seqs, block_q)
    rows = bq * group  # query rows of one KV head in a tile
    i32, f32 = jnp.int32, jnp.float32

    # Tile table: tile t covers tokens token[t, :n_valid[t]] of sequence seq[t].
    live = jnp.arange(max_seqs) < num_seqs[0]
    q_len = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    if bq == 1:
        max_tiles = num_tokens
        t = jnp.arange(max_tiles, dtype=i32)
        seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], t, side="right"), max_seqs - 1).astype(i32)
        within = t - cu_q_lens[seq]
        n_valid = (t < cu_q_lens[num_seqs[0]]).astype(i32)
        token = t[:, None]
    else:
        tiles_per_seq = (q_len + bq - 1) // bq
        tile_end = jnp.cumsum(tiles_per_seq)
        tile_start = tile_end - tiles_per_seq
        max_tiles = max_tiles_of(num_tokens, max_seqs, bq)
        t = jnp.arange(max_tiles, dtype=i32)
        seq = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), max_seqs - 1).astype(i32)
        within = (t - tile_start[seq]) * bq
        n_valid = jnp.where(t < tile_end[-1], jnp.clip(q_len[seq] - within, 0, bq), 0)
        token = cu_q_lens[seq][:, None] + within[:, None] + jnp.arange(bq, dtype=i32)[None, :]
    b = jnp.arange(bq, dtype=i32)
    token_valid = b[None, :] < n_valid[:, None]  # [NT, bq]
    first_pos = kv_lens[seq] - q_len[seq] + within  # position of each tile's first token
    position = jnp.where(token_valid, first_pos[:, None] + b[None, :], -1)

    # Work list: tile t sees blocks first_block[t] .. last_block[t], items item_start[t] onwards.
    last_block = jnp.minimum((first_pos + n_valid - 1) // tokens_per_block, max_blocks - 1)
    first_block = jnp.zeros_like(last_block)
    if sliding_window is not None:
        first_block = jnp.maximum(first_pos - sliding_window + 1, 0) // tokens_per_block
    num_items = jnp.where(n_valid > 0, jnp.maximum(last_block - first_block + 1, 0), 0)
    item_end = jnp.cumsum(num_items)
    item_start = item_end - num_items
    total_items = item_end[-1]

    # Queries as [NT, Hkv, bq * G, D]: the rows one KV head serves in a tile.
    qt = q[:, None] if bq == 1 else q[jnp.clip(token, 0, num_tokens - 1)]  # [NT, bq, Hq, D]
    qt = qt.astype(f32) * sm_scale
    qt = qt.reshape(max_tiles, bq, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qt = qt.reshape(max_tiles, num_kv_heads, rows, head_dim)
    row_pos = jnp.repeat(position, group, axis=1)  # [NT, rows], row r = (token r // G, head r % G)

    per_step = items_per_step or default_items_per_step(num_kv_heads, tokens_per_block, head_dim)
    offsets = jnp.arange(tokens_per_block, dtype=i32)

    def visit(c, state):
        m_s, l_s, acc_s = state
        item = c * per_step + jnp.arange(per_step, dtype=i32)
        tile = jnp.searchsorted(item_end, item, side="right", method="compare_all")
        tile = jnp.minimum(tile, max_tiles - 1).astype(i32)
        item_live = item < total_items
        blk = jnp.clip(first_block[tile] + item - item_start[tile], 0, max_blocks - 1)
        block_ids = block_tables[seq[tile], blk]  # [P]
        k = jnp.swapaxes(k_cache[:, block_ids], 0, 1).astype(f32)  # [P, Hkv, tpb, D]
        v = jnp.swapaxes(v_cache[:, block_ids], 0, 1).astype(f32)
        key_pos = blk[:, None] * tokens_per_block + offsets[None, :]  # [P, tpb]
        rp = row_pos[tile]  # [P, rows]
        allowed = (key_pos[:, None, :] <= rp[:, :, None]) & item_live[:, None, None]
        if sliding_window is not None:
            allowed &= key_pos[:, None, :] > rp[:, :, None] - sliding_window
        allowed = allowed[:, None]  # [P, 1, rows, tpb]
        scores = jnp.einsum("phmd,phkd->phmk", qt[tile], k)
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        scores = jnp.where(allowed, scores, _MASK_VALUE)
        m = scores.max(axis=-1)  # [P, Hkv, rows]
        probs = jnp.where(allowed, jnp.exp(scores - m[..., None]), 0.0)
        o = jnp.einsum("phmk,phkd->phmd", probs, v)
        # Merge the partials into their tiles' running softmax (several items may share a tile).
        dest = jnp.where(item_live, tile, max_tiles)
        m_new = m_s.at[dest].max(m, mode="drop")
        correction = jnp.exp(m_s - m_new)
        weight = jnp.exp(m - m_new[tile])
        l_s = (l_s * correction).at[dest].add(probs.sum(axis=-1) * weight, mode="drop")
        acc_s = (acc_s * correction[..., None]).at[dest].add(o * weight[..., None], mode="drop")
        return m_new, l_s, acc_s

    state = (
        jnp.full((max_tiles, num_kv_heads, rows), _MASK_VALUE, f32),
        jnp.zeros((max_tiles, num_kv_heads, rows), f32),
        jnp.zeros((max_tiles, num_kv_heads, rows, head_dim), f32),
    )
    bound = max_work_items(max_tiles, max_blocks, tokens_per_block, bq, sliding_window)
    trips = -(-(bound if max_items is None else min(bound, max_items)) // per_step)
    _, denom, acc = jax.lax.fori_loop(0, trips, visit, state)
    out = jnp.where(denom[..., None] > 0, acc / jnp.maximum(denom[..., None], 1e-30), 0.0)
    out = out.reshape(max_tiles, num_kv_heads, bq, group, head_dim).transpose(0, 2, 1, 3, 4)
    out = out.reshape(max_tiles * bq, num_q_heads, head_dim).astype(q.dtype)
    if bq == 1:  # tile t is token t; padding tokens saw no key, so they are zeros already
        return out
    dest = jnp.where(token_valid, token, num_tokens).reshape(-1)
    return jnp.zeros_like(q).at[dest].set(out, mode="drop")
