"""Rotary position embeddings, neox style (rotate_half), as Hugging Face Llama/Qwen apply them.

The inverse frequencies depend only on the config, so they are computed on the host
in float32 exactly as transformers does (including the llama3 frequency adjustment of
`_compute_llama3_parameters`) and become constants of the compiled step; cos/sin come
from each token's absolute position.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """float32[head_dim // 2] inverse frequencies, scaled per `config.rope_scaling`."""
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    if scaling.rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {scaling.rope_type!r}")
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
    smooth = ((old_context / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [T, head_dim], computed in float32 and cast to the activation dtype."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
