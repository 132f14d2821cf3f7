"""Quantized-weight GEMM as a Pallas Triton kernel: FP8 (e4m3) block-scaled weights, and
weight-only int8 / int4 with group scales, dequantized tile by tile in registers.

Numerics are those of the models' XLA path (`reference.quantized_matmul_reference`): each
weight tile is loaded in its stored type (1 byte, or half a byte for int4), widened to
float32, multiplied by its block's scale, rounded to the activations' dtype and fed to the
MMA with float32 accumulation. With FP8's dynamic activations the activations come in
already quantized per token-group of 128 and dequantized (DeepSeek's `act_quant`, the same
function the XLA path calls), so the kernel computes `act_quant(x) @ dequantize(w)`, as
XLA does, and only the summation order differs. (Hopper's e4m3 x e4m3 `wgmma` with the
scales applied per 128-deep K block in the accumulator is the same product in exact
arithmetic, but rounds differently when the activations are bf16.)

Grid (row tile, column tile, K split). `block_k` divides the scale block along K, so a
K step reads one row of scales ([block_n] values, each column's block scale). int4 bytes
hold columns 2j and 2j + 1: a tile of `block_n` columns loads `block_n / 2` bytes per row,
unpacks both nibbles with integer shifts, and runs two MMAs whose columns are stored
interleaved. Small batches (decode) are weight-bandwidth bound: column tiles narrow and
K is split (partials added with float32 atomics) until about two working programs per SM
exist, as in the grouped MoE kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.triton_backend import check_power_of_two, compiler_params

TARGET_WORKING_CTAS = 2 * 132  # two per SM on the 132-SM H100 / H200
MAX_ACC_REGS_PER_THREAD = 128
MAX_K_SPLITS = 16


@dataclass(frozen=True)
class QuantTiling:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    num_k_splits: int = 1

    def __post_init__(self) -> None:
        for name, minimum in (("block_m", 16), ("block_n", 32), ("block_k", 16), ("num_warps", 1), ("num_k_splits", 1)):
            check_power_of_two("QuantTiling", name, getattr(self, name), minimum)
        if self.num_stages < 1:
            raise ValueError(f"{self}: num_stages must be >= 1")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def scale_block_k_tile(scale_block_k: int, k: int) -> Optional[int]:
    """The K tile: the largest power of two <= 64 dividing the scale block (a whole-K block
    needs only to cover K), None when that is below 16 (the MMA's minimum)."""
    if scale_block_k >= k:
        return 64 if k >= 64 else max(16, _next_pow2(k))
    tile = 64
    while tile >= 16 and scale_block_k % tile:
        tile //= 2
    return tile if tile >= 16 else None


def default_tiling(m: int, n: int, k: int, scale_block_k: int) -> QuantTiling:
    """Tiles from static shapes only: 16 to 128 rows (decode buckets get 16), 128-column tiles
    narrowed to 32 and then K split while fewer than `TARGET_WORKING_CTAS` programs work."""
    block_k = scale_block_k_tile(scale_block_k, k)
    if block_k is None:
        raise ValueError(f"quantized matmul: the scale block along K ({scale_block_k}) must be a multiple of 16")
    block_m = min(128, max(16, _next_pow2(m)))
    block_n = 128
    tiles = _cdiv(m, block_m)
    while block_n > 32 and tiles * _cdiv(n, block_n) < TARGET_WORKING_CTAS:
        block_n //= 2
    splits = 1
    steps = _cdiv(k, block_k)
    while splits < MAX_K_SPLITS and tiles * _cdiv(n, block_n) * splits < TARGET_WORKING_CTAS and steps >= 8 * splits:
        splits *= 2
    num_warps = 4
    while block_m * block_n // (32 * num_warps) > MAX_ACC_REGS_PER_THREAD:
        num_warps *= 2
    return QuantTiling(block_m, block_n, block_k, num_warps, num_stages=3, num_k_splits=splits)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jax.lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def _load(ref, rows: jax.Array, cols: jax.Array, mask: Optional[jax.Array]) -> jax.Array:
    """`ref[rows, cols]` as a 2-D gather (masked entries read as zero)."""
    idx = ref.at[rows[:, None], cols[None, :]]
    return pltriton.load(idx) if mask is None else pltriton.load(idx, mask=mask, other=0)


def _and(*masks: Optional[jax.Array]) -> Optional[jax.Array]:
    present = [m for m in masks if m is not None]
    return functools.reduce(jnp.logical_and, present) if present else None


def _nibbles(byte: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 -> (low, high) nibbles as sign-extended int32 in [-8, 7] (integer ops only)."""
    v = byte.astype(jnp.int32)
    lo, hi = v & 15, (v >> 4) & 15
    return lo - ((lo & 8) << 1), hi - ((hi & 8) << 1)


def _kernel(
    x_ref,
    w_ref,
    s_ref,
    *rest,
    tiling: QuantTiling,
    n_size: int,
    scale_block: tuple[int, int],
    packed: bool,
    atomic: bool,
    interpret: bool,
):
    o_ref = rest[-1]
    bm, bn, bk = tiling.block_m, tiling.block_n, tiling.block_k
    m_size, k_size = x_ref.shape
    sbk, sbn = scale_block
    rows = pl.program_id(0) * bm + jnp.arange(bm, dtype=jnp.int32)
    row_mask = rows < m_size
    width = bn // 2 if packed else bn
    wcols = pl.program_id(1) * width + jnp.arange(width, dtype=jnp.int32)  # columns of the stored value
    out_cols = [2 * wcols, 2 * wcols + 1] if packed else [wcols]
    w_cols_size = w_ref.shape[1]
    wcol_mask = wcols < w_cols_size if w_cols_size % width else None
    # Scale columns: tail columns clamp to the last one (their products are never stored).
    scale_cols = [jnp.minimum(c, n_size - 1) // sbn for c in out_cols]
    zero_row = jnp.zeros((1,), jnp.int32)

    def body(step, accs):
        ks = step * bk + jnp.arange(bk, dtype=jnp.int32)
        k_mask = ks < k_size if k_size % bk else None
        a = _load(x_ref, rows, ks, _and(row_mask[:, None], None if k_mask is None else k_mask[None, :]))
        w_mask = _and(None if k_mask is None else k_mask[:, None], None if wcol_mask is None else wcol_mask[None, :])
        stored = _load(w_ref, ks, wcols, w_mask)
        parts = _nibbles(stored) if packed else (stored,)
        srow = zero_row + (step * bk) // sbk
        new = []
        for acc, part, scols in zip(accs, parts, scale_cols):
            scale = pltriton.load(s_ref.at[srow[:, None], scols[None, :]])
            w = (part.astype(jnp.float32) * scale).astype(a.dtype)
            new.append(acc + _dot(a, w))
        return tuple(new)

    num_steps = _cdiv(k_size, bk)
    per_split = _cdiv(num_steps, tiling.num_k_splits)
    first = pl.program_id(2) * per_split
    last = jnp.minimum(first + per_split, num_steps)
    zeros = jnp.zeros((bm, width), jnp.float32)
    accs = jax.lax.fori_loop(first, last, body, (zeros,) * len(out_cols))
    for acc, cols in zip(accs, out_cols):
        col_mask = cols < n_size if n_size % bn else None
        mask = _and(row_mask[:, None], None if col_mask is None else col_mask[None, :])
        if atomic:
            # A spare row and column past the end take the masked entries (interpret mode has
            # no masked atomics and adds duplicate indices of one call as a scatter).
            safe_rows = jnp.where(row_mask, rows, o_ref.shape[0] - 1)
            safe_cols = cols if col_mask is None else jnp.where(col_mask, cols, n_size)
            value = acc if mask is None else jnp.where(mask, acc, 0.0)
            full_mask = None if interpret or mask is None else jnp.broadcast_to(mask, value.shape)
            pltriton.atomic_add(o_ref, (safe_rows[:, None], safe_cols[None, :]), value, mask=full_mask)
        else:
            safe_rows = jnp.where(row_mask, rows, o_ref.shape[0])
            pltriton.store(o_ref.at[safe_rows[:, None], cols[None, :]], acc.astype(o_ref.dtype), mask=mask)


def check_operands(x: jax.Array, value: jax.Array, scale: jax.Array, block: tuple[int, int], packed: bool) -> int:
    """Validates shapes and dtypes; returns N (the logical column count)."""
    if x.ndim != 2 or value.ndim != 2 or scale.ndim != 2:
        raise ValueError(
            f"quantized matmul takes 2-D operands, got x {x.shape}, value {value.shape}, scale {scale.shape}"
        )
    k, n = value.shape[0], value.shape[1] * (2 if packed else 1)
    if x.shape[1] != k:
        raise ValueError(f"x {x.shape} does not contract with a [{k}, {n}] weight")
    expected = (_cdiv(k, block[0]), _cdiv(n, block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale {scale.shape} does not match a [{k}, {n}] weight in {block} blocks: want {expected}")
    allowed = (jnp.dtype(jnp.uint8),) if packed else (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.int8))
    if value.dtype not in allowed:
        raise ValueError(f"quantized matmul: value dtype {value.dtype} (packed={packed}) is not supported")
    if packed and block[1] % 2 and block[1] != 1:
        raise ValueError(f"int4 weights: the column block {block[1]} must keep byte pairs together")
    return n


def quantized_matmul_forward(
    x: jax.Array,
    value: jax.Array,
    scale: jax.Array,
    *,
    block: tuple[int, int],
    packed: bool = False,
    tiling: Optional[QuantTiling] = None,
    interpret: bool = False,
    poison_output: bool = False,
) -> jax.Array:
    """Launches the kernel; [M, N] in x's dtype. `poison_output` hands it a NaN-filled output
    (no split-K) so a test sees any element it leaves unwritten."""
    m, k = x.shape
    n = check_operands(x, value, scale, block, packed)
    if tiling is None:
        tiling = default_tiling(m, n, k, block[0])
    if block[0] % tiling.block_k and block[0] < k:
        raise ValueError(f"{tiling}: block_k must divide the scale block along K ({block[0]})")
    atomic = tiling.num_k_splits > 1
    inputs = [x, value, scale.astype(jnp.float32)]
    aliases: dict[int, int] = {}
    if atomic:
        out_shape = jax.ShapeDtypeStruct((m + 1, n + 1), jnp.float32)
        aliases[3] = 0
        inputs.append(jnp.zeros(out_shape.shape, jnp.float32))
    else:
        out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
        if poison_output:
            aliases[3] = 0
            inputs.append(jnp.full(out_shape.shape, jnp.nan, x.dtype))
    body = functools.partial(
        _kernel,
        tiling=tiling,
        n_size=n,
        scale_block=block,
        packed=packed,
        atomic=atomic,
        interpret=interpret,
    )
    out = pl.pallas_call(
        body,
        out_shape=out_shape,
        grid=(pl.cdiv(m, tiling.block_m), pl.cdiv(n, tiling.block_n), tiling.num_k_splits),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=compiler_params(tiling.num_warps, tiling.num_stages),
        name="quantized_matmul_int4" if packed else f"quantized_matmul_{value.dtype}",
    )(*inputs)
    return out[:-1, :-1].astype(x.dtype) if atomic else out


@functools.partial(jax.jit, static_argnames=("block", "packed", "interpret", "tiling"))
def quantized_matmul(
    x: jax.Array,  # [M, K]
    value: jax.Array,  # [K, N] float8_e4m3fn / int8, or uint8 [K, N / 2] (int4 pairs)
    scale: jax.Array,  # float32 [ceil(K / bk), ceil(N / bn)]
    *,
    block: tuple[int, int],
    packed: bool = False,
    interpret: bool = False,
    tiling: Optional[QuantTiling] = None,
) -> jax.Array:
    """`x @ (value * scale per block)` in x's dtype: [M, N]. Same contract as
    `quantized_matmul_reference`."""
    return quantized_matmul_forward(x, value, scale, block=block, packed=packed, tiling=tiling, interpret=interpret)
