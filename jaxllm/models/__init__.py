"""Hugging Face decoder architectures in JAX: config, checkpoint loading, forward pass, presets."""

from jaxllm.models.config import ModelConfig, RopeScaling, load_model_config
from jaxllm.models.decoder import (
    KVCache,
    Params,
    compute_logits,
    forward,
    forward_all_logits,
    init_kv_cache,
    kv_cache_bytes_per_token,
    param_shapes,
)
from jaxllm.models.loader import load_params
from jaxllm.models.presets import is_preset, materialize_preset

__all__ = [
    "KVCache",
    "ModelConfig",
    "Params",
    "RopeScaling",
    "compute_logits",
    "forward",
    "forward_all_logits",
    "init_kv_cache",
    "is_preset",
    "kv_cache_bytes_per_token",
    "load_model_config",
    "load_params",
    "materialize_preset",
    "param_shapes",
]
