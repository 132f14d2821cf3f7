"""Choose the attention and MoE implementations the model step calls.

`xla` is plain XLA (default off-GPU): query-tiled paged attention and a tiled grouped FFN
that, unlike `jax.lax.ragged_dot`, only computes the rows each expert owns; `pallas` runs the Pallas kernels,
natively on GPU and in interpret mode elsewhere (slow: for tests).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax


def default_platform() -> str:
    return jax.default_backend()


def resolve_backends(attention_backend: Optional[str], moe_backend: Optional[str]) -> tuple[str, str, Callable, Callable]:
    on_gpu = default_platform() in ("gpu", "cuda", "rocm")
    attention_backend = attention_backend or ("pallas" if on_gpu else "xla")
    moe_backend = moe_backend or ("pallas" if on_gpu else "xla")
    # Attention backends take (q, layer cache, AttentionMetadata); see jaxllm.models.attention.
    from jaxllm.models.attention import pallas_attention, xla_attention

    attention_fn = pallas_attention(interpret=not on_gpu) if attention_backend == "pallas" else xla_attention()
    if moe_backend == "pallas":
        from pallas_kernels.moe_grouped_gemm import moe_fused_ffn, moe_grouped_ffn

        moe_fn = functools.partial(moe_grouped_ffn, interpret=not on_gpu)
        # Unsharded layers call the kernel that gathers rows and combines in place (jaxllm.models.moe).
        moe_fn.fused = functools.partial(moe_fused_ffn, interpret=not on_gpu)
    else:
        from pallas_kernels.moe_grouped_gemm.tiled_xla import moe_grouped_ffn_tiled

        moe_fn = moe_grouped_ffn_tiled
    return attention_backend, moe_backend, attention_fn, moe_fn
