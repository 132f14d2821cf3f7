"""Mosaic GPU FP8 kernels (e4m3 x e4m3 wgmma, DeepSeek-V3's per-128 block scales): numerics
through jax's Mosaic GPU interpreter on CPU, the engine's choice of them, and the real
Mosaic GPU lowering for CUDA (sm_90a) at DeepSeek-V3 and Qwen3-30B-A3B shapes, where the
lowered module must issue Hopper's `wgmma ... .e4m3.e4m3` (both operands e4m3).

Two oracles. The scheme itself in plain XLA (`fp8_block_matmul_reference`: the exact e4m3
products per 128-deep K block, times the row's and the block's scales, summed in f32):
with f32 outputs the kernels match it to 1e-5 (max |out - ref| / max |ref|; only the
summation order differs). And the models' XLA path (`act_quant(x)` times the weights
dequantized, the hidden activations `act_quant`ed before down): within 2e-2 in bf16 for
the GEMM (that path rounds the dequantized operands to bf16), 5e-2 for the grouped FFN
(see MOE_XLA_TOL). The interpreter fills every buffer it allocates with NaN, so an
unwritten row shows (`JAXLLM_MOSAIC_DETECT_RACES=1` adds its race detector). It
multiplies e4m3 exactly in f32 (numpy); Hopper's wgmma accumulates f8 products at reduced
precision inside each 128-deep block, which only a GPU run can measure.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models.quantization import QuantizedWeight, act_quant, dense, quantize_blocks
from pallas_kernels import mosaic_gpu_interpret
from pallas_kernels.moe_grouped_gemm import moe_grouped_ffn_reference
from pallas_kernels.moe_grouped_gemm.mosaic_gpu_fp8 import (
    Fp8MoeTiling,
    moe_fp8_forward,
    moe_fused_ffn_fp8_mosaic,
    moe_grouped_ffn_fp8_scheme_reference,
)
from pallas_kernels.moe_grouped_gemm.mosaic_gpu_fp8 import supports as moe_supports
from pallas_kernels.quantized_matmul import quantized_matmul_reference
from pallas_kernels.quantized_matmul.mosaic_gpu_fp8 import (
    Fp8GemmTiling,
    fp8_block_matmul,
    fp8_block_matmul_reference,
    fp8_gemm_forward,
    k_major,
    quantize_activations,
    supports,
)

SCHEME_TOL = 1e-5
BF16_TOL = 2e-2
# The grouped FFN against the XLA path: both round the hidden activations to bf16 (from
# differently rounded products) and quantize them to e4m3 again, which moves some hidden
# values by one e4m3 step: ~2-3% of max |out| (the XLA path is as far from the exact
# scheme), ~1.5% in norm.
MOE_XLA_TOL = 5e-2
MOE_XLA_NORM_TOL = 3e-2
needs_interpreter = pytest.mark.skipif(not mosaic_gpu_interpret.available(), reason="no Mosaic GPU interpreter")


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def norm_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def fp8_weight(seed: int, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """(e4m3 values, f32 scales) quantized per 128 x 128 block by the models' host quantizer."""
    w = np.random.default_rng(seed).standard_normal(shape) / np.sqrt(shape[-2])
    value, scale = quantize_blocks(w, (1,) * (len(shape) - 2) + (128, 128))
    return jnp.asarray(value), jnp.asarray(scale)


def activations(seed: int, shape: tuple[int, int]) -> jax.Array:
    x = np.random.default_rng(seed).standard_normal(shape) * np.linspace(0.1, 4.0, shape[1])
    x[0, :128] = 0.0  # an all-zero group (scale 1)
    return jnp.asarray(x, jnp.bfloat16)


def assert_no_races() -> None:
    """With `JAXLLM_MOSAIC_DETECT_RACES=1`, the interpreter's race detector found none."""
    if mosaic_gpu_interpret.detect_races():
        assert not mosaic_gpu_interpret.races_found(), "the interpreter's race detector flagged the kernel"


def _mosaic_calls(text: str) -> int:
    return len(re.findall(r"custom_call @mosaic_gpu", text))


def _e4m3_wgmma(text: str) -> bool:
    """The lowered kernel issues Hopper's 8-bit wgmma (PTX inline in the Mosaic GPU module)."""
    return re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", text) is not None


def test_activation_quantization_is_act_quant():
    x = activations(0, (5, 384))
    q, s = quantize_activations(x)
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (5, 3)
    expanded = (q.astype(jnp.float32) * jnp.repeat(s, 128, axis=1)).astype(x.dtype)
    np.testing.assert_array_equal(np.asarray(expanded, np.float32), np.asarray(act_quant(x, 1), np.float32))
    # The engine hands the kernels `act_quant`'s output: quantizing it again gives the same
    # e4m3 values, and the scales up to bf16 rounding.
    q2, s2 = quantize_activations(act_quant(x, 1))
    np.testing.assert_array_equal(np.asarray(q2, np.float32), np.asarray(q, np.float32))
    np.testing.assert_allclose(np.asarray(s2), np.asarray(s), rtol=2**-8)


@needs_interpreter
@pytest.mark.parametrize("tiling", [Fp8GemmTiling(128, 64, 2)])
def test_fp8_gemm_matches_the_scheme_and_the_xla_path(tiling):
    # 70 rows: a partial row tile; N = 192: a partial 128-column scale block.
    x = activations(1, (70, 384))
    w, ws = fp8_weight(2, (384, 192))
    xq, xs = quantize_activations(x)
    run = functools.partial(fp8_gemm_forward, out_dtype=jnp.float32, tiling=tiling, interpret=True)
    out = jax.jit(run)(xq, xs, k_major(w), ws)
    assert_no_races()
    assert out.shape == (70, 192) and not np.isnan(np.asarray(out)).any()
    assert rel_err(out, fp8_block_matmul_reference(xq, xs, w, ws)) < SCHEME_TOL
    out16 = jax.jit(functools.partial(fp8_block_matmul, tiling=tiling, interpret=True))(act_quant(x, 1), k_major(w), ws)
    assert out16.dtype == jnp.bfloat16
    assert rel_err(out16, quantized_matmul_reference(act_quant(x, 1), w, ws, block=(128, 128))) < BF16_TOL


def test_fp8_kernels_refuse_what_they_cannot_run():
    from types import SimpleNamespace

    assert supports(7168, 1536, (128, 128), 128)
    assert not supports(7168, 1536, (128, 128), -1)  # per-token activations
    assert not supports(7168, 1536, (64, 128), 128)
    assert not supports(192, 1536, (128, 128), 128)  # K not whole 128-deep steps
    hopper, blackwell = SimpleNamespace(compute_capability="9.0"), SimpleNamespace(compute_capability="10.0")
    assert supports(7168, 1536, (128, 128), 128, hopper) and not supports(7168, 1536, (128, 128), 128, blackwell)
    assert not moe_supports(7168, 2048, (128, 128), device=blackwell)
    assert moe_supports(7168, 2048, (128, 128)) and moe_supports(2048, 768, (128, 128))
    assert not moe_supports(2048, 704, (128, 128)) and not moe_supports(2048, 768, (128, 128), act_group=0)
    xq, xs = quantize_activations(activations(3, (8, 256)))
    w, ws = fp8_weight(4, (256, 192))
    with pytest.raises(ValueError, match="block_n=128 must be 64 or 128 and divide N=192"):
        fp8_gemm_forward(xq, xs, k_major(w), ws, tiling=Fp8GemmTiling(64, 128))
    with pytest.raises(ValueError, match="accumulator registers"):
        fp8_gemm_forward(xq, xs, k_major(w[:, :128]), ws[:, :1], tiling=Fp8GemmTiling(128, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm_forward(xq.astype(jnp.bfloat16), xs, k_major(w), ws)


# ----------------------------------------------------------------------------- grouped MoE


def moe_case(seed: int, sizes: list[int], num_rows: int, hidden: int = 256, inter: int = 128):
    e = len(sizes)
    (wg, sg), (wu, su) = fp8_weight(seed, (e, hidden, inter)), fp8_weight(seed + 1, (e, hidden, inter))
    wd, sd = fp8_weight(seed + 2, (e, inter, hidden))
    return activations(seed + 3, (num_rows, hidden)), jnp.asarray(sizes, jnp.int32), (wg, wu, wd, sg, su, sd)


def xla_path(x, sizes, experts):
    """The models' XLA path: act_quant'ed rows, dequantized experts, act_quant'ed hidden."""
    wg, wu, wd, sg, su, sd = experts
    d = [dense(QuantizedWeight(v, s, (1, 128, 128)), x.dtype) for v, s in ((wg, sg), (wu, su), (wd, sd))]
    hidden_fn = functools.partial(act_quant, num_contracted=1)
    return moe_grouped_ffn_reference(act_quant(x, 1), sizes, *d, hidden_fn=hidden_fn)


@needs_interpreter
def test_fp8_moe_matches_the_scheme_and_the_xla_path():
    # Ragged groups, an empty one, 21 padding rows, 3 row tiles (a batch smaller than one
    # row tile: the engine wiring test below).
    sizes, num_rows = [50, 0, 60], 131
    x, group_sizes, experts = moe_case(5, sizes, num_rows)
    wg, wu, wd, sg, su, sd = experts
    xq, xs = quantize_activations(act_quant(x, 1))
    run = functools.partial(moe_fp8_forward, out_dtype=jnp.float32, interpret=True)
    out, hidden = jax.jit(run)(xq, xs, group_sizes, k_major(wg), k_major(wu), k_major(wd), sg, su, sd)
    assert_no_races()  # of the down kernel (the detector keeps the last kernel's verdict)
    total = sum(sizes)
    assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(hidden[:total])).any()
    assert np.all(np.asarray(out[total:]) == 0.0), "padding rows must be zero"
    scheme = moe_grouped_ffn_fp8_scheme_reference(xq, xs, group_sizes, *experts, out_dtype=jnp.float32)
    assert rel_err(out[:total], scheme[:total]) < SCHEME_TOL
    fused = jax.jit(functools.partial(moe_fused_ffn_fp8_mosaic, interpret=True))
    # Each row its own token with weight 1, as the expert-parallel layer calls it.
    ids = jnp.repeat(jnp.arange(len(sizes) + 1, dtype=jnp.int32), jnp.asarray(sizes + [num_rows - total]))[:, None]
    out16 = fused(act_quant(x, 1), ids, jnp.ones(ids.shape, jnp.float32), *experts)
    assert out16.dtype == jnp.bfloat16 and np.all(np.asarray(out16[total:], np.float32) == 0.0)
    scheme16 = moe_grouped_ffn_fp8_scheme_reference(xq, xs, group_sizes, *experts, out_dtype=jnp.bfloat16)
    assert rel_err(out16[:total], scheme16[:total]) < BF16_TOL
    xla = xla_path(x, group_sizes, experts)[:total]
    assert rel_err(out16[:total], xla) < MOE_XLA_TOL and norm_err(out16[:total], xla) < MOE_XLA_NORM_TOL


def test_fp8_moe_tiling_checks():
    x, group_sizes, (wg, wu, wd, sg, su, sd) = moe_case(6, [3, 1], 4)
    xq, xs = quantize_activations(x)
    args = (xq, xs, group_sizes, k_major(wg), k_major(wu), k_major(wd), sg, su, sd)
    with pytest.raises(ValueError, match="same block_m"):
        moe_fp8_forward(*args, tiling=Fp8MoeTiling(Fp8GemmTiling(64, 64), Fp8GemmTiling(128, 64)))
    with pytest.raises(ValueError, match="gate_up.*accumulator registers"):
        moe_fp8_forward(*args, tiling=Fp8MoeTiling(Fp8GemmTiling(64, 128), Fp8GemmTiling(64, 128)))
    with pytest.raises(ValueError, match="gate_up: block_m=96 must be a multiple of 64"):
        moe_fp8_forward(*args, tiling=Fp8MoeTiling(Fp8GemmTiling(96, 64), Fp8GemmTiling(96, 64)))
    with pytest.raises(ValueError, match="w_gate_t"):
        moe_fp8_forward(xq, xs, group_sizes, wg, k_major(wu), k_major(wd), sg, su, sd)  # not K-major


# ----------------------------------------------------------------------------- engine wiring


def test_pallas_on_hopper_and_mosaic_by_name_pick_the_fp8_kernels(monkeypatch):
    """On a Hopper GPU the default `pallas` and `mosaic` by name send FP8 weights to the FP8
    kernels (the engine stores them K-major for them: `mosaic_fp8_selected`); `triton` by name
    and other GPUs keep them on Triton; off-GPU only `mosaic` by name picks them (interpreted)."""
    from jaxllm.models import backends, quantized_matmul

    monkeypatch.setattr(backends, "default_platform", lambda: "gpu")
    monkeypatch.setattr(backends, "converts_fp8", lambda device: True)
    flavour = {"name": "mosaic"}
    monkeypatch.setattr(backends, "gpu_kernel_flavour", lambda device: flavour["name"])
    with quantized_matmul.use_backend("xla"):  # restores the process-wide choice afterwards
        for moe_backend in (None, "pallas", "mosaic"):
            _, _, _, moe_fn = backends.resolve_backends(None, moe_backend)
            assert hasattr(moe_fn, "fused_fp8_dynamic") and hasattr(moe_fn, "fused_fp8")
            assert moe_fn.fused_fp8_dynamic.reads_k_major
            assert quantized_matmul.backend() == "triton" and quantized_matmul.mosaic_fp8()
            assert backends.mosaic_fp8_selected(moe_backend, "gpu")
        _, _, _, moe_fn = backends.resolve_backends(None, "triton")
        assert not hasattr(moe_fn, "fused_fp8_dynamic") and not quantized_matmul.mosaic_fp8()
        assert not backends.mosaic_fp8_selected("triton", "gpu")
        flavour["name"] = "triton"  # a GPU without sm_90a's wgmma
        _, _, _, moe_fn = backends.resolve_backends(None, None)
        assert not hasattr(moe_fn, "fused_fp8_dynamic") and not quantized_matmul.mosaic_fp8()
        assert not backends.mosaic_fp8_selected(None, "gpu")
    assert not quantized_matmul.mosaic_fp8()
    assert backends.mosaic_fp8_selected("mosaic", "cpu") and not backends.mosaic_fp8_selected(None, "cpu")


@needs_interpreter
def test_mosaic_backend_sends_dynamic_fp8_weights_to_the_fp8_kernels():
    """`moe_backend="mosaic"` (off-GPU: the interpreter) gives FP8 experts with per-128
    activations to the FP8 grouped kernels and dense FP8 projections to the FP8 GEMM;
    other activation schemes keep the Triton kernels."""
    from jaxllm.models import quantized_matmul
    from jaxllm.models.backends import resolve_backends
    from jaxllm.models.moe import fp8_expert_operands, fp8_experts_fn, grouped_expert_ffn
    from jaxllm.models.quantization import qeinsum

    with quantized_matmul.use_backend("xla"):  # restores the process-wide choice afterwards
        _, _, _, moe_fn = resolve_backends("xla", "mosaic")
        _, _, _, triton_fn = resolve_backends("xla", "pallas")
    assert not hasattr(triton_fn, "fused_fp8_dynamic")
    x, _, (wg, wu, wd, sg, su, sd) = moe_case(7, [0] * 4, 6)
    p = {
        n: QuantizedWeight(v, s, (1, 128, 128))
        for n, v, s in (("w_gate", wg, sg), ("w_up", wu, su), ("w_down", wd, sd))
    }
    assert fp8_experts_fn(moe_fn, p) is moe_fn.fused_fp8_dynamic
    static = {n: QuantizedWeight(w.value, w.scale, w.blocks, act_group=0) for n, w in p.items()}
    assert fp8_experts_fn(moe_fn, static) is moe_fn.fused_fp8

    ids = jnp.asarray([[0, 3], [1, 3], [3, 2], [0, 1], [2, 0], [4, 4]], jnp.int32)  # the last token: padding
    weights = jnp.asarray(np.random.default_rng(8).uniform(0.1, 1.0, ids.shape), jnp.float32)
    xq, experts, block = fp8_expert_operands(x, p, moe_fn.fused_fp8_dynamic)  # made K-major here
    fused = jax.jit(functools.partial(moe_fn.fused_fp8_dynamic, block=block))
    assert "moe_fp8_gate_up" in str(jax.make_jaxpr(fused)(xq, ids, weights, *experts))
    out = fused(xq, ids, weights, *experts)
    hidden_fn = functools.partial(act_quant, num_contracted=1)
    ref_fn = functools.partial(moe_grouped_ffn_reference, hidden_fn=hidden_fn)
    dq = [dense(p[n], x.dtype) for n in ("w_gate", "w_up", "w_down")]
    ref = grouped_expert_ffn(xq, ids, weights, *dq, moe_fn=ref_fn)
    assert rel_err(out, ref) < MOE_XLA_TOL and norm_err(out, ref) < MOE_XLA_NORM_TOL
    assert np.all(np.asarray(out[5], np.float32) == 0.0)

    # Dense: the FP8 GEMM takes a weight stored K-major ([N, K]) as stored; one in the
    # parameter's layout, or activations quantized per token, stay on the Triton kernel.
    w_dense = QuantizedWeight(*fp8_weight(9, (512, 256)), (128, 128))
    stored_k_major = QuantizedWeight(k_major(w_dense.value), w_dense.scale, (128, 128), k_major=True)
    assert stored_k_major.shape == (512, 256)
    per_token = QuantizedWeight(w_dense.value, w_dense.scale, (128, 128), act_group=-1)
    xd = activations(10, (5, 512))
    spec = "th,hi->ti"
    ref = jax.jit(functools.partial(qeinsum, spec))(xd, w_dense)
    with quantized_matmul.use_backend("triton", interpret=True, mosaic_fp8=True):
        program = str(jax.make_jaxpr(functools.partial(qeinsum, spec))(xd, stored_k_major))
        out = jax.jit(functools.partial(qeinsum, spec))(xd, stored_k_major)
        fallbacks = [str(jax.make_jaxpr(functools.partial(qeinsum, spec))(xd, w)) for w in (w_dense, per_token)]
    assert "fp8_block_gemm" in program and not re.search(r"f8_e4m3fn\[[0-9,]*\] = transpose", program)
    assert all("quantized_matmul_float8" in f and "fp8_block_gemm" not in f for f in fallbacks)
    assert out.shape == (5, 256) and rel_err(out, ref) < BF16_TOL


# ----------------------------------------------------------------------------- CUDA lowering


@pytest.mark.parametrize(
    "m,k,n",
    [
        (1, 7168, 1536),  # DeepSeek-V3 q_a, decode
        (4096, 1536, 24576),  # DeepSeek-V3 q_b, a 4096-token prefill (128-row tiles)
        (64, 16384, 7168),  # DeepSeek-V3 o
        (64, 2048, 4096),  # Qwen3-30B-A3B q
    ],
)
def test_fp8_gemm_lowers_for_cuda(m, k, n):
    s = jax.ShapeDtypeStruct
    specs = (s((m, k), jnp.bfloat16), s((n, k), jnp.float8_e4m3fn), s((k // 128, n // 128), jnp.float32))
    text = fp8_block_matmul.trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert _mosaic_calls(text) == 1 and _e4m3_wgmma(text)


@pytest.mark.parametrize(
    "num_tokens,num_experts,hidden,inter",
    [
        (1, 256, 7168, 2048),  # DeepSeek-V3 decode, batch 1 x top-8
        (4096, 256, 7168, 2048),  # DeepSeek-V3 prefill
        (1, 128, 2048, 768),  # Qwen3-30B-A3B decode
        (512, 128, 2048, 768),  # Qwen3-30B-A3B, 4096 rows
    ],
)
def test_fp8_moe_lowers_for_cuda(num_tokens, num_experts, hidden, inter):
    s = jax.ShapeDtypeStruct
    e, f8 = num_experts, jnp.float8_e4m3fn
    specs = (
        s((num_tokens, hidden), jnp.bfloat16),
        s((num_tokens, 8), jnp.int32),
        s((num_tokens, 8), jnp.float32),
        s((e, hidden, inter), f8),
        s((e, hidden, inter), f8),
        s((e, inter, hidden), f8),
        s((e, hidden // 128, inter // 128), jnp.float32),
        s((e, hidden // 128, inter // 128), jnp.float32),
        s((e, inter // 128, hidden // 128), jnp.float32),
    )
    text = jax.jit(moe_fused_ffn_fp8_mosaic).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert _mosaic_calls(text) == 2 and _e4m3_wgmma(text)


def test_fp8_cost_model_counts_e4m3_rate_and_no_k_major_pass():
    """The weights come K-major (stored so at load): the launches are the kernels and the
    activations' quantization, nothing transposing a weight."""
    from pallas_kernels.cost_model import H100, MOE_MODELS
    from pallas_kernels.cost_model_mosaic import mosaic_fp8_gemm_costs, mosaic_moe_fp8_costs
    from pallas_kernels.cost_model_quant import GEMM_SHAPES

    q_a = GEMM_SHAPES[0]
    gemm, act = mosaic_fp8_gemm_costs(q_a, 4096)
    assert gemm.mma_rate == 2.0 and gemm.flops == 2.0 * 4096 * q_a.k * q_a.n
    assert gemm.roofline_s(H100) >= gemm.flops / (2 * H100.bf16_flops_per_s)
    assert act.bytes > 4096 * q_a.k * 2
    gate_up, down, glue = mosaic_moe_fp8_costs(MOE_MODELS[0], 1)
    # Qwen3-30B-A3B at batch 1: 8 active experts x 64-column tiles, only theirs read.
    assert gate_up.working == 8 * (768 // 64) and down.working == 8 * (2048 // 64)
    assert gate_up.bytes < 2 * 8 * 2048 * 768 * 1.01 + 1e6 and glue.kernel == "moe_xla_glue_fp8"
