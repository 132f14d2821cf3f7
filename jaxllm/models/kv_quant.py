"""The FP8 (e4m3) KV cache: `KvCacheConfig(dtype="fp8")` / `--kv-cache-dtype fp8`.

The paged K and V arrays (or MLA's latent cache) are stored as float8_e4m3fn, one byte per
value instead of two or four, so the same memory holds twice (bf16) the tokens. Each layer has
one float32 scale for its keys and one for its values (per tensor, as vLLM and TensorRT-LLM
keep them); the cached value is `fp8 * scale`. The scales come from the checkpoint when it
carries them (`self_attn.k_scale` / `v_scale` of compressed-tensors and ModelOpt exports, or
`k_proj.k_scale` / `k_proj.output_scale`), else they are 1.0 (vLLM's default), which suits
activations within e4m3's range (|x| <= 448).

Writes quantize: `clip(x / scale, -448, 448)` rounded to e4m3. Reads dequantize inside the
attention step with the scales folded out of the kernels: a per-tensor scale commutes with
attention, `softmax(q . (s_k k)) (s_v v) = s_v softmax((s_k q) . k) v`, so the queries are
multiplied by the key scale before attention and the output by the value scale after, and
every backend only widens the loaded fp8 page to the compute dtype (the XLA backends cast
the gathered block, the Triton kernel the loaded tile). For MLA's latent cache, which holds
both keys and values, the one scale is folded into the queries and the output the same way
(absorbed form), or the gathered pages are dequantized before they are expanded to K/V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.llm_args import normalize_kv_cache_dtype
from jaxllm.models.model_config import ModelConfig, numpy_dtype
from jaxllm.models.quant_config import FP8_DTYPE, FP8_MAX, KV_SCALE_SUFFIXES, KvCacheQuant

FP8_KV = np.dtype(getattr(jnp, FP8_DTYPE))

# Checkpoint names of one layer's key / value scale (first found wins).
_K_SCALE_NAMES = ("self_attn.k_scale", "self_attn.k_proj.k_scale", "self_attn.k_proj.output_scale")
_V_SCALE_NAMES = ("self_attn.v_scale", "self_attn.v_proj.v_scale", "self_attn.v_proj.output_scale")


def kv_storage_dtype(config: ModelConfig) -> np.dtype:
    """The dtype the engine stores `config`'s KV cache in."""
    return FP8_KV if config.kv_cache_quant is not None else numpy_dtype(config.dtype)


def with_kv_cache_dtype(config: ModelConfig, model_dir: Optional[str | Path], kv_cache_dtype: str) -> ModelConfig:
    """`config` with its KV cache stored as `kv_cache_dtype` ("auto": the model's dtype; "fp8":
    float8_e4m3fn with the checkpoint's scales, or 1.0 where it has none)."""
    if normalize_kv_cache_dtype(kv_cache_dtype) == "auto":
        return replace(config, kv_cache_quant=None)
    quant = checkpoint_kv_scales(model_dir, config) if model_dir is not None else None
    if quant is None:
        ones = (1.0,) * config.num_layers
        quant = KvCacheQuant(ones, ones, "unit")
    return replace(config, kv_cache_quant=quant)


def checkpoint_kv_scales(model_dir: str | Path, config: ModelConfig) -> Optional[KvCacheQuant]:
    """The per-layer K/V scales a safetensors checkpoint carries, or None when it has none.
    Scales for some layers but not all, or a scale that is not one positive number, is a
    ValueError naming the tensor."""
    from safetensors import safe_open

    from jaxllm.models.loader import checkpoint_files

    try:
        files = checkpoint_files(model_dir)
    except ValueError:
        return None  # a converted (orbax) or GGUF-derived checkpoint: no scale tensors
    found: dict[str, np.ndarray] = {}
    for path in files:
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                if name.endswith(KV_SCALE_SUFFIXES):
                    found[name] = f.get_tensor(name)
    if not found:
        return None
    k = _layer_scales(found, _K_SCALE_NAMES, config.num_layers)
    v = k if config.is_mla else _layer_scales(found, _V_SCALE_NAMES, config.num_layers)
    return KvCacheQuant(k, v, "checkpoint")


def _layer_scales(found: dict[str, np.ndarray], names: Sequence[str], num_layers: int) -> tuple[float, ...]:
    scales = []
    for layer in range(num_layers):
        hits = [f"model.layers.{layer}.{n}" for n in names if f"model.layers.{layer}.{n}" in found]
        if not hits:
            raise ValueError(f"the checkpoint has KV cache scales but none named model.layers.{layer}.{names[0]}")
        value = np.asarray(found[hits[0]], np.float32)
        if value.size != 1 or not np.isfinite(value).all() or float(value.reshape(())) <= 0:
            raise ValueError(f"{hits[0]} must be one positive KV cache scale, got shape {list(value.shape)}")
        scales.append(float(value.reshape(())))
    return tuple(scales)


KvScales = Optional[tuple[jax.Array, jax.Array]]


def layer_kv_scales(config: ModelConfig, index: jax.Array | int) -> KvScales:
    """Layer `index`'s (key scale, value scale) as float32 scalars (`index` may be traced inside
    a layer scan), or None for an unquantized cache."""
    quant = config.kv_cache_quant
    if quant is None:
        return None
    if isinstance(index, int):
        return jnp.float32(quant.k_scales[index]), jnp.float32(quant.v_scales[index])
    return jnp.asarray(quant.k_scales, jnp.float32)[index], jnp.asarray(quant.v_scales, jnp.float32)[index]


def quantize_kv(x: jax.Array, scale: jax.Array) -> jax.Array:
    """`x / scale` saturated to e4m3's range and rounded to it (what the cache stores)."""
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(FP8_KV)


def dequantize_kv(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    return (x.astype(jnp.float32) * scale).astype(dtype)


def quantize_entries(k: jax.Array, v: jax.Array, scales: KvScales) -> tuple[jax.Array, jax.Array]:
    """This step's K and V as the cache stores them."""
    if scales is None:
        return k, v
    return quantize_kv(k, scales[0]), quantize_kv(v, scales[1])


def scale_queries(q: jax.Array, scale: Optional[jax.Array]) -> jax.Array:
    """The queries with the key scale folded in (q . (s k) == (s q) . k)."""
    return q if scale is None else (q.astype(jnp.float32) * scale).astype(q.dtype)


def scale_outputs(out: jax.Array, scale: Optional[jax.Array]) -> jax.Array:
    """Attention output with the value scale applied (softmax @ (s v) == s (softmax @ v))."""
    return out if scale is None else (out.astype(jnp.float32) * scale).astype(out.dtype)
