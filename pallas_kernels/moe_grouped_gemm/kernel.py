"""Grouped expert FFN (SwiGLU) as two Pallas Triton kernels: over expert-sorted rows, or
fused with the token gather and the weighted top-k combine.

Lowering: Triton (`compiler_params=pltriton.CompilerParams`), for the same reasons as
the attention kernel: it runs on Ampere and Hopper, supports masked loads, scalar reads
from refs, atomics and dynamic loop trip counts, and can be checked on CPU in interpret
mode. From jax 0.11 the Triton backend is deprecated (see `pallas_kernels.triton_backend`).

Two kernels, each on grid (work item, column tile, K split); the work list (see
`schedule.py`) pairs every row tile with each group it overlaps, so ragged groups,
straddling tiles and empty groups need no host sync and no per-group Python loop:
  1. gate/up: `hidden = silu(x @ w_gate[g]) * (x @ w_up[g])` with both products
     accumulated in f32 in one pass over `x` (x is read once for the two projections),
     rounded to the activation dtype like the reference.
  2. down: `out = hidden @ w_down[g]`, f32 accumulation.
`moe_grouped_ffn` takes rows already sorted by group and returns them in that order
(rows past `sum(group_sizes)` are zeros). `moe_fused_ffn` takes the tokens, their top-k
expert ids and routing weights: the gate/up kernel gathers each row's token straight
from `x` (no sorted copy of the activations), and the down kernel multiplies each row by
its routing weight and adds it into the token's f32 output row with atomics (no unsort
scatter, no separate combine pass); the same atomics let the down projection split K
when a small batch would otherwise leave most SMs idle.
Weights are viewed as 2-D (`[E * K, N]`) so every load is a 2-D gather with a contiguous
last axis. Tile sizes and split-K come from `tiling.py`.
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
from pallas_kernels.moe_grouped_gemm.tiling import GemmTiling, MoeTiling, default_tiling
from pallas_kernels.triton_backend import compiler_params


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """f32-accumulating MMA. HIGHEST keeps f32 inputs in IEEE f32 (Triton's default for
    f32 is TF32); bf16 inputs are unaffected."""
    return jax.lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


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


def _store_tile(
    ref, rows: jax.Array, cols: jax.Array, value: jax.Array, row_mask: jax.Array, col_mask: Optional[jax.Array]
) -> None:
    """Stores the rows in `row_mask` (and columns in `col_mask`). Masked-off rows are
    redirected one past the end (masked columns are past the end already): GPU stores
    never happen there, and interpret mode drops them instead of racing with real rows."""
    rows = jnp.where(row_mask, rows, ref.shape[0])
    mask = _and(row_mask[:, None], None if col_mask is None else col_mask[None, :])
    pltriton.store(ref.at[rows[:, None], cols[None, :]], value, mask=mask)


def _add_tile(
    ref,
    rows: jax.Array,
    cols: jax.Array,
    value: jax.Array,
    row_mask: jax.Array,
    col_mask: Optional[jax.Array],
    interpret: bool,
) -> None:
    """Atomically adds the masked rows (and columns) of `value` into `ref[rows, cols]`.

    `ref` has one spare row at the end, and one spare column when the width has a tail:
    masked-off rows and tail columns are redirected there, with zeros added. On a GPU the
    mask stops those accesses anyway; interpret mode has no masked atomics and adds one
    call as a gather, add and scatter, so of duplicate indices only one write lands: a
    redirected entry must never share an index with a real one (and rows within one call
    must be distinct, as they are here).
    """
    mask = _and(row_mask[:, None], None if col_mask is None else col_mask[None, :])
    rows = jnp.where(row_mask, rows, ref.shape[0] - 1)
    if col_mask is not None:
        cols = jnp.where(col_mask, cols, ref.shape[1] - 1)
    value = jnp.where(mask, value, 0.0)
    # Triton's atomic_rmw wants the mask in the value's own shape (no implicit broadcast).
    mask = jnp.broadcast_to(mask, value.shape)
    pltriton.atomic_add(ref, (rows[:, None], cols[None, :]), value, mask=None if interpret else mask)


def _grouped_kernel(
    sched_ref,
    *refs,
    num_weights: int,
    swiglu: bool,
    gather: bool,
    combine: bool,
    atomic: bool,
    block_m: int,
    block_n: int,
    block_k: int,
    num_k_splits: int,
    interpret: bool,
    num_aliased: int,
    scale_block: Optional[tuple[int, int]] = None,
):
    """One (work item, column tile, K split): `a[rows] @ w[g]` for each weight, then the epilogue.

    Refs after the work table: `row_token` (int32 [M], with `gather` or `combine`),
    `row_weight` (f32 [M], with `combine`), `a`, the weights, then the output.
    `a` is [M, K], or [T, K] with `gather` (row r reads token `row_token[r]`); each weight
    ref is the [E * K, N] view of a [E, K, N] stack. With `scale_block` (bk, bn) the weights
    are quantized (FP8) and one float32 scale ref per weight follows them, the
    [E * ceil(K / bk), ceil(N / bn)] view of its [E, ...] block scales: each weight tile is
    widened, multiplied by its blocks' scales and rounded to a's dtype before the MMA (the
    dequantized reference's numerics; `block_k` divides bk, so a K step reads one scale row).
    With `swiglu` the two products (gate, up) become `silu(gate) * up`. The output is stored
    per row, or with `atomic` added into an f32 buffer with a spare last row (and column): at row r, or
    with `combine` at `row_token[r]` after scaling by `row_weight[r]`.
    """
    refs = list(refs)
    row_token_ref = refs.pop(0) if gather or combine else None
    row_weight_ref = refs.pop(0) if combine else None
    a_ref = refs.pop(0)
    w_refs = refs[:num_weights]
    num_scales = num_weights if scale_block is not None else 0
    s_refs = refs[num_weights : num_weights + num_scales]
    (o_ref,) = refs[num_weights + num_scales + num_aliased :]
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
    token = None
    if row_token_ref is not None:
        token = pltriton.load(row_token_ref.at[jnp.where(row_mask, rows, 0)], mask=row_mask, other=0)
    a_rows = token if gather else rows
    cols = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    col_mask = _tail_mask(cols, n_size, block_n)
    w_row_base = expert * k_size

    def weight_tile(w_ref, s_ref, step, ks, w_mask, dtype):
        w = _load_tile(w_ref, w_row_base + ks, cols, w_mask)
        if s_ref is None:
            return w
        sbk, sbn = scale_block
        srow = jnp.zeros((1,), jnp.int32) + expert * pl.cdiv(k_size, sbk) + (step * block_k) // sbk
        scale = pltriton.load(s_ref.at[srow[:, None], (jnp.minimum(cols, n_size - 1) // sbn)[None, :]])
        return (w.astype(jnp.float32) * scale).astype(dtype)

    def body(step, accs):
        ks = step * block_k + jnp.arange(block_k, dtype=jnp.int32)
        k_mask = _tail_mask(ks, k_size, block_k)
        a = _load_tile(a_ref, a_rows, ks, _and(row_mask[:, None], None if k_mask is None else k_mask[None, :]))
        w_mask = _and(None if k_mask is None else k_mask[:, None], None if col_mask is None else col_mask[None, :])
        scales = s_refs or (None,) * num_weights
        return tuple(
            acc + _dot(a, weight_tile(w_ref, s_ref, step, ks, w_mask, a.dtype))
            for acc, w_ref, s_ref in zip(accs, w_refs, scales)
        )

    # Zero-filling and unused items skip the K loop (and every weight load).
    num_steps = (k_size + block_k - 1) // block_k
    steps_per_split = (num_steps + num_k_splits - 1) // num_k_splits
    first_step = pl.program_id(2) * steps_per_split
    last_step = jnp.minimum(first_step + steps_per_split, num_steps)
    last_step = jnp.where(active > 0, last_step, first_step)
    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    accs = jax.lax.fori_loop(first_step, last_step, body, (zeros,) * num_weights)
    if swiglu:
        gate, up = accs
        out = gate * jax.nn.sigmoid(gate) * up
    else:
        (out,) = accs
    if not atomic:
        _store_tile(o_ref, rows, cols, out.astype(o_ref.dtype), row_mask, col_mask)
        return
    add_mask = row_mask & (active > 0)  # zero-filling items add nothing (the buffer starts at zero)
    if combine:
        weight = pltriton.load(row_weight_ref.at[jnp.where(row_mask, rows, 0)], mask=row_mask, other=0.0)
        _add_tile(o_ref, token, cols, out * weight[:, None], add_mask, col_mask, interpret)
    else:
        _add_tile(o_ref, rows, cols, out, add_mask, col_mask, interpret)


def _grouped_call(
    sched,
    a,
    weights,
    out_struct,
    tiling: GemmTiling,
    *,
    swiglu: bool,
    interpret: bool,
    poison: bool,
    name: str,
    row_token: Optional[jax.Array] = None,
    row_weight: Optional[jax.Array] = None,
    gather: bool = False,
    scales: Optional[list[jax.Array]] = None,
    scale_block: Optional[tuple[int, int]] = None,
) -> jax.Array:
    """Launches one kernel. The output is stored row by row, unless the kernel adds into it
    (split-K, or the weighted combine when `row_weight` is given): then it is an f32
    buffer with one spare row (and a spare column when the width has a tail), zeroed
    first (never poisoned)."""
    combine = row_weight is not None
    atomic = combine or tiling.num_k_splits > 1
    if atomic and swiglu:
        raise ValueError("the gate/up kernel cannot add partial products (SwiGLU needs whole sums)")
    inputs = [sched]
    if gather or combine:
        inputs.append(row_token)
    if combine:
        inputs.append(row_weight)
    inputs += [a, *weights, *(scales or [])]
    aliases: dict[int, int] = {}
    num_rows, width = out_struct.shape
    spare_col = atomic and width % tiling.block_n != 0
    if atomic:
        out_struct = jax.ShapeDtypeStruct((num_rows + 1, width + spare_col), jnp.float32)
        aliases[len(inputs)] = 0
        inputs.append(jnp.zeros(out_struct.shape, jnp.float32))
    elif poison:
        aliases[len(inputs)] = 0
        inputs.append(jnp.full(out_struct.shape, jnp.nan, out_struct.dtype))
    grid = (sched.shape[0], pl.cdiv(width, tiling.block_n), tiling.num_k_splits)
    body = functools.partial(
        _grouped_kernel,
        num_weights=len(weights),
        swiglu=swiglu,
        gather=gather,
        combine=combine,
        atomic=atomic,
        block_m=tiling.block_m,
        block_n=tiling.block_n,
        block_k=tiling.block_k,
        num_k_splits=tiling.num_k_splits,
        interpret=interpret,
        num_aliased=len(aliases),
        scale_block=scale_block if scales else None,
    )
    out = pl.pallas_call(
        body,
        out_shape=out_struct,
        grid=grid,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=compiler_params(tiling.num_warps, tiling.num_stages),
        name=name,
    )(*inputs)
    return out[:num_rows, :width]


def check_weights(
    hidden_size: int, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *dtypes, quantized: bool = False
) -> None:
    """Stacked expert weights [E, H, I], [E, H, I], [E, I, H] of one dtype with the activations'
    (`quantized`: the weights are float8_e4m3fn, whatever the activations)."""
    num_groups, wh, inter_size = w_gate.shape
    if wh != hidden_size or w_up.shape != w_gate.shape or w_down.shape != (num_groups, inter_size, hidden_size):
        raise ValueError(
            f"shape mismatch: hidden size {hidden_size}, w_gate {w_gate.shape}, "
            f"w_up {w_up.shape}, w_down {w_down.shape}"
        )
    if quantized:
        if {w_gate.dtype, w_up.dtype, w_down.dtype} != {jnp.dtype(jnp.float8_e4m3fn)}:
            raise ValueError("quantized expert weights must be float8_e4m3fn")
    elif len({*dtypes, w_gate.dtype, w_up.dtype, w_down.dtype}) != 1:
        raise ValueError("the activations and the weights must share one dtype")


def _stacked(w: jax.Array) -> jax.Array:
    return w.reshape(w.shape[0] * w.shape[1], w.shape[2])


@dataclass(frozen=True)
class ExpertScales:
    """float32 block scales of FP8 expert weights, [E, ceil(K / bk), ceil(N / bn)] each."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array
    block: tuple[int, int] = (128, 128)

    def check(self, tiling: MoeTiling, w_gate: jax.Array, w_down: jax.Array) -> None:
        bk, bn = self.block
        for name, s, w in (("gate", self.gate, w_gate), ("up", self.up, w_gate), ("down", self.down, w_down)):
            want = (w.shape[0], -(-w.shape[1] // bk), -(-w.shape[2] // bn))
            if tuple(s.shape) != want:
                raise ValueError(f"{name} scales {s.shape} do not match {w.shape} weights in {self.block} blocks")
        for t in (tiling.gate_up, tiling.down):
            if bk % t.block_k:
                raise ValueError(f"{t}: block_k must divide the scale block along K ({bk})")

    def stacked(self, *names: str) -> list[jax.Array]:
        return [_stacked(getattr(self, n).astype(jnp.float32)) for n in names]


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
    scales: Optional[ExpertScales] = None,
) -> tuple[jax.Array, jax.Array]:
    """Runs both kernels on expert-sorted rows; returns (out [M, H], hidden [M, I]).
    With `scales` the weights are FP8 with those block scales.

    `poison_outputs` hands each kernel that stores rows a NaN-filled output buffer
    (aliased in place) so a test can check that every element was written.
    """
    num_rows, hidden_size = x_sorted.shape
    num_groups, _, inter_size = w_gate.shape
    check_weights(hidden_size, w_gate, w_up, w_down, x_sorted.dtype, quantized=scales is not None)
    if group_sizes.shape != (num_groups,):
        raise ValueError(f"group_sizes {group_sizes.shape} does not match {num_groups} groups")
    if tiling is None:
        tiling = default_tiling(num_rows, num_groups, hidden_size, inter_size)
    if scales is not None:
        scales.check(tiling, w_gate, w_down)
    quant = {} if scales is None else dict(scale_block=scales.block)

    sched = schedule.group_tile_schedule(group_sizes, num_rows=num_rows, block_m=tiling.gate_up.block_m)
    hidden = _grouped_call(
        sched,
        x_sorted,
        [_stacked(w_gate), _stacked(w_up)],
        jax.ShapeDtypeStruct((num_rows, inter_size), x_sorted.dtype),
        tiling.gate_up,
        swiglu=True,
        interpret=interpret,
        poison=poison_outputs,
        name="moe_gate_up",
        scales=None if scales is None else scales.stacked("gate", "up"),
        **quant,
    )
    out = _grouped_call(
        sched,
        hidden,
        [_stacked(w_down)],
        jax.ShapeDtypeStruct((num_rows, hidden_size), x_sorted.dtype),
        tiling.down,
        swiglu=False,
        interpret=interpret,
        poison=poison_outputs,
        name="moe_down",
        scales=None if scales is None else scales.stacked("down"),
        **quant,
    )
    return out.astype(x_sorted.dtype), hidden


def moe_fused_forward(
    x: jax.Array,
    expert_ids: jax.Array,
    routing_weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    tiling: Optional[MoeTiling] = None,
    interpret: bool = False,
    poison_outputs: bool = False,
    scales: Optional[ExpertScales] = None,
) -> tuple[jax.Array, jax.Array]:
    """Runs both kernels with the token gather and the weighted combine inside them;
    returns (out f32 [T, H], hidden [T * top_k, I] in expert-sorted row order).

    Only the row order is computed in XLA (a stable sort of the T * top_k expert ids);
    ids outside `[0, E)` mark padding rows, which no kernel computes.
    """
    num_tokens, hidden_size = x.shape
    num_groups, _, inter_size = w_gate.shape
    check_weights(hidden_size, w_gate, w_up, w_down, x.dtype, quantized=scales is not None)
    if expert_ids.ndim != 2 or expert_ids.shape[0] != num_tokens or routing_weights.shape != expert_ids.shape:
        raise ValueError(
            f"expert_ids {expert_ids.shape} and routing_weights {routing_weights.shape} must both "
            f"be [{num_tokens}, top_k]"
        )
    top_k = expert_ids.shape[1]
    num_rows = num_tokens * top_k
    if tiling is None:
        tiling = default_tiling(num_rows, num_groups, hidden_size, inter_size)
    if scales is not None:
        scales.check(tiling, w_gate, w_down)
    quant = {} if scales is None else dict(scale_block=scales.block)

    ids = expert_ids.reshape(-1).astype(jnp.int32)
    ids = jnp.where((ids >= 0) & (ids < num_groups), ids, num_groups)
    order = jnp.argsort(ids, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(ids, length=num_groups).astype(jnp.int32)
    row_token = order // top_k
    row_weight = routing_weights.reshape(-1).astype(jnp.float32)[order]

    sched = schedule.group_tile_schedule(group_sizes, num_rows=num_rows, block_m=tiling.gate_up.block_m)
    hidden = _grouped_call(
        sched,
        x,
        [_stacked(w_gate), _stacked(w_up)],
        jax.ShapeDtypeStruct((num_rows, inter_size), x.dtype),
        tiling.gate_up,
        swiglu=True,
        interpret=interpret,
        poison=poison_outputs,
        name="moe_fused_gate_up",
        row_token=row_token,
        gather=True,
        scales=None if scales is None else scales.stacked("gate", "up"),
        **quant,
    )
    out = _grouped_call(
        sched,
        hidden,
        [_stacked(w_down)],
        jax.ShapeDtypeStruct((num_tokens, hidden_size), jnp.float32),
        tiling.down,
        swiglu=False,
        interpret=interpret,
        poison=False,
        name="moe_fused_down",
        row_token=row_token,
        row_weight=row_weight,
        scales=None if scales is None else scales.stacked("down"),
        **quant,
    )
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


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def moe_fused_ffn(
    x: jax.Array,  # [T, H]
    expert_ids: jax.Array,  # int32[T, top_k]; ids outside [0, E) are skipped
    routing_weights: jax.Array,  # [T, top_k]
    w_gate: jax.Array,  # [E, H, I]
    w_up: jax.Array,  # [E, H, I]
    w_down: jax.Array,  # [E, I, H]
    *,
    interpret: bool = False,
    tiling: Optional[MoeTiling] = None,
) -> jax.Array:
    """`sum_k routing_weights[t, k] * FFN_{expert_ids[t, k]}(x[t])`: [T, H] in x's dtype,
    combined in f32. Same contract as `moe_fused_ffn_reference`."""
    out, _ = moe_fused_forward(x, expert_ids, routing_weights, w_gate, w_up, w_down, tiling=tiling, interpret=interpret)
    return out.astype(x.dtype)
