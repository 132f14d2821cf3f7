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

from jaxllm.models.model_config import ModelConfig


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
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(dim, config.rope_theta, scaling)
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


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, base: float, s) -> np.ndarray:
    """YaRN frequencies (transformers' `_compute_yarn_parameters`): extrapolated above
    `beta_fast` rotations over the original context, interpolated (divided by factor)
    below `beta_slow`, a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = (np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))).astype(np.float32)
    extrapolation = (1.0 / pos_freqs).astype(np.float32)
    interpolation = (1.0 / (np.float32(s.factor) * pos_freqs)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = (1 - ramp).astype(np.float32)
    return (interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor).astype(np.float32)


def rope_attention_factor(config: ModelConfig) -> float:
    """YaRN's scale of cos/sin (1 for every other RoPE type)."""
    s = config.rope_scaling
    if s is None or s.rope_type != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return _yarn_get_mscale(s.factor, s.mscale) / _yarn_get_mscale(s.factor, s.mscale_all_dim)
    return _yarn_get_mscale(s.factor)


def yarn_softmax_scale(config: ModelConfig) -> float:
    """DeepSeek's softmax correction: mscale(factor, mscale_all_dim)^2 with YaRN, else 1."""
    s = config.rope_scaling
    if s is None or s.rope_type != "yarn" or not s.mscale_all_dim:
        return 1.0
    return _yarn_get_mscale(s.factor, s.mscale_all_dim) ** 2
