"""Which implementation multiplies activations by a quantized weight: XLA (dequantize the
weight inside the step, then an einsum; every platform, and the fallback) or the Pallas GEMM
kernel that reads the stored FP8 / int8 / int4 values and dequantizes tile by tile
(`pallas_kernels.quantized_matmul`, same numerics up to summation order).

The choice is process-wide: `resolve_backends` sets it when an engine is built, from the
same option that picks the grouped-FFN kernels (`moe_backend`: `pallas`, the default on a
GPU, `triton` or `mosaic`), on a GPU and a single-device mesh only (a kernel call is not
split over a mesh). It is read when a step is traced, so it holds for the engines built
after it is set. On CPU it stays `xla` unless set explicitly (tests: `use_backend`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Optional

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from jaxllm.models.quantization import QuantizedWeight

BACKENDS = ("xla", "triton")
_state = {"backend": "xla", "interpret": False, "fp8": True, "mosaic_fp8": False}


def set_backend(backend: str, *, interpret: bool = False, fp8: bool = True, mosaic_fp8: bool = False) -> None:
    """`xla` or `triton` (the kernel; `interpret` runs it in Pallas interpret mode, off-GPU;
    `fp8=False` keeps FP8 weights on XLA, for GPUs that cannot convert e4m3 in the kernel;
    `mosaic_fp8` sends FP8 weights with per-128-group dynamic activations to the Mosaic GPU
    e4m3 x e4m3 kernel where it takes them, Hopper only)."""
    if backend not in BACKENDS:
        raise ValueError(f"quantized matmul backend must be one of {BACKENDS}, got {backend!r}")
    _state.update(backend=backend, interpret=interpret, fp8=fp8, mosaic_fp8=mosaic_fp8)


def backend() -> str:
    return str(_state["backend"])


def mosaic_fp8() -> bool:
    """Whether FP8 weights with per-128-group activations go to the Mosaic GPU FP8 kernel."""
    return bool(_state["mosaic_fp8"])


@contextlib.contextmanager
def use_backend(name: str, *, interpret: bool = False, mosaic_fp8: bool = False) -> Iterator[None]:
    """The backend for the traces inside the block, restored after it."""
    saved = dict(_state)
    set_backend(name, interpret=interpret, mosaic_fp8=mosaic_fp8)
    try:
        yield
    finally:
        _state.update(saved)


def merged_block(dims: Sequence[int], blocks: Sequence[int]) -> Optional[int]:
    """The scale block of `dims` flattened into one axis, when it is uniform: the innermost
    axes whose blocks cover them whole merge with the next one out; any axis further out
    must have blocks of 1, and every inner axis must hold whole blocks. None otherwise."""
    block, covered = 1, 1
    for pos in range(len(dims) - 1, -1, -1):
        n, b = int(dims[pos]), int(blocks[pos])
        if block == covered:  # everything inside this axis is one block so far
            if pos > 0 and n % b:
                return None
            block, covered = b * covered, n * covered
        elif b != 1:
            return None
    return block


def _plan(spec: str, x: jax.Array, w: QuantizedWeight) -> Optional[tuple[int, int, int, tuple[int, int]]]:
    """(contracted axes, K, N, scale block) of `spec` as a 2-D `x [M, K] @ w [K, N]`, or None when the einsum
    is not that (x's trailing axes contracted with w's leading ones, w's others trailing the
    output) or the scales do not flatten to uniform blocks."""
    inputs, out = spec.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    contracted = [c for c in xs if c not in out]
    lead = xs[: len(xs) - len(contracted)]
    shape = w.shape
    if (
        len(ws) != len(shape)
        or xs[len(lead) :] != ws[: len(contracted)]
        or out != lead + ws[len(contracted) :]
        or len(set(xs)) != len(xs)
        or not contracted
    ):
        return None
    blocks = (1,) * (len(shape) - len(w.blocks)) + tuple(w.blocks)
    nk = len(contracted)
    bk, bn = merged_block(shape[:nk], blocks[:nk]), merged_block(shape[nk:], blocks[nk:])
    if bk is None or bn is None or (w.packed and bn != 1 and bn % 2):
        return None
    return nk, math.prod(shape[:nk]), math.prod(shape[nk:]), (bk, bn)


def block_scale(w: QuantizedWeight) -> Optional[jax.Array]:
    """`w`'s float32 scale per block (a K-quant's `d * sc`): the super-block scales repeated
    over the blocks each covers; None when a super-block is not whole blocks along some axis."""
    scale = w.scale.astype(jnp.float32)
    if w.super_scale is None:
        return scale
    blocks = (1,) * (scale.ndim - len(w.blocks)) + tuple(w.blocks)
    supers = (1,) * (scale.ndim - len(w.super_blocks)) + tuple(w.super_blocks)
    if any(s % b for s, b in zip(supers, blocks)):
        return None
    per_super = w.super_scale.astype(jnp.float32)
    for axis, (s, b) in enumerate(zip(supers, blocks)):
        if s > b:
            per_super = jnp.repeat(per_super, s // b, axis=axis, total_repeat_length=per_super.shape[axis] * (s // b))
    return scale * per_super[tuple(slice(0, n) for n in scale.shape)]


def kernel_einsum(spec: str, x: jax.Array, w: QuantizedWeight) -> Optional[jax.Array]:
    """`einsum(spec, x, dense(w, x.dtype))` by the Pallas kernel when the backend is `triton`
    and the kernel takes the problem; None otherwise (the caller runs the XLA path)."""
    if _state["backend"] != "triton" or (w.value.dtype == jnp.float8_e4m3fn and not _state["fp8"]):
        return None
    if w.offset is not None or w.unsigned:  # asymmetric formats (GGUF Q4_1 / Q4_K, AWQ): XLA path
        return None
    from pallas_kernels.quantized_matmul.kernel import scale_block_k_tile

    plan = _plan(spec, x, w)
    if plan is None:
        return None
    nk, k, n, block = plan
    m = math.prod(x.shape) // k if k else 0
    if m == 0 or scale_block_k_tile(block[0], k) is None or x.dtype not in (jnp.bfloat16, jnp.float32):
        return None
    per_block = block_scale(w)  # float32 (K-quants: d * sc)
    if per_block is None:
        return None
    scale = per_block.reshape(-(-k // block[0]), -(-n // block[1]))
    lead = x.shape[: x.ndim - nk]
    if _state["mosaic_fp8"] and w.k_major and nk == 1:
        from pallas_kernels.quantized_matmul import mosaic_gpu_fp8

        device = None if _state["interpret"] else jax.devices()[0]  # compiled: Hopper only
        if mosaic_gpu_fp8.supports(k, n, block, w.act_group, device):
            # x is `act_quant`'s output: quantizing it again gives back the same e4m3 values.
            # The weight is stored K-major ([N, K]), as 8-bit wgmma reads it.
            y = mosaic_gpu_fp8.fp8_block_matmul(x.reshape(m, k), w.value, scale, interpret=bool(_state["interpret"]))
            return y.reshape(lead + w.shape[nk:])
    value = w.param_value().reshape(k, -1)
    from pallas_kernels.quantized_matmul import quantized_matmul

    out: Any = quantized_matmul(
        x.reshape(m, k), value, scale, block=block, packed=w.packed, interpret=bool(_state["interpret"])
    )
    return out.reshape(lead + w.shape[nk:])
