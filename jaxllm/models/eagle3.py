"""The EAGLE-3 draft head's forward: one decoder layer over the target's fused hidden states.

At position i the head takes the target's hidden states entering three of its layers (low,
mid, high: `default_aux_layers`, as SGLang and vLLM pick them; TensorRT-LLM names the outputs
of the layers before, the same tensors) and the embedding of the next token t_{i+1}:

    h = fc([h_low; h_mid; h_high])                       [3 Ht] -> [H] (first step only)
    a = attention([input_layernorm(embed(t_{i+1})); hidden_norm(h)])    q/k/v over 2H
    x = h + a;  x = x + mlp(post_attention_layernorm(x))
    draft logits(t_{i+2}) = lm_head(norm(x))             over the draft vocabulary [Vd]
    target id = draft id + d2t[draft id]

and x (before `norm`) is the hidden state the next draft step is fed instead of the fused
features (no `fc` then). The target gives the features through
`jaxllm.models.hidden_states.forward_with_hidden_states(aux_layers=...)`; the embedding is the
head's own when its checkpoint has one, else the target's. The head's keys and values live
in its own one-layer page pool (`init_eagle3_kv_cache`), addressed by the target's block ids
and positions, through the same attention backends as the target's layers
(`jaxllm.models.decoder.attention_block`). Weights: `jaxllm.models.eagle3_weights`.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxllm.models.attention import AttentionFn, AttentionMetadata, reference_attention
from jaxllm.models.decoder import attention_backends, attention_block, mlp_block
from jaxllm.models.draft_chain import chain_drafts
from jaxllm.models.eagle3_weights import Eagle3Config
from jaxllm.models.kv_cache_spec import init_kv_cache
from jaxllm.models.numerics import matmul_precision, rms_norm
from jaxllm.models.quantization import qeinsum
from jaxllm.models.rope import rope_cos_sin, rope_inv_freq
from jaxllm.models.weights import Params
from jaxllm.step_batch import StepBatch
from pallas_kernels.moe_grouped_gemm.reference import moe_grouped_ffn_reference

_REFERENCE_ATTENTION = reference_attention()


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose input EAGLE-3 fuses: 2, L // 2 and L - 3."""
    if num_layers < 5:
        raise ValueError(f"EAGLE-3's default feature layers need a target of at least 5 layers, got {num_layers}")
    return (2, num_layers // 2, num_layers - 3)


def aux_layers_for(config: Eagle3Config, target_num_layers: int) -> tuple[int, ...]:
    """The head's own feature layers (its config's `eagle_aux_hidden_state_layer_ids`) or the default."""
    layers = config.aux_layers if config.aux_layers is not None else default_aux_layers(target_num_layers)
    if len(layers) != 3:
        raise ValueError(f"EAGLE-3 fuses 3 target layers, the config names {len(layers)}: {list(layers)}")
    if max(layers) >= target_num_layers:
        raise ValueError(f"EAGLE-3 feature layers {list(layers)} past the target's {target_num_layers} layers")
    return tuple(layers)


def init_eagle3_kv_cache(
    config: Eagle3Config, num_blocks: int, tokens_per_block: int, dtype: Any, mesh: Optional[jax.sharding.Mesh] = None
) -> Any:
    """The head's zeroed K/V pages (one layer), the same block ids as the target's cache."""
    return init_kv_cache(config.model, num_blocks, tokens_per_block, dtype, mesh)


def draft_to_target(params: Params, draft_ids: jax.Array) -> jax.Array:
    """Draft-vocabulary ids to target ids (`d2t` holds the offsets)."""
    return draft_ids + params["d2t"][draft_ids]


def eagle3_forward(
    params: Params,
    target_embed: jax.Array,
    cache: Any,
    batch: StepBatch,
    hidden: jax.Array,
    *,
    config: Eagle3Config,
    attention_fn: AttentionFn = _REFERENCE_ATTENTION,
    mesh: Optional[jax.sharding.Mesh] = None,
) -> tuple[jax.Array, jax.Array, Any]:
    """One head step over a packed batch: `batch.token_ids` the next tokens t_{i+1} at
    `batch.positions` i; `hidden` [T, 3 Ht] the target's fused features (concatenated low,
    mid, high) or [T, H] a previous step's output. Returns float32 draft-vocabulary logits
    [S, Vd] at `batch.logits_indices`, the head's hidden states [T, H] and its cache."""
    c = config.model
    eps, prec = c.rms_norm_eps, matmul_precision(c)
    p = params["layer"]
    if hidden.shape[-1] == 3 * config.target_hidden_size and hidden.shape[-1] != c.hidden_size:
        hidden = qeinsum("tf,fh->th", hidden.astype(params["fc"].dtype), params["fc"], precision=prec)
    elif hidden.shape[-1] != c.hidden_size:
        raise ValueError(
            f"EAGLE-3 hidden input of width {hidden.shape[-1]}: expected 3 x {config.target_hidden_size} "
            f"(fused target features) or {c.hidden_size} (a previous step's)"
        )
    embeds = params.get("embed", target_embed)[batch.token_ids].astype(hidden.dtype)
    layer_cache = cache if not isinstance(cache, list) else cache[0]
    attention, write_fn, _ = attention_backends(c, layer_cache, attention_fn, moe_grouped_ffn_reference, mesh)
    cos, sin = rope_cos_sin(batch.positions, rope_inv_freq(c), hidden.dtype)
    x = jnp.concatenate([rms_norm(embeds, p["embed_norm"], eps), rms_norm(hidden, p["hidden_norm"], eps)], axis=-1)
    a, layer_cache = attention_block(
        x,
        p["attn"],
        layer_cache,
        AttentionMetadata.from_batch(batch),
        cos,
        sin,
        config=c,
        attention_fn=attention,
        write_fn=write_fn,
    )
    x = hidden + a
    x = x + mlp_block(rms_norm(x, p["mlp_norm"], eps), p["mlp"], c)
    h = rms_norm(x[batch.logits_indices], params["norm"], eps)
    logits = jnp.einsum("nh,hv->nv", h, params["lm_head"], precision=prec, preferred_element_type=jnp.float32)
    return logits, x, (layer_cache if not isinstance(cache, list) else [layer_cache])


def eagle3_draft(
    params: Params,
    target_embed: jax.Array,
    cache: Any,
    batch: StepBatch,
    features: jax.Array,
    num_draft_tokens: int,
    *,
    config: Eagle3Config,
    attention_fn: AttentionFn = _REFERENCE_ATTENTION,
    mesh: Optional[jax.sharding.Mesh] = None,
    return_logits: bool = False,
    own_blocks_only: bool = False,
) -> tuple[jax.Array, Any, Optional[jax.Array]]:
    """A greedy chain of `num_draft_tokens` drafts per sequence, as target ids int32 [S, k],
    from the target's fused features [T, 3 Ht] (see `draft_chain.chain_drafts`, also for
    `own_blocks_only`); the head's cache, and with `return_logits` the draft-vocabulary logits
    [S, k, Vd]."""
    pages = jax.tree_util.tree_leaves(cache)[0]  # [Hkv', blocks, tokens_per_block, D]

    def step(cache: Any, b: StepBatch, h: jax.Array, j: int) -> tuple[jax.Array, jax.Array, Any]:
        return eagle3_forward(params, target_embed, cache, b, h, config=config, attention_fn=attention_fn, mesh=mesh)

    return chain_drafts(
        step,
        cache,
        batch,
        features,
        num_draft_tokens,
        tokens_per_block=int(pages.shape[2]),
        num_blocks=int(pages.shape[1]),
        to_target=lambda ids: draft_to_target(params, ids),
        return_logits=return_logits,
        own_blocks_only=own_blocks_only,
    )
