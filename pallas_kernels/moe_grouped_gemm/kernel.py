"""Grouped expert FFN (SwiGLU) over expert-sorted rows, as two Pallas Triton kernels.

Lowering: Triton (`compiler_params=pltriton.CompilerParams`), for the same reasons as
the attention kernel: it runs on Ampere and Hopper, supports masked loads, scalar reads
from refs and dynamic loop trip counts, and can be checked on CPU in interpret mode.
Mosaic GPU (`ragged_dot_mgpu`) would use TMA and wgmma but is Hopper-only. From jax
0.11 the Triton backend emits a deprecation warning; it still lowers there.

Two kernels, each on grid (work item, column tile); the work list (see `schedule.py`)
pairs every row tile with each group it overlaps, so ragged groups, straddling tiles and
empty groups need no host sync and no per-group Python loop:
  1. gate/up: `hidden = silu(x @ w_gate[g]) * (x @ w_up[g])` with both products
     accumulated in f32 in one pass over `x` (x is read once for the two projections),
     rounded to the activation dtype like the reference.
  2. down: `out = hidden @ w_down[g]`, f32 accumulation.
Rows past `sum(group_sizes)` come out as zeros. Routing weights are not applied here.
Weights are viewed as 2-D (`[E * K, N]`) so every load is a 2-D gather with a contiguous
last axis.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.moe_grouped_gemm import schedule


@dataclass(frozen=True)
class GemmTiling:
    """Static tile sizes and launch parameters of one grouped GEMM kernel."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeTiling:
    """Both kernels share `block_m` (they share the work list)."""

    gate_up: GemmTiling
    down: GemmTiling


def default_tiling(num_rows: int, num_groups: int, hidden: int, inter: int) -> MoeTiling:
    """Tile sizes from static shapes only.

    Small batches are weight-bandwidth bound: 64-row tiles keep every active expert's
    weights read about once per column tile. When groups average 128+ rows, 128-row
    tiles halve weight re-reads and raise MMA efficiency. Shared memory per pipeline
    stage (bf16): gate/up holds an x tile and two weight tiles (40 KiB at 64 rows, 32 KiB
    at 128 rows with 64 columns), down holds two tiles (24-32 KiB), so three stages stay
    under 128 KiB (Ampere allows 164 KiB, Hopper 227 KiB). f32 accumulators stay at
    <= 64 KiB of registers per program (<= 128 registers per thread).
    """
    del hidden, inter
    if num_rows >= 128 * num_groups:
        return MoeTiling(GemmTiling(128, 64, 64, 8, 3), GemmTiling(128, 128, 64, 8, 3))
    return MoeTiling(GemmTiling(64, 128, 64, 4, 3), GemmTiling(64, 128, 64, 4, 3))


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """f32-accumulating MMA. HIGHEST keeps f32 inputs in IEEE f32 (Triton's default for
    f32 is TF32); bf16 inputs are unaffected."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)


def _tail_mask(idx: jax.Array, size: int, block: int) -> Optional[jax.Array]:
    """`idx < size`, or None when `size` is a multiple of the block (no tail to mask)."""
    return idx < size if size % block else None


def _and(*masks: Optional[jax.Array]) -> Optional[jax.Array]:
    present = [m for m in masks if m is not None]
    return functools.reduce(jnp.logical_and, present) if present else None


def _load_tile(ref, rows: jax.Array, cols: jax.Array, mask: Optional[jax.Array]) -> jax.Array:
    """`ref[rows, cols]` as a 2-D gather; masked entries read as zero.

    Both axes are integer arrays (interpret mode cannot mix an index vector with a slice);
    the indices themselves are left unmasked so Triton sees contiguous column offsets
    and vectorises the access.
    """
    idx = ref.at[rows[:, None], cols[None, :]]
    return pltriton.load(idx) if mask is None else pltriton.load(idx, mask=mask, other=0)


def _store_tile(ref, rows: jax.Array, cols: jax.Array, value: jax.Array, row_mask: jax.Array,
                col_mask: Optional[jax.Array]) -> None:
    """Stores the rows in `row_mask` (and columns in `col_mask`). Masked-off rows are
    redirected one past the end (masked columns are past the end already): GPU stores
    never happen there, and interpret mode drops them instead of racing with real rows."""
    rows = jnp.where(row_mask, rows, ref.shape[0])
    mask = _and(row_mask[:, None], None if col_mask is None else col_mask[None, :])
    pltriton.store(ref.at[rows[:, None], cols[None, :]], value, mask=mask)


def _grouped_kernel(sched_ref, a_ref, *refs, num_weights: int, swiglu: bool, block_m: int,
                    block_n: int, block_k: int, num_aliased: int):
    """One (work item, column tile): `a[rows] @ w[g]` for each weight, then the epilogue.

    `a_ref` is [M, K]; each weight ref is the [E * K, N] view of a [E, K, N] stack. With
    `swiglu` the two products (gate, up) become `silu(gate) * up`.
    """
    w_refs = refs[:num_weights]
    (o_ref,) = refs[num_weights + num_aliased:]
    item = pl.program_id(0)
    tile_start = sched_ref[item, schedule.TILE_START]
    row_lo = sched_ref[item, schedule.ROW_LO]
    row_hi = sched_ref[item, schedule.ROW_HI]
    expert = sched_ref[item, schedule.EXPERT]
    active = sched_ref[item, schedule.ACTIVE]
    k_size = a_ref.shape[1]
    n_size = w_refs[0].shape[1]

    rows = tile_start + jnp.arange(block_m, dtype=jnp.int32)
    row_mask = (rows >= row_lo) & (rows < row_hi)
    cols = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    col_mask = _tail_mask(cols, n_size, block_n)
    w_row_base = expert * k_size

    def body(step, accs):
        ks = step * block_k + jnp.arange(block_k, dtype=jnp.int32)
        k_mask = _tail_mask(ks, k_size, block_k)
        a = _load_tile(a_ref, rows, ks, _and(row_mask[:, None], None if k_mask is None else k_mask[None, :]))
        w_mask = _and(None if k_mask is None else k_mask[:, None], None if col_mask is None else col_mask[None, :])
        return tuple(acc + _dot(a, _load_tile(w_ref, w_row_base + ks, cols, w_mask))
                     for acc, w_ref in zip(accs, w_refs))

    # Zero-filling and unused items skip the K loop (and every weight load).
    trip_count = jnp.where(active > 0, (k_size + block_k - 1) // block_k, 0)
    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    accs = jax.lax.fori_loop(0, trip_count, body, (zeros,) * num_weights)
    if swiglu:
        gate, up = accs
        out = gate * jax.nn.sigmoid(gate) * up
    else:
        (out,) = accs
    _store_tile(o_ref, rows, cols, out.astype(o_ref.dtype), row_mask, col_mask)


def _grouped_call(sched, a, weights, out_struct, tiling: GemmTiling, *, swiglu: bool, interpret: bool,
                  poison: bool, name: str) -> jax.Array:
    inputs = [sched, a, *weights]
    aliases: dict[int, int] = {}
    if poison:
        aliases[len(inputs)] = 0
        inputs.append(jnp.full(out_struct.shape, jnp.nan, out_struct.dtype))
    grid = (sched.shape[0], pl.cdiv(out_struct.shape[1], tiling.block_n))
    body = functools.partial(_grouped_kernel, num_weights=len(weights), swiglu=swiglu,
                             block_m=tiling.block_m, block_n=tiling.block_n, block_k=tiling.block_k,
                             num_aliased=len(aliases))
    return pl.pallas_call(
        body,
        out_shape=out_struct,
        grid=grid,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        name=name,
    )(*inputs)


def _check(name: str, size: int) -> None:
    if size < 16 or size & (size - 1):
        raise ValueError(f"{name}={size} must be a power of two >= 16 (Triton tensor shapes, MMA)")


def moe_forward(
    x_sorted: jax.Array,
    group_sizes: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    tiling: Optional[MoeTiling] = None,
    interpret: bool = False,
    poison_outputs: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Runs both kernels; returns (out [M, H], hidden [M, I]).

    `poison_outputs` hands each kernel a NaN-filled output buffer (aliased in place) so a
    test can check that every element was written.
    """
    num_rows, hidden_size = x_sorted.shape
    num_groups, wh, inter_size = w_gate.shape
    if wh != hidden_size or w_up.shape != w_gate.shape or w_down.shape != (num_groups, inter_size, hidden_size):
        raise ValueError(f"shape mismatch: x {x_sorted.shape}, w_gate {w_gate.shape}, "
                         f"w_up {w_up.shape}, w_down {w_down.shape}")
    if group_sizes.shape != (num_groups,):
        raise ValueError(f"group_sizes {group_sizes.shape} does not match {num_groups} groups")
    if len({x_sorted.dtype, w_gate.dtype, w_up.dtype, w_down.dtype}) != 1:
        raise ValueError("x_sorted and the weights must share one dtype")
    if tiling is None:
        tiling = default_tiling(num_rows, num_groups, hidden_size, inter_size)
    if tiling.gate_up.block_m != tiling.down.block_m:
        raise ValueError("both kernels must use the same block_m")
    for t in (tiling.gate_up, tiling.down):
        for name in ("block_m", "block_n", "block_k"):
            _check(name, getattr(t, name))

    sched = schedule.group_tile_schedule(group_sizes, num_rows=num_rows, block_m=tiling.gate_up.block_m)
    hidden = _grouped_call(
        sched, x_sorted,
        [w_gate.reshape(num_groups * hidden_size, inter_size), w_up.reshape(num_groups * hidden_size, inter_size)],
        jax.ShapeDtypeStruct((num_rows, inter_size), x_sorted.dtype), tiling.gate_up, swiglu=True,
        interpret=interpret, poison=poison_outputs, name="moe_gate_up")
    out = _grouped_call(
        sched, hidden, [w_down.reshape(num_groups * inter_size, hidden_size)],
        jax.ShapeDtypeStruct((num_rows, hidden_size), x_sorted.dtype), tiling.down, swiglu=False,
        interpret=interpret, poison=poison_outputs, name="moe_down")
    return out, hidden


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def moe_grouped_ffn(
    x_sorted: jax.Array,  # [M, H]
    group_sizes: jax.Array,  # int32[E]
    w_gate: jax.Array,  # [E, H, I]
    w_up: jax.Array,  # [E, H, I]
    w_down: jax.Array,  # [E, I, H]
    *,
    interpret: bool = False,
    tiling: Optional[MoeTiling] = None,
) -> jax.Array:
    """Per-group SwiGLU FFN of expert-sorted rows: [M, H]; rows past sum(group_sizes) are 0.

    Same contract as `moe_grouped_ffn_reference`. `tiling` overrides the shape-derived
    tile sizes (benchmarks, tests).
    """
    out, _ = moe_forward(x_sorted, group_sizes, w_gate, w_up, w_down, tiling=tiling, interpret=interpret)
    return out
