"""Kernel selection: Mosaic GPU on Hopper, Triton on other GPUs, XLA off-GPU by default;
explicit overrides; the Mosaic GPU wrappers fall back to Triton for what they cannot run."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from jaxllm.engine.engine_config import EngineConfig
from jaxllm.models import backends
from jaxllm.models.attention import mosaic_or_triton_attention


@pytest.mark.parametrize(
    "capability,flavour",
    [
        ("9.0", "mosaic"),  # H100 / H200 (sm_90a: TMA + wgmma)
        ("8.0", "triton"),  # A100
        ("8.9", "triton"),  # L4 / Ada
        ("10.0", "triton"),  # B200: no wgmma
        ("12.0", "triton"),
        (None, "triton"),  # a device that reports none
    ],
)
def test_gpu_kernel_flavour_by_compute_capability(capability, flavour):
    assert backends.gpu_kernel_flavour(SimpleNamespace(compute_capability=capability)) == flavour


def test_off_gpu_defaults_and_overrides():
    assert backends.resolve_backends(None, None)[:2] == ("xla", "xla")
    _, _, attention_fn, moe_fn = backends.resolve_backends("pallas", "pallas")  # Triton, interpreted
    assert attention_fn.__name__ != "mha_ragged_paged_attention_mosaic" and hasattr(moe_fn, "fused")
    _, _, attention_fn, moe_fn = backends.resolve_backends("mosaic", "mosaic")
    assert attention_fn.__name__ == "mha_ragged_paged_attention_mosaic" and not hasattr(moe_fn, "fused")
    EngineConfig(model="x", attention_backend="mosaic", moe_backend="tokamax")
    with pytest.raises(ValueError, match="moe_backend"):
        EngineConfig(model="x", moe_backend="cutlass")


@pytest.mark.skipif(importlib.util.find_spec("tokamax") is not None, reason="tokamax is installed")
def test_tokamax_backend_without_tokamax_is_a_clear_error():
    with pytest.raises(ValueError, match="tokamax"):
        backends.resolve_backends("xla", "tokamax")


@pytest.mark.parametrize("dtype,kernel", [(jnp.bfloat16, "mosaic_gpu"), (jnp.float32, "triton")])
def test_mosaic_moe_falls_back_to_triton_for_float32(dtype, kernel):
    # float32 is not a Mosaic GPU (wgmma bf16/f16) problem: the Triton kernels run it.
    s = jax.ShapeDtypeStruct
    specs = (
        s((64, 256), dtype),
        s((8,), jnp.int32),
        s((8, 256, 128), dtype),
        s((8, 256, 128), dtype),
        s((8, 128, 256), dtype),
    )
    text = (
        jax.jit(backends.mosaic_or_triton_moe(interpret=False))
        .trace(*specs)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert ("custom_call @mosaic_gpu" in text) == (kernel == "mosaic_gpu")
    assert ("triton" in text) == (kernel == "triton")


def test_mosaic_attention_falls_back_to_triton_for_float32():
    s = jax.ShapeDtypeStruct
    fn = mosaic_or_triton_attention(interpret=False)
    for dtype, mosaic in ((jnp.bfloat16, True), (jnp.float32, False)):
        specs = (
            s((16, 8, 64), dtype),
            s((2, 64, 16, 64), dtype),
            s((2, 64, 16, 64), dtype),
            s((4,), jnp.int32),
            s((4, 8), jnp.int32),
            s((5,), jnp.int32),
            s((1,), jnp.int32),
        )
        text = jax.jit(lambda *a: fn(*a, sm_scale=0.125)).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
        assert ("custom_call @mosaic_gpu" in text) == mosaic
