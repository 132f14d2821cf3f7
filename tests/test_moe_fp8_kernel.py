"""FP8 grouped MoE FFN: the Triton kernels with e4m3 expert weights and 128 x 128 block scales,
in interpret mode against the dequantized reference, and lowered for CUDA at DeepSeek-V3 and
Qwen3-30B-A3B shapes.

The weights are quantized by the models' host quantizer (`quantize_blocks`, amax / 448 per
block), and the reference (`moe_grouped_ffn_fp8_reference`) is checked against the models'
own dequantization (`jaxllm.models.quantization.dense`) element for element, so the
kernels are held to the grouped FFN the engine runs on dequantized weights today.
Tolerance: max |out - ref| / max |ref| < 1e-5 in float32, 2e-2 in bfloat16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models.quantization import QuantizedWeight, dense, quantize_blocks
from pallas_kernels.moe_grouped_gemm import GemmTiling, MoeTiling
from pallas_kernels.moe_grouped_gemm.fp8 import (
    dequantize_experts,
    moe_fused_ffn_fp8,
    moe_fused_ffn_fp8_reference,
    moe_grouped_ffn_fp8,
    moe_grouped_ffn_fp8_reference,
)
from pallas_kernels.moe_grouped_gemm.kernel import ExpertScales, moe_forward
from pallas_kernels.triton_backend import cuda_lowering_target
from tests.conftest import verified_triton_lowering

F32_TOL = 1e-5
BF16_TOL = 2e-2
BLOCKS = (1, 128, 128)


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def fp8_experts(seed: int, e: int, hidden: int, inter: int):
    """(w_gate, w_up, w_down, s_gate, s_up, s_down): random experts quantized per 128 x 128 block."""
    rng = np.random.default_rng(seed)
    shapes = ((e, hidden, inter), (e, hidden, inter), (e, inter, hidden))
    pairs = [quantize_blocks(rng.standard_normal(s) / np.sqrt(s[1]), BLOCKS) for s in shapes]
    return tuple(jnp.asarray(v) for v, _ in pairs) + tuple(jnp.asarray(s) for _, s in pairs)


# H 192 and I 160: a partial scale block along both, and a partial 64-deep K step.
HIDDEN, INTER = 192, 160
SMALL = MoeTiling(GemmTiling(16, 32, 32, 4, 2), GemmTiling(16, 32, 32, 4, 2))
SPLIT_K = MoeTiling(GemmTiling(16, 32, 32, 4, 2), GemmTiling(16, 32, 32, 4, 2, num_k_splits=4))


def test_reference_dequantizes_as_the_models_do():
    w = fp8_experts(0, 3, HIDDEN, INTER)
    for value, scale in zip(w[:3], w[3:]):
        model = dense(QuantizedWeight(value, scale, BLOCKS), jnp.float32)
        np.testing.assert_array_equal(np.asarray(dequantize_experts(value, scale, (128, 128), jnp.float32)), model)


@pytest.mark.parametrize("tiling", [SMALL, SPLIT_K, None], ids=["small", "split_k", "default"])
def test_fp8_grouped_ffn_matches_the_dequantized_reference(tiling):
    sizes = [0, 5, 21, 0, 1, 17, 0, 9, 0]
    weights = fp8_experts(1, len(sizes), HIDDEN, INTER)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((64, HIDDEN)), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    run = functools.partial(moe_forward, tiling=tiling, interpret=True, poison_outputs=True)
    out, hidden = jax.jit(lambda *a: run(*a[:5], scales=ExpertScales(*a[5:])))(x, group_sizes, *weights)
    ref = jax.jit(moe_grouped_ffn_fp8_reference)(x, group_sizes, *weights)
    total = sum(sizes)
    assert not np.isnan(np.asarray(hidden[:total])).any() and not np.isnan(np.asarray(out)).any()
    assert rel_err(out[:total], ref[:total]) < F32_TOL
    assert np.all(np.asarray(out[total:]) == 0.0), "padding rows must be zero"


def test_fp8_fused_ffn_bf16_decode():
    rng = np.random.default_rng(3)
    num_tokens, e, top_k = 6, 16, 4
    weights = fp8_experts(4, e, HIDDEN, INTER)
    ids = np.argsort(-rng.standard_normal((num_tokens, e)), axis=1)[:, :top_k].astype(np.int32)
    ids[-1] = e  # a padding token routed nowhere
    routing = jnp.asarray(rng.uniform(0.1, 1.0, (num_tokens, top_k)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((num_tokens, HIDDEN)), jnp.bfloat16)
    args = (x, jnp.asarray(ids), routing, *weights)
    out = jax.jit(functools.partial(moe_fused_ffn_fp8, interpret=True))(*args)
    ref = jax.jit(moe_fused_ffn_fp8_reference)(*args)
    assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < BF16_TOL
    assert np.all(np.asarray(out[-1], np.float32) == 0.0)
    sorted_out = jax.jit(functools.partial(moe_grouped_ffn_fp8, interpret=True))(
        x[:4], jnp.asarray([1, 0, 3] + [0] * (e - 3), jnp.int32), *weights
    )
    assert sorted_out.dtype == jnp.bfloat16


def test_fp8_refuses_float_weights_and_mismatched_scales():
    weights = fp8_experts(5, 2, HIDDEN, INTER)
    x = jnp.zeros((4, HIDDEN), jnp.float32)
    sizes = jnp.asarray([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        moe_grouped_ffn_fp8(x, sizes, weights[0].astype(jnp.float32), *weights[1:], interpret=True)
    with pytest.raises(ValueError, match="gate scales"):
        moe_grouped_ffn_fp8(x, sizes, *weights[:3], weights[3][:, :1], *weights[4:], interpret=True)


@pytest.mark.parametrize(
    "num_tokens,top_k,num_experts,hidden,inter",
    [
        (4, 8, 256, 7168, 2048),  # DeepSeek-V3 routed experts, decode
        (512, 8, 256, 7168, 2048),  # DeepSeek-V3, a prefill chunk
        (1, 8, 128, 2048, 768),  # Qwen3-30B-A3B decode, batch 1
        (2048, 8, 128, 2048, 768),  # Qwen3-30B-A3B, large batch
    ],
)
def test_fp8_moe_lowers_for_cuda(num_tokens, top_k, num_experts, hidden, inter):
    s = jax.ShapeDtypeStruct
    fp8, f32 = jnp.float8_e4m3fn, jnp.float32
    weights = (
        s((num_experts, hidden, inter), fp8),
        s((num_experts, hidden, inter), fp8),
        s((num_experts, inter, hidden), fp8),
        s((num_experts, hidden // 128, inter // 128), f32),
        s((num_experts, hidden // 128, inter // 128), f32),
        s((num_experts, inter // 128, hidden // 128), f32),
    )
    x = s((num_tokens * top_k, hidden), jnp.bfloat16)
    for fn, specs in (
        (moe_grouped_ffn_fp8, (x, s((num_experts,), jnp.int32), *weights)),
        (
            moe_fused_ffn_fp8,
            (s((num_tokens, hidden), jnp.bfloat16), s((num_tokens, top_k), jnp.int32), s((num_tokens, top_k), f32))
            + weights,
        ),
    ):
        with cuda_lowering_target(), verified_triton_lowering():
            text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call") >= 2
