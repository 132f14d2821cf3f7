"""Device-side work schedule for the ragged paged attention kernel.

The Triton lowering has no scalar prefetch and no dynamic grid, so the kernel's grid is
sized for the worst case and each program reads its work item from a small int32 table
built here, in plain XLA, from the step metadata (no host sync). A work item ("query
tile") is up to `block_q` consecutive query tokens of ONE sequence, so a program never
has to handle a sequence boundary; the padding tokens past `cu_q_lens[num_seqs]` get
tiles of their own that write zeros, so every output row is written exactly once.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

# Columns of the tile table.
Q_START, Q_END, POS_OFFSET, SEQ, KV_LO, KV_HI, SPLITS = range(7)
NUM_FIELDS = 8  # padded to a power of two
# A flash-decoding split walks at least this many key chunks (shorter ones cost more in
# partial writes and merging than they save).
MIN_CHUNKS_PER_SPLIT = 4


def max_query_tiles(num_tokens: int, num_seq_slots: int, block_q: int) -> int:
    """Static upper bound on the number of query tiles for any batch of this bucket.

    Each live sequence and the padding run add at most one partially filled tile:
    sum_s ceil(q_s / b) + ceil(pad / b) <= (T + (n + 1) (b - 1)) / b with n <= min(S, T).
    """
    live = min(num_seq_slots, num_tokens)
    return max(1, (num_tokens + (live + 1) * (block_q - 1)) // block_q)


def _cdiv(a: jax.Array, b: int) -> jax.Array:
    return (a + b - 1) // b


def query_tile_schedule(
    cu_q_lens: jax.Array,  # int32[S + 1]
    kv_lens: jax.Array,  # int32[S]
    num_seqs: jax.Array,  # int32[1]
    *,
    num_tokens: int,
    block_q: int,
    tokens_per_block: int,
    sliding_window: Optional[int],
    max_kv_len: Optional[int] = None,
    max_q_len: Optional[int] = None,
    min_q_len: int = 0,
    include_padding: bool = True,
    num_tiles: Optional[int] = None,
    num_splits: int = 1,
    block_k: int = 16,
) -> jax.Array:
    """int32[max_query_tiles, NUM_FIELDS]: per tile its token range, sequence and KV range.

    Unused tiles have an empty token range (`Q_START == Q_END`) and write nothing; padding
    tiles have an empty KV range and write zeros. `POS_OFFSET` turns a token index into its
    absolute position; `[KV_LO, KV_HI)` is the key range any token of the tile may see,
    with `KV_LO` aligned down to a cache block so loads start on a page boundary.

    The metadata is clamped as the XLA reference clamps it, so bad metadata cannot make a
    kernel read or write out of bounds: `num_seqs` to `[0, S]`, token ranges to `[0, T)`
    (a sequence running past the bucket keeps its positions but loses the tokens past
    `T`), `KV_HI` to `max_kv_len` (the block table's capacity).

    One launch may cover only some sequences: those with `min_q_len <= q_len <= max_q_len`
    (a mixed bucket gives its decode sequences decode-sized tiles in a launch of their
    own), and the padding run only with `include_padding`; `num_tiles` overrides the
    static tile count when the caller knows a tighter bound.

    `SPLITS` (flash-decoding, `num_splits > 1`) is each tile's share of the launch's
    split slots, from the actual KV lengths on device: key chunks (of `block_k` keys) are
    dealt so that every used split walks about the same number of chunks, and at least
    `MIN_CHUNKS_PER_SPLIT`; a short sequence uses one split and leaves its other slots
    idle, a long one uses all of them.
    """
    num_slots = kv_lens.shape[0]
    if num_tiles is None:
        num_tiles = max_query_tiles(num_tokens, num_slots, block_q)
    n = jnp.clip(num_seqs[0], 0, num_slots)
    live = jnp.arange(num_slots, dtype=jnp.int32) < n
    # Positions follow the metadata as given; the token ranges are clamped to the bucket.
    q_lens_given = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    clamped = jnp.clip(cu_q_lens, 0, num_tokens)
    starts, ends = clamped[:-1], clamped[1:]
    q_lens = jnp.where(live, jnp.maximum(ends - starts, 0), 0)
    total_q = clamped[n]
    picked = q_lens_given >= min_q_len
    if max_q_len is not None:
        picked &= q_lens_given <= max_q_len
    tiled_q_lens = jnp.where(picked, q_lens, 0)

    # Segments 0..S-1 are sequences; segment S is the padding run [total_q, num_tokens).
    seg_start = jnp.concatenate([starts, total_q[None]])
    padding_end = num_tokens if include_padding else total_q
    seg_end = jnp.concatenate([starts + tiled_q_lens, jnp.full((1,), padding_end, jnp.int32)])
    seg_tiles = _cdiv(jnp.maximum(seg_end - seg_start, 0), block_q)
    cum = jnp.cumsum(seg_tiles)
    first_tile = cum - seg_tiles

    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(cum, tile, side="right").astype(jnp.int32), num_slots)
    used = tile < cum[-1]
    q_start = seg_start[seg] + (tile - first_tile[seg]) * block_q
    q_end = jnp.minimum(q_start + block_q, seg_end[seg])
    q_start = jnp.where(used, q_start, 0)
    q_end = jnp.where(used, q_end, 0)

    is_seq = used & (seg < num_slots)
    seq = jnp.minimum(seg, num_slots - 1)
    pos_offset = kv_lens[seq] - q_lens_given[seq] - cu_q_lens[seq]
    kv_hi = jnp.where(is_seq, q_end - 1 + pos_offset + 1, 0)
    if sliding_window is None:
        kv_lo = jnp.zeros_like(kv_hi)
    else:
        kv_lo = jnp.maximum(q_start + pos_offset - sliding_window + 1, 0)
        kv_lo = jnp.where(is_seq, kv_lo // tokens_per_block * tokens_per_block, 0)
    if max_kv_len is not None:
        kv_hi = jnp.minimum(kv_hi, max_kv_len)
    kv_hi = jnp.maximum(kv_hi, kv_lo)
    splits = jnp.ones_like(q_start)
    if num_splits > 1:
        chunks = _cdiv(kv_hi - kv_lo, block_k)
        busy_tiles = jnp.maximum(jnp.sum(chunks > 0), 1)
        per_split = jnp.maximum(_cdiv(jnp.sum(chunks), busy_tiles * num_splits), MIN_CHUNKS_PER_SPLIT)
        splits = jnp.clip((chunks + per_split - 1) // per_split, 1, num_splits)
    zeros = jnp.zeros_like(q_start)
    fields = [q_start, q_end, pos_offset, seq, kv_lo, kv_hi, splits]
    fields += [zeros] * (NUM_FIELDS - len(fields))
    return jnp.stack(fields, axis=1).astype(jnp.int32)
