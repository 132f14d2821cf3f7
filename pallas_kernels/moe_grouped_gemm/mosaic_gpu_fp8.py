"""Grouped expert FFN (SwiGLU) with FP8 e4m3 operands on Hopper's wgmma: two Mosaic GPU kernels.

Same contract as `moe_grouped_ffn_reference` (rows of group `e` use expert `e`, rows past
`sum(group_sizes)` come out as zeros) and the same work list and row stores as the bf16
`mosaic_gpu.py`. What differs is the arithmetic, DeepSeek-V3's FP8 scheme (as DeepGEMM's
grouped GEMM): activations quantized per (token, 128-group) to e4m3 (`quantize_activations`),
expert weights e4m3 with one scale per 128 x 128 block, and each 128-deep K block's wgmma
partial scaled by (row scale) x (weight block scale) into f32 accumulators
(`scaled_fp8_accumulate`, shared with the dense FP8 GEMM).
  1. gate/up: both weights per K step, epilogue `silu(g) * u` rounded to the output dtype
     (as the reference rounds its hidden activations).
  2. the hidden activations quantized per 128-group in XLA (DeepSeek quantizes the down
     projection's input too; a per-row amax inside the epilogue would need TMA stores of
     single scales, below TMA's 16-byte minimum), then down.
Padding items store zeros without running the pipeline. Weights come K-major
([E, N, K], see `quantized_matmul.mosaic_gpu_fp8`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe_grouped_gemm import schedule
from pallas_kernels.moe_grouped_gemm.mosaic_gpu import store_rows
from pallas_kernels.mosaic_gpu_interpret import interpret_params
from pallas_kernels.quantized_matmul.mosaic_gpu_fp8 import (
    BLOCK,
    OUT_DTYPES,
    Fp8GemmTiling,
    check_tiling,
    fp8_block_matmul_reference,
    k_major,
    on_hopper,
    quantize_activations,
    scaled_fp8_accumulate,
)


@dataclass(frozen=True)
class Fp8MoeTiling:
    """Both kernels share `block_m` (they share the work list)."""

    gate_up: Fp8GemmTiling
    down: Fp8GemmTiling


def default_tiling(num_rows: int, num_groups: int, hidden: int, inter: int) -> Fp8MoeTiling:
    """64-row tiles (one warpgroup): gate/up keeps two running sums and one partial, 3 x 64 x
    64 f32 = 96 registers per thread at 64-column tiles (128 rows would need 192). down takes
    128 columns beyond decode sizes (fewer, wider CTAs once many experts work)."""
    del num_groups, inter
    down_n = 128 if num_rows > 64 and hidden % 128 == 0 else 64
    return Fp8MoeTiling(Fp8GemmTiling(64, 64), Fp8GemmTiling(64, down_n))


def supports(hidden: int, inter: int, block: Sequence[int], act_group: int = BLOCK, device: Any = None) -> bool:
    """Whether the kernels take the problem: 128 x 128 weight blocks, activations quantized
    per 128-group, hidden and intermediate sizes multiples of 128, and (when `device` is
    given) a Hopper GPU."""
    shapes = tuple(block) == (BLOCK, BLOCK) and act_group == BLOCK and hidden % BLOCK == 0 and inter % BLOCK == 0
    return shapes and (device is None or on_hopper(device))


def _grouped_fp8_gemm(
    sched: jax.Array,
    a: jax.Array,
    a_scale_t: jax.Array,
    weights: Sequence[jax.Array],
    w_scales: Sequence[jax.Array],
    out_dtype,
    tiling: Fp8GemmTiling,
    *,
    swiglu: bool,
    interpret: bool,
) -> jax.Array:
    """[rows of a, N]: per work item, the scaled `a[tile] @ w[group]^T` (and SwiGLU)."""
    num_weights = len(weights)
    _, n_size, k_size = weights[0].shape
    bm, bn = tiling.block_m, tiling.block_n
    num_rows = a.shape[0]

    def body(sched_gmem, a_gmem, as_gmem, *refs):
        w_gmems, ws_gmems, o_gmem = refs[:num_weights], refs[num_weights : 2 * num_weights], refs[-1]
        col_tile, item = jax.lax.axis_index("n"), jax.lax.axis_index("item")
        tile_start = sched_gmem[item, schedule.TILE_START]
        row_lo = sched_gmem[item, schedule.ROW_LO]
        row_hi = sched_gmem[item, schedule.ROW_HI]
        expert = sched_gmem[item, schedule.EXPERT]
        active = sched_gmem[item, schedule.ACTIVE]
        scale_col = jax.lax.div(col_tile * bn, jnp.int32(BLOCK))

        @pl.when(row_hi > row_lo)
        def _used():
            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), out_dtype))
            def _tile(o_smem):
                @pl.when(active > 0)
                def _gemm():
                    accs = scaled_fp8_accumulate(
                        a_gmem,
                        as_gmem,
                        [w.at[expert] for w in w_gmems],
                        lambda i, kb: ws_gmems[i][expert, kb, scale_col],
                        row_tile=jax.lax.div(tile_start, jnp.int32(bm)),
                        col_tile=col_tile,
                        k_size=k_size,
                        tiling=tiling,
                    )
                    if swiglu:
                        gate, up = accs
                        out = gate / (1.0 + jnp.exp(-gate)) * up
                    else:
                        (out,) = accs
                    o_smem[...] = out.astype(out_dtype)

                @pl.when(active == 0)
                def _padding():
                    o_smem[...] = jnp.zeros((bm, bn), out_dtype)

                plgpu.commit_smem()
                store_rows(
                    o_smem,
                    o_gmem,
                    smem_start=row_lo - tile_start,
                    gmem_start=row_lo,
                    num_rows=row_hi - row_lo,
                    max_rows=bm,
                    col_start=col_tile * bn,
                    block_n=bn,
                )

    body.__name__ = "moe_fp8_gate_up" if swiglu else "moe_fp8_down"  # the kernel's name in programs
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_rows, n_size), out_dtype),
        grid=(n_size // bn, sched.shape[0]),
        grid_names=("n", "item"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params(interpret),
    )
    return kernel(sched, a, a_scale_t, *weights, *[s.astype(jnp.float32) for s in w_scales])


def moe_fp8_forward(
    xq: jax.Array,
    x_scale: jax.Array,
    group_sizes: jax.Array,
    w_gate_t: jax.Array,
    w_up_t: jax.Array,
    w_down_t: jax.Array,
    s_gate: jax.Array,
    s_up: jax.Array,
    s_down: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    tiling: Optional[Fp8MoeTiling] = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """xq e4m3 [M, H] with scales f32 [M, H / 128]; K-major e4m3 experts w_gate_t / w_up_t
    [E, I, H], w_down_t [E, H, I] with block scales [E, H / 128, I / 128] (gate, up) and
    [E, I / 128, H / 128] (down). Returns (out [M, H], hidden [M, I]) in `out_dtype`."""
    num_rows, hidden_size = xq.shape
    num_groups, inter_size, _ = w_gate_t.shape
    for name, w, shape in (
        ("w_gate_t", w_gate_t, (num_groups, inter_size, hidden_size)),
        ("w_up_t", w_up_t, (num_groups, inter_size, hidden_size)),
        ("w_down_t", w_down_t, (num_groups, hidden_size, inter_size)),
    ):
        if w.shape != shape or w.dtype != jnp.float8_e4m3fn:
            raise ValueError(f"{name} {w.shape} {w.dtype}: want float8_e4m3fn {shape}")
    if xq.dtype != jnp.float8_e4m3fn or x_scale.shape != (num_rows, hidden_size // BLOCK):
        raise ValueError(f"x {xq.shape} {xq.dtype} with scales {x_scale.shape}: want e4m3 and per-128-group scales")
    if group_sizes.shape != (num_groups,):
        raise ValueError(f"group_sizes {group_sizes.shape} does not match {num_groups} groups")
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"output dtype {out_dtype} is not one of {OUT_DTYPES}")
    if not supports(hidden_size, inter_size, (BLOCK, BLOCK)):
        raise ValueError(f"hidden {hidden_size} and intermediate {inter_size} sizes must be multiples of {BLOCK}")
    tiling = tiling or default_tiling(num_rows, num_groups, hidden_size, inter_size)
    if tiling.gate_up.block_m != tiling.down.block_m:
        raise ValueError("both kernels must use the same block_m")
    check_tiling(tiling.gate_up, hidden_size, inter_size, 2, "gate_up")
    check_tiling(tiling.down, inter_size, hidden_size, 1, "down")

    block_m = tiling.gate_up.block_m
    sched = schedule.group_tile_schedule(group_sizes, num_rows=num_rows, block_m=block_m)
    padded_rows = -(-num_rows // block_m) * block_m
    pad = ((0, padded_rows - num_rows), (0, 0))
    # As in the bf16 kernels, rows past `num_rows` are never written and only reach
    # accumulator rows that are not stored; quantization is per row, so they stay there.
    hidden = _grouped_fp8_gemm(
        sched,
        jnp.pad(xq, pad),
        jnp.pad(x_scale.astype(jnp.float32), pad).T,
        [w_gate_t, w_up_t],
        [s_gate, s_up],
        out_dtype,
        tiling.gate_up,
        swiglu=True,
        interpret=interpret,
    )
    hq, h_scale = quantize_activations(hidden)
    out = _grouped_fp8_gemm(
        sched, hq, h_scale.T, [w_down_t], [s_down], out_dtype, tiling.down, swiglu=False, interpret=interpret
    )
    return out[:num_rows], hidden[:num_rows]


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def moe_grouped_ffn_fp8_mosaic(
    x_sorted: jax.Array,  # [M, H] bf16 / f16 (quantized here per 128-group)
    group_sizes: jax.Array,  # int32[E]
    w_gate_t: jax.Array,  # float8_e4m3fn [E, I, H] (K-major: `k_major(w_gate)`)
    w_up_t: jax.Array,  # float8_e4m3fn [E, I, H]
    w_down_t: jax.Array,  # float8_e4m3fn [E, H, I]
    s_gate: jax.Array,  # float32 [E, H / 128, I / 128]
    s_up: jax.Array,
    s_down: jax.Array,  # float32 [E, I / 128, H / 128]
    *,
    interpret: bool = False,
    tiling: Optional[Fp8MoeTiling] = None,
) -> jax.Array:
    """Per-group SwiGLU FFN of expert-sorted rows in DeepSeek's FP8 scheme: [M, H] in x's
    dtype; rows past sum(group_sizes) are 0."""
    xq, x_scale = quantize_activations(x_sorted)
    out, _ = moe_fp8_forward(
        xq,
        x_scale,
        group_sizes,
        w_gate_t,
        w_up_t,
        w_down_t,
        s_gate,
        s_up,
        s_down,
        out_dtype=x_sorted.dtype,
        tiling=tiling,
        interpret=interpret,
    )
    return out


def moe_fused_ffn_fp8_mosaic(
    x,
    expert_ids,
    routing_weights,
    w_gate,
    w_up,
    w_down,
    s_gate,
    s_up,
    s_down,
    *,
    interpret: bool = False,
    weights_k_major: bool = False,
) -> jax.Array:
    """`moe_fused_ffn_fp8`'s contract ([E, K, N] experts, ids outside [0, E) skipped) on the
    sorted-rows path: sort in XLA, the two kernels, unsort and combine in float32. The
    experts are made K-major here, inside the step, unless `weights_k_major` says they come
    so ([E, N, K]; the engine stores them [E, K, N] today, so it pays that pass)."""
    num_tokens, top_k = expert_ids.shape
    num_groups = w_gate.shape[0]
    ids = expert_ids.reshape(-1).astype(jnp.int32)
    ids = jnp.where((ids >= 0) & (ids < num_groups), ids, num_groups)
    order = jnp.argsort(ids, stable=True)
    group_sizes = jnp.bincount(ids, length=num_groups).astype(jnp.int32)
    weights_t = (w_gate, w_up, w_down) if weights_k_major else (k_major(w_gate), k_major(w_up), k_major(w_down))
    y_sorted = moe_grouped_ffn_fp8_mosaic(
        x[order // top_k], group_sizes, *weights_t, s_gate, s_up, s_down, interpret=interpret
    )
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
    out = jnp.einsum(
        "tkh,tk->th", y.reshape(num_tokens, top_k, -1).astype(jnp.float32), routing_weights.astype(jnp.float32)
    )
    return out.astype(x.dtype)


def moe_grouped_ffn_fp8_scheme_reference(
    xq, x_scale, group_sizes, w_gate, w_up, w_down, s_gate, s_up, s_down, *, out_dtype=jnp.bfloat16
) -> jax.Array:
    """Plain XLA of the kernels' scheme ([E, K, N] experts): every expert's scaled product for
    every row, each row keeping its own expert's; hidden rounded to `out_dtype` and quantized
    per 128-group before down. Rows past sum(group_sizes) are 0. Small problems only."""
    num_rows = xq.shape[0]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    row_group = jnp.searchsorted(ends, jnp.arange(num_rows), side="right")

    def grouped(a, a_scale, w, s):
        outs = jnp.stack([fp8_block_matmul_reference(a, a_scale, w[e], s[e]) for e in range(w.shape[0])])
        return jnp.take_along_axis(outs, jnp.minimum(row_group, w.shape[0] - 1)[None, :, None], axis=0)[0]

    gate, up = grouped(xq, x_scale, w_gate, s_gate), grouped(xq, x_scale, w_up, s_up)
    hidden = (jax.nn.silu(gate) * up).astype(out_dtype)
    out = grouped(*quantize_activations(hidden), w_down, s_down)
    return jnp.where((jnp.arange(num_rows) < ends[-1])[:, None], out, 0.0).astype(out_dtype)
