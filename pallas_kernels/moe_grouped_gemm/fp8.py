"""Grouped expert FFN with FP8 (e4m3) expert weights and block scales (DeepSeek-V3's 128 x 128),
on the Triton kernels of `kernel.py`, and its reference: the weights dequantized, then the
float grouped FFN (what the models run in XLA today).

The kernels load each weight tile as e4m3 (half the bytes of bf16), multiply it by its
blocks' scales in float32 and round it to the activations' dtype before the MMA, so the
numerics are the reference's up to summation order. Activations arrive as the models hand
them over: with dynamic activation quantization the expert input is already quantized
per token-group of 128 (`act_quant` in XLA); the SwiGLU output before the down projection
is not (as with float weights on the Pallas backends).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from pallas_kernels.moe_grouped_gemm.kernel import ExpertScales, moe_forward, moe_fused_forward
from pallas_kernels.moe_grouped_gemm.reference import moe_fused_ffn_reference, moe_grouped_ffn_reference
from pallas_kernels.moe_grouped_gemm.tiling import MoeTiling

BLOCK = (128, 128)


def dequantize_experts(value: jax.Array, scale: jax.Array, block: tuple[int, int], dtype) -> jax.Array:
    """[E, K, N] e4m3 values times their [E, ceil(K / bk), ceil(N / bn)] block scales, in
    float32, rounded to `dtype` (as `jaxllm.models.quantization.dense`)."""
    s = jnp.repeat(scale, block[0], axis=1)[:, : value.shape[1]]
    s = jnp.repeat(s, block[1], axis=2)[:, :, : value.shape[2]]
    return (value.astype(jnp.float32) * s).astype(dtype)


def moe_grouped_ffn_fp8_reference(
    x_sorted, group_sizes, w_gate, w_up, w_down, s_gate, s_up, s_down, *, block: tuple[int, int] = BLOCK
) -> jax.Array:
    d = functools.partial(dequantize_experts, block=block, dtype=x_sorted.dtype)
    return moe_grouped_ffn_reference(x_sorted, group_sizes, d(w_gate, s_gate), d(w_up, s_up), d(w_down, s_down))


def moe_fused_ffn_fp8_reference(
    x, expert_ids, routing_weights, w_gate, w_up, w_down, s_gate, s_up, s_down, *, block: tuple[int, int] = BLOCK
) -> jax.Array:
    d = functools.partial(dequantize_experts, block=block, dtype=x.dtype)
    return moe_fused_ffn_reference(x, expert_ids, routing_weights, d(w_gate, s_gate), d(w_up, s_up), d(w_down, s_down))


@functools.partial(jax.jit, static_argnames=("block", "interpret", "tiling"))
def moe_grouped_ffn_fp8(
    x_sorted: jax.Array,  # [M, H]
    group_sizes: jax.Array,  # int32[E]
    w_gate: jax.Array,  # float8_e4m3fn [E, H, I]
    w_up: jax.Array,  # float8_e4m3fn [E, H, I]
    w_down: jax.Array,  # float8_e4m3fn [E, I, H]
    s_gate: jax.Array,  # float32 [E, ceil(H / bk), ceil(I / bn)]
    s_up: jax.Array,
    s_down: jax.Array,  # float32 [E, ceil(I / bk), ceil(H / bn)]
    *,
    block: tuple[int, int] = BLOCK,
    interpret: bool = False,
    tiling: Optional[MoeTiling] = None,
) -> jax.Array:
    """Per-group SwiGLU FFN of expert-sorted rows with FP8 weights: [M, H] in x's dtype."""
    scales = ExpertScales(s_gate, s_up, s_down, block)
    out, _ = moe_forward(x_sorted, group_sizes, w_gate, w_up, w_down, tiling=tiling, interpret=interpret, scales=scales)
    return out


@functools.partial(jax.jit, static_argnames=("block", "interpret", "tiling"))
def moe_fused_ffn_fp8(
    x: jax.Array,  # [T, H]
    expert_ids: jax.Array,  # int32[T, top_k]
    routing_weights: jax.Array,  # [T, top_k]
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    s_gate: jax.Array,
    s_up: jax.Array,
    s_down: jax.Array,
    *,
    block: tuple[int, int] = BLOCK,
    interpret: bool = False,
    tiling: Optional[MoeTiling] = None,
) -> jax.Array:
    """`moe_fused_ffn` with FP8 expert weights: [T, H] in x's dtype, combined in float32."""
    scales = ExpertScales(s_gate, s_up, s_down, block)
    out, _ = moe_fused_forward(
        x, expert_ids, routing_weights, w_gate, w_up, w_down, tiling=tiling, interpret=interpret, scales=scales
    )
    return out.astype(x.dtype)
