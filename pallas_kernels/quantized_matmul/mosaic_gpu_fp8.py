"""FP8 (e4m3) block-scaled GEMM as a Mosaic GPU kernel (Hopper, sm90a): e4m3 x e4m3 `wgmma`.

The Triton kernel (`kernel.py`) widens each weight tile to bf16 and multiplies bf16 x bf16.
Here both operands reach the tensor cores as e4m3 (twice the wgmma rate of bf16, half the
shared memory), with DeepSeek-V3's scaling, as DeepGEMM and TensorRT-LLM's FP8 block-scale
GEMM do: activations quantized per (token, 128-group) at run time (`quantize_activations`,
the numerics of the models' `act_quant`), weights with one scale per 128 x 128 block. Each
128-deep K step is one TMA load per operand and a wgmma into a fresh f32 accumulator; its
partial product is multiplied by (row's activation scale) x (column block's weight scale)
and added to an f32 accumulator in registers. Promoting every 128-deep block to f32 also
bounds the error of Hopper's reduced-precision f8 accumulation inside wgmma.

Layout: 8-bit wgmma takes K-major operands only (Mosaic GPU refuses an N-major f8 B:
"Only f16 WGMMA supports transposes"), so the weight comes as `w_t` [N, K] (the
checkpoint's own [out, in] layout) and is read through `plgpu.transpose_ref`; callers
holding [K, N] transpose it (`k_major`). Activation scales go transposed ([K / 128, M])
so one K step's row scales are one contiguous TMA box. A 128-deep e4m3 tile is 128 bytes
per row: exactly the 128-byte swizzle. The column tile (64 or 128) lies inside one scale
block, so a step's weight scale is one scalar read from global memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_gpu_interpret import interpret_params

BLOCK = 128  # the scale block along K and N, the K step, and the activation group
FP8_MAX = 448.0
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# f32 registers per thread for the accumulators (one warpgroup: 128 threads): the running
# sums plus one wgmma partial. Hopper has 255 per thread; the epilogue and the pipeline's
# addressing need the rest (spills to local memory would cost more than narrower tiles).
MAX_ACC_REGS_PER_THREAD = 128
TARGET_WORKING_CTAS = 132  # one per SM of an H100 / H200


@dataclass(frozen=True)
class Fp8GemmTiling:
    """`block_m` is a multiple of 64 (one warpgroup's wgmma rows), `block_n` 64 or 128 (inside
    one 128-column scale block); the K step is always one 128-deep scale block."""

    block_m: int
    block_n: int
    max_concurrent_steps: int = 4


def quantize_activations(x: jax.Array, group: int = BLOCK) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, K / group]): one scale amax / 448 per
    token and group, the numerics of `jaxllm.models.quantization.act_quant` (which returns
    `q * scale` rounded to x's dtype instead)."""
    m, k = x.shape
    if k % group:
        raise ValueError(f"activation quantization: K={k} is not a multiple of the group {group}")
    grouped = x.astype(jnp.float32).reshape(m, k // group, group)
    amax = jnp.max(jnp.abs(grouped), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax * jnp.float32(1.0 / FP8_MAX), 1.0)
    q = (grouped * (1.0 / scale)).astype(jnp.float8_e4m3fn)
    return q.reshape(m, k), scale[..., 0]


def k_major(value: jax.Array) -> jax.Array:
    """A [..., K, N] weight as the kernels read it: [..., N, K]."""
    return jnp.swapaxes(value, -1, -2)


def on_hopper(device: Any) -> bool:
    """Whether `device` has sm_90a's wgmma: compute capability 9.x (Blackwell has not)."""
    return str(getattr(device, "compute_capability", "") or "").split(".")[0] == "9"


def supports(k: int, n: int, block: Sequence[int], act_group: int, device: Any = None) -> bool:
    """Whether the kernel takes x [M, K] @ w [K, N]: 128 x 128 weight blocks, activations
    quantized per 128-group, K a multiple of 128 and N of 64, and (when `device` is given)
    a Hopper GPU. Without a device the shapes alone decide (the interpreter runs anywhere)."""
    shapes = tuple(block) == (BLOCK, BLOCK) and act_group == BLOCK and k % BLOCK == 0 and n % 64 == 0
    return shapes and (device is None or on_hopper(device))


def default_tiling(m: int, n: int) -> Fp8GemmTiling:
    """64 rows unless the batch fills 128-row tiles; 128 columns, narrowed to 64 while fewer
    than one CTA per SM would work (decode batches)."""
    block_m = 128 if m >= 256 else 64
    block_n = 128 if n % 128 == 0 else 64
    if block_n == 128 and (block_m == 128 or -(-m // block_m) * (n // 128) < TARGET_WORKING_CTAS):
        block_n = 64
    return Fp8GemmTiling(block_m, block_n)


def check_tiling(t: Fp8GemmTiling, k: int, n: int, num_weights: int, name: str) -> None:
    if t.block_m % 64:
        raise ValueError(f"{name}: block_m={t.block_m} must be a multiple of 64 (wgmma rows)")
    if t.block_n not in (64, 128) or n % t.block_n:
        raise ValueError(f"{name}: block_n={t.block_n} must be 64 or 128 and divide N={n}")
    if k % BLOCK:
        raise ValueError(f"{name}: K={k} must be a multiple of {BLOCK}")
    regs = (num_weights + 1) * t.block_m * t.block_n // 128
    if regs > MAX_ACC_REGS_PER_THREAD:
        raise ValueError(f"{name}: {t} needs {regs} accumulator registers per thread (> {MAX_ACC_REGS_PER_THREAD})")
    if t.max_concurrent_steps < 1:
        raise ValueError(f"{name}: max_concurrent_steps must be >= 1")


def scaled_fp8_accumulate(
    a_gmem,
    a_scale_gmem,
    w_gmems: Sequence,
    w_scale: Callable[[int, jax.Array], jax.Array],
    *,
    row_tile: jax.Array,
    col_tile: jax.Array,
    k_size: int,
    tiling: Fp8GemmTiling,
) -> tuple[jax.Array, ...]:
    """Inside a kernel body: per weight, the f32 [block_m, block_n] tile of
    `sum_kb (a[:, kb] @ w[kb, :]) * a_scale[:, kb] * w_scale(weight, kb)`.

    `a_gmem` e4m3 [M, K], `a_scale_gmem` f32 [K / 128, M], each `w_gmems` entry e4m3 [N, K];
    `w_scale(i, kb)` reads weight i's scale of K block `kb` for this column tile. The
    weights' wgmmas run one after the other through one accumulator, so the registers
    hold the running sums plus one partial."""
    bm, bn = tiling.block_m, tiling.block_n

    def step(idxs, a_smem, a_scale_smem, *rest):
        *w_smems, carry = rest
        (kb,) = idxs
        row_scale = jax.lax.broadcast_in_dim(a_scale_smem[0, :], (bm, bn), (0,))
        new = []
        for i, (w_smem, total) in enumerate(zip(w_smems, carry)):

            def partial_product(acc_ref, w_smem=w_smem):
                plgpu.wgmma(acc_ref, a_smem, plgpu.transpose_ref(w_smem, (1, 0)))
                return acc_ref[...]

            part = pl.run_scoped(partial_product, plgpu.ACC((bm, bn)))
            new.append(total + part * (row_scale * w_scale(i, kb)))
        return tuple(new)

    init = tuple(jnp.zeros((bm, bn), jnp.float32) for _ in w_gmems)
    return plgpu.emit_pipeline(
        step,
        grid=(k_size // BLOCK,),
        in_specs=[
            plgpu.BlockSpec((bm, BLOCK), lambda kb: (row_tile, kb)),
            plgpu.BlockSpec((1, bm), lambda kb: (kb, row_tile)),
        ]
        + [plgpu.BlockSpec((bn, BLOCK), lambda kb: (col_tile, kb))] * len(w_gmems),
        max_concurrent_steps=max(2, tiling.max_concurrent_steps),
        init_carry=init,
    )(a_gmem, a_scale_gmem, *w_gmems)


def fp8_gemm_forward(
    xq: jax.Array,
    x_scale: jax.Array,
    w_t: jax.Array,
    w_scale: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    tiling: Optional[Fp8GemmTiling] = None,
    interpret: bool = False,
) -> jax.Array:
    """xq e4m3 [M, K], x_scale f32 [M, K / 128], w_t e4m3 [N, K], w_scale f32 [K / 128, N / 128]
    -> [M, N] in `out_dtype`. Rows are padded to whole row tiles for the TMA loads."""
    m, k = xq.shape
    n = w_t.shape[0]
    if xq.dtype != jnp.float8_e4m3fn or w_t.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"FP8 GEMM takes float8_e4m3fn operands, got {xq.dtype} and {w_t.dtype}")
    if w_t.shape[1] != k or x_scale.shape != (m, k // BLOCK) or w_scale.shape != (k // BLOCK, -(-n // BLOCK)):
        raise ValueError(
            f"FP8 GEMM shapes do not fit: x {xq.shape}, x_scale {x_scale.shape}, "
            f"w_t {w_t.shape}, w_scale {w_scale.shape}"
        )
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"FP8 GEMM output dtype {out_dtype} is not one of {OUT_DTYPES}")
    tiling = tiling or default_tiling(m, n)
    check_tiling(tiling, k, n, 1, "fp8 gemm")
    bm, bn = tiling.block_m, tiling.block_n
    padded = -(-m // bm) * bm
    xq = jnp.pad(xq, ((0, padded - m), (0, 0)))
    x_scale_t = jnp.pad(x_scale.astype(jnp.float32), ((0, padded - m), (0, 0))).T

    def fp8_block_gemm(a_gmem, as_gmem, w_gmem, ws_gmem, o_gmem):
        row_tile, col_tile = jax.lax.axis_index("m"), jax.lax.axis_index("n")
        scale_col = jax.lax.div(col_tile * bn, jnp.int32(BLOCK))
        (acc,) = scaled_fp8_accumulate(
            a_gmem,
            as_gmem,
            [w_gmem],
            lambda _, kb: ws_gmem[kb, scale_col],
            row_tile=row_tile,
            col_tile=col_tile,
            k_size=k,
            tiling=tiling,
        )

        @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), out_dtype))
        def _store(o_smem):
            o_smem[...] = acc.astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(row_tile * bm, bm), pl.ds(col_tile * bn, bn)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        fp8_block_gemm,
        out_type=jax.ShapeDtypeStruct((padded, n), out_dtype),
        grid=(padded // bm, n // bn),
        grid_names=("m", "n"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params(interpret),
    )
    return kernel(xq, x_scale_t, w_t, w_scale.astype(jnp.float32))[:m]


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def fp8_block_matmul(
    x: jax.Array,  # [M, K] bf16 / f16 / f32 (quantized here per 128-group)
    w_t: jax.Array,  # float8_e4m3fn [N, K]
    w_scale: jax.Array,  # float32 [K / 128, N / 128]
    *,
    interpret: bool = False,
    tiling: Optional[Fp8GemmTiling] = None,
) -> jax.Array:
    """`act_quant(x) @ dequantize(w)` as DeepSeek's FP8 GEMM computes it: [M, N] in x's dtype."""
    xq, x_scale = quantize_activations(x)
    return fp8_gemm_forward(xq, x_scale, w_t, w_scale, out_dtype=x.dtype, tiling=tiling, interpret=interpret)


def fp8_block_matmul_reference(xq: jax.Array, x_scale: jax.Array, w: jax.Array, w_scale: jax.Array) -> jax.Array:
    """Plain XLA of the same scheme, f32 [M, N]: per 128-deep K block, the exact e4m3 product
    (f32) times the row's activation scale and the block's weight scale, summed in f32.
    `w` is [K, N] here (the layout does not matter to XLA)."""
    m, k = xq.shape
    n = w.shape[1]
    a = xq.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK)
    b = w.astype(jnp.float32).reshape(k // BLOCK, BLOCK, n)
    parts = jnp.einsum("mbk,bkn->bmn", a, b, precision=jax.lax.Precision.HIGHEST)
    col_scale = jnp.repeat(w_scale.astype(jnp.float32), BLOCK, axis=1)[:, :n]  # [K / 128, N]
    return jnp.einsum("bmn,mb,bn->mn", parts, x_scale.astype(jnp.float32), col_scale)
