"""How every model computes in its dtype: RMSNorm in float32, and the matmul precision that
keeps float32 models exact."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxllm.models.model_config import ModelConfig


def matmul_precision(config: ModelConfig) -> Optional[jax.lax.Precision]:
    # float32 models are run for exactness: keep GPUs from using TF32 for their matmuls.
    return jax.lax.Precision.HIGHEST if config.dtype == "float32" else None


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis in float32, scaled in the activation dtype (as HF does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)
