"""The dequantize-then-matmul the models run in XLA (`jaxllm.models.quantization.dense` and
`qeinsum`), on plain 2-D arrays: the quantized GEMM kernels' reference.

A quantized weight is `value` [K, N] (float8_e4m3fn or int8; int4 packed two to a uint8
along N, entry 2j in the low nibble of byte j, 2j + 1 in the high one) and float32
`scale` [ceil(K / bk), ceil(N / bn)], one per `block = (bk, bn)` block: the weight is
`value * scale` expanded over the blocks, computed in float32 and rounded to the
activations' dtype; the product accumulates in float32 and is rounded to that dtype too.
FP8 block weights use (128, 128) blocks, per-channel FP8 (K, 1), GGUF Q8_0 / Q4_0 (32, 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def unpack_int4(packed: jax.Array) -> jax.Array:
    """uint8 [..., n] -> int8 [..., 2n]: the low nibble is entry 2j, the high one 2j + 1 (sign-extended)."""
    v = jax.lax.bitcast_convert_type(packed, jnp.int8)
    lo, hi = jnp.left_shift(v, 4) >> 4, v >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def dequantize(value: jax.Array, scale: jax.Array, block: tuple[int, int], dtype, packed: bool = False) -> jax.Array:
    """`value * scale` per block, in float32, then rounded to `dtype`: [K, N]."""
    if packed:
        value = unpack_int4(value)
    s = scale
    for axis, b in enumerate(block):
        if b > 1:
            s = jnp.repeat(s, b, axis=axis, total_repeat_length=s.shape[axis] * b)
    s = s[: value.shape[0], : value.shape[1]]
    return (value.astype(jnp.float32) * s).astype(dtype)


def quantized_matmul_reference(
    x: jax.Array,  # [M, K]
    value: jax.Array,  # [K, N] (int4: uint8 [K, N / 2])
    scale: jax.Array,  # float32 [ceil(K / bk), ceil(N / bn)]
    *,
    block: tuple[int, int],
    packed: bool = False,
) -> jax.Array:
    """`x @ dequantize(value, scale)` accumulated in float32, in x's dtype: [M, N]."""
    w = dequantize(value, scale, block, x.dtype, packed)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32).astype(x.dtype)
