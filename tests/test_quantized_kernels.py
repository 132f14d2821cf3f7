"""Quantized-weight kernels: interpret-mode correctness on CPU and CUDA lowering at real shapes.

The dense kernel (`pallas_kernels.quantized_matmul`) is checked against its reference, and
the reference against the models' own XLA path (`jaxllm.models.quantization.qeinsum`,
dynamic FP8 activations included), so the kernel is held to what the engine computes
today. Weights are quantized by the models' host quantizers (`quantize_blocks`: amax / 448
per 128 x 128 block; `quantize_blocks_int`: llama.cpp's Q8_0 / Q4_0). Tolerance: max |out -
ref| / max |ref| below 1e-5 in float32 (only the summation order differs) and 2e-2 in
bfloat16 (products rounded to bf16 at a different point of the sum). Every interpret run
without split-K hands the kernel a NaN-filled output, so an unwritten element shows up.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models.quantization import (
    QuantizedWeight,
    act_quant,
    pack_int4,
    qeinsum,
    quantize_blocks,
    quantize_blocks_int,
)
from pallas_kernels.quantized_matmul import QuantTiling, quantized_matmul, quantized_matmul_reference
from pallas_kernels.quantized_matmul.kernel import default_tiling, quantized_matmul_forward
from pallas_kernels.triton_backend import cuda_lowering_target
from tests.conftest import verified_triton_lowering

F32_TOL = 1e-5
BF16_TOL = 2e-2


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def quantized(kind: str, k: int, n: int, seed: int = 0) -> tuple[jax.Array, jax.Array, tuple[int, int], bool]:
    """(value, scale, block, packed) of a random [K, N] weight in the models' layouts."""
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32) / np.sqrt(k)
    if kind == "fp8":
        block = (128, 128)
        value, scale = quantize_blocks(w, block)
    elif kind == "fp8_channel":
        block = (k, 1)
        value, scale = quantize_blocks(w, block)
    else:
        block = (32, 1)
        value, scale = quantize_blocks_int(w, block, 8 if kind == "int8" else 4)
    packed = kind == "int4"
    if packed:
        value = pack_int4(value)
    return jnp.asarray(value), jnp.asarray(scale), block, packed


def check(kind: str, m: int, k: int, n: int, tiling, dtype=jnp.float32, tol: float = F32_TOL) -> None:
    value, scale, block, packed = quantized(kind, k, n)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((m, k)), dtype)
    poison = tiling is None or tiling.num_k_splits == 1
    if tiling is None:
        poison = default_tiling(m, n, k, block[0]).num_k_splits == 1
    fn = functools.partial(
        quantized_matmul_forward, block=block, packed=packed, tiling=tiling, interpret=True, poison_output=poison
    )
    out = jax.jit(fn)(x, value, scale)
    ref = jax.jit(functools.partial(quantized_matmul_reference, block=block, packed=packed))(x, value, scale)
    assert out.shape == (m, n) and out.dtype == dtype
    assert not np.isnan(np.asarray(out, np.float32)).any(), "kernel left unwritten (NaN) elements"
    err = rel_err(out, ref)
    assert err < tol, f"{kind}: relative error {err} >= {tol}"


SMALL = QuantTiling(16, 32, 32, 4, 2)
SPLIT_K = QuantTiling(16, 64, 32, 4, 2, num_k_splits=4)


# K and N not multiples of the tiles or the scale blocks; rows not a multiple of 16.
@pytest.mark.parametrize("tiling", [SMALL, SPLIT_K, None], ids=["small", "split_k", "default"])
@pytest.mark.parametrize("kind", ["fp8", "fp8_channel", "int8", "int4"])
def test_quantized_matmul_matches_the_dequantized_reference(kind, tiling):
    # FP8: K 300 ends inside a 32- and a 64-deep K step and inside a 128 block.
    check(kind, m=5, k=300 if kind.startswith("fp8") else 320, n=200, tiling=tiling)


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_quantized_matmul_bf16_activations(kind):
    check(kind, m=40, k=256, n=384, tiling=None, dtype=jnp.bfloat16, tol=BF16_TOL)


def test_reference_is_the_models_xla_path():
    """The reference (and so the kernel) computes what `qeinsum` computes: FP8 with dynamic
    per-token-group activations (act_quant first), and weight-only int4."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((7, 256)), jnp.float32)
    for kind, act_group in (("fp8", 128), ("int4", 0), ("int8", 0)):
        value, scale, block, packed = quantized(kind, 256, 192)
        w = QuantizedWeight(value, scale, block, act_group=act_group, packed=packed)
        model = qeinsum("th,hi->ti", x, w, precision=jax.lax.Precision.HIGHEST)
        xq = act_quant(x, 1, act_group) if act_group else x
        ref = quantized_matmul_reference(xq, value, scale, block=block, packed=packed)
        np.testing.assert_allclose(np.asarray(ref), np.asarray(model), rtol=1e-6, atol=1e-6)
        kernel = quantized_matmul(xq, value, scale, block=block, packed=packed, interpret=True)
        assert rel_err(kernel, model) < F32_TOL


@pytest.mark.parametrize(
    "m,n,k,splits",
    [(1, 1536, 7168, True), (1, 7168, 18432, True), (4096, 18432, 7168, False), (64, 768, 2048, True)],
)
def test_default_tiling_fills_the_gpu_and_fits_registers(m, n, k, splits):
    t = default_tiling(m, n, k, 128)
    assert t.block_m * t.block_n // (32 * t.num_warps) <= 128
    working = -(-m // t.block_m) * -(-n // t.block_n) * t.num_k_splits
    assert working >= 132 or not splits
    assert (t.num_k_splits > 1) == splits


def test_bad_operands_are_refused_with_a_named_error():
    value, scale, block, packed = quantized("fp8", 256, 128)
    x = jnp.zeros((4, 256), jnp.float32)
    with pytest.raises(ValueError, match="does not contract"):
        quantized_matmul(x[:, :200], value, scale, block=block, interpret=True)
    with pytest.raises(ValueError, match="scale"):
        quantized_matmul(x, value, scale[:1], block=block, interpret=True)
    with pytest.raises(ValueError, match="dtype"):
        quantized_matmul(x, value.astype(jnp.float32), scale, block=block, interpret=True)
    with pytest.raises(ValueError, match="block_n"):
        QuantTiling(16, 48, 32, 4, 2)
    with pytest.raises(ValueError, match="multiple of 16"):
        default_tiling(4, 128, 256, 24)


# ----------------------------------------------------------------------------- CUDA lowering

# (M, K, N) of DeepSeek-V3's projections (hidden 7168, q_lora 1536, kv_lora 512 + rope 64,
# 128 heads x 192 / 128, dense intermediate 18432, shared expert 2048) and Qwen3-30B-A3B's
# (hidden 2048, 32 q heads and 4 kv heads of 128, expert intermediate 768).
DEEPSEEK_V3 = [(7168, 1536), (1536, 128 * 192), (7168, 576), (128 * 128, 7168), (7168, 18432), (18432, 7168)]
DEEPSEEK_V3 += [(7168, 2048), (2048, 7168)]
QWEN3_30B_A3B = [(2048, 4096), (2048, 512), (4096, 2048), (2048, 768), (768, 2048)]


def _lower_for_cuda(fn, *specs) -> str:
    with cuda_lowering_target(), verified_triton_lowering():
        text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text, "no Triton kernel in the lowering"
    return text


def _weight_specs(kind: str, k: int, n: int):
    s = jax.ShapeDtypeStruct
    if kind == "fp8":
        return s((k, n), jnp.float8_e4m3fn), s((-(-k // 128), -(-n // 128)), jnp.float32), (128, 128), False
    value = s((k, n // 2), jnp.uint8) if kind == "int4" else s((k, n), jnp.int8)
    return value, s((k // 32, n), jnp.float32), (32, 1), kind == "int4"


@pytest.mark.parametrize("kind", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("model", ["DeepSeek-V3", "Qwen3-30B-A3B"])
def test_quantized_matmul_lowers_for_cuda(model, kind):
    shapes = DEEPSEEK_V3 if model == "DeepSeek-V3" else QWEN3_30B_A3B
    for k, n in shapes:
        for m in (1, 64, 2048):  # decode (split-K), a small batch, a prefill chunk
            value, scale, block, packed = _weight_specs(kind, k, n)
            fn = functools.partial(quantized_matmul, block=block, packed=packed)
            _lower_for_cuda(fn, jax.ShapeDtypeStruct((m, k), jnp.bfloat16), value, scale)
    k, n = shapes[0]
    value, scale, block, packed = _weight_specs(kind, k, n)
    fn = functools.partial(quantized_matmul, block=block, packed=packed)
    _lower_for_cuda(fn, jax.ShapeDtypeStruct((16, k), jnp.float32), value, scale)  # float32 models
