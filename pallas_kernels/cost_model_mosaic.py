"""Launch cost model of the Mosaic GPU (Hopper) kernels, next to the Triton ones'.

Same counting as `cost_model.py` (grid, working CTAs, HBM bytes with re-reads, MMA
FLOPs, datasheet roofline), built from the Mosaic kernels' own tilings and the same
device work tables. What differs from the Triton launches:
  - MoE: a CTA per (work item, column tile), 64-row wgmma tiles loaded whole by TMA
    (padded rows included), no split-K, no fused gather/combine: the sorted-rows path
    (gather, unsort scatter, f32 combine in XLA) is counted as glue.
  - attention: 64-row tiles (one warpgroup), one TMA copy per page of K and V, splits
    only in decode buckets; q goes head-major and back through XLA (counted as glue).
  - FP8 (e4m3 x e4m3 wgmma, twice bf16's peak: `mma_rate`): the dense GEMM and the grouped
    FFN at the FP8 cases of `cost_model_quant`, with the XLA passes they need (activations
    quantized; the weights come K-major, as the engine stores them for these kernels).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cost_model import (
    ATTENTION_MODELS,
    MOE_MODELS,
    MOE_TOKEN_COUNTS,
    AttentionBatch,
    AttentionShape,
    LaunchCost,
    MoeShape,
    default_attention_batches,
    routed_group_sizes,
    step_metadata,
    useful_attention_flops,
)
from pallas_kernels.cost_model_quant import GEMM_SHAPES, GEMM_TOKEN_COUNTS, MOE_FP8_TOKEN_COUNTS, GemmShape


@dataclass(frozen=True)
class _RoutedTiles:
    """`num_tokens` tokens routed evenly over the experts, tiled as a grouped kernel's
    device-built schedule tiles them."""

    rows: int  # routed rows (tokens x top_k)
    case: str
    tiling: Any  # the kernel's default tiling for this problem
    block_m: int
    num_items: int  # work items of the schedule
    num_active: int  # those that run
    active_experts: int


def _routed_tiles(shape: MoeShape, num_tokens: int, default_tiling: Callable) -> _RoutedTiles:
    from pallas_kernels.moe_grouped_gemm import schedule

    e, k = shape.num_experts, shape.top_k
    rows = num_tokens * k
    tiling = default_tiling(rows, e, shape.hidden, shape.inter)
    block_m = tiling.gate_up.block_m
    sizes = routed_group_sizes(num_tokens, e, k)
    build = jax.jit(functools.partial(schedule.group_tile_schedule, num_rows=rows, block_m=block_m))
    sched = np.asarray(build(jnp.asarray(sizes)))
    num_active = int((sched[:, schedule.ACTIVE] > 0).sum())
    case = f"{shape.name} T={num_tokens}"
    return _RoutedTiles(rows, case, tiling, block_m, sched.shape[0], num_active, int((sizes > 0).sum()))


def mosaic_moe_costs(shape: MoeShape, num_tokens: int, itemsize: int = 2) -> list[LaunchCost]:
    from pallas_kernels.moe_grouped_gemm.mosaic_gpu import default_tiling

    routed = _routed_tiles(shape, num_tokens, default_tiling)
    rows, case, tiling, block_m, num_active = routed.rows, routed.case, routed.tiling, routed.block_m, routed.num_active
    e, h, i = shape.num_experts, shape.hidden, shape.inter
    costs = []
    for name, t, n, kk, num_weights in (
        ("moe_gate_up_mosaic", tiling.gate_up, i, h, 2),
        ("moe_down_mosaic", tiling.down, h, i, 1),
    ):
        col_tiles = n // t.block_n
        working = num_active * col_tiles
        weight_bytes = working * kk * t.block_n * num_weights * itemsize
        act_bytes = num_active * block_m * kk * itemsize  # whole tiles (L2 serves the column tiles)
        out_bytes = rows * n * itemsize
        flops = 2.0 * working * block_m * t.block_n * kk * num_weights
        note = (
            f"block_m={block_m} block_n={t.block_n} block_k={t.block_k} stages={t.max_concurrent_steps} "
            f"active experts {routed.active_experts}/{e}"
        )
        costs.append(
            LaunchCost(
                name,
                case,
                (col_tiles, routed.num_items),
                working,
                weight_bytes + act_bytes + out_bytes,
                flops,
                2.0 * rows * h * i * num_weights,
                note,
            )
        )
    glue = rows * h * itemsize * (2 + 2 + 1) + num_tokens * h * itemsize
    if rows % block_m:
        glue += 2 * rows * h * itemsize  # x padded to whole tiles
    costs.append(LaunchCost("moe_xla_glue", case, (), 0, glue, 0.0, 0.0, "Mosaic path: gather, pad, scatter, combine"))
    return costs


def mosaic_attention_costs(
    shape: AttentionShape, batch: AttentionBatch, itemsize: int = 2, tokens_per_block: int = 16
) -> list[LaunchCost]:
    from pallas_kernels.ragged_paged_attention import schedule
    from pallas_kernels.ragged_paged_attention.mosaic_gpu import _ROWS, default_num_kv_splits, rows_per_token

    hq, hkv, d, tpb = shape.num_q_heads, shape.num_kv_heads, shape.head_dim, tokens_per_block
    group_pow2 = rows_per_token(hq // hkv)
    cu, kv, n = step_metadata(batch)
    splits = default_num_kv_splits(batch.num_tokens, batch.num_seq_slots, hkv, batch.max_kv_len, tpb)
    build = jax.jit(
        functools.partial(
            schedule.query_tile_schedule,
            num_tokens=batch.num_tokens,
            block_q=_ROWS // group_pow2,
            tokens_per_block=tpb,
            sliding_window=None,
        )
    )
    tiles = np.asarray(build(jnp.asarray(cu), jnp.asarray(kv), jnp.asarray([n], jnp.int32)))
    working = kv_bytes = q_bytes = flops = 0.0
    for row in tiles:
        if row[schedule.Q_END] <= row[schedule.Q_START]:
            continue
        pages = -(-int(row[schedule.KV_HI]) // tpb) - int(row[schedule.KV_LO]) // tpb
        per_split = -(-pages // splits) if pages > 0 else 0
        for s in range(splits):
            mine = max(0, min(per_split, pages - s * per_split))
            working += hkv if mine else 0
            q_bytes += hkv * _ROWS * d * itemsize
            kv_bytes += hkv * mine * tpb * d * 2 * itemsize
            flops += hkv * mine * 4.0 * _ROWS * tpb * d
    out_rows = batch.num_tokens * hq
    out_bytes = out_rows * d * itemsize
    if splits > 1:
        out_bytes += 2 * splits * out_rows * (d + 16) * 4
    glue = 4 * batch.num_tokens * hkv * group_pow2 * d * itemsize  # q to head-major and the output back
    useful = useful_attention_flops(shape, batch.q_lens, batch.kv_lens)
    case = f"{shape.name} {batch.name}"
    note = f"64-row tiles ({hq // hkv} of {group_pow2} rows per token) page={tpb} splits={splits}"
    return [
        LaunchCost(
            "ragged_paged_attn_mosaic",
            case,
            (tiles.shape[0], hkv, splits),
            int(working),
            kv_bytes + q_bytes + out_bytes,
            flops,
            useful,
            note,
        ),
        LaunchCost("attn_mosaic_xla_glue", case, (), 0, glue, 0.0, 0.0, "q head-major and back"),
    ]


def mosaic_fp8_gemm_costs(shape: GemmShape, m: int, itemsize: int = 2) -> list[LaunchCost]:
    """The e4m3 x e4m3 GEMM (`quantized_matmul.mosaic_gpu_fp8`) and its XLA pass: the
    activations quantized (read bf16, write e4m3 and scales). The weight is stored K-major."""
    from pallas_kernels.quantized_matmul.mosaic_gpu_fp8 import default_tiling

    k, n = shape.k, shape.n
    t = default_tiling(m, n)
    row_tiles, col_tiles = -(-m // t.block_m), n // t.block_n
    scales = 4.0 * (k // 128) * -(-n // 128)
    act = row_tiles * t.block_m * k * (1 + 4.0 / 128)  # e4m3 rows and their scales, whole tiles
    kernel_bytes = row_tiles * (k * n + scales) + act + m * n * itemsize
    flops = 2.0 * row_tiles * t.block_m * n * k
    case = f"{shape.name} fp8 M={m}"
    note = f"block_m={t.block_m} block_n={t.block_n} block_k=128 e4m3 wgmma"
    glue = m * k * (itemsize + 1 + 4.0 / 128)
    return [
        LaunchCost(
            "quantized_matmul_mosaic_fp8",
            case,
            (row_tiles, col_tiles),
            row_tiles * col_tiles,
            kernel_bytes,
            flops,
            2.0 * m * k * n,
            note,
            mma_rate=2.0,
        ),
        LaunchCost("xla_act_quant", case, (), 0, glue, 0.0, 0.0, "x -> e4m3 + per-128 scales"),
    ]


def mosaic_moe_fp8_costs(shape: MoeShape, num_tokens: int, itemsize: int = 2) -> list[LaunchCost]:
    """The two e4m3 grouped kernels (`moe_grouped_gemm.mosaic_gpu_fp8`) and their XLA glue:
    sort / unsort / combine as the bf16 Mosaic path, activation and hidden quantization.
    The experts are stored K-major."""
    from pallas_kernels.moe_grouped_gemm.mosaic_gpu_fp8 import default_tiling

    routed = _routed_tiles(shape, num_tokens, default_tiling)
    rows, case, tiling, block_m, num_active = routed.rows, routed.case, routed.tiling, routed.block_m, routed.num_active
    e, h, i = shape.num_experts, shape.hidden, shape.inter
    costs = []
    for name, t, n, kk, num_weights in (
        ("moe_gate_up_mosaic_fp8", tiling.gate_up, i, h, 2),
        ("moe_down_mosaic_fp8", tiling.down, h, i, 1),
    ):
        col_tiles = n // t.block_n
        working = num_active * col_tiles
        weight_bytes = working * kk * t.block_n * num_weights * (1 + 4.0 / (128 * 128))
        act_bytes = num_active * block_m * kk * (1 + 4.0 / 128)
        flops = 2.0 * working * block_m * t.block_n * kk * num_weights
        note = (
            f"block_m={block_m} block_n={t.block_n} block_k=128 e4m3 wgmma, active experts {routed.active_experts}/{e}"
        )
        costs.append(
            LaunchCost(
                name,
                case,
                (col_tiles, routed.num_items),
                working,
                weight_bytes + act_bytes + rows * n * itemsize,
                flops,
                2.0 * rows * h * i * num_weights,
                note,
                mma_rate=2.0,
            )
        )
    glue = rows * h * itemsize * (2 + 2 + 1) + num_tokens * h * itemsize  # as the bf16 Mosaic path
    glue += rows * h * (itemsize + 1) + rows * i * (itemsize + 1)  # x and hidden quantized
    costs.append(LaunchCost("moe_xla_glue_fp8", case, (), 0, glue, 0.0, 0.0, "gather, quantize, scatter, combine"))
    return costs


def default_cases() -> list[LaunchCost]:
    """The Mosaic GPU launches at the cases `cost_model.default_cases` covers (Hopper)."""
    costs: list[LaunchCost] = []
    for shape in ATTENTION_MODELS:
        for batch in default_attention_batches():
            costs += mosaic_attention_costs(shape, batch)
    for moe in MOE_MODELS:
        for tokens in MOE_TOKEN_COUNTS:
            costs += mosaic_moe_costs(moe, tokens)
    for gemm in GEMM_SHAPES:
        for m in GEMM_TOKEN_COUNTS:
            costs += mosaic_fp8_gemm_costs(gemm, m)
    for moe in (MOE_MODELS[0], MOE_MODELS[2]):
        for tokens in MOE_FP8_TOKEN_COUNTS:
            costs += mosaic_moe_fp8_costs(moe, tokens)
    return costs
