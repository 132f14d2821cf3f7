"""Mosaic GPU (Hopper) kernels: correctness through jax's Mosaic GPU interpreter on CPU,
and the real Mosaic GPU lowering for CUDA at engine shapes.

The interpreter simulates shared memory, TMA copies, barriers and wgmma (with
`JAXLLM_MOSAIC_DETECT_RACES=1` its race detector runs too: the attention checks then
assert it found none; several times slower, so off by default); it fills every
buffer it allocates (outputs included) with NaN, so a row the kernel forgets to write
shows up, and reading a cache slot no live sequence owns (NaN in the kernel's cache,
finite garbage for the reference) poisons the result. The lowering tests run the
Pallas -> Mosaic GPU lowering (sm_90a) on this CPU-only machine; PTX compilation and
timings need a GPU.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels import BF16_TOL, make_attention_case, make_moe_case, rel_err

from pallas_kernels import mosaic_gpu_interpret
from pallas_kernels.moe_grouped_gemm import moe_grouped_ffn_reference
from pallas_kernels.moe_grouped_gemm.mosaic_gpu import (
    MosaicGemmTiling,
    MosaicMoeTiling,
    moe_forward,
    moe_grouped_ffn_mosaic,
)
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.mosaic_gpu import (
    MosaicAttentionTiling,
    attention_forward,
    default_num_kv_splits,
    ragged_paged_attention_mosaic,
)

needs_interpreter = pytest.mark.skipif(
    not mosaic_gpu_interpret.available(), reason="this jax has no Mosaic GPU interpreter"
)


def _mosaic_calls(text: str) -> int:
    return len(re.findall(r"custom_call @mosaic_gpu", text))


# ----------------------------------------------------------------------------- attention


def check_attention(case, *, sliding_window=None, soft_cap=None, tiling=None) -> None:
    """Kernel (NaN in every cache slot no live sequence owns, except the tail of each
    sequence's last page: see the kernel's docstring) against the reference (finite
    garbage there)."""
    tpb = case.k_kernel.shape[2]
    k, v = np.array(case.k_kernel), np.array(case.v_kernel)
    for s in range(int(case.num_seqs[0])):
        last = case.block_tables[s, (case.kv_lens[s] - 1) // tpb]
        k[:, last], v[:, last] = case.k_ref[:, last], case.v_ref[:, last]
    opts = dict(sm_scale=case.q.shape[-1] ** -0.5, sliding_window=sliding_window, soft_cap=soft_cap)
    meta = (case.kv_lens, case.block_tables, case.cu_q_lens, case.num_seqs)
    out = jax.jit(functools.partial(attention_forward, **opts, tiling=tiling, interpret=True))(case.q, k, v, *meta)
    ref = jax.jit(functools.partial(ragged_paged_attention_reference, **opts))(case.q, case.k_ref, case.v_ref, *meta)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    if mosaic_gpu_interpret.detect_races():
        assert not mosaic_gpu_interpret.races_found(), "the interpreter's race detector flagged the kernel"
    assert not np.isnan(np.asarray(out, np.float32)).any(), "unwritten rows or a poisoned page was read"
    n = case.num_valid_tokens
    err = rel_err(out[:n], ref[:n])
    assert err < BF16_TOL, f"relative error {err} >= {BF16_TOL}"
    assert np.all(np.asarray(out[n:], np.float32) == 0.0), "padding tokens must be zero"


@needs_interpreter
def test_attention_mosaic_mixed_batch_gqa():
    # A 37-token prefill chunk after 20 cached tokens (a 64-row tile holds 32 tokens of
    # GQA 2, so it spans two tiles), two decodes, a 1-token prefill, 3 padding tokens;
    # pages of 16 in random order.
    case = make_attention_case(
        0,
        [37, 1, 1, 1],
        [57, 9, 33, 1],
        num_tokens=43,
        num_seq_slots=6,
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=64,
        tokens_per_block=16,
        max_blocks=4,
        num_blocks=16,
        dtype=jnp.bfloat16,
    )
    check_attention(case)


@needs_interpreter
def test_attention_mosaic_window_soft_cap_odd_group_kv_splits():
    # Three q heads per kv head (padded to four rows each), a sliding window that starts
    # mid-page and a soft-cap; float16, pages of 32; the pages split over three CTAs
    # (flash-decoding: uneven shares, and some CTAs get none).
    case = make_attention_case(
        1,
        [6, 1],
        [70, 40],
        num_tokens=8,
        num_seq_slots=2,
        num_q_heads=3,
        num_kv_heads=1,
        head_dim=32,
        tokens_per_block=32,
        max_blocks=3,
        num_blocks=8,
        dtype=jnp.float16,
    )
    check_attention(case, sliding_window=19, soft_cap=5.0, tiling=MosaicAttentionTiling(num_kv_splits=3))


@pytest.mark.parametrize(
    "num_tokens,num_seq_slots,tpb,window,cap,splits",
    [
        (512, 64, 32, None, None, 1),  # Llama-3-8B mixed bucket
        (64, 64, 16, 4096, 50.0, 1),  # decode bucket, window, soft-cap
        (8, 8, 32, None, None, 4),  # small decode bucket: four KV splits
        (575, 64, 16, None, None, 1),  # 575 tokens x 4 rows: not a whole number of 8-row tiles
        (1, 1, 16, None, None, 16),  # one token: 4 rows
    ],
)
def test_attention_mosaic_lowers_for_cuda(num_tokens, num_seq_slots, tpb, window, cap, splits):
    s = jax.ShapeDtypeStruct
    hq, hkv, d, dt = 32, 8, 128, jnp.bfloat16
    specs = (
        s((num_tokens, hq, d), dt),
        s((hkv, 8192, tpb, d), dt),
        s((hkv, 8192, tpb, d), dt),
        s((num_seq_slots,), jnp.int32),
        s((num_seq_slots, 128), jnp.int32),
        s((num_seq_slots + 1,), jnp.int32),
        s((1,), jnp.int32),
    )
    assert default_num_kv_splits(num_tokens, num_seq_slots, hkv, 128 * tpb, tpb) == splits
    fn = functools.partial(ragged_paged_attention_mosaic, sm_scale=d**-0.5, sliding_window=window, soft_cap=cap)
    assert _mosaic_calls(jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()) == 1


def test_attention_mosaic_q_tiles_start_on_whole_smem_tiles():
    """A tile's q copy starts at `first_token * rows_per_token(group)`, and a TMA copy into the
    8-row tiled buffer must start on a whole tile whatever the first token (jax 0.11's layout
    inference rejects the kernel otherwise: Llama's 4 q heads per kv head did)."""
    from pallas_kernels.ragged_paged_attention.mosaic_gpu import rows_per_token

    for group in range(1, 65):
        rows = rows_per_token(group)
        assert rows >= group and rows % 8 == 0 and 64 % rows == 0, (group, rows)


# ----------------------------------------------------------------------------- MoE


def check_moe(args, tiling=None, tol: float = BF16_TOL) -> None:
    out, hidden = jax.jit(functools.partial(moe_forward, tiling=tiling, interpret=True))(*args)
    ref = jax.jit(moe_grouped_ffn_reference)(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    total = int(np.sum(np.asarray(args[1])))
    assert not np.isnan(np.asarray(out, np.float32)).any(), "kernel left unwritten (NaN) rows"
    assert not np.isnan(np.asarray(hidden[:total], np.float32)).any()
    if total:
        err = rel_err(out[:total], ref[:total])
        assert err < tol, f"relative error {err} >= {tol}"
    assert np.all(np.asarray(out[total:], np.float32) == 0.0), "padding rows must be zero"


@needs_interpreter
def test_moe_mosaic_ragged_groups_with_empty_groups():
    # Empty first, middle and last groups; groups straddle the 64-row tiles (a group of
    # 70 spans two); odd owned-row counts exercise every power-of-two store box; 13
    # padding rows; K pipelined over two steps in both kernels.
    sizes = [0, 5, 70, 0, 1, 33, 0, 9, 0]
    tiling = MosaicMoeTiling(MosaicGemmTiling(64, 64, 64, 2), MosaicGemmTiling(64, 64, 32, 2))
    check_moe(make_moe_case(0, sizes, num_rows=131, hidden=128, inter=64, dtype=jnp.bfloat16), tiling)


@needs_interpreter
@pytest.mark.parametrize("sizes", [[0, 3, 0, 5], [1, 0, 0, 1]], ids=["one token x top-8", "one token x top-2"])
def test_moe_mosaic_batch_smaller_than_one_row_tile(sizes):
    # A decode step of one token: 8 (or 2) expert rows in a 64-row tile, default tiling.
    check_moe(make_moe_case(3, sizes, num_rows=sum(sizes), hidden=128, inter=64, dtype=jnp.bfloat16))


def test_moe_mosaic_refuses_what_it_cannot_run():
    args = make_moe_case(2, [3, 1], num_rows=4, hidden=64, inter=32, dtype=np.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        moe_forward(*args)
    bf16 = [a.astype(jnp.bfloat16) if a.dtype != jnp.int32 else a for a in args]
    with pytest.raises(ValueError, match="block_k"):
        moe_forward(*bf16, tiling=MosaicMoeTiling(MosaicGemmTiling(64, 32, 48, 2), MosaicGemmTiling(64, 64, 32, 2)))
    # 32-column tiles (64-byte swizzle) faulted on an H200 with a misaligned address.
    with pytest.raises(ValueError, match="block_n=32 must be a multiple of 64"):
        moe_forward(*bf16, tiling=MosaicMoeTiling(MosaicGemmTiling(64, 32, 32, 2), MosaicGemmTiling(64, 64, 32, 2)))


@pytest.mark.parametrize(
    "num_rows,num_groups,hidden,inter",
    [
        (8, 128, 2048, 768),  # Qwen3-30B-A3B decode, batch 1 x top-8
        (65536, 128, 2048, 768),  # large batch: 128-row tiles
    ],
)
def test_moe_mosaic_lowers_for_cuda(num_rows, num_groups, hidden, inter):
    s = jax.ShapeDtypeStruct
    dt = jnp.bfloat16
    specs = (
        s((num_rows, hidden), dt),
        s((num_groups,), jnp.int32),
        s((num_groups, hidden, inter), dt),
        s((num_groups, hidden, inter), dt),
        s((num_groups, inter, hidden), dt),
    )
    text = moe_grouped_ffn_mosaic.trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert _mosaic_calls(text) == 2


# ----------------------------------------------------------------------------- cost model


def test_mosaic_cost_model_decode_occupancy():
    from pallas_kernels.cost_model import H100, MOE_MODELS, AttentionShape, decode_batch
    from pallas_kernels.cost_model_mosaic import mosaic_attention_costs, mosaic_moe_costs

    llama = AttentionShape("Llama-3-8B", 32, 8, 128)
    attention, _ = mosaic_attention_costs(llama, decode_batch(1, 4096))
    assert attention.grid == (1, 8, 16) and attention.working >= 0.9 * H100.num_sms, attention
    assert attention.bytes >= 4096 * 8 * 128 * 2 * 2  # every cached K/V row read at least once
    gate_up, down, _ = mosaic_moe_costs(MOE_MODELS[0], 1)
    # Qwen3-30B-A3B at batch 1: 8 active experts x 64-column tiles. The down projection
    # fills the SMs; gate/up reaches 96 of 132 CTAs (32-column tiles would fill them, but
    # faulted on an H200, see `default_tiling`).
    assert gate_up.working == 8 * (768 // 64) and down.working == 8 * (2048 // 64) >= H100.num_sms
