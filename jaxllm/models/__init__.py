"""Hugging Face decoder architectures in JAX: config, weight declaration, loading, forward pass, presets."""

from jaxllm.models.decoder import compute_logits, forward, forward_all_logits
from jaxllm.models.kv_cache_spec import KVCache, init_kv_cache, kv_cache_bytes_per_token, kv_cache_spec
from jaxllm.models.loader import load_params, param_shardings
from jaxllm.models.model_config import ModelConfig, RopeScaling, load_model_config
from jaxllm.models.presets import is_preset, materialize_preset
from jaxllm.models.weights import Params, declare_weights, param_bytes, param_shapes, partition_specs

__all__ = [
    "KVCache",
    "ModelConfig",
    "Params",
    "RopeScaling",
    "compute_logits",
    "declare_weights",
    "forward",
    "forward_all_logits",
    "init_kv_cache",
    "is_preset",
    "kv_cache_bytes_per_token",
    "kv_cache_spec",
    "load_model_config",
    "load_params",
    "materialize_preset",
    "param_bytes",
    "param_shapes",
    "param_shardings",
    "partition_specs",
]
