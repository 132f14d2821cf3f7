"""Grouped expert FFN (SwiGLU) over expert-sorted rows, as two Mosaic GPU kernels (Hopper, sm90a).

Same contract as `moe_grouped_ffn_reference` and the Triton `kernel.py`: rows
`[offset_e, offset_e + group_sizes[e])` use expert `e`'s weights, rows past
`sum(group_sizes)` come out as zeros, routing weights are applied by the caller.

Why a second implementation: on Hopper the Triton path cannot use TMA or wgmma, and
jax 0.11 deprecates the Pallas Triton backend. Here every operand tile is one TMA copy
into swizzled shared memory, fed to `wgmma` from a multi-stage `emit_pipeline`, and the
f32 accumulators live in registers (one warpgroup per CTA).

Work split: the device-built work list of `schedule.py` (one item per (row tile, group)
pair that overlap, no host sync) times the column tiles is the CTA grid. An item's CTA
runs the whole `block_m`-row tile through its group's weights and stores only the rows
inside the group, so the items of one tile write disjoint rows. TMA stores need static
box sizes, so the 1..block_m owned rows are stored with a ladder of power-of-two boxes
(as in jax's `ragged_dot_mgpu`). Padding items (rows past the groups) skip the pipeline
and store zeros; unused items return at once.
  1. gate/up: two accumulators over one pass of `x` tiles, epilogue `silu(g) * u`,
     rounded to the activation dtype like the reference.
  2. down: one accumulator.
Rows of `x` are padded to a multiple of `block_m` for the TMA loads (the output is not).
wgmma wants 16-bit operands here (bf16/f16); the column and K tiles must divide the
weight dims (`supports` says whether a problem fits).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe_grouped_gemm import schedule
from pallas_kernels.moe_grouped_gemm.kernel import check_weights
from pallas_kernels.mosaic_gpu_interpret import interpret_params

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclass(frozen=True)
class MosaicGemmTiling:
    """Static tiles of one grouped GEMM kernel. `block_m` is a multiple of 64 (one
    warpgroup's wgmma rows); `block_k` 64 fills a 128-byte swizzle row of bf16."""

    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int


@dataclass(frozen=True)
class MosaicMoeTiling:
    """Both kernels share `block_m` (they share the work list)."""

    gate_up: MosaicGemmTiling
    down: MosaicGemmTiling


def default_tiling(num_rows: int, num_groups: int, hidden: int, inter: int) -> MosaicMoeTiling:
    """Tiles from static shapes.

    64 rows (the smallest wgmma) unless groups average 128+ rows. gate/up keeps two f32
    accumulators, so its column tile is 64 (2 x 64x64 f32 = 64 registers per thread);
    down has one and takes 128 columns where they divide the width. Shared memory per
    stage (bf16) is 24-32 KiB, four stages stay far under Hopper's 227 KiB. Narrower
    column tiles also mean more CTAs at decode batch sizes, where only the few active
    experts' items do work.
    """
    block_m = 128 if num_rows >= 128 * num_groups else 64
    # Column tiles are at least 64 wide (128 bytes, the 128-byte swizzle): on an H200 the
    # 32-column tiles once used for decode batches (more CTAs for the few active experts)
    # ended in CUDA_ERROR_MISALIGNED_ADDRESS.
    gate_up_n = _largest_divisor_tile(inter, (_MIN_BLOCK_N,))
    down_n = _largest_divisor_tile(hidden, (128, _MIN_BLOCK_N) if num_rows > 64 else (_MIN_BLOCK_N,))
    return MosaicMoeTiling(
        MosaicGemmTiling(block_m, gate_up_n or 64, _block_k(hidden), 4),
        MosaicGemmTiling(block_m, down_n or 128, _block_k(inter), 4),
    )


_MIN_BLOCK_N = 64


def _largest_divisor_tile(size: int, candidates: Sequence[int]) -> Optional[int]:
    return next((c for c in candidates if size % c == 0), None)


def _block_k(k_size: int) -> int:
    return _largest_divisor_tile(k_size, (64, 32, 16)) or 64


def supports(x_dtype, hidden: int, inter: int) -> bool:
    """Whether the Mosaic GPU kernels take this problem (dtype and tile divisibility)."""
    return jnp.dtype(x_dtype) in SUPPORTED_DTYPES and hidden % _MIN_BLOCK_N == 0 and inter % _MIN_BLOCK_N == 0


def _check_tiling(t: MosaicGemmTiling, k_size: int, n_size: int, name: str) -> None:
    if t.block_m % 64:
        raise ValueError(f"{name}: block_m={t.block_m} must be a multiple of 64 (wgmma rows)")
    if k_size % t.block_k or t.block_k % 16:
        raise ValueError(f"{name}: block_k={t.block_k} must be a multiple of 16 dividing K={k_size}")
    if n_size % t.block_n or t.block_n % _MIN_BLOCK_N:
        raise ValueError(f"{name}: block_n={t.block_n} must be a multiple of {_MIN_BLOCK_N} dividing N={n_size}")
    if t.max_concurrent_steps < 1:
        raise ValueError(f"{name}: max_concurrent_steps must be >= 1")


def store_rows(o_smem, o_gmem, *, smem_start, gmem_start, num_rows, max_rows: int, col_start, block_n: int):
    """Stores `num_rows` (0..max_rows, dynamic) rows of `o_smem` from `smem_start` to
    `o_gmem` from `gmem_start` with power-of-two TMA boxes, largest first."""
    size = 1 << (max_rows.bit_length() - 1)
    while size >= 1:

        @pl.when((num_rows & size) != 0)
        def _(size=size, smem_start=smem_start, gmem_start=gmem_start):
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(smem_start, size)], o_gmem.at[pl.ds(gmem_start, size), pl.ds(col_start, block_n)]
            )

        smem_start = smem_start + (num_rows & size)
        gmem_start = gmem_start + (num_rows & size)
        size //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _grouped_gemm(
    sched: jax.Array,
    a: jax.Array,
    weights: Sequence[jax.Array],
    out_rows: int,
    tiling: MosaicGemmTiling,
    *,
    swiglu: bool,
    interpret: bool,
) -> jax.Array:
    """[out_rows, N]: per work item, `a[tile] @ w[group]` (and the SwiGLU epilogue)."""
    num_weights = len(weights)
    _, k_size, n_size = weights[0].shape
    block_m, block_n, block_k = tiling.block_m, tiling.block_n, tiling.block_k
    num_items = sched.shape[0]
    out_dtype = a.dtype

    def body(sched_gmem, a_gmem, *refs):
        w_gmems, o_gmem = refs[:num_weights], refs[num_weights]
        col_tile = jax.lax.axis_index("n")
        item = jax.lax.axis_index("item")
        tile_start = sched_gmem[item, schedule.TILE_START]
        row_lo = sched_gmem[item, schedule.ROW_LO]
        row_hi = sched_gmem[item, schedule.ROW_HI]
        expert = sched_gmem[item, schedule.EXPERT]
        active = sched_gmem[item, schedule.ACTIVE]
        row_tile = jax.lax.div(tile_start, jnp.int32(block_m))

        @pl.when(row_hi > row_lo)
        def _used():
            def acc_scope(*acc_refs):
                @pl.when(active > 0)
                def _gemm():
                    def step(_, a_smem, *w_smems):
                        for acc_ref, w_smem in zip(acc_refs, w_smems):
                            plgpu.wgmma(acc_ref, a_smem, w_smem)

                    plgpu.emit_pipeline(
                        step,
                        grid=(k_size // block_k,),
                        in_specs=[plgpu.BlockSpec((block_m, block_k), lambda k: (row_tile, k), delay_release=1)]
                        + [plgpu.BlockSpec((block_k, block_n), lambda k: (k, col_tile), delay_release=1)] * num_weights,
                        max_concurrent_steps=max(2, tiling.max_concurrent_steps),
                    )(a_gmem, *[w.at[expert] for w in w_gmems])

                return tuple(acc_ref[...] for acc_ref in acc_refs)

            accs = pl.run_scoped(acc_scope, *[plgpu.ACC((block_m, block_n))] * num_weights)
            if swiglu:
                gate, up = accs
                out = gate / (1.0 + jnp.exp(-gate)) * up
            else:
                (out,) = accs

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_m, block_n), out_dtype))
            def _store(o_smem):
                o_smem[...] = out.astype(out_dtype)
                plgpu.commit_smem()
                store_rows(
                    o_smem,
                    o_gmem,
                    smem_start=row_lo - tile_start,
                    gmem_start=row_lo,
                    num_rows=row_hi - row_lo,
                    max_rows=block_m,
                    col_start=col_tile * block_n,
                    block_n=block_n,
                )

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((out_rows, n_size), out_dtype),
        grid=(n_size // block_n, num_items),
        grid_names=("n", "item"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params(interpret),
    )
    return kernel(sched, a, *weights)


def moe_forward(
    x_sorted: jax.Array,
    group_sizes: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    tiling: Optional[MosaicMoeTiling] = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Runs both kernels; returns (out [M, H], hidden [M, I])."""
    num_rows, hidden_size = x_sorted.shape
    num_groups, _, inter_size = w_gate.shape
    check_weights(hidden_size, w_gate, w_up, w_down, x_sorted.dtype)
    if group_sizes.shape != (num_groups,):
        raise ValueError(f"group_sizes {group_sizes.shape} does not match {num_groups} groups")
    if x_sorted.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"Mosaic GPU MoE kernels take bfloat16 or float16, not {x_sorted.dtype}")
    if tiling is None:
        tiling = default_tiling(num_rows, num_groups, hidden_size, inter_size)
    if tiling.gate_up.block_m != tiling.down.block_m:
        raise ValueError("both kernels must use the same block_m")
    _check_tiling(tiling.gate_up, hidden_size, inter_size, "gate_up")
    _check_tiling(tiling.down, inter_size, hidden_size, "down")

    block_m = tiling.gate_up.block_m
    sched = schedule.group_tile_schedule(group_sizes, num_rows=num_rows, block_m=block_m)
    padded_rows = -(-num_rows // block_m) * block_m
    pad = ((0, padded_rows - num_rows), (0, 0))
    # `hidden` keeps the padded rows for the down kernel's TMA loads; they are never
    # written, and only ever land in accumulator rows that are not stored. Both outputs
    # span whole row tiles (a batch of fewer rows than one tile, e.g. one decode token's
    # 8 expert rows, gets a full tile's buffer) and are cut back to `num_rows` in XLA.
    hidden = _grouped_gemm(
        sched, jnp.pad(x_sorted, pad), [w_gate, w_up], padded_rows, tiling.gate_up, swiglu=True, interpret=interpret
    )
    out = _grouped_gemm(sched, hidden, [w_down], padded_rows, tiling.down, swiglu=False, interpret=interpret)
    return out[:num_rows], hidden[:num_rows]


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def moe_grouped_ffn_mosaic(
    x_sorted: jax.Array,  # [M, H]
    group_sizes: jax.Array,  # int32[E]
    w_gate: jax.Array,  # [E, H, I]
    w_up: jax.Array,  # [E, H, I]
    w_down: jax.Array,  # [E, I, H]
    *,
    interpret: bool = False,
    tiling: Optional[MosaicMoeTiling] = None,
) -> jax.Array:
    """Per-group SwiGLU FFN of expert-sorted rows: [M, H]; rows past sum(group_sizes) are 0.

    Same contract as `moe_grouped_ffn_reference`. `interpret` runs jax's Mosaic GPU
    interpreter on CPU (slow: tests only).
    """
    out, _ = moe_forward(x_sorted, group_sizes, w_gate, w_up, w_down, tiling=tiling, interpret=interpret)
    return out
