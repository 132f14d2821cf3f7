"""Mosaic GPU (Hopper) kernels: correctness through jax's Mosaic GPU interpreter on CPU,
and the real Mosaic GPU lowering for CUDA at engine shapes.

The interpreter simulates shared memory, TMA copies, barriers and wgmma; it fills every
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

from pallas_kernels import mosaic_gpu_interpret
from pallas_kernels.moe_grouped_gemm import moe_grouped_ffn_reference
from pallas_kernels.moe_grouped_gemm.mosaic_gpu import (
    MosaicGemmTiling, MosaicMoeTiling, moe_forward, moe_grouped_ffn_mosaic)
from test_kernels import BF16_TOL, make_moe_case, rel_err

needs_interpreter = pytest.mark.skipif(not mosaic_gpu_interpret.available(),
                                       reason="this jax has no Mosaic GPU interpreter")


def _mosaic_calls(text: str) -> int:
    return len(re.findall(r"custom_call @mosaic_gpu", text))


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
    tiling = MosaicMoeTiling(MosaicGemmTiling(64, 32, 64, 2), MosaicGemmTiling(64, 64, 32, 2))
    check_moe(make_moe_case(0, sizes, num_rows=131, hidden=128, inter=64, dtype=jnp.bfloat16), tiling)


@needs_interpreter
def test_moe_mosaic_decode_rows_default_tiling():
    # A decode step: 2 tokens x top-2 over 8 experts (4 of 64 rows used), float16.
    args = make_moe_case(1, [0, 2, 0, 0, 1, 0, 1, 0], num_rows=4, hidden=64, inter=32, dtype=jnp.float16)
    check_moe(args)


def test_moe_mosaic_refuses_what_it_cannot_run():
    args = make_moe_case(2, [3, 1], num_rows=4, hidden=64, inter=32, dtype=np.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        moe_forward(*args)
    bf16 = [a.astype(jnp.bfloat16) if a.dtype != jnp.int32 else a for a in args]
    with pytest.raises(ValueError, match="block_k"):
        moe_forward(*bf16, tiling=MosaicMoeTiling(MosaicGemmTiling(64, 32, 48, 2), MosaicGemmTiling(64, 64, 32, 2)))


@pytest.mark.parametrize(
    "num_rows,num_groups,hidden,inter",
    [
        (8, 128, 2048, 768),  # Qwen3-30B-A3B decode, batch 1 x top-8
        (4096, 128, 2048, 768),  # Qwen3-30B-A3B, 512 tokens x top-8
        (65536, 128, 2048, 768),  # large batch: 128-row tiles
        (256, 8, 4096, 14336),  # Mixtral-like, top-2
    ],
)
def test_moe_mosaic_lowers_for_cuda(num_rows, num_groups, hidden, inter):
    s = jax.ShapeDtypeStruct
    dt = jnp.bfloat16
    specs = (s((num_rows, hidden), dt), s((num_groups,), jnp.int32), s((num_groups, hidden, inter), dt),
             s((num_groups, hidden, inter), dt), s((num_groups, inter, hidden), dt))
    text = moe_grouped_ffn_mosaic.trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert _mosaic_calls(text) == 2
