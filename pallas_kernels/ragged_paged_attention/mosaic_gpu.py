"""Ragged paged attention for mixed prefill + decode batches, as a Mosaic GPU kernel (Hopper, sm90a).

Same contract as `ragged_paged_attention_reference` and the Triton `kernel.py`.

Why it maps onto TMA: the engine's cache is `[Hkv, num_blocks, tokens_per_block, D]`
(`jaxllm/kv_cache/spec.py`), so the keys of one (kv head, page) are one contiguous
`[tokens_per_block, D]` tile: one TMA copy per page and per K/V, no per-row gather. The
KV loop is an `emit_pipeline` whose index map looks the page up in the block table,
so page fetches run `max_concurrent_steps` ahead of the wgmma's.

Grid: (query tile, kv head). A query tile is up to `block_q` consecutive tokens of one
sequence (the device-built work list of `schedule.py`); its 64 rows (one warpgroup's
wgmma) are (token, q head of the GQA group) pairs, so one page load serves every q head
sharing the kv head. q is handed to the kernel head-major, `[Hkv, T * G, D]` with the
group padded to a power of two G of at least 8 (`rows_per_token`), which makes a tile's
rows one contiguous TMA box starting on a whole 8-row tile; the
output comes back the same way and is transposed in XLA (q-sized, small next to the KV
reads). Per page: `S = q @ K^T` (wgmma, K transposed in shared memory), causal /
window / soft-cap masking and an online softmax in f32, `acc += P @ V` (wgmma with P from
shared memory). Rows are stored with power-of-two TMA boxes so a tile never writes rows of
another sequence's tokens. Padding tiles see no keys and write zeros.
Decode buckets split each tile's pages over up to 16 CTAs (flash-decoding,
`default_num_kv_splits`): a CTA stores its unnormalised rows, running max and denominator
in f32 and XLA merges them; the split count comes from static shapes, not from lengths.

Metadata is not trusted: page ids are clamped into the cache and token ranges to T.
Whole pages are loaded, so the slots past a sequence's last key in its last page are read
(and masked); they must hold finite values, since 0 * inf poisons P @ V. The engine's
cache starts zeroed and only ever holds written keys and values, so they do; the Triton
kernel's masked loads never read them at all.
Requirements (`supports`): bf16/f16, `tokens_per_block % 16 == 0` (the P @ V contraction),
`head_dim % 16 == 0`, q heads per kv head <= 64.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_gpu_interpret import interpret_params
from pallas_kernels.ragged_paged_attention import schedule
from pallas_kernels.ragged_paged_attention.kernel_io import check_shapes, int32_metadata, merge_splits

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MASK_VALUE = -1e30
_ROWS = 64  # one warpgroup's wgmma tile
_WGMMA = plgpu.Layout.WGMMA
_WGMMA_ROW = plgpu.Layout.WGMMA.reduce(1)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


_TMA_ROW_TILE = 8  # rows of the swizzled shared-memory tiling of q (`_smem_transforms`)


def rows_per_token(group: int) -> int:
    """Rows of a q tile per token: the GQA group padded to a power of two and to at least
    8. A tile's q copy starts at row `first_token * rows_per_token`, and a TMA copy into
    a tiled buffer must start on a whole tile (8 rows): with 4 rows per token (Llama's
    32 q / 8 kv heads) a tile starting at an odd token would not. Groups under 8 leave
    rows of the 64-row wgmma unused, which costs prefill compute, not decode bandwidth."""
    return max(_TMA_ROW_TILE, _next_pow2(group))


@dataclass(frozen=True)
class MosaicAttentionTiling:
    """Pages in flight per CTA (K and V each: tokens_per_block * D * 2 bytes per page), and
    the flash-decoding split: each tile's pages are cut into `num_kv_splits` contiguous
    shares, one CTA each, merged in XLA (None: `default_num_kv_splits`)."""

    max_concurrent_steps: int = 4
    num_kv_splits: Optional[int] = None


_NUM_SMS = 132  # H100 SXM; H200 has the same count
_ML_COLS = 8  # running max / denominator stored as [rows, 8] f32: TMA rows of 32 bytes


def default_num_kv_splits(
    num_tokens: int, num_seq_slots: int, num_kv_heads: int, max_kv_len: int, tokens_per_block: int
) -> int:
    """Decode buckets only (T <= S, one token per tile): double the split while the grid
    holds fewer than two CTAs per SM and each share keeps at least four pages; mixed and
    prefill buckets have enough tiles and run unsplit (no partial buffers)."""
    if num_tokens > num_seq_slots:
        return 1
    splits = 1
    while (
        splits < 16
        and num_tokens * num_kv_heads * splits * 2 <= 2 * _NUM_SMS
        and max_kv_len >= tokens_per_block * 4 * splits * 2
    ):
        splits *= 2
    return splits


def supports(dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, tokens_per_block: int) -> bool:
    """Whether the Mosaic GPU kernel takes this problem."""
    return (
        jnp.dtype(dtype) in SUPPORTED_DTYPES
        and tokens_per_block % 16 == 0
        and head_dim % 16 == 0
        and num_q_heads % num_kv_heads == 0
        and _next_pow2(num_q_heads // num_kv_heads) <= _ROWS
    )


def _smem_transforms(dtype, *widths: int) -> tuple:
    """Tiling + swizzle for wgmma operands whose minor dims have `widths` elements (the
    two operands of one wgmma must share a swizzle): the widest swizzle (128, 64 or 32
    bytes) that every row's bytes are a multiple of."""
    swizzle = next(b for b in (128, 64, 32) if all(w * jnp.dtype(dtype).itemsize % b == 0 for w in widths))
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _store_rows(o_smem, o_gmem, *, gmem_start, num_rows, max_rows: int):
    """Stores the first `num_rows` (dynamic, 0..max_rows) rows of `o_smem` at `gmem_start`
    with power-of-two TMA boxes, largest first."""
    size = 1 << (max_rows.bit_length() - 1)
    smem_start = 0
    while size >= 1:

        @pl.when((num_rows & size) != 0)
        def _(size=size, smem_start=smem_start):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(smem_start, size)], o_gmem.at[pl.ds(gmem_start + smem_start, size)])

        smem_start = smem_start + (num_rows & size)
        size //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _check(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array) -> None:
    check_shapes(q, k_cache, v_cache)
    if k_cache.dtype != q.dtype:
        raise ValueError(f"Mosaic GPU attention takes a cache of q's dtype, got {k_cache.dtype} (FP8 caches: Triton)")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, tokens_per_block, _ = k_cache.shape
    if not supports(q.dtype, num_q_heads, num_kv_heads, head_dim, tokens_per_block):
        raise ValueError(
            f"Mosaic GPU attention needs bf16/f16 (got {q.dtype}), tokens_per_block % 16 == 0 (got "
            f"{tokens_per_block}), head_dim % 16 == 0 (got {head_dim}) and <= {_ROWS} q heads per kv head"
        )


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
    tiling: Optional[MosaicAttentionTiling] = None,
    interpret: bool = False,
) -> jax.Array:
    _check(q, k_cache, v_cache)
    tiling = tiling or MosaicAttentionTiling()
    kv_lens, block_tables, cu_q_lens, num_seqs = int32_metadata(kv_lens, block_tables, cu_q_lens, num_seqs)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_blocks, tokens_per_block, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    group_pow2 = rows_per_token(group)
    block_q = _ROWS // group_pow2
    dtype = q.dtype
    num_splits = tiling.num_kv_splits or default_num_kv_splits(
        num_tokens, block_tables.shape[0], num_kv_heads, max_blocks * tokens_per_block, tokens_per_block
    )
    if num_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_splits}")
    tiles = schedule.query_tile_schedule(
        cu_q_lens,
        kv_lens,
        num_seqs,
        num_tokens=num_tokens,
        block_q=block_q,
        tokens_per_block=tokens_per_block,
        sliding_window=sliding_window,
    )

    # Head-major q: [Hkv, T * G (+ at least one tile of padding for the last TMA box,
    # rounded to whole tiles: the swizzled copy wants rows in multiples of its 8-row tiling), D].
    qh = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    if group_pow2 != group:
        qh = jnp.pad(qh, ((0, 0), (0, 0), (0, group_pow2 - group), (0, 0)))
    qh = jnp.swapaxes(qh, 0, 1).reshape(num_kv_heads, num_tokens * group_pow2, head_dim)
    q_rows = -(-num_tokens * group_pow2 // _ROWS) * _ROWS + _ROWS
    qh = jnp.pad(qh, ((0, 0), (0, q_rows - num_tokens * group_pow2), (0, 0)))
    # Pages as row blocks of a 2-D view: page p of head h is row block h * num_blocks + p.
    k_rows = k_cache.reshape(-1, head_dim)
    v_rows = v_cache.reshape(-1, head_dim)
    sm_scale = float(sm_scale)
    # Register layouts are lowering hints; jax's GPU interpreter has no rules for them.
    cast = (lambda x, layout: x) if interpret else plgpu.layout_cast
    iota = (
        (lambda shape, dim: jax.lax.broadcasted_iota(jnp.int32, shape, dim))
        if interpret
        else (lambda shape, dim: plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=_WGMMA))
    )
    qk_transforms = _smem_transforms(dtype, head_dim)  # q and K
    pv_transforms = _smem_transforms(dtype, head_dim, tokens_per_block)  # P and V

    def body(tiles_gmem, q_gmem, k_gmem, v_gmem, bt_gmem, *out_gmems):
        tile = jax.lax.axis_index("tile")
        head = jax.lax.axis_index("head")
        split = jax.lax.axis_index("split")
        q_end = jnp.minimum(tiles_gmem[tile, schedule.Q_END], num_tokens)
        q_start = jnp.minimum(tiles_gmem[tile, schedule.Q_START], q_end)
        pos_offset = tiles_gmem[tile, schedule.POS_OFFSET]
        seq = tiles_gmem[tile, schedule.SEQ]
        kv_lo = tiles_gmem[tile, schedule.KV_LO]
        kv_hi = tiles_gmem[tile, schedule.KV_HI]
        first_page = jnp.maximum(kv_lo, 0) // tokens_per_block
        last_page = jnp.minimum((kv_hi + tokens_per_block - 1) // tokens_per_block, max_blocks)
        total_pages = jnp.maximum(last_page - first_page, 0)
        # This CTA's contiguous share of the tile's pages.
        pages_per_split = (total_pages + num_splits - 1) // num_splits
        first_page = first_page + split * pages_per_split
        num_pages = jnp.clip(total_pages - split * pages_per_split, 0, pages_per_split)

        def page_block(j):
            page = bt_gmem[seq, first_page + j]
            return jnp.clip(page, 0, num_blocks - 1) + head * num_blocks

        @pl.when(q_end > q_start)
        def _tile():
            @functools.partial(
                pl.run_scoped,
                q_smem=plgpu.SMEM((_ROWS, head_dim), dtype, transforms=qk_transforms),
                p_smem=plgpu.SMEM((_ROWS, tokens_per_block), dtype, transforms=pv_transforms),
                o_smem=plgpu.SMEM((_ROWS, head_dim), dtype if num_splits == 1 else jnp.float32),
                ml_smem=plgpu.SMEM((2, _ROWS, _ML_COLS), jnp.float32),
                barrier=plgpu.Barrier(),
            )
            def _scope(q_smem, p_smem, o_smem, ml_smem, barrier):
                plgpu.copy_gmem_to_smem(q_gmem.at[head, pl.ds(q_start * group_pow2, _ROWS)], q_smem, barrier)
                plgpu.barrier_wait(barrier)
                shape = (_ROWS, tokens_per_block)
                row = iota(shape, 0)
                col = iota(shape, 1)
                position = q_start + row // group_pow2 + pos_offset

                def step(idx, k_smem, v_smem, carry):
                    acc, running_max, denom = carry
                    (j,) = idx

                    def qk(s_ref):
                        plgpu.wgmma(s_ref, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
                        return s_ref[...]

                    scores = pl.run_scoped(qk, plgpu.ACC(shape)) * sm_scale
                    if soft_cap is not None:
                        scores = soft_cap * jnp.tanh(scores / soft_cap)
                    page_start = (first_page + j) * tokens_per_block
                    key_pos = page_start + col
                    allowed = (key_pos <= position) & (key_pos < kv_hi)
                    if sliding_window is not None:
                        allowed &= key_pos > position - sliding_window
                    scores = jnp.where(allowed, scores, _MASK_VALUE)
                    new_max = jnp.maximum(running_max, scores.max(axis=1))
                    probs = jnp.where(allowed, jnp.exp(scores - jax.lax.broadcast_in_dim(new_max, shape, [0])), 0.0)
                    correction = jnp.exp(running_max - new_max)
                    denom = denom * correction + probs.sum(axis=1)
                    # P goes through shared memory: jax's GPU interpreter takes wgmma
                    # operands from shared memory only.
                    p_smem[...] = probs.astype(dtype)
                    plgpu.commit_smem()

                    def pv(pv_ref):
                        plgpu.wgmma(pv_ref, p_smem, v_smem)
                        return pv_ref[...]

                    # A fresh accumulator plus a register add, instead of seeding the
                    # wgmma with the rescaled acc (`run_state`, which the interpreter lacks).
                    pv_out = pl.run_scoped(pv, plgpu.ACC((_ROWS, head_dim)))
                    acc = acc * jax.lax.broadcast_in_dim(correction, acc.shape, [0]) + pv_out
                    return acc, new_max, denom

                init = (
                    cast(jnp.zeros((_ROWS, head_dim), jnp.float32), _WGMMA),
                    cast(jnp.full((_ROWS,), _MASK_VALUE, jnp.float32), _WGMMA_ROW),
                    cast(jnp.zeros((_ROWS,), jnp.float32), _WGMMA_ROW),
                )
                k_spec, v_spec = (
                    plgpu.BlockSpec((tokens_per_block, head_dim), lambda j: (page_block(j), 0), transforms=t)
                    for t in (qk_transforms, pv_transforms)
                )
                acc, running_max, denom = plgpu.emit_pipeline(
                    step,
                    grid=(num_pages,),
                    in_specs=[k_spec, v_spec],
                    max_concurrent_steps=max(2, tiling.max_concurrent_steps),
                    init_carry=init,
                )(k_gmem, v_gmem)
                rows = dict(gmem_start=q_start * group_pow2, num_rows=(q_end - q_start) * group_pow2, max_rows=_ROWS)
                # Not q_smem: wgmma operands are tiled and swizzled, while the row
                # ladder slices the output at any row.
                if num_splits == 1:
                    seen = denom > 0
                    inv = jnp.where(seen, 1.0 / jnp.where(seen, denom, 1.0), 0.0)
                    o_smem[...] = (acc * jax.lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
                    plgpu.commit_smem()
                    _store_rows(o_smem, out_gmems[0].at[head], **rows)
                else:  # unnormalised partials, merged in XLA
                    o_part, ml_part = out_gmems
                    o_smem[...] = acc
                    ml_shape = (_ROWS, _ML_COLS)
                    ml_smem[0] = cast(jax.lax.broadcast_in_dim(running_max, ml_shape, [0]), _WGMMA)
                    ml_smem[1] = cast(jax.lax.broadcast_in_dim(denom, ml_shape, [0]), _WGMMA)
                    plgpu.commit_smem()
                    _store_rows(o_smem, o_part.at[split, head], **rows)
                    _store_rows(ml_smem.at[0], ml_part.at[split, 0, head], **rows)
                    _store_rows(ml_smem.at[1], ml_part.at[split, 1, head], **rows)

    rows_shape = (num_kv_heads, num_tokens * group_pow2)
    if num_splits == 1:
        out_type = [jax.ShapeDtypeStruct((*rows_shape, head_dim), dtype)]
    else:
        out_type = [
            jax.ShapeDtypeStruct((num_splits, *rows_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, 2, *rows_shape, _ML_COLS), jnp.float32),
        ]
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(tiles.shape[0], num_kv_heads, num_splits),
        grid_names=("tile", "head", "split"),
        interpret=interpret_params(interpret),
    )
    raw = kernel(tiles, qh, k_rows, v_rows, block_tables)
    if num_splits == 1:
        out = raw[0]
    else:
        o_part, ml_part = raw
        out = merge_splits(o_part, ml_part[:, 0, ..., 0], ml_part[:, 1, ..., 0]).astype(dtype)
    out = out.reshape(num_kv_heads, num_tokens, group_pow2, head_dim)[:, :, :group]
    return jnp.swapaxes(out, 0, 1).reshape(num_tokens, num_q_heads, head_dim)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "tiling"))
def ragged_paged_attention_mosaic(
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
    tiling: Optional[MosaicAttentionTiling] = None,
) -> jax.Array:
    """Attention of a packed prefill+decode batch over the paged KV cache: [T, Hq, D].

    Same contract as `ragged_paged_attention_reference`; padding tokens get zeros.
    `interpret` runs jax's Mosaic GPU interpreter on CPU (slow: tests only).
    """
    return attention_forward(
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
        interpret=interpret,
    )
