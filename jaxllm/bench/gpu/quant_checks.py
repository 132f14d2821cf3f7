"""Section 2, quantized weights: the quantized GEMM kernel and the FP8 grouped FFN on the
device against XLA's dequantize-then-compute, at DeepSeek-V3 / Qwen3-30B-A3B shapes.

Weights are random e4m3 values (or int4 nibbles) with random float32 block scales (128 x 128
for FP8, 32 x 1 for int4), generated on the device; activations bf16. References: the
dense `quantized_matmul_reference` (dequantize to bf16, dot with f32 accumulation); for the
FP8 MoE the experts dequantized to bf16, then the plain-XLA grouped FFN (`ragged_dot`, or
the tiled XLA FFN where ragged_dot would densify a large problem) and the routing-weighted
combine. Same tolerance and row format as the other kernel checks. Where the Mosaic GPU
kernels run (Hopper, or the interpreter in a dry run), also the e4m3 x e4m3 wgmma kernels
against the same references with the activations quantized per 128-group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.bench.kernels_quant import MoeFp8Case, QuantGemmCase, moe_fp8_inputs, quant_gemm_inputs
from jaxllm.models.quantization import act_quant as quantize_groups
from pallas_kernels.moe_grouped_gemm.fp8 import dequantize_experts, moe_fused_ffn_fp8
from pallas_kernels.moe_grouped_gemm.reference import moe_grouped_ffn_reference
from pallas_kernels.moe_grouped_gemm.tiled_xla import moe_grouped_ffn_tiled
from pallas_kernels.quantized_matmul import quantized_matmul, quantized_matmul_reference

DENSE_REFERENCE_FLOPS = 2e13  # above this the MoE reference is the tiled XLA FFN


@dataclass(frozen=True)
class QuantPlan:
    gemms: tuple[QuantGemmCase, ...]
    moes: tuple[MoeFp8Case, ...]


def quant_plan(dry_run: bool) -> QuantPlan:
    if dry_run:
        return QuantPlan(
            (QuantGemmCase("tiny", 5, 256, 192, "fp8"), QuantGemmCase("tiny", 5, 256, 192, "int4")),
            (MoeFp8Case("tiny MoE", 6, 8, 2, 256, 128),),
        )
    return QuantPlan(
        (
            QuantGemmCase("DeepSeek-V3 q_a", 4, 7168, 1536, "fp8"),
            QuantGemmCase("DeepSeek-V3 o", 512, 16384, 7168, "fp8"),
            QuantGemmCase("DeepSeek-V3 dense up", 64, 7168, 18432, "fp8"),
            QuantGemmCase("DeepSeek-V3 dense up", 8, 7168, 18432, "int4"),
            QuantGemmCase("Qwen3-30B-A3B q", 256, 2048, 4096, "fp8"),
        ),
        (MoeFp8Case("Qwen3-30B-A3B", 64, 128, 8, 2048, 768), MoeFp8Case("DeepSeek-V3", 32, 256, 8, 7168, 2048)),
    )


def check_gemm(record: Callable[..., None], case: QuantGemmCase, interpret: bool) -> None:
    (x, value, scale), block, packed = quant_gemm_inputs(case, seed=case.m)
    ref = jax.jit(functools.partial(quantized_matmul_reference, block=block, packed=packed))(x, value, scale)
    out = jax.jit(functools.partial(quantized_matmul, block=block, packed=packed, interpret=interpret))(x, value, scale)
    record(
        family=f"quantized matmul {case.kind}",
        model=case.name,
        batch=f"M={case.m} K={case.k} N={case.n}",
        impl="triton",
        reference="xla dequantize + dot",
        out=out,
        ref=ref,
        valid=case.m,
    )


def fp8_moe_reference(tokens, ids, routing, wg, wu, wd, sg, su, sd, *, tiled: bool, act_quant: bool = False):
    """Dequantized experts through the plain-XLA grouped FFN, unsorted and combined in f32;
    `act_quant`: tokens and hidden activations quantized per 128-group (the models' XLA
    path for dynamic FP8 activations)."""
    d = functools.partial(dequantize_experts, block=(128, 128), dtype=tokens.dtype)
    hidden_fn = functools.partial(quantize_groups, num_contracted=1) if act_quant else None
    if act_quant:
        tokens = quantize_groups(tokens, 1)
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=wg.shape[0]).astype(jnp.int32)
    ffn = moe_grouped_ffn_tiled if tiled else moe_grouped_ffn_reference
    y_sorted = ffn(tokens[order // top_k], sizes, d(wg, sg), d(wu, su), d(wd, sd), hidden_fn=hidden_fn)
    y = jnp.zeros(y_sorted.shape, jnp.float32).at[order].set(y_sorted.astype(jnp.float32))
    return jnp.einsum("tkh,tk->th", y.reshape(num_tokens, top_k, -1), routing.astype(jnp.float32))


def check_moe_fp8(record: Callable[..., None], case: MoeFp8Case, interpret: bool) -> None:
    args = moe_fp8_inputs(case, seed=case.num_tokens)
    rows = case.num_tokens * case.top_k
    tiled = not interpret and 6.0 * rows * case.num_experts * case.hidden * case.inter > DENSE_REFERENCE_FLOPS
    ref = jax.jit(functools.partial(fp8_moe_reference, tiled=tiled))(*args)
    out = jax.jit(functools.partial(moe_fused_ffn_fp8, interpret=interpret))(*args)
    record(
        family="moe fp8",
        model=case.name,
        batch=f"{case.num_tokens} tokens top{case.top_k}",
        impl="triton fused",
        reference=("tiled xla" if tiled else "jax.lax.ragged_dot") + " on dequantized experts + combine",
        out=out,
        ref=ref,
        valid=case.num_tokens,
    )


def check_gemm_mosaic_fp8(record: Callable[..., None], case: QuantGemmCase, interpret: bool) -> None:
    """The e4m3 x e4m3 wgmma GEMM against the models' XLA path for dynamic FP8 activations
    (`act_quant(x)` times the dequantized weight)."""
    from pallas_kernels.quantized_matmul.mosaic_gpu_fp8 import fp8_block_matmul, k_major

    (x, value, scale), block, _ = quant_gemm_inputs(case, seed=case.m)
    ref = jax.jit(lambda a, v, sc: quantized_matmul_reference(quantize_groups(a, 1), v, sc, block=block))
    fn = jax.jit(lambda a, v, sc: fp8_block_matmul(a, k_major(v), sc, interpret=interpret))
    record(
        family="quantized matmul fp8",
        model=case.name,
        batch=f"M={case.m} K={case.k} N={case.n}",
        impl="mosaic e4m3 wgmma",
        reference="xla act_quant + dequantize + dot",
        out=fn(x, value, scale),
        ref=ref(x, value, scale),
        valid=case.m,
    )


def check_moe_mosaic_fp8(record: Callable[..., None], case: MoeFp8Case, interpret: bool) -> None:
    """The e4m3 grouped kernels against the XLA path with tokens and hidden activations
    quantized per 128-group. Tolerance 5e-2: both round the hidden activations to bf16 from
    differently rounded products before quantizing them to e4m3 again, which moves some of
    them by one e4m3 step (`tests/test_mosaic_gpu_fp8.py`)."""
    from pallas_kernels.moe_grouped_gemm.mosaic_gpu_fp8 import moe_fused_ffn_fp8_mosaic

    args = moe_fp8_inputs(case, seed=case.num_tokens)
    rows = case.num_tokens * case.top_k
    tiled = not interpret and 6.0 * rows * case.num_experts * case.hidden * case.inter > DENSE_REFERENCE_FLOPS
    ref = jax.jit(functools.partial(fp8_moe_reference, tiled=tiled, act_quant=True))(*args)
    out = jax.jit(functools.partial(moe_fused_ffn_fp8_mosaic, interpret=interpret))(*args)
    record(
        family="moe fp8",
        model=case.name,
        batch=f"{case.num_tokens} tokens top{case.top_k}",
        impl="mosaic e4m3 wgmma",
        reference=("tiled xla" if tiled else "jax.lax.ragged_dot") + " act_quant, dequantized experts + combine",
        out=out,
        ref=ref,
        valid=case.num_tokens,
        tol=5e-2,
    )


def cases(
    record: Callable[..., None], dry_run: bool, interpret: bool, mosaic: bool = False
) -> list[tuple[str, Callable[[], None]]]:
    """(name, check) pairs, most informative first; `mosaic`: the Mosaic GPU FP8 kernels run
    here (a Hopper GPU, or the interpreter in a dry run)."""
    plan = quant_plan(dry_run)
    steps = [
        (f"quantized matmul {c.kind} {c.name} M={c.m}", functools.partial(check_gemm, record, c, interpret))
        for c in plan.gemms
    ]
    steps += [
        (f"moe fp8 {c.name} {c.num_tokens} tokens", functools.partial(check_moe_fp8, record, c, interpret))
        for c in plan.moes
    ]
    if mosaic:
        steps += [
            (
                f"quantized matmul fp8 mosaic {c.name} M={c.m}",
                functools.partial(check_gemm_mosaic_fp8, record, c, interpret),
            )
            for c in plan.gemms
            if c.kind == "fp8"
        ]
        steps += [
            (
                f"moe fp8 mosaic {c.name} {c.num_tokens} tokens",
                functools.partial(check_moe_mosaic_fp8, record, c, interpret),
            )
            for c in plan.moes
        ]
    return steps
