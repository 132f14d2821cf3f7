"""Pallas kernels: interpret-mode correctness on CPU, and CUDA lowering at engine shapes.

Correctness runs the Triton kernels through Pallas' interpreter against the plain-XLA
references (and, for decode, against JAX's own GPU `paged_attention`). Every run hands
the kernel NaN-filled output buffers, so an element the kernel forgets to write shows up.
Cache slots that no live sequence owns are NaN as well for the kernel (finite garbage for
the references, which multiply masked probabilities by whatever they gather), so reading
one poisons the result. The lowering tests run the real Pallas->Triton lowering for CUDA
on this CPU-only machine; they catch GPU-only rule violations that interpret mode accepts.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe_grouped_gemm import (
    GemmTiling,
    MoeTiling,
    moe_fused_ffn,
    moe_fused_ffn_reference,
    moe_grouped_ffn,
    moe_grouped_ffn_reference,
)
from pallas_kernels.moe_grouped_gemm.kernel import moe_forward, moe_fused_forward
from pallas_kernels.moe_grouped_gemm.tiling import default_tiling as default_moe_tiling
from pallas_kernels.ragged_paged_attention import (
    AttentionTiling,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.ragged_paged_attention.kernel import attention_forward
from pallas_kernels.triton_backend import cuda_lowering_target
from tests.conftest import verified_triton_lowering

F32_TOL = 1e-5
BF16_TOL = 2e-2


def rel_err(out: jax.Array, ref: jax.Array) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def assert_all_written(raw: tuple[jax.Array, ...] | jax.Array) -> None:
    for buf in raw if isinstance(raw, tuple) else (raw,):
        assert not np.isnan(np.asarray(buf, np.float32)).any(), "kernel left poisoned (unwritten) elements"


# ----------------------------------------------------------------------------- attention


@dataclass
class AttentionCase:
    q: np.ndarray
    k_kernel: np.ndarray  # unowned cache slots are NaN
    v_kernel: np.ndarray
    k_ref: np.ndarray  # same, with finite garbage in unowned slots
    v_ref: np.ndarray
    kv_lens: np.ndarray
    block_tables: np.ndarray
    cu_q_lens: np.ndarray
    num_seqs: np.ndarray
    num_valid_tokens: int


def make_attention_case(
    seed: int,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    num_tokens: int,
    num_seq_slots: int,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    tokens_per_block: int = 8,
    max_blocks: int = 8,
    num_blocks: int = 48,
    dtype=np.float32,
) -> AttentionCase:
    """A packed batch: live sequences own distinct random pages; every other slot is garbage."""
    rng = np.random.default_rng(seed)
    n = len(q_lens)
    assert n == len(kv_lens) and n <= num_seq_slots and sum(q_lens) <= num_tokens
    cu = np.zeros(num_seq_slots + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    lens = np.zeros(num_seq_slots, np.int32)
    lens[:n] = kv_lens
    # Unused entries point at random pages (garbage or other sequences' pages).
    tables = rng.integers(0, num_blocks, (num_seq_slots, max_blocks)).astype(np.int32)
    pages = rng.permutation(num_blocks)
    owned = np.zeros((num_blocks, tokens_per_block), bool)
    used = 0
    for s, kv in enumerate(kv_lens):
        nb = -(-kv // tokens_per_block)
        assert nb <= max_blocks
        tables[s, :nb] = pages[used : used + nb]
        used += nb
        for p in range(kv):
            owned[tables[s, p // tokens_per_block], p % tokens_per_block] = True
    assert used <= num_blocks
    shape = (num_kv_heads, num_blocks, tokens_per_block, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    garbage = ~owned[None, :, :, None]
    k_ref = np.where(garbage, 50.0 * rng.standard_normal(shape), k).astype(dtype)
    v_ref = np.where(garbage, 50.0 * rng.standard_normal(shape), v).astype(dtype)
    k_kernel = np.where(garbage, np.nan, k).astype(dtype)
    v_kernel = np.where(garbage, np.nan, v).astype(dtype)
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(dtype)
    return AttentionCase(
        q, k_kernel, v_kernel, k_ref, v_ref, lens, tables, cu, np.array([n], np.int32), int(sum(q_lens))
    )


def check_attention(
    case: AttentionCase,
    tiling: Optional[AttentionTiling],
    *,
    tol: float = F32_TOL,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    decode_tiling: Optional[AttentionTiling] = None,
) -> None:
    opts = dict(sm_scale=case.q.shape[-1] ** -0.5, sliding_window=sliding_window, soft_cap=soft_cap)
    meta = (case.kv_lens, case.block_tables, case.cu_q_lens, case.num_seqs)
    # Whole-function jit: one compile instead of many eager op dispatches (interpret mode).
    kernel = jax.jit(
        functools.partial(
            attention_forward, **opts, tiling=tiling, decode_tiling=decode_tiling, interpret=True, poison_outputs=True
        )
    )
    out, raw = kernel(case.q, case.k_kernel, case.v_kernel, *meta)
    reference = jax.jit(functools.partial(ragged_paged_attention_reference, **opts))
    ref = reference(case.q, case.k_ref, case.v_ref, *meta)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_all_written(raw)
    n = case.num_valid_tokens
    if n:
        err = rel_err(out[:n], ref[:n])
        assert err < tol, f"relative error {err} >= {tol}"
    assert np.all(np.asarray(out[n:], np.float32) == 0.0), "padding tokens must be zero"


SMALL = AttentionTiling(block_m=16, block_k=16, num_kv_splits=1, num_warps=4, num_stages=2)
SPLIT = AttentionTiling(block_m=16, block_k=16, num_kv_splits=4, num_warps=4, num_stages=2)
WIDE = AttentionTiling(block_m=32, block_k=32, num_kv_splits=2, num_warps=4, num_stages=2)

# Lengths with tokens_per_block 8: 1, exactly one block, block + 1, many blocks.
EDGE_KV_LENS = [1, 8, 9, 61]


@pytest.mark.parametrize("tiling", [SMALL, SPLIT], ids=["one_split", "four_splits"])
def test_attention_decode_only(tiling):
    case = make_attention_case(0, [1, 1, 1, 1], EDGE_KV_LENS, num_tokens=8, num_seq_slots=6)
    check_attention(case, tiling)


@pytest.mark.parametrize("tiling", [SMALL, WIDE], ids=["small", "wide_split"])
def test_attention_prefill_only(tiling):
    # Fresh prompts (q_len == kv_len) and one chunk continuing a cached prefix.
    case = make_attention_case(1, [1, 8, 9, 19, 5], [1, 8, 9, 19, 30], num_tokens=48, num_seq_slots=5)
    check_attention(case, tiling)


@pytest.mark.parametrize(
    "tiling,decode",
    [(SPLIT, None), (None, None), (SMALL, SPLIT), (WIDE, SMALL)],
    ids=["one_launch_split", "default", "decode_launch_split", "prefill_launch_split"],
)
def test_attention_mixed_batch(tiling, decode):
    # Context chunks first, then generation tokens (and a 3-token one: with 2 kv heads of 4 q
    # heads a 16-row decode tile holds 8 tokens, so it runs in the decode launch too); padding last.
    case = make_attention_case(2, [13, 3, 1, 1, 1, 9], [13, 40, 9, 1, 64, 30], num_tokens=32, num_seq_slots=7)
    check_attention(case, tiling, decode_tiling=decode)


def test_attention_flash_decoding_splits_follow_the_lengths():
    """Split slots are dealt from the actual lengths: short sequences use one, long ones all
    four; the result matches the reference either way."""
    from pallas_kernels.ragged_paged_attention import schedule

    lens = [1, 9, 200, 250, 17]
    case = make_attention_case(12, [1] * 5, lens, num_tokens=5, num_seq_slots=6, max_blocks=32, num_blocks=80)
    check_attention(case, SPLIT)
    tiles = schedule.query_tile_schedule(
        jnp.asarray(case.cu_q_lens),
        jnp.asarray(case.kv_lens),
        jnp.asarray(case.num_seqs),
        num_tokens=5,
        block_q=8,
        tokens_per_block=8,
        sliding_window=None,
        num_splits=4,
        block_k=16,
    )
    splits = {int(t[schedule.KV_HI]): int(t[schedule.SPLITS]) for t in np.asarray(tiles) if t[schedule.KV_HI] > 0}
    assert splits == {1: 1, 9: 1, 17: 1, 200: 4, 250: 4}


@pytest.mark.parametrize("window,cap", [(10, None), (None, 5.0), (17, 2.0)])
def test_attention_sliding_window_and_soft_cap(window, cap):
    case = make_attention_case(3, [12, 1, 1, 2], [12, 33, 9, 50], num_tokens=24, num_seq_slots=4)
    check_attention(case, SPLIT, sliding_window=window, soft_cap=cap)
    check_attention(case, SMALL, sliding_window=window, soft_cap=cap, decode_tiling=SPLIT)


@pytest.mark.parametrize("heads", [(8, 1), (6, 2)], ids=["mqa", "gqa3"])
def test_attention_mqa_and_odd_group(heads):
    hq, hkv = heads
    case = make_attention_case(
        4, [6, 1, 1], [20, 8, 9], num_tokens=12, num_seq_slots=4, num_q_heads=hq, num_kv_heads=hkv
    )
    check_attention(case, SPLIT)


def test_attention_bf16_head_dim_128():
    case = make_attention_case(
        5, [9, 1, 1, 1], [25, 1, 8, 40], num_tokens=16, num_seq_slots=4, head_dim=128, dtype=jnp.bfloat16
    )
    check_attention(case, SPLIT, tol=BF16_TOL)


def test_attention_head_dim_not_power_of_two():
    case = make_attention_case(6, [4, 1], [11, 17], num_tokens=8, num_seq_slots=2, head_dim=24)
    check_attention(case, SMALL)


def test_attention_single_token_and_empty_batch():
    case = make_attention_case(7, [1], [1], num_tokens=1, num_seq_slots=1)
    check_attention(case, SMALL)
    empty = make_attention_case(8, [], [], num_tokens=4, num_seq_slots=2)
    check_attention(empty, SPLIT)


def test_attention_public_function_inside_jit():
    case = make_attention_case(9, [5, 1, 1], [21, 9, 30], num_tokens=8, num_seq_slots=4)
    meta = (case.kv_lens, case.block_tables, case.cu_q_lens, case.num_seqs)

    @jax.jit
    def step(q, k, v, kv_lens, block_tables, cu_q_lens, num_seqs):
        return (
            ragged_paged_attention(q, k, v, kv_lens, block_tables, cu_q_lens, num_seqs, sm_scale=0.125, interpret=True)
            * 2.0
        )

    out = step(case.q, case.k_kernel, case.v_kernel, *meta)
    ref = (
        jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=0.125))(
            case.q, case.k_ref, case.v_ref, *meta
        )
        * 2.0
    )
    assert rel_err(out[:7], ref[:7]) < F32_TOL
    assert np.all(np.asarray(out[7:]) == 0.0)


def _jax_paged_attention():
    """JAX's GPU paged_attention, a peer for decode; deprecated (in favour of tokamax) on jax >= 0.11."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message="jax.experimental.pallas.ops.gpu.paged_attention is deprecated",
            category=DeprecationWarning,
        )
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    return paged_attention


def test_attention_matches_jax_paged_attention_on_decode():
    paged_attention = _jax_paged_attention()

    lens = [1, 8, 9, 61, 33, 16]
    case = make_attention_case(10, [1] * len(lens), lens, num_tokens=len(lens), num_seq_slots=len(lens))
    sm_scale = case.q.shape[-1] ** -0.5
    theirs = paged_attention(
        jnp.asarray(case.q) * sm_scale,
        jnp.asarray(case.k_ref),
        jnp.asarray(case.v_ref),
        jnp.asarray(case.block_tables),
        jnp.asarray(case.kv_lens),
        block_h=16,
        pages_per_compute_block=2,
        k_splits=2,
        interpret=True,
    )
    for tiling in (SMALL, SPLIT):
        out = ragged_paged_attention(
            case.q,
            case.k_kernel,
            case.v_kernel,
            case.kv_lens,
            case.block_tables,
            case.cu_q_lens,
            case.num_seqs,
            sm_scale=sm_scale,
            interpret=True,
            tiling=tiling,
        )
        assert rel_err(out, theirs) < F32_TOL


def test_attention_clamps_bad_metadata():
    """Metadata the engine never produces must not make the kernel leave its buffers: block-table
    ids out of range (both signs), a last sequence running past the bucket (`cu_q_lens[n] > T`),
    a KV length past the block table's capacity, `num_seqs > S`. The kernel clamps as the
    reference does; every cache slot is finite here, so the outputs must agree."""
    case = make_attention_case(11, [3, 1, 6], [9, 61, 20], num_tokens=10, num_seq_slots=3)
    q = case.q[:8]  # the bucket holds 8 tokens; cu_q_lens still says 10
    num_blocks, max_blocks, tpb = case.k_ref.shape[1], case.block_tables.shape[1], case.k_ref.shape[2]
    tables = case.block_tables.copy()
    tables[0, 0], tables[1, 7], tables[2, 1] = num_blocks + 5, -3, 10**6
    kv_lens = case.kv_lens.copy()
    kv_lens[1] = max_blocks * tpb + 40
    meta = (kv_lens, tables, case.cu_q_lens, np.array([7], np.int32))
    opts = dict(sm_scale=0.125)
    ref = jax.jit(functools.partial(ragged_paged_attention_reference, **opts))(q, case.k_ref, case.v_ref, *meta)
    for tiling in (SMALL, SPLIT):
        out, raw = jax.jit(
            functools.partial(attention_forward, **opts, tiling=tiling, interpret=True, poison_outputs=True)
        )(q, case.k_ref, case.v_ref, *meta)
        assert_all_written(raw)
        assert rel_err(out, ref) < F32_TOL


@pytest.mark.parametrize("field,value", [("block_m", 48), ("block_k", 8), ("num_warps", 3), ("num_kv_splits", 0)])
def test_attention_tiling_refuses_invalid_sizes_up_front(field, value):
    kw = dict(block_m=16, block_k=16, num_kv_splits=1, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match=field):
        AttentionTiling(**{**kw, field: value})


# ----------------------------------------------------------------------------- MoE


def make_moe_case(
    seed: int, group_sizes: list[int], num_rows: int, hidden: int = 64, inter: int = 96, dtype=np.float32
):
    rng = np.random.default_rng(seed)
    e = len(group_sizes)
    x = rng.standard_normal((num_rows, hidden))
    w_gate = rng.standard_normal((e, hidden, inter)) / np.sqrt(hidden)
    w_up = rng.standard_normal((e, hidden, inter)) / np.sqrt(hidden)
    w_down = rng.standard_normal((e, inter, hidden)) / np.sqrt(inter)
    return (
        jnp.asarray(x, dtype),
        jnp.asarray(group_sizes, jnp.int32),
        jnp.asarray(w_gate, dtype),
        jnp.asarray(w_up, dtype),
        jnp.asarray(w_down, dtype),
    )


def check_moe(args, tiling: Optional[MoeTiling], tol: float = F32_TOL) -> None:
    kernel = jax.jit(functools.partial(moe_forward, tiling=tiling, interpret=True, poison_outputs=True))
    out, hidden = kernel(*args)
    ref = jax.jit(moe_grouped_ffn_reference)(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert_all_written((out, hidden))
    total = int(np.sum(np.asarray(args[1])))
    if total:
        err = rel_err(out[:total], ref[:total])
        assert err < tol, f"relative error {err} >= {tol}"
    assert np.all(np.asarray(out[total:], np.float32) == 0.0), "padding rows must be zero"


MOE_SMALL = MoeTiling(GemmTiling(16, 32, 32, 4, 2), GemmTiling(16, 32, 32, 4, 2))
# Split-K in the down projection: 96 / 16 = 6 K steps over 4 splits (the last one short).
MOE_SPLIT_K = MoeTiling(GemmTiling(16, 32, 32, 4, 2), GemmTiling(16, 32, 16, 4, 2, num_k_splits=4))


@pytest.mark.parametrize("dtype,tol", [(np.float32, F32_TOL), (jnp.bfloat16, BF16_TOL)], ids=["f32", "bf16"])
def test_moe_ragged_groups_with_empty_groups(dtype, tol):
    # Empty first, middle and last groups; groups straddle 16-row tiles; 11 padding rows.
    sizes = [0, 5, 21, 0, 1, 17, 0, 9, 0]
    check_moe(make_moe_case(0, sizes, num_rows=64, dtype=dtype), MOE_SMALL, tol)


def test_moe_one_group_and_no_padding():
    check_moe(make_moe_case(1, [0, 48, 0], num_rows=48), MOE_SMALL)


def test_moe_split_k_down_projection():
    check_moe(make_moe_case(5, [0, 5, 21, 0, 1, 17, 0, 9, 0], num_rows=64), MOE_SPLIT_K)


def test_moe_split_k_and_combine_with_a_column_tail():
    # Output width 48 over 32-wide column tiles: the second tile's last 16 columns are past the
    # end, in the split-K adds (sorted rows) and in the weighted combine (fused).
    check_moe(make_moe_case(8, [0, 5, 21, 0, 1, 17, 0, 9, 0], num_rows=64, hidden=48), MOE_SPLIT_K)
    x, ids, weights, *_ = make_fused_case(9, num_tokens=12, num_valid=11, num_experts=6, top_k=2)
    _, _, w_gate, w_up, w_down = make_moe_case(9, [0] * 6, 12, hidden=48, inter=96)
    check_fused_moe((x[:, :48], ids, weights, w_gate, w_up, w_down), MOE_SPLIT_K)


def make_fused_case(
    seed: int,
    num_tokens: int,
    num_valid: int,
    num_experts: int,
    top_k: int,
    hidden: int = 64,
    inter: int = 96,
    dtype=np.float32,
):
    """Tokens routed to distinct experts each (top-k of random scores, skewed so some experts
    are hot and some empty); tokens past `num_valid` are padding (every id out of range)."""
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((num_tokens, num_experts)) + np.linspace(0, 3, num_experts)
    ids = np.argsort(-scores, axis=1)[:, :top_k].astype(np.int32)
    ids[num_valid:] = rng.choice([num_experts, -1, num_experts + 7], size=(num_tokens - num_valid, top_k))
    weights = rng.uniform(0.1, 1.0, (num_tokens, top_k))
    x, _, w_gate, w_up, w_down = make_moe_case(seed, [0] * num_experts, num_tokens, hidden, inter, dtype)
    return x, jnp.asarray(ids), jnp.asarray(weights, jnp.float32), w_gate, w_up, w_down


def check_fused_moe(args, tiling: Optional[MoeTiling], tol: float = F32_TOL) -> None:
    kernel = jax.jit(functools.partial(moe_fused_forward, tiling=tiling, interpret=True, poison_outputs=True))
    out, hidden = kernel(*args)
    ref = jax.jit(moe_fused_ffn_reference)(*args)
    valid_rows = int(np.sum((np.asarray(args[1]) >= 0) & (np.asarray(args[1]) < args[3].shape[0])))
    assert out.shape == ref.shape and out.dtype == jnp.float32
    assert_all_written(hidden[:valid_rows])
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err} >= {tol}"
    padding = np.all((np.asarray(args[1]) < 0) | (np.asarray(args[1]) >= args[3].shape[0]), axis=1)
    assert np.all(np.asarray(out)[padding] == 0.0), "padding tokens must be zero"


@pytest.mark.parametrize("tiling", [MOE_SMALL, MOE_SPLIT_K, None], ids=["small", "split_k", "default"])
def test_moe_fused_gather_and_weighted_combine(tiling):
    # 24 tokens (3 padding) x top-3 over 8 experts: hot, cold and empty experts, straddling tiles.
    check_fused_moe(make_fused_case(6, num_tokens=24, num_valid=21, num_experts=8, top_k=3), tiling)


def test_moe_fused_bf16_decode_and_public_function():
    args = make_fused_case(7, num_tokens=2, num_valid=2, num_experts=16, top_k=4, dtype=jnp.bfloat16)
    check_fused_moe(args, None, BF16_TOL)
    out = jax.jit(functools.partial(moe_fused_ffn, interpret=True))(*args)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, jax.jit(moe_fused_ffn_reference)(*args)) < BF16_TOL


@pytest.mark.parametrize(
    "num_rows,num_groups,hidden,inter",
    [
        (8, 128, 2048, 768),
        (2048, 128, 2048, 768),
        (2, 8, 4096, 14336),
        (512, 8, 4096, 14336),
        (8, 256, 7168, 2048),
        (65536, 128, 2048, 768),
    ],
)
def test_moe_default_tiling_fits_registers_and_small_batches(num_rows, num_groups, hidden, inter):
    tiling = default_moe_tiling(num_rows, num_groups, hidden, inter)
    assert tiling.gate_up.acc_regs_per_thread(2) <= 128 and tiling.down.acc_regs_per_thread(1) <= 128
    if num_rows <= num_groups:  # decode: one row per group
        assert tiling.gate_up.block_m == 16


def test_moe_single_token_and_all_empty():
    check_moe(make_moe_case(2, [0, 1, 0, 0], num_rows=1), MOE_SMALL)
    check_moe(make_moe_case(3, [0, 0, 0, 0], num_rows=8), MOE_SMALL)


@pytest.mark.parametrize("field,value", [("block_m", 24), ("block_n", 96), ("block_k", 8), ("num_warps", 6)])
def test_moe_tiling_refuses_invalid_sizes_up_front(field, value):
    kw = dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match=field):
        GemmTiling(**{**kw, field: value})


def test_moe_public_function_default_tiling_inside_jit():
    args = make_moe_case(4, [7, 0, 30, 12, 0, 3], num_rows=60, hidden=48, inter=40)
    out = jax.jit(functools.partial(moe_grouped_ffn, interpret=True))(*args)
    total = 52
    assert rel_err(out[:total], jax.jit(moe_grouped_ffn_reference)(*args)[:total]) < F32_TOL
    assert np.all(np.asarray(out[total:]) == 0.0)


# ----------------------------------------------------------------------------- CUDA lowering


def _lower_for_cuda(fn, *specs) -> str:
    with cuda_lowering_target(), verified_triton_lowering():
        text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text, "no Triton kernel in the lowering"
    return text


def _attention_specs(num_tokens, num_seq_slots, max_blocks, hq, hkv, head_dim, tpb, num_blocks, dtype):
    s = jax.ShapeDtypeStruct
    return (
        s((num_tokens, hq, head_dim), dtype),
        s((hkv, num_blocks, tpb, head_dim), dtype),
        s((hkv, num_blocks, tpb, head_dim), dtype),
        s((num_seq_slots,), jnp.int32),
        s((num_seq_slots, max_blocks), jnp.int32),
        s((num_seq_slots + 1,), jnp.int32),
        s((1,), jnp.int32),
    )


@pytest.mark.parametrize(
    "num_tokens,num_seq_slots,hq,hkv,head_dim,tpb,window,cap,dtype",
    [
        (512, 64, 32, 8, 128, 16, None, None, jnp.bfloat16),  # mixed bucket
        (64, 64, 32, 8, 128, 32, None, None, jnp.bfloat16),  # decode bucket: flash-decoding splits
        (256, 256, 32, 8, 128, 16, None, None, jnp.bfloat16),  # large decode bucket, one split
        (512, 64, 32, 8, 64, 16, 4096, 50.0, jnp.bfloat16),  # head dim 64, window, soft-cap
        (512, 64, 16, 8, 256, 32, None, None, jnp.bfloat16),  # head dim 256
        (2048, 8, 32, 1, 128, 16, None, None, jnp.bfloat16),  # MQA prefill bucket
        (512, 64, 32, 8, 128, 16, None, None, jnp.float32),
    ],
)
def test_attention_lowers_for_cuda(num_tokens, num_seq_slots, hq, hkv, head_dim, tpb, window, cap, dtype):
    specs = _attention_specs(num_tokens, num_seq_slots, 128, hq, hkv, head_dim, tpb, 8192, dtype)
    fn = functools.partial(ragged_paged_attention, sm_scale=head_dim**-0.5, sliding_window=window, soft_cap=cap)
    _lower_for_cuda(fn, *specs)


@pytest.mark.parametrize(
    "num_tokens,top_k,num_groups,hidden,inter,dtype",
    [
        (512, 8, 64, 2048, 768, jnp.bfloat16),  # E 64 top-8, 512 tokens
        (1, 8, 128, 2048, 768, jnp.bfloat16),  # Qwen3-30B-A3B decode, batch 1: block_m 16, narrow tiles
        (8192, 8, 128, 2048, 768, jnp.bfloat16),  # large batch: 128-row tiles
        (1, 2, 8, 4096, 14336, jnp.bfloat16),  # Mixtral decode, batch 1: split-K down projection
        (128, 2, 8, 4096, 14336, jnp.bfloat16),  # Mixtral, 128 tokens
        (4, 8, 256, 7168, 2048, jnp.bfloat16),  # DeepSeek-V3 routed experts, decode
        (256, 2, 16, 1024, 512, jnp.float32),
    ],
)
def test_moe_lowers_for_cuda(num_tokens, top_k, num_groups, hidden, inter, dtype):
    s = jax.ShapeDtypeStruct
    weights = (
        s((num_groups, hidden, inter), dtype),
        s((num_groups, hidden, inter), dtype),
        s((num_groups, inter, hidden), dtype),
    )
    sorted_specs = (s((num_tokens * top_k, hidden), dtype), s((num_groups,), jnp.int32), *weights)
    text = _lower_for_cuda(moe_grouped_ffn, *sorted_specs)
    assert text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call") >= 2
    fused_specs = (
        s((num_tokens, hidden), dtype),
        s((num_tokens, top_k), jnp.int32),
        s((num_tokens, top_k), jnp.float32),
        *weights,
    )
    text = _lower_for_cuda(moe_fused_ffn, *fused_specs)
    assert text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call") >= 2


def test_triton_deprecation_is_filtered_and_nothing_else():
    """jax >= 0.11 warns at every Triton lowering; building one of our kernels filters exactly
    that DeprecationWarning (other deprecations still show), and on such a jax a CUDA lowering
    of both kernels emits none."""
    from pallas_kernels.triton_backend import compiler_params

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiler_params(4, 2)
        warnings.warn(
            "The Pallas Triton backend is deprecated and will be removed in a future JAX version.", DeprecationWarning
        )
        warnings.warn("some other deprecation", DeprecationWarning)
        specs = _attention_specs(64, 64, 16, 8, 2, 64, 16, 256, jnp.bfloat16)
        _lower_for_cuda(functools.partial(ragged_paged_attention, sm_scale=0.125), *specs)
    messages = [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)]
    assert messages == ["some other deprecation"], messages


# ----------------------------------------------------------------------------- benchmark


def test_kernel_benchmark_smoke(capsys):
    from jaxllm.bench import kernels

    assert kernels.main(["--smoke"]) == 0
    printed = capsys.readouterr().out
    assert "ragged_paged_attention" in printed and "moe_grouped_ffn" in printed
    assert "failed" not in printed
