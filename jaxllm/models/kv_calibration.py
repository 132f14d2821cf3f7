"""Computed FP8 KV cache scales (`KvCacheConfig(dtype="fp8", calculate_kv_scales=True)`).

A checkpoint without `k_scale` / `v_scale` tensors gets scale 1.0 per layer (vLLM's default),
which loses keys and values beyond e4m3's range (|x| > 448 saturates) or far below it (values
under 2^-9 flush to zero). Calibrating instead runs one unquantized prefill of a calibration
prompt into a scratch float cache, before the engine's KV pool exists, and sets each layer's
key and value scale to amax / 448 of what that prefill wrote (vLLM's `calculate_kv_scales`
computes them from the first forward pass the same way). The cache then holds exactly the
values attention reads: keys after RoPE (and k_norm), values, or MLA's latent vector, whose
one scale covers both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kv_cache.spec import MhaLayerCache
from jaxllm.models.decoder import forward
from jaxllm.models.kv_cache_spec import init_kv_cache
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.quant_config import FP8_MAX, KvCacheQuant
from jaxllm.step_batch import StepBatch

_TOKENS_PER_BLOCK = 16


def _prefill_batch(tokens: Sequence[int], num_blocks: int) -> StepBatch:
    """One sequence of `tokens` over blocks 0, 1, ... of a scratch cache."""
    n = len(tokens)
    i32 = np.int32
    return StepBatch(
        token_ids=np.asarray(tokens, i32),
        positions=np.arange(n, dtype=i32),
        slot_mapping=np.arange(n, dtype=i32),
        cu_q_lens=np.asarray([0, n], i32),
        kv_lens=np.asarray([n], i32),
        block_tables=np.arange(num_blocks, dtype=i32)[None],
        num_seqs=np.asarray([1], i32),
        logits_indices=np.asarray([n - 1], i32),
    )


def _per_layer_amax(leaf: jax.Array, num_layers: int, block_axis: int) -> np.ndarray:
    """Largest |entry| of each layer of a page pool (layer i owns the i-th run of blocks)."""
    shape = leaf.shape
    split = shape[:block_axis] + (num_layers, shape[block_axis] // num_layers) + shape[block_axis + 1 :]
    axes = tuple(a for a in range(len(split)) if a != block_axis)
    return np.asarray(jnp.max(jnp.abs(leaf.reshape(split).astype(jnp.float32)), axis=axes))


def cache_amax(cache: Any, config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """(key amax, value amax) per layer of a float cache (MLA: the latent's, for both)."""
    layers = config.num_layers
    if isinstance(cache, list):  # one cache per layer
        amax = [[float(jnp.max(jnp.abs(leaf.astype(jnp.float32)))) for leaf in jax.tree.leaves(c)] for c in cache]
        k = np.asarray([a[0] for a in amax])
        return k, np.asarray([a[-1] for a in amax])
    if isinstance(cache, MhaLayerCache):  # [Hkv, layers * blocks, tokens, D]
        return _per_layer_amax(cache.k, layers, 1), _per_layer_amax(cache.v, layers, 1)
    (latent,) = jax.tree.leaves(cache)  # MLA pool [layers * blocks, tokens, latent]
    amax = _per_layer_amax(latent, layers, 0)
    return amax, amax


def calibrate_kv_scales(
    params: Any, config: ModelConfig, tokens: Sequence[int], mesh: Optional[jax.sharding.Mesh] = None
) -> KvCacheQuant:
    """Per-layer K/V scales amax / 448 (1.0 for a layer whose amax is 0) from one unquantized
    prefill of `tokens` (the weights as loaded, quantized or not)."""
    if not tokens:
        raise ValueError("KV cache scale calibration needs at least one token")
    float_config = replace(config, kv_cache_quant=None)
    num_blocks = -(-len(tokens) // _TOKENS_PER_BLOCK)
    cache = init_kv_cache(float_config, num_blocks, _TOKENS_PER_BLOCK, float_config.dtype, mesh)
    step = jax.jit(forward, static_argnames=("config", "mesh"))
    _, cache = step(params, cache, _prefill_batch(tokens, num_blocks).as_device(), config=float_config, mesh=mesh)
    k, v = cache_amax(cache, float_config)

    def scales(amax: np.ndarray) -> tuple[float, ...]:
        return tuple(float(np.float32(a) / np.float32(FP8_MAX)) if a > 0 else 1.0 for a in amax)

    return KvCacheQuant(scales(k), scales(v), "computed")


# The calibration prompt: ordinary prose, numbers, code and a chat turn, so the prefill's keys
# and values are those of typical traffic.
CALIBRATION_TEXT = (
    "The history of a city is written in its streets. Early maps show a market square, two churches "
    "and a bridge over the river; by 1850 the railway had reached the northern bank, and the population "
    "grew from 12,000 to more than 85,000 within forty years.\n"
    "def mean(values):\n    return sum(values) / len(values)\n"
    "User: What is the capital of France, and how far is it from Lyon?\n"
    "Assistant: The capital of France is Paris. By road it is about 465 kilometres from Lyon, "
    "roughly four and a half hours by car or two hours by high-speed train."
)


def calibration_tokens(tokenizer_source: Any) -> list[int]:
    """The calibration prompt's token ids under the model's tokenizer."""
    from jaxllm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tokenizer_source))
    return [int(t) for t in tokenizer.encode(CALIBRATION_TEXT)]


def with_computed_kv_scales(
    config: ModelConfig, params: Any, mesh: Optional[jax.sharding.Mesh], tokenizer_source: Any
) -> ModelConfig:
    """`config` with its FP8 KV cache scales computed from a calibration prefill, unless the
    checkpoint carries scales (those are kept)."""
    quant = config.kv_cache_quant
    if quant is None:
        raise ValueError("calculate_kv_scales needs an FP8 KV cache: KvCacheConfig(dtype='fp8')")
    if quant.source == "checkpoint":
        return config
    return replace(
        config, kv_cache_quant=calibrate_kv_scales(params, config, calibration_tokens(tokenizer_source), mesh)
    )
