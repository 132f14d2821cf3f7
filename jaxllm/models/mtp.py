"""DeepSeek-V3's multi-token-prediction (MTP) layers: the draft module of MTP speculative decoding.

A DeepSeek-V3 / R1 checkpoint carries `num_nextn_predict_layers` MTP layers after its decoder
layers (`model.layers.{num_hidden_layers + j}`); `load_params(load_mtp=True)` reads them into
`params["mtp"][j]` (`jaxllm.models.weights`, `jaxllm.models.deepseek_weights.declare_mtp_extras`).
MTP layer j at position i takes the target's final hidden state h_i (before the final norm)
and the embedding of the next token t_{i+1}:

    x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])        [2H] -> [H]
    x = decoder_layer(x)                                     MLA attention + MoE, as layer L + j
    logits(t_{i+2}) = lm_head(shared_head.norm(x))           the main model's LM head

and x (before shared_head.norm) is the hidden state the next draft step is fed. The embedding
and LM head are the main model's (the checkpoint's copies are not read).

Cache: the MTP layers have their own latent pages, one pool of `num_nextn_predict_layers`
layers (`init_mtp_kv_cache`) addressed by the same block ids and positions as the target's
(MTP position i holds the entry of (h_i, t_{i+1})); its bytes per token are
`mtp_kv_cache_spec(config).bytes_per_token()`. The decoder layer is the target's own layer
function (`jaxllm.models.deepseek.mla_decoder_layer`), so every attention and MoE backend,
tensor parallelism and FP8 weights work as in the target.

`mtp_draft` chains k steps (`jaxllm.models.draft_chain`), step j running MTP layer
min(j, num_nextn_predict_layers - 1): with the published one layer, every step runs it
(TensorRT-LLM's MTP-Eagle).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxllm.kv_cache.spec import MlaKvCacheSpec, MlaLayerCache
from jaxllm.models.attention import AttentionFn, reference_attention
from jaxllm.models.deepseek import mla_decoder_layer, mla_step
from jaxllm.models.draft_chain import chain_drafts
from jaxllm.models.ep_moe import EpMoeOptions
from jaxllm.models.layer_runner import layer_metadata
from jaxllm.models.model_config import ModelConfig, numpy_dtype
from jaxllm.models.moe import MoeFn, quantized_moe_fn
from jaxllm.models.numerics import matmul_precision, rms_norm
from jaxllm.models.partitioning import rules_for
from jaxllm.models.quantization import qeinsum
from jaxllm.models.weights import Params
from jaxllm.step_batch import StepBatch
from pallas_kernels.moe_grouped_gemm.reference import moe_grouped_ffn_reference

_REFERENCE_ATTENTION = reference_attention()


def mtp_kv_cache_spec(config: ModelConfig, dtype: Any = None) -> MlaKvCacheSpec:
    """The MTP layers' latent cache layout (one layer per MTP layer)."""
    _check_mtp(config)
    dtype = str(numpy_dtype(dtype or config.dtype))
    return MlaKvCacheSpec(config.num_nextn_predict_layers, config.kv_lora_rank, config.qk_rope_head_dim, dtype)


def init_mtp_kv_cache(
    config: ModelConfig, num_blocks: int, tokens_per_block: int, dtype: Any, mesh: Optional[jax.sharding.Mesh] = None
) -> MlaLayerCache:
    """Zeroed MTP latent pages: one pool of `num_blocks` pages per MTP layer, the same block ids
    as the target's cache."""
    rules = None if mesh is None else rules_for(config, mesh)
    return mtp_kv_cache_spec(config, dtype).init_pool(num_blocks, tokens_per_block, mesh, rules)


def _check_mtp(config: ModelConfig) -> None:
    if not config.is_mla or not config.num_nextn_predict_layers:
        raise ValueError(
            f"{config.architecture} config has no multi-token-prediction layers (num_nextn_predict_layers)"
        )


def mtp_logits(params: Params, hidden: jax.Array, config: ModelConfig, layer: int = 0) -> jax.Array:
    """The shared head: float32 logits [N, V] of MTP hidden rows [N, H] (shared_head.norm, then
    the main model's LM head)."""
    h = rms_norm(hidden, params["mtp"][layer]["head_norm"], config.rms_norm_eps)
    prec = matmul_precision(config)
    if config.tie_word_embeddings:
        return jnp.einsum("nh,vh->nv", h, params["embed"], precision=prec, preferred_element_type=jnp.float32)
    return jnp.einsum("nh,hv->nv", h, params["lm_head"], precision=prec, preferred_element_type=jnp.float32)


def mtp_forward(
    params: Params,
    mtp_cache: MlaLayerCache,
    batch: StepBatch,
    hidden: jax.Array,
    *,
    config: ModelConfig,
    layer: int = 0,
    attention_fn: AttentionFn = _REFERENCE_ATTENTION,
    moe_fn: MoeFn = moe_grouped_ffn_reference,
    mesh: Optional[jax.sharding.Mesh] = None,
    moe_options: Optional[EpMoeOptions] = None,
    slot_moe_layer: Optional[Callable] = None,
) -> tuple[jax.Array, jax.Array, MlaLayerCache]:
    """MTP layer `layer` over a packed batch: `batch.token_ids` are the next tokens t_{i+1} at
    `batch.positions` i, `hidden` [T, H] the hidden states h_i fed in (the target's before its
    final norm, or a previous MTP step's). Returns float32 logits [S, V] at
    `batch.logits_indices` (for t_{i+2}), the MTP hidden states [T, H] and the MTP cache.
    `slot_moe_layer`: attention data parallelism's MoE layer (`deepseek.MlaStep.slot_moe_layer`)."""
    _check_mtp(config)
    if not 0 <= layer < config.num_nextn_predict_layers:
        raise ValueError(f"MTP layer {layer} out of range [0, {config.num_nextn_predict_layers})")
    if "mtp" not in params:
        raise ValueError("params hold no MTP layers: load them with load_params(..., load_mtp=True)")
    p = params["mtp"][layer]
    eps, prec = config.rms_norm_eps, matmul_precision(config)
    embeds = params["embed"][batch.token_ids]
    fused = jnp.concatenate(
        [rms_norm(embeds, p["enorm"], eps), rms_norm(hidden.astype(embeds.dtype), p["hnorm"], eps)], -1
    )
    x = qeinsum("tc,ch->th", fused, p["eh_proj"], precision=prec)
    step = mla_step(
        batch,
        mtp_cache.latent.dtype,
        x.dtype,
        config=config,
        attention_fn=attention_fn,
        moe_fn=quantized_moe_fn(moe_fn, config),
        mesh=mesh,
        moe_options=moe_options,
        slot_moe_layer=slot_moe_layer,
    )
    num_layers = config.num_nextn_predict_layers
    pool_pages, tokens_per_block = mtp_cache.latent.shape[0], mtp_cache.latent.shape[1]
    if pool_pages % num_layers:
        raise ValueError(f"an MTP page pool of {pool_pages} pages does not split over {num_layers} MTP layers")
    md = layer_metadata(step.md, layer, pool_pages // num_layers, tokens_per_block, num_layers)
    x, mtp_cache, _, _ = mla_decoder_layer(x, p, mtp_cache, md, step, f"mtp {layer}")
    return mtp_logits(params, x[batch.logits_indices], config, layer), x, mtp_cache


def mtp_draft(
    params: Params,
    mtp_cache: MlaLayerCache,
    batch: StepBatch,
    hidden: jax.Array,
    num_draft_tokens: int,
    *,
    config: ModelConfig,
    attention_fn: AttentionFn = _REFERENCE_ATTENTION,
    moe_fn: MoeFn = moe_grouped_ffn_reference,
    mesh: Optional[jax.sharding.Mesh] = None,
    moe_options: Optional[EpMoeOptions] = None,
    return_logits: bool = False,
    own_blocks_only: bool = False,
    slot_moe_layer: Optional[Callable] = None,
) -> tuple[jax.Array, MlaLayerCache, Optional[jax.Array]]:
    """`num_draft_tokens` greedy drafts per sequence, int32 [S, k], from `batch` (next tokens at
    the target's positions) and the target's hidden states `hidden` [T, H]; see
    `draft_chain.chain_drafts` (`own_blocks_only`: as there; `slot_moe_layer`: as in
    `mtp_forward`). Returns the drafts, the MTP cache and optionally their logits."""
    pool_pages, tokens_per_block = mtp_cache.latent.shape[0], mtp_cache.latent.shape[1]
    num_layers = max(config.num_nextn_predict_layers, 1)

    def step(cache: MlaLayerCache, b: StepBatch, h: jax.Array, j: int) -> tuple[jax.Array, jax.Array, MlaLayerCache]:
        return mtp_forward(
            params,
            cache,
            b,
            h,
            config=config,
            layer=min(j, num_layers - 1),
            attention_fn=attention_fn,
            moe_fn=moe_fn,
            mesh=mesh,
            moe_options=moe_options,
            slot_moe_layer=slot_moe_layer,
        )

    return chain_drafts(
        step,
        mtp_cache,
        batch,
        hidden,
        num_draft_tokens,
        tokens_per_block=tokens_per_block,
        num_blocks=pool_pages // num_layers,
        return_logits=return_logits,
        own_blocks_only=own_blocks_only,
    )
