"""Ragged paged attention for mixed prefill + decode batches, as a Pallas Triton kernel.

Lowering: Triton (`compiler_params=pltriton.CompilerParams`). It runs on Ampere and
Hopper alike, and it has what a paged kernel needs: per-element gathers through the block
table (`ref[index_vector, :]` becomes a pointer tensor), masked loads, scalar reads from
refs and `fori_loop`s with dynamic trip counts. Mosaic GPU is Hopper-only and wants
rectangular TMA copies and `plgpu.kernel`; a page gather per key row does not map onto it
without a different cache layout. Triton's constraints shape the design: no scalar
prefetch and no dynamic grid (so the grid is sized for the worst case and each program
reads its work from a table built in XLA), power-of-two tensor shapes (so GQA groups and
head dims are padded to powers of two inside the kernel, with masked loads and stores),
at most three grid dims.
From jax 0.11 the Triton backend is deprecated (see `pallas_kernels.triton_backend`).

Grid: (query tile, kv head x head block, kv split).
  - A query tile is `block_q` consecutive tokens of one sequence (see `schedule.py`); its
    rows are (token, q head of the GQA group) pairs, `block_m = block_q * group_pow2`, so
    one K/V tile load serves every q head that shares the kv head (GQA/MQA). A group too
    wide for one tile's shared memory (MLA) is cut into head blocks of `block_m` heads,
    one token per tile, each its own program along the second grid axis.
  - Each program walks its share of the tile's key range `[kv_lo, kv_hi)` in chunks of
    `block_k` keys with an online softmax in f32. Keys are gathered row by row through the
    block table, so a chunk may span pages and pages may have any size.
  - With `num_kv_splits > 1` (decode tiles only) the key range is cut into up to that
    many contiguous parts (flash-decoding), as many as the tile's `SPLITS` entry, which
    the schedule deals on device from the actual KV lengths; each program writes an
    unnormalised partial output plus its running max and denominator, and a small XLA
    epilogue merges them. With one split the kernel normalises and writes the final
    output directly.
A mixed bucket is two launches (`plan_launches`): its decode sequences with the smallest
MMA tile and flash-decoding splits, the prefill chunks and padding with 64-row tiles and
no split, both writing into one output buffer.
Metadata is clamped (`schedule.py`, block-table ids here) so that bad metadata cannot
read or write out of bounds; tilings are validated when they are built.
KV cache layout is the engine's `[Hkv, num_blocks, tokens_per_block, D]` (the layout of
JAX's GPU `paged_attention`), viewed as `[Hkv * num_blocks * tokens_per_block, D]` rows.

Latent variant (`ragged_paged_latent_attention`, multi-head latent attention's absorbed
form): one cache `[num_blocks, tokens_per_block, L]` is both the keys and the values, the
values being its first `value_dim` columns; the kernel reads the value tile from the key
rows it just used (`value_dim` set) and writes `[T, Hq, value_dim]`. Every query head
shares the one latent "KV head" (MQA), so each latent row loaded serves all of them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.ragged_paged_attention import schedule
from pallas_kernels.ragged_paged_attention.kernel_io import FP8_CACHE, check_shapes, int32_metadata, merge_splits
from pallas_kernels.ragged_paged_attention.tiling import (
    AttentionTiling,
    block_q,
    decode_tiling,
    default_tiling,
    head_blocks,
    heads_per_tile,
    next_pow2,
)
from pallas_kernels.triton_backend import compiler_params

_MASK_VALUE = -1e30


def _dot(a: jax.Array, b: jax.Array, *, contract_b: int) -> jax.Array:
    """f32-accumulating MMA. HIGHEST keeps f32 inputs in IEEE f32 (Triton's default for
    f32 is TF32); bf16 inputs are unaffected."""
    return jax.lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())), precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def _row_col_mask(ref, mask: jax.Array, width: int, num_cols: Optional[int] = None) -> jax.Array:
    """[rows, 1] mask, or [rows, width] when the tile is wider than the ref (padded head
    dim). Column indices are never masked or clamped themselves: they must stay a plain
    `arange` so Triton can prove the row contiguous and vectorise the access."""
    num_cols = ref.shape[1] if num_cols is None else num_cols  # columns in use (a prefix of the ref's)
    if width == num_cols:
        return mask[:, None]
    return mask[:, None] & (jnp.arange(width, dtype=jnp.int32) < num_cols)[None, :]


def _load_rows(ref, rows: jax.Array, mask: jax.Array, width: int, num_cols: Optional[int] = None) -> jax.Array:
    """Gathers `ref[rows, :]` as a [len(rows), width] tile; masked rows and columns past
    the ref's width read as zero.

    Both axes are indexed with integer arrays: interpret mode cannot mix an index vector
    with a slice, and Triton sees the same contiguous column offsets either way.
    """
    cols = jnp.arange(width, dtype=jnp.int32)
    other = 0.0 if ref.dtype == FP8_CACHE else 0  # Triton lowering casts no integer to fp8
    return pltriton.load(
        ref.at[rows[:, None], cols[None, :]], mask=_row_col_mask(ref, mask, width, num_cols), other=other
    )


def _store_rows(ref, rows: jax.Array, value: jax.Array, mask: jax.Array) -> None:
    """Scatters `value` ([len(rows), width]) into `ref[rows, :]` where `mask` holds.

    Masked-off rows are redirected one row past the end (and padded columns are past the
    end already): on GPU they are never touched, and interpret mode drops out-of-bounds
    scatter updates instead of racing with a real row.
    """
    width = value.shape[1]
    cols = jnp.arange(width, dtype=jnp.int32)
    rows = jnp.where(mask, rows, ref.shape[0])
    pltriton.store(ref.at[rows[:, None], cols[None, :]], value, mask=_row_col_mask(ref, mask, width))


def _store_vector(ref, idx: jax.Array, value: jax.Array, mask: jax.Array) -> None:
    pltriton.store(ref.at[jnp.where(mask, idx, ref.shape[0])], value, mask=mask)


def _attention_kernel(
    tiles_ref,  # int32[num_tiles, NUM_FIELDS]
    q_ref,  # [T * Hq, D]
    k_ref,  # [Hkv * NB * tpb, D]
    v_ref,  # [Hkv * NB * tpb, D]
    block_tables_ref,  # int32[S * MB]
    *refs,
    num_tokens: int,
    num_q_heads: int,
    group: int,
    group_pow2: int,
    tokens_per_block: int,
    num_blocks: int,
    max_blocks: int,
    head_dim_pow2: int,
    value_dim: Optional[int],
    value_dim_pow2: int,
    block_m: int,
    block_k: int,
    num_splits: int,
    sm_scale: float,
    sliding_window: Optional[int],
    soft_cap: Optional[float],
    num_aliased: int,
):
    out_refs = refs[num_aliased:]
    tile, split = pl.program_id(0), pl.program_id(2)
    tile_heads = heads_per_tile(block_m, group_pow2)
    num_head_blocks = head_blocks(block_m, group_pow2)
    kv_head = pl.program_id(1) // num_head_blocks
    first_head = (pl.program_id(1) % num_head_blocks) * tile_heads
    q_start = tiles_ref[tile, schedule.Q_START]
    q_end = tiles_ref[tile, schedule.Q_END]
    pos_offset = tiles_ref[tile, schedule.POS_OFFSET]
    seq = tiles_ref[tile, schedule.SEQ]
    kv_lo = tiles_ref[tile, schedule.KV_LO]
    kv_hi = tiles_ref[tile, schedule.KV_HI]
    tile_splits = tiles_ref[tile, schedule.SPLITS]  # split slots this tile uses (<= num_splits)

    rows = jnp.arange(block_m, dtype=jnp.int32)
    token = q_start + jax.lax.div(rows, tile_heads)
    head_in_group = first_head + jax.lax.rem(rows, tile_heads)
    row_valid = (token < q_end) & (head_in_group < group)
    q_row = jnp.where(row_valid, token * num_q_heads + kv_head * group + head_in_group, 0)
    position = token + pos_offset  # absolute position of each row's query token

    q = _load_rows(q_ref, q_row, row_valid, head_dim_pow2)

    # This program's contiguous share of the tile's key range (none past the tile's splits).
    num_chunks = (kv_hi - kv_lo + block_k - 1) // block_k
    chunks_per_split = (num_chunks + tile_splits - 1) // tile_splits
    lo = kv_lo + split * chunks_per_split * block_k
    hi = jnp.minimum(lo + chunks_per_split * block_k, kv_hi)
    trip_count = (jnp.maximum(hi - lo, 0) + block_k - 1) // block_k

    key_offsets = jnp.arange(block_k, dtype=jnp.int32)
    cache_row_base = kv_head * (num_blocks * tokens_per_block)

    def body(step, carry):
        acc, running_max, denom = carry
        key_pos = lo + step * block_k + key_offsets
        key_valid = key_pos < hi
        logical_block = jax.lax.div(key_pos, tokens_per_block)
        page = pltriton.load(
            block_tables_ref.at[jnp.where(key_valid, seq * max_blocks + logical_block, 0)],
            mask=key_valid,
            other=0,
        )
        page = jnp.clip(page, 0, num_blocks - 1)  # a bad block-table id must not leave the cache
        in_page = jax.lax.rem(key_pos, tokens_per_block)
        cache_row = jnp.where(key_valid, cache_row_base + page * tokens_per_block + in_page, 0)
        k = _load_rows(k_ref, cache_row, key_valid, head_dim_pow2).astype(q.dtype)  # an fp8 page: widened here
        scores = _dot(q, k, contract_b=1) * sm_scale  # [block_m, block_k]
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        allowed = key_valid[None, :] & (key_pos[None, :] <= position[:, None])
        if sliding_window is not None:
            allowed &= key_pos[None, :] > position[:, None] - sliding_window
        scores = jnp.where(allowed, scores, _MASK_VALUE)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=1))
        probs = jnp.where(allowed, jnp.exp(scores - new_max[:, None]), 0.0)
        correction = jnp.exp(running_max - new_max)
        denom = denom * correction + jnp.sum(probs, axis=1)
        v = _load_rows(v_ref, cache_row, key_valid, value_dim_pow2, value_dim).astype(q.dtype)
        pv = _dot(probs.astype(v.dtype), v, contract_b=0)
        return acc * correction[:, None] + pv, new_max, denom

    init = (
        jnp.zeros((block_m, value_dim_pow2), jnp.float32),
        jnp.full((block_m,), _MASK_VALUE, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
    )
    acc, running_max, denom = jax.lax.fori_loop(0, trip_count, body, init)

    if num_splits == 1:
        (o_ref,) = out_refs
        safe = jnp.where(denom > 0, denom, 1.0)
        out = jnp.where(denom[:, None] > 0, acc / safe[:, None], 0.0)
        _store_rows(o_ref, q_row, out.astype(o_ref.dtype), row_valid)
    else:
        o_ref, m_ref, l_ref = out_refs
        part_row = split * (num_tokens * num_q_heads) + q_row
        _store_rows(o_ref, part_row, acc, row_valid)
        _store_vector(m_ref, part_row, running_max, row_valid)
        _store_vector(l_ref, part_row, denom, row_valid)


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a step: its tiling and which sequences it covers."""

    tiling: AttentionTiling
    num_tiles: int  # static grid size along the tile axis
    max_q_len: Optional[int]  # sequences with q_len <= this (None: no bound)
    min_q_len: int  # and q_len >= this
    include_padding: bool  # whether it writes the padding tokens' zeros


def plan_launches(
    num_tokens: int,
    num_seq_slots: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_kv_len: int,
    itemsize: int,
    tiling: Optional[AttentionTiling] = None,
    decode: Optional[AttentionTiling] = None,
) -> list[Launch]:
    """The launches of a bucket, from static shapes.

    A decode-only bucket (T <= S), or an explicit `tiling` without a `decode` one, is one
    launch over every token. A mixed or prefill bucket is two: the sequences whose
    queries fit one decode-sized tile (q_len <= decode block_q) with the decode tiling
    and its flash-decoding splits, and the rest (plus the padding) with `tiling`
    (64-row tiles, no split by default).
    """
    group_pow2 = next_pow2(num_q_heads // num_kv_heads)
    args = (num_q_heads, num_kv_heads, head_dim, max_kv_len, itemsize)
    explicit = tiling is not None
    if tiling is None:
        tiling = default_tiling(num_tokens, num_seq_slots, *args)
    one = Launch(
        tiling, schedule.max_query_tiles(num_tokens, num_seq_slots, block_q(tiling.block_m, group_pow2)), None, 0, True
    )
    if num_tokens <= num_seq_slots or (explicit and decode is None):
        return [one]
    if decode is None:
        decode = decode_tiling(num_seq_slots, *args)
    decode_q = block_q(decode.block_m, group_pow2)
    return [
        Launch(tiling, one.num_tiles, None, decode_q + 1, True),
        Launch(decode, min(num_seq_slots, num_tokens), decode_q, 0, False),
    ]


def _launch(
    launch: Launch,
    q2d: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    num_q_heads: int,
    sm_scale: float,
    sliding_window: Optional[int],
    soft_cap: Optional[float],
    interpret: bool,
    out_init: Optional[jax.Array],
    poison: bool,
    value_dim: Optional[int] = None,
):
    """Runs one launch. Returns (tile table, raw outputs): the [T * Hq, D] output (written
    in place over `out_init` when given) or, with splits, the f32 partials (acc, max, denom)."""
    num_kv_heads, num_blocks, tokens_per_block, head_dim = k_cache.shape
    out_dim = head_dim if value_dim is None else value_dim
    rows = q2d.shape[0]
    num_tokens = rows // num_q_heads
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    group_pow2 = next_pow2(group)
    tiling = launch.tiling
    num_splits = tiling.num_kv_splits
    tiles = schedule.query_tile_schedule(
        cu_q_lens,
        kv_lens,
        num_seqs,
        num_tokens=num_tokens,
        block_q=block_q(tiling.block_m, group_pow2),
        tokens_per_block=tokens_per_block,
        sliding_window=sliding_window,
        max_kv_len=max_blocks * tokens_per_block,
        max_q_len=launch.max_q_len,
        min_q_len=launch.min_q_len,
        include_padding=launch.include_padding,
        num_tiles=launch.num_tiles,
        num_splits=num_splits,
        block_k=tiling.block_k,
    )
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((rows, out_dim), q2d.dtype)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((num_splits * rows, out_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_splits * rows,), jnp.float32),
            jax.ShapeDtypeStruct((num_splits * rows,), jnp.float32),
        ]
    inputs = [tiles, q2d, k_cache.reshape(-1, head_dim), v_cache.reshape(-1, head_dim), block_tables.reshape(-1)]
    aliases: dict[int, int] = {}
    if num_splits == 1 and out_init is not None:
        aliases[len(inputs)] = 0
        inputs.append(out_init)
    elif poison:
        for i, shape in enumerate(out_shape):
            aliases[len(inputs)] = i
            inputs.append(jnp.full(shape.shape, jnp.nan, shape.dtype))

    kernel = functools.partial(
        _attention_kernel,
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
        group=group,
        group_pow2=group_pow2,
        tokens_per_block=tokens_per_block,
        num_blocks=num_blocks,
        max_blocks=max_blocks,
        head_dim_pow2=max(16, next_pow2(head_dim)),
        value_dim=value_dim,
        value_dim_pow2=max(16, next_pow2(out_dim)),
        block_m=tiling.block_m,
        block_k=tiling.block_k,
        num_splits=num_splits,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        num_aliased=len(aliases),
    )
    raw = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(launch.num_tiles, num_kv_heads * head_blocks(tiling.block_m, group_pow2), num_splits),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=compiler_params(tiling.num_warps, tiling.num_stages),
        name="ragged_paged_attention",
    )(*inputs)
    return tiles, tuple(raw)


def _tile_rows(tiles: jax.Array, block_q: int, num_q_heads: int, num_rows: int) -> jax.Array:
    """Output rows (token * Hq + head) of every tile's tokens, [tiles * block_q * Hq];
    rows of unused token slots point one past the end."""
    token = tiles[:, schedule.Q_START, None] + jnp.arange(block_q, dtype=jnp.int32)[None, :]
    used = token < tiles[:, schedule.Q_END, None]
    rows = token[:, :, None] * num_q_heads + jnp.arange(num_q_heads, dtype=jnp.int32)[None, None, :]
    return jnp.where(used[:, :, None], rows, num_rows).reshape(-1)


def attention_forward(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    tiling: Optional[AttentionTiling] = None,
    decode_tiling: Optional[AttentionTiling] = None,
    interpret: bool = False,
    poison_outputs: bool = False,
    value_dim: Optional[int] = None,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Runs the kernel launches (`plan_launches`); returns (output [T, Hq, D], raw buffers).

    `poison_outputs` hands the kernel NaN-filled output buffers (aliased in place), so a
    test can check that every element the kernel owns was written: the raw buffers are
    the output every launch writes into and the partials each split launch wrote (of the
    decode launch of a mixed bucket, only its own tokens' rows). `value_dim` keeps only the
    first `value_dim` columns of the values (the output is [T, Hq, value_dim]).
    """
    check_shapes(q, k_cache, v_cache, value_dim)
    kv_lens, block_tables, cu_q_lens, num_seqs = int32_metadata(kv_lens, block_tables, cu_q_lens, num_seqs)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, tokens_per_block, _ = k_cache.shape
    num_seq_slots, max_blocks = block_tables.shape
    group_pow2 = next_pow2(num_q_heads // num_kv_heads)
    launches = plan_launches(
        num_tokens,
        num_seq_slots,
        num_q_heads,
        num_kv_heads,
        head_dim,
        max_blocks * tokens_per_block,
        q.dtype.itemsize,
        tiling,
        decode_tiling,
    )
    rows = num_tokens * num_q_heads
    q2d = q.reshape(rows, head_dim)
    out_dim = head_dim if value_dim is None else value_dim
    out = None
    raw_all: list[jax.Array] = []
    for launch in launches:
        num_splits = launch.tiling.num_kv_splits
        out_init = out
        if out_init is None and poison_outputs and num_splits == 1:
            out_init = jnp.full((rows, out_dim), jnp.nan, q.dtype)
        tiles, raw = _launch(
            launch,
            q2d,
            k_cache,
            v_cache,
            kv_lens,
            block_tables,
            cu_q_lens,
            num_seqs,
            num_q_heads=num_q_heads,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            interpret=interpret,
            out_init=out_init,
            poison=poison_outputs,
            value_dim=value_dim,
        )
        if num_splits == 1:
            out = raw[0]
            continue
        o_part, m_part, l_part = (
            raw[0].reshape(num_splits, rows, out_dim),
            raw[1].reshape(num_splits, rows),
            raw[2].reshape(num_splits, rows),
        )
        if launch.include_padding and launch.max_q_len is None and launch.min_q_len == 0:
            merged = merge_splits(o_part, m_part, l_part).astype(q.dtype)  # the launch owns every row
            raw_all += raw
            out = merged  # a launch over every row is the only launch
            continue
        # One launch of several (a mixed bucket's): merge (and report) only its own rows.
        if out is None:
            out = jnp.full((rows, out_dim), jnp.nan if poison_outputs else 0.0, q.dtype)
        mine = _tile_rows(tiles, block_q(launch.tiling.block_m, group_pow2), num_q_heads, rows)
        valid = mine < rows
        take = jnp.where(valid, mine, 0)
        o_mine, m_mine, l_mine = o_part[:, take], m_part[:, take], l_part[:, take]
        raw_all += [
            jnp.where(valid[None, :, None], o_mine, 0.0),
            jnp.where(valid[None], m_mine, 0.0),
            jnp.where(valid[None], l_mine, 0.0),
        ]
        merged = merge_splits(o_mine, m_mine, l_mine).astype(q.dtype)
        out = out.at[mine].set(merged, mode="drop")
    return out.reshape(num_tokens, num_q_heads, out_dim), (out, *raw_all)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "tiling", "decode_tiling")
)
def ragged_paged_attention(
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
    interpret: bool = False,
    tiling: Optional[AttentionTiling] = None,
    decode_tiling: Optional[AttentionTiling] = None,
) -> jax.Array:
    """Attention of a packed prefill+decode batch over the paged KV cache: [T, Hq, D].

    Same contract as `ragged_paged_attention_reference`; padding tokens get zeros.
    `tiling` overrides the shape-derived tile sizes (benchmarks, tests): alone, one launch
    with it over the whole batch; with `decode_tiling`, the decode sequences of a mixed
    bucket run in a launch of their own with that tiling (see `plan_launches`).
    """
    out, _ = attention_forward(
        q,
        k_cache,
        v_cache,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        tiling=tiling,
        decode_tiling=decode_tiling,
        interpret=interpret,
    )
    return out


@functools.partial(jax.jit, static_argnames=("sm_scale", "value_dim", "interpret", "tiling", "decode_tiling"))
def ragged_paged_latent_attention(
    q: jax.Array,  # [T, Hq, L]
    latent_cache: jax.Array,  # [num_blocks, tokens_per_block, L]
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    value_dim: int,
    interpret: bool = False,
    tiling: Optional[AttentionTiling] = None,
    decode_tiling: Optional[AttentionTiling] = None,
) -> jax.Array:
    """Multi-query attention over a latent cache whose rows are the keys and whose first
    `value_dim` columns are the values (MLA's absorbed form): [T, Hq, value_dim]."""
    kv = latent_cache[None]
    out, _ = attention_forward(
        q,
        kv,
        kv,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        tiling=tiling,
        decode_tiling=decode_tiling,
        interpret=interpret,
        value_dim=value_dim,
    )
    return out
