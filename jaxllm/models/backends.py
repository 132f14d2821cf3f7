"""Choose the attention and MoE implementations the model step calls.

`xla` is plain XLA (default off-GPU): query-tiled paged attention and a tiled grouped FFN
that, unlike `jax.lax.ragged_dot`, only computes the rows each expert owns. `pallas` (the
default on GPU) runs the Pallas kernels of the GPU's generation (`gpu_kernel_flavour`):
the Mosaic GPU kernels (TMA + wgmma) on Hopper, the Triton kernels on other GPUs, and
the Triton kernels in interpret mode off-GPU (slow: for tests). `triton` and `mosaic`
force one flavour; the Mosaic GPU kernels take bf16/f16 and their tile constraints
(`supports`), and fall back to Triton per call for anything else. FP8 weights whose
activations are quantized per 128-group (DeepSeek-V3's scheme) run on the Mosaic GPU FP8
kernels (e4m3 x e4m3 wgmma), dense projections and experts, with `pallas` on Hopper or
`mosaic` named (`mosaic_fp8_selected`); the engine then stores them K-major, as 8-bit wgmma
reads them. `tokamax` (MoE only) runs tokamax's `ragged_dot` (the optional `tokamax` extra) for the three projections.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from jaxllm.models import quantized_matmul
from jaxllm.models.attention import mosaic_attention, pallas_attention, xla_attention

KERNEL_FLAVOURS = ("triton", "mosaic")


def default_platform() -> str:
    return jax.default_backend()


def gpu_kernel_flavour(device: Any) -> str:
    """'mosaic' on Hopper (compute capability 9.x: the kernels use sm_90a's wgmma, which
    Blackwell does not have), 'triton' on every other GPU."""
    capability = str(getattr(device, "compute_capability", "") or "")
    major = capability.split(".")[0]
    return "mosaic" if major == "9" else "triton"


def _flavour(backend: str, on_gpu: bool) -> str:
    if backend in KERNEL_FLAVOURS:
        return backend
    return gpu_kernel_flavour(jax.devices()[0]) if on_gpu else "triton"


def mosaic_or_triton_moe(interpret: bool) -> Callable:
    """The Mosaic GPU grouped FFN where it takes the problem, else the Triton one."""
    from pallas_kernels.moe_grouped_gemm import moe_grouped_ffn, mosaic_gpu

    def moe(x_sorted, group_sizes, w_gate, w_up, w_down):
        _, hidden, inter = w_gate.shape
        if x_sorted.dtype == w_gate.dtype and mosaic_gpu.supports(x_sorted.dtype, hidden, inter):
            return mosaic_gpu.moe_grouped_ffn_mosaic(x_sorted, group_sizes, w_gate, w_up, w_down, interpret=interpret)
        return moe_grouped_ffn(x_sorted, group_sizes, w_gate, w_up, w_down, interpret=interpret)

    return moe


def mosaic_or_triton_moe_fp8(interpret: bool) -> Callable:
    """`fused_fp8` with e4m3 activations, taking K-major experts ([E, N, K]: `reads_k_major`,
    as the engine stores them for it): the Mosaic GPU FP8 grouped FFN (e4m3 x e4m3 wgmma,
    DeepSeek's per-128 scales) where it takes the experts, else the Triton FP8 kernel on the
    experts transposed back."""
    from pallas_kernels.moe_grouped_gemm import mosaic_gpu_fp8
    from pallas_kernels.moe_grouped_gemm.fp8 import moe_fused_ffn_fp8

    device = None if interpret else jax.devices()[0]  # interpreted anywhere, compiled on Hopper only

    def fused_fp8(x, ids, weights, w_gate_t, w_up_t, w_down_t, s_gate, s_up, s_down, *, block):
        _, inter, hidden = w_gate_t.shape
        if mosaic_gpu_fp8.supports(hidden, inter, block, device=device):
            return mosaic_gpu_fp8.moe_fused_ffn_fp8_mosaic(
                x,
                ids,
                weights,
                w_gate_t,
                w_up_t,
                w_down_t,
                s_gate,
                s_up,
                s_down,
                interpret=interpret,
                weights_k_major=True,
            )
        experts = tuple(mosaic_gpu_fp8.k_major(w) for w in (w_gate_t, w_up_t, w_down_t))
        return moe_fused_ffn_fp8(x, ids, weights, *experts, s_gate, s_up, s_down, block=block, interpret=interpret)

    fused_fp8.reads_k_major = True  # type: ignore[attr-defined]
    return fused_fp8


def mosaic_fp8_selected(moe_backend: str | None, platform: str, device: Any = None) -> bool:
    """Whether FP8 weights with DeepSeek's per-128 activations run on the Mosaic GPU FP8
    kernels, which read them K-major (so the engine stores them so at load): `mosaic` named
    (interpreted off-GPU), or the default `pallas` on a Hopper GPU."""
    on_gpu = platform in ("gpu", "cuda", "rocm")
    if on_gpu and not converts_fp8(device):
        return False
    if moe_backend == "mosaic":
        return True
    return on_gpu and moe_backend in (None, "pallas") and gpu_kernel_flavour(device) == "mosaic"


def tokamax_moe() -> Callable:
    """Per-group SwiGLU FFN from tokamax's `ragged_dot` (same contract as the reference)."""
    try:
        import tokamax
    except ImportError as e:
        raise ValueError("moe_backend='tokamax' needs the tokamax package: pip install 'jaxllm[tokamax]'") from e
    import jax.numpy as jnp

    def moe(x_sorted, group_sizes, w_gate, w_up, w_down):
        f32 = jnp.float32
        sizes = group_sizes.astype(jnp.int32)
        gate = tokamax.ragged_dot(x_sorted, w_gate, sizes, preferred_element_type=f32)
        up = tokamax.ragged_dot(x_sorted, w_up, sizes, preferred_element_type=f32)
        hidden = (jax.nn.silu(gate) * up).astype(x_sorted.dtype)
        out = tokamax.ragged_dot(hidden, w_down, sizes, preferred_element_type=f32)
        valid = jnp.arange(x_sorted.shape[0]) < sizes.sum()
        return jnp.where(valid[:, None], out, 0.0).astype(x_sorted.dtype)

    return moe


def resolve_backends(
    attention_backend: str | None, moe_backend: str | None, num_devices: int = 1
) -> tuple[str, str, Callable, Callable]:
    """(attention backend, MoE backend, attention_fn, moe_fn). Also sets the process-wide
    quantized matmul backend (`jaxllm.models.quantized_matmul`): the Pallas kernel with the
    Pallas MoE backends on a GPU and one device, else XLA."""
    on_gpu = default_platform() in ("gpu", "cuda", "rocm")
    attention_backend = attention_backend or ("pallas" if on_gpu else "xla")
    moe_backend = moe_backend or ("pallas" if on_gpu else "xla")
    # Attention backends take (q, layer cache, AttentionMetadata); see jaxllm.models.attention.
    if attention_backend == "xla":
        attention_fn = xla_attention()
    elif _flavour(attention_backend, on_gpu) == "mosaic":
        attention_fn = mosaic_attention(interpret=not on_gpu)
    else:
        attention_fn = pallas_attention(interpret=not on_gpu)

    if moe_backend == "tokamax":
        moe_fn = tokamax_moe()
    elif moe_backend == "xla":
        from pallas_kernels.moe_grouped_gemm.tiled_xla import moe_grouped_ffn_tiled

        moe_fn = moe_grouped_ffn_tiled
    elif _flavour(moe_backend, on_gpu) == "mosaic":
        moe_fn = mosaic_or_triton_moe(interpret=not on_gpu)
    else:
        from pallas_kernels.moe_grouped_gemm import moe_fused_ffn, moe_grouped_ffn

        moe_fn = functools.partial(moe_grouped_ffn, interpret=not on_gpu)
        # The MoE layer calls the kernel that gathers rows and combines in place (jaxllm.models.moe).
        moe_fn.fused = functools.partial(moe_fused_ffn, interpret=not on_gpu)
    fp8 = not on_gpu or converts_fp8(jax.devices()[0])
    if moe_backend not in ("xla", "tokamax") and fp8:
        from pallas_kernels.moe_grouped_gemm.fp8 import moe_fused_ffn_fp8

        # FP8 experts: the Triton kernel reading e4m3 tiles (jaxllm.models.moe.moe_block).
        moe_fn.fused_fp8 = functools.partial(moe_fused_ffn_fp8, interpret=not on_gpu)
    # The Mosaic FP8 kernels read K-major weights: the engine stores them so where this holds
    # (`jaxllm.engine.builder`), else they would be transposed inside every step.
    mosaic_fp8 = mosaic_fp8_selected(moe_backend, default_platform(), jax.devices()[0])
    if mosaic_fp8:
        # Dynamically quantized FP8 experts: e4m3 activations into wgmma (jaxllm.models.moe.fp8_experts_fn).
        moe_fn.fused_fp8_dynamic = mosaic_or_triton_moe_fp8(interpret=not on_gpu)
    kernel = on_gpu and num_devices == 1 and moe_backend not in ("xla", "tokamax")
    quantized_matmul.set_backend("triton" if kernel else "xla", fp8=fp8, mosaic_fp8=mosaic_fp8)
    return attention_backend, moe_backend, attention_fn, moe_fn


def converts_fp8(device: Any) -> bool:
    """Triton converts e4m3 in registers from compute capability 8.9 (Ada, Hopper) on; older
    GPUs keep FP8 weights on the XLA path (int8 / int4 kernels still run)."""
    capability = str(getattr(device, "compute_capability", "") or "")
    try:
        major, minor = (int(x) for x in capability.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (8, 9)
