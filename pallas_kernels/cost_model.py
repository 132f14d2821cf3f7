"""Launch cost model of the Triton kernels, computed without a GPU.

For a kernel call at a given shape it builds the same launch plan, tilings and device
work tables the kernels build (the schedules run in XLA on the CPU), then counts:
  - grid: the static launch grid; programs = its product;
  - working CTAs: programs that do work (a GEMM; a non-empty key range). The rest exit at
    once, but a launch with fewer working CTAs than SMs leaves SMs idle;
  - bytes: HBM traffic of the working programs, re-reads included (each weight or K/V
    tile is counted every time a program loads it, activations and outputs once), plus
    the f32 partials / atomics / XLA passes around the kernels;
  - FLOPs executed by the MMAs (padded rows included) and the useful share of them;
  - roofline time on datasheet numbers, max(bytes / HBM bandwidth, FLOPs / bf16 peak),
    and an SM-limited estimate that scales the bandwidth by the share of SMs that have
    a working CTA (min(1, working / SMs)): crude, but it shows occupancy regressions.
Numbers are models, not measurements; `jaxllm bench kernels` measures on a GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet numbers (SXM parts; dense bf16 tensor-core peak)."""

    name: str
    num_sms: int
    hbm_bytes_per_s: float
    bf16_flops_per_s: float


H100 = GpuSpec("H100", 132, 3.35e12, 989e12)
H200 = GpuSpec("H200", 132, 4.8e12, 989e12)
GPUS = {"h100": H100, "h200": H200}


@dataclass(frozen=True)
class LaunchCost:
    kernel: str
    case: str
    grid: tuple[int, ...]
    working: int
    bytes: float
    flops: float
    useful_flops: float
    note: str = ""
    mma_rate: float = 1.0  # peak MMA rate relative to bf16 (2 for e4m3 x e4m3 wgmma)

    @property
    def programs(self) -> int:
        return int(np.prod(self.grid)) if self.grid else 0

    def roofline_s(self, gpu: GpuSpec) -> float:
        return max(self.bytes / gpu.hbm_bytes_per_s, self.flops / (gpu.bf16_flops_per_s * self.mma_rate))

    def sm_limited_s(self, gpu: GpuSpec) -> float:
        if not self.grid:  # an XLA pass: XLA fills the GPU
            return self.roofline_s(gpu)
        busy = min(1.0, self.working / gpu.num_sms) if self.working else 1.0
        peak = gpu.bf16_flops_per_s * self.mma_rate * busy
        return max(self.bytes / (gpu.hbm_bytes_per_s * busy), self.flops / peak)


# ----------------------------------------------------------------------------- MoE


@dataclass(frozen=True)
class MoeShape:
    name: str
    num_experts: int
    top_k: int
    hidden: int
    inter: int


MOE_MODELS = (
    MoeShape("Qwen3-30B-A3B", 128, 8, 2048, 768),
    MoeShape("Mixtral-8x7B", 8, 2, 4096, 14336),
    MoeShape("DeepSeek-V3", 256, 8, 7168, 2048),
)


def routed_group_sizes(num_tokens: int, num_experts: int, top_k: int, seed: int = 0) -> np.ndarray:
    """Rows per expert for `num_tokens` tokens routed top-k over random scores (distinct
    experts per token, as a router gives)."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(-rng.standard_normal((num_tokens, num_experts)), axis=1)[:, :top_k]
    return np.bincount(ids.reshape(-1), minlength=num_experts).astype(np.int32)


def moe_costs(
    shape: MoeShape, num_tokens: int, itemsize: int = 2, fused: bool = True, weight_itemsize: Optional[float] = None
) -> list[LaunchCost]:
    """The two kernels (and the XLA passes around them) of one MoE layer at `num_tokens`
    (`weight_itemsize`: bytes per stored weight value, 1 for FP8; default `itemsize`)."""
    w_item = itemsize if weight_itemsize is None else weight_itemsize
    from pallas_kernels.moe_grouped_gemm import schedule
    from pallas_kernels.moe_grouped_gemm.tiling import default_tiling

    e, k, h, i = shape.num_experts, shape.top_k, shape.hidden, shape.inter
    rows = num_tokens * k
    case = f"{shape.name} T={num_tokens}" + ("" if fused else " sorted-rows path")
    tiling = default_tiling(rows, e, h, i)
    sizes = routed_group_sizes(num_tokens, e, k)
    build = jax.jit(functools.partial(schedule.group_tile_schedule, num_rows=rows, block_m=tiling.gate_up.block_m))
    sched = np.asarray(build(jnp.asarray(sizes)))
    active = sched[:, schedule.ACTIVE] > 0
    item_rows = np.where(active, sched[:, schedule.ROW_HI] - sched[:, schedule.ROW_LO], 0)
    num_active = int(active.sum())
    costs = []
    for name, t, n, kk, num_weights in (("moe_gate_up", tiling.gate_up, i, h, 2), ("moe_down", tiling.down, h, i, 1)):
        col_tiles = -(-n // t.block_n)
        grid = (sched.shape[0], col_tiles, t.num_k_splits)
        working = num_active * col_tiles * t.num_k_splits
        weight_bytes = num_active * kk * col_tiles * t.block_n * num_weights * w_item
        act_bytes = int(item_rows.sum()) * kk * itemsize  # each item's rows once (L2 serves the column tiles)
        if name == "moe_gate_up":
            out_bytes = rows * i * itemsize
        elif fused or t.num_k_splits > 1:  # f32 atomics: zeroed buffer, adds at L2, one write-back, cast
            out_rows = num_tokens if fused else rows
            out_bytes = out_rows * h * 4 * 3 + out_rows * h * itemsize
        else:
            out_bytes = rows * h * itemsize
        flops = 2.0 * working * t.block_m * t.block_n * (-(-kk // t.num_k_splits)) * num_weights
        useful = 2.0 * rows * h * i * num_weights
        note = (
            f"block_m={t.block_m} block_n={t.block_n} split_k={t.num_k_splits} warps={t.num_warps} "
            f"active experts {int((sizes > 0).sum())}/{e}"
        )
        costs.append(LaunchCost(name, case, grid, working, weight_bytes + act_bytes + out_bytes, flops, useful, note))
    if not fused:  # x_sorted gather, unsort scatter and the f32 combine, each an XLA pass over the rows
        glue = rows * h * itemsize * (2 + 2 + 1) + num_tokens * h * itemsize
        costs.append(
            LaunchCost("moe_xla_glue", case, (), 0, glue, 0.0, 0.0, "sorted-rows path: gather, scatter, combine")
        )
    return costs


# ----------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class AttentionShape:
    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


ATTENTION_MODELS = (
    AttentionShape("Llama-3-8B", 32, 8, 128),
    AttentionShape("Qwen3-30B-A3B", 32, 4, 128),
    AttentionShape("Mixtral-8x7B", 32, 8, 128),
)


@dataclass(frozen=True)
class AttentionBatch:
    """A step: live sequences' query and KV lengths, in a bucket of `num_tokens` tokens and
    `num_seq_slots` sequence slots, with a block table of `max_kv_len` tokens."""

    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_tokens: int
    num_seq_slots: int
    max_kv_len: int


def decode_batch(batch: int, context: int, max_kv_len: int = 8192) -> AttentionBatch:
    return AttentionBatch(f"decode B={batch} ctx={context}", (1,) * batch, (context,) * batch, batch, batch, max_kv_len)


def mixed_batch(
    chunk: int, num_decode: int, context: int, num_tokens: int, num_seq_slots: int, max_kv_len: int = 8192
) -> AttentionBatch:
    return AttentionBatch(
        f"mixed {chunk} prefill + {num_decode} decode ctx={context} (T={num_tokens})",
        (chunk,) + (1,) * num_decode,
        (chunk,) + (context,) * num_decode,
        num_tokens,
        num_seq_slots,
        max_kv_len,
    )


def default_attention_batches() -> list[AttentionBatch]:
    """The attention steps every kernel's cost model is reported at: decode at four batch
    sizes, a mixed bucket, a long prefill."""
    return [
        *(decode_batch(batch, 4096) for batch in (1, 16, 64, 256)),
        mixed_batch(512, 63, 4096, num_tokens=1024, num_seq_slots=64),
        AttentionBatch("prefill 2048", (2048,), (2048,), 2048, 8, 8192),
    ]


MOE_TOKEN_COUNTS = (1, 4, 16, 64, 256, 2048)
"""Tokens per MoE layer call the MoE kernels' cost models are reported at."""


def step_metadata(batch: AttentionBatch) -> tuple[np.ndarray, np.ndarray, int]:
    """(cu_q_lens int32[S + 1], kv_lens int32[S], live sequences) of `batch`, as a step passes them."""
    n = len(batch.q_lens)
    cu = np.zeros(batch.num_seq_slots + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(batch.q_lens)
    cu[n + 1 :] = cu[n]
    kv = np.zeros(batch.num_seq_slots, np.int32)
    kv[:n] = batch.kv_lens
    return cu, kv, n


def useful_attention_flops(shape: AttentionShape, q_lens, kv_lens) -> float:
    """QK and PV FLOPs of causal attention over the sequences' real keys (no padding, no masked keys)."""
    return (
        4.0
        * shape.num_q_heads
        * shape.head_dim
        * sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in zip(q_lens, kv_lens))
    )


def attention_costs(
    shape: AttentionShape, batch: AttentionBatch, itemsize: int = 2, tokens_per_block: int = 16
) -> list[LaunchCost]:
    """Every launch of one attention layer for `batch` (see `kernel.plan_launches`)."""
    from pallas_kernels.ragged_paged_attention import schedule
    from pallas_kernels.ragged_paged_attention.kernel import plan_launches
    from pallas_kernels.ragged_paged_attention.tiling import block_q as tile_tokens
    from pallas_kernels.ragged_paged_attention.tiling import head_blocks, next_pow2

    hq, hkv, d = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    group = hq // hkv
    group_pow2 = next_pow2(group)
    cu, kv, n = step_metadata(batch)
    launches = plan_launches(batch.num_tokens, batch.num_seq_slots, hq, hkv, d, batch.max_kv_len, itemsize)
    case = f"{shape.name} {batch.name}"
    costs = []
    for launch in launches:
        t = launch.tiling
        block_q = tile_tokens(t.block_m, group_pow2)
        programs = hkv * head_blocks(t.block_m, group_pow2)  # per tile and split
        build = jax.jit(
            functools.partial(
                schedule.query_tile_schedule,
                num_tokens=batch.num_tokens,
                block_q=block_q,
                tokens_per_block=tokens_per_block,
                sliding_window=None,
                max_kv_len=batch.max_kv_len,
                max_q_len=launch.max_q_len,
                min_q_len=launch.min_q_len,
                include_padding=launch.include_padding,
                num_tiles=launch.num_tiles,
                num_splits=t.num_kv_splits,
                block_k=t.block_k,
            )
        )
        tiles = np.asarray(build(jnp.asarray(cu), jnp.asarray(kv), jnp.asarray([n], jnp.int32)))
        working = kv_bytes = q_bytes = flops = 0.0
        out_rows = 0
        for row in tiles:
            tokens = int(row[schedule.Q_END] - row[schedule.Q_START])
            chunks = -(-int(row[schedule.KV_HI] - row[schedule.KV_LO]) // t.block_k)
            if tokens <= 0:
                continue
            out_rows += tokens * hq
            splits = int(row[schedule.SPLITS])
            per_split = -(-chunks // splits) if chunks else 0
            for s in range(splits):
                mine = max(0, min(per_split, chunks - s * per_split))
                if not mine:
                    continue
                working += programs
                kv_bytes += programs * mine * t.block_k * d * 2 * itemsize
                q_bytes += tokens * hq * d * itemsize
                flops += programs * mine * 4.0 * t.block_m * t.block_k * d
        out_bytes = out_rows * d * itemsize
        if t.num_kv_splits > 1:  # f32 partials (acc, max, denom) written, read back by the merge
            out_bytes += 2 * t.num_kv_splits * out_rows * (d + 2) * 4
        kind = "decode launch" if launch.max_q_len is not None else ("prefill launch" if len(launches) > 1 else "")
        note = (
            f"{kind + ' ' if kind else ''}block_m={t.block_m} ({group} of {group_pow2} rows per token) "
            f"block_k={t.block_k} splits<={t.num_kv_splits}"
        )
        covered = [
            (q, kv_)
            for q, kv_ in zip(batch.q_lens, batch.kv_lens)
            if q >= launch.min_q_len and (launch.max_q_len is None or q <= launch.max_q_len)
        ]
        useful = useful_attention_flops(shape, *zip(*covered)) if covered else 0.0
        costs.append(
            LaunchCost(
                "ragged_paged_attention",
                case,
                (launch.num_tiles, programs, t.num_kv_splits),
                int(working),
                kv_bytes + q_bytes + out_bytes,
                flops,
                useful,
                note,
            )
        )
    return costs


# ----------------------------------------------------------------------------- LM head


@dataclass(frozen=True)
class LmHeadShape:
    name: str
    hidden: int
    vocab: int


LM_HEAD_MODELS = (LmHeadShape("Llama-3-8B", 4096, 128256), LmHeadShape("Qwen3-30B-A3B", 2048, 151936))
LM_HEAD_ROWS = (64, 256)


def lm_head_costs(shape: LmHeadShape, rows: int, fused: bool) -> LaunchCost:
    """The LM head of a greedy-only step (an XLA pass): bf16 weights [H, V] and activations
    read once, and the float32 logits [rows, V] written and read back by the argmax, or with
    the fused reduction (`jaxllm.models.lm_head_argmax`) only each chunk's accumulators, which
    stay in L2 (not counted), and the int32 tokens."""
    weights = 2 * shape.hidden * shape.vocab
    activations = 2 * rows * shape.hidden
    logits = 4 * rows if fused else 2 * 4 * rows * shape.vocab
    flops = 2 * rows * shape.hidden * shape.vocab
    note = "fused argmax, no f32 logits" if fused else f"f32 logits {4 * rows * shape.vocab / 1e6:.0f} MB x2"
    case = f"{shape.name} rows={rows} {'fused' if fused else 'full'}"
    return LaunchCost("lm_head_argmax", case, (), 0, weights + activations + logits, flops, flops, note)


# ----------------------------------------------------------------------------- report


def default_cases() -> list[LaunchCost]:
    costs: list[LaunchCost] = []
    for shape in ATTENTION_MODELS:
        for batch in default_attention_batches():
            costs += attention_costs(shape, batch)
    for moe in MOE_MODELS:
        for tokens in MOE_TOKEN_COUNTS:
            costs += moe_costs(moe, tokens)
        costs += moe_costs(moe, 256, fused=False)  # the sorted-rows path, for its extra passes
    for head in LM_HEAD_MODELS:
        for rows in LM_HEAD_ROWS:
            costs += [lm_head_costs(head, rows, fused=False), lm_head_costs(head, rows, fused=True)]
    return costs


def format_table(costs: Sequence[LaunchCost], gpus: Sequence[GpuSpec]) -> str:
    head = (
        f"{'kernel':<24} {'case':<56} {'grid':<16} {'programs':>8} {'working':>8} {'MB':>9} {'GFLOP':>8} "
        f"{'useful%':>7} " + " ".join(f"{g.name + ' us':>9} {g.name + ' SM-lim':>11}" for g in gpus) + "  note"
    )
    lines = [head]
    for c in costs:
        useful = f"{100 * c.useful_flops / c.flops:.0f}" if c.flops and c.useful_flops else "-"
        grid = "x".join(str(x) for x in c.grid) if c.grid else "xla"
        times = " ".join(f"{c.roofline_s(g) * 1e6:>9.1f} {c.sm_limited_s(g) * 1e6:>11.1f}" for g in gpus)
        lines.append(
            f"{c.kernel:<24} {c.case:<56} {grid:<16} {c.programs:>8} {c.working:>8} {c.bytes / 1e6:>9.2f} "
            f"{c.flops / 1e9:>8.2f} {useful:>7} {times}  {c.note}"
        )
    return "\n".join(lines)


def report(gpus: Optional[Sequence[GpuSpec]] = None) -> str:
    return format_table(default_cases(), gpus or (H100, H200))
