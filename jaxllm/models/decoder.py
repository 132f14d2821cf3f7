"""The decoder forward pass over a packed `StepBatch` and a paged KV cache.

One implementation covers Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral: they differ only in
flags of `ModelConfig` (q/k norm, q/k/v biases, sparse layers, RoPE scaling, window).
Parameters are a plain pytree passed to the step as an argument:

    embed [V, H]; final_norm [H]; lm_head [H, V] (absent when embeddings are tied)
    layers[i]: attn_norm [H], mlp_norm [H],
      attn: q [H, Hq, D], k [H, Hkv, D], v [H, Hkv, D], o [Hq, D, H]
            (+ q_bias [Hq, D], k_bias / v_bias [Hkv, D] with attention_bias;
               o_bias [H] with o_proj_bias; q_norm / k_norm [D] with qk_norm)
      mlp:  gate [H, I], up [H, I], down [I, H]                  (dense layers)
      moe:  router [H, E], w_gate [E, H, I], w_up [E, H, I], w_down [E, I, H]  (sparse layers)

Attention and the grouped expert FFN are passed in as functions so kernel backends plug
in without touching the model. The KV cache is a per-layer list built by
`init_kv_cache`, so a model with another cache layout only changes that function and
its attention block.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jaxllm.models.config import ModelConfig, normalize_dtype
from jaxllm.models.moe import MoeFn, moe_block
from jaxllm.models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from jaxllm.step_batch import StepBatch
from pallas_kernels.moe_grouped_gemm.reference import moe_grouped_ffn_reference
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference, write_kv

Params = dict[str, Any]
KVCache = list[tuple[jax.Array, jax.Array]]
AttentionFn = Callable[..., jax.Array]

_JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def jnp_dtype(dtype: Any) -> Any:
    return _JNP_DTYPES[normalize_dtype(dtype)]


def param_shapes(config: ModelConfig, dtype: Any = None) -> Params:
    """The parameter pytree as `jax.ShapeDtypeStruct`s: the layout `load_params` produces."""
    c = config
    dt = jnp_dtype(dtype or c.dtype)
    h, d, hq, hkv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads

    def s(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dt)

    layers = []
    for i in range(c.num_layers):
        attn = {"q": s(h, hq, d), "k": s(h, hkv, d), "v": s(h, hkv, d), "o": s(hq, d, h)}
        if c.attention_bias:
            attn.update(q_bias=s(hq, d), k_bias=s(hkv, d), v_bias=s(hkv, d))
        if c.o_proj_bias:
            attn["o_bias"] = s(h)
        if c.qk_norm:
            attn.update(q_norm=s(d), k_norm=s(d))
        layer = {"attn_norm": s(h), "attn": attn, "mlp_norm": s(h)}
        if c.is_moe_layer(i):
            e, inter = c.num_experts, c.moe_intermediate_size
            layer["moe"] = {"router": s(h, e), "w_gate": s(e, h, inter), "w_up": s(e, h, inter),
                            "w_down": s(e, inter, h)}
        else:
            inter = c.intermediate_size
            layer["mlp"] = {"gate": s(h, inter), "up": s(h, inter), "down": s(inter, h)}
        layers.append(layer)
    params: Params = {"embed": s(c.vocab_size, h), "layers": layers, "final_norm": s(h)}
    if not c.tie_word_embeddings:
        params["lm_head"] = s(h, c.vocab_size)
    return params


def init_kv_cache(config: ModelConfig, num_blocks: int, tokens_per_block: int, dtype: Any) -> KVCache:
    """Per layer (k, v), each [num_kv_heads, num_blocks, tokens_per_block, head_dim], zeroed."""
    shape = (config.num_kv_heads, num_blocks, tokens_per_block, config.head_dim)
    dt = jnp_dtype(dtype)
    return [(jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(config.num_layers)]


def kv_cache_bytes_per_token(config: ModelConfig, dtype: Any) -> int:
    """Bytes of K and V one token occupies across all layers."""
    itemsize = jnp.dtype(jnp_dtype(dtype)).itemsize
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


def _precision(config: ModelConfig) -> Optional[jax.lax.Precision]:
    # float32 models are run for exactness: keep GPUs from using TF32 for their matmuls.
    return jax.lax.Precision.HIGHEST if config.dtype == "float32" else None


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis in float32, scaled in the activation dtype (as HF does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def _attention(x: jax.Array, p: dict, cache: tuple[jax.Array, jax.Array], batch: StepBatch,
               cos: jax.Array, sin: jax.Array, *, config: ModelConfig, attention_fn: AttentionFn
               ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    prec = _precision(config)
    q = jnp.einsum("th,hnd->tnd", x, p["q"], precision=prec)
    k = jnp.einsum("th,hnd->tnd", x, p["k"], precision=prec)
    v = jnp.einsum("th,hnd->tnd", x, p["v"], precision=prec)
    if config.attention_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], config.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache, v_cache = write_kv(cache[0], cache[1], k, v, batch.slot_mapping)
    window = {} if config.sliding_window is None else {"sliding_window": config.sliding_window}
    out = attention_fn(q, k_cache, v_cache, batch.kv_lens, batch.block_tables, batch.cu_q_lens,
                       batch.num_seqs, sm_scale=config.head_dim ** -0.5, **window)
    y = jnp.einsum("tnd,ndh->th", out.astype(x.dtype), p["o"], precision=prec)
    if config.o_proj_bias:
        y = y + p["o_bias"]
    return y, (k_cache, v_cache)


def _mlp(x: jax.Array, p: dict, config: ModelConfig) -> jax.Array:
    prec = _precision(config)
    gate = jnp.einsum("th,hi->ti", x, p["gate"], precision=prec)
    up = jnp.einsum("th,hi->ti", x, p["up"], precision=prec)
    return jnp.einsum("ti,ih->th", jax.nn.silu(gate) * up, p["down"], precision=prec)


def decode_layers(params: Params, kv_cache: KVCache, batch: StepBatch, *, config: ModelConfig,
                  attention_fn: AttentionFn = ragged_paged_attention_reference,
                  moe_fn: MoeFn = moe_grouped_ffn_reference) -> tuple[jax.Array, KVCache]:
    """Embedding and all decoder layers: the residual stream [T, H] (before the final norm)."""
    if len(kv_cache) != config.num_layers:
        raise ValueError(f"kv_cache has {len(kv_cache)} layers, the model {config.num_layers}")
    x = params["embed"][batch.token_ids]
    cos, sin = rope_cos_sin(batch.positions, rope_inv_freq(config), x.dtype)
    num_tokens = batch.token_ids.shape[0]
    valid = jnp.arange(num_tokens, dtype=jnp.int32) < batch.cu_q_lens[batch.num_seqs[0]]
    new_cache: KVCache = []
    for i, (layer, cache) in enumerate(zip(params["layers"], kv_cache)):
        h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
        h, cache = _attention(h, layer["attn"], cache, batch, cos, sin, config=config, attention_fn=attention_fn)
        new_cache.append(cache)
        x = x + h
        h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
        if config.is_moe_layer(i):
            x = x + moe_block(h, layer["moe"], config=config, moe_fn=moe_fn, valid=valid)
        else:
            x = x + _mlp(h, layer["mlp"], config)
    return x, new_cache


def compute_logits(params: Params, residual: jax.Array, config: ModelConfig) -> jax.Array:
    """Final norm and LM head: float32 logits [N, V] for residual rows [N, H]."""
    h = rms_norm(residual, params["final_norm"], config.rms_norm_eps)
    prec = _precision(config)
    if config.tie_word_embeddings:
        return jnp.einsum("nh,vh->nv", h, params["embed"], precision=prec, preferred_element_type=jnp.float32)
    return jnp.einsum("nh,hv->nv", h, params["lm_head"], precision=prec, preferred_element_type=jnp.float32)


def forward(params: Params, kv_cache: KVCache, batch: StepBatch, *, config: ModelConfig,
            attention_fn: AttentionFn = ragged_paged_attention_reference,
            moe_fn: MoeFn = moe_grouped_ffn_reference) -> tuple[jax.Array, KVCache]:
    """One engine step: float32 logits [S, V] at `batch.logits_indices`, and the updated cache."""
    residual, kv_cache = decode_layers(params, kv_cache, batch, config=config,
                                       attention_fn=attention_fn, moe_fn=moe_fn)
    return compute_logits(params, residual[batch.logits_indices], config), kv_cache


def forward_all_logits(params: Params, kv_cache: KVCache, batch: StepBatch, *, config: ModelConfig,
                       attention_fn: AttentionFn = ragged_paged_attention_reference,
                       moe_fn: MoeFn = moe_grouped_ffn_reference) -> tuple[jax.Array, KVCache]:
    """Like `forward` but float32 logits for every token slot [T, V] (prompt scoring, tests)."""
    residual, kv_cache = decode_layers(params, kv_cache, batch, config=config,
                                       attention_fn=attention_fn, moe_fn=moe_fn)
    return compute_logits(params, residual, config), kv_cache
