"""The model forward of one engine step, as the runner compiles it (one program per layout).

The packed step inputs are unpacked and fed (`jaxllm.engine.step_inputs`), the model runs
(plain, with MoE statistics, with the logits of chosen packed tokens, attention-DP, or with
the hidden states a drafter reads: `jaxllm.engine.hidden_states_step`), and each row's greedy
token comes back padded to the runner's sampler rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxllm.engine.hidden_states_step import hidden_states_step
from jaxllm.engine.host_transfer import PackedLayout
from jaxllm.engine.step_inputs import fed_step_inputs
from jaxllm.models import ModelConfig, forward
from jaxllm.models.decoder import decode_layers, decode_layers_with_moe_stats, forward_with_moe_stats, forward_with_rows
from jaxllm.models.ep_moe import EpMoeOptions
from jaxllm.models.lm_head_argmax import greedy_tokens
from jaxllm.models.parallel.attention_dp import forward_attention_dp
from jaxllm.sampling.sampler import first_argmax
from sharding.expert_load import MoeStepStats


def model_forward_step(
    params,
    kv_cache,
    inputs: tuple,
    prev_tokens,
    *,
    layout: PackedLayout,
    model_config: ModelConfig,
    attention_fn: Callable,
    moe_fn: Callable,
    mesh: jax.sharding.Mesh,
    moe_options: Optional[EpMoeOptions] = None,
    moe_stats: bool = False,
    attention_dp_specs: Any = None,
    fed_rows: int = 0,
    return_hidden: bool = False,
    aux_layers: tuple[int, ...] = (),
    fused_argmax: bool = False,
):
    """Model forward of one step: (updated KV cache, float32 logits [S, V] of each sequence,
    with `moe_stats` the step's expert counts int32 [num_moe_layers, num_experts] else None,
    the context logits [E, V] of the packed tokens `context_index` when the inputs carry
    one (the variant for steps where a request asks for its prompt's logits) else None,
    and each row's greedy token int32 [S], the sampler's own argmax, so that a step whose
    rows all decode greedily with no processing needs no sampler program).
    `attention_dp_specs` (the parameters' partition specs) selects the attention-DP forward:
    the batch then has a leading rank axis and the logits are [ranks * S, V]. The greedy
    tokens are padded to `fed_rows` rows (the runner's sampler rows), the shape every forward
    takes its fed tokens in, whichever bucket of rows ran. With `return_hidden` a sixth output:
    every packed token's final residual [T, H] (what DeepSeek-V3's MTP layers draft from), or
    with `aux_layers` the residuals entering those layers, flattened [T, K * H] (EAGLE-3's); under
    attention DP with a leading rank axis ([ranks, T_rank, ...], split over the devices).
    `fused_argmax` (the variant of greedy-only steps, `jaxllm.models.lm_head_argmax`): the
    greedy tokens come from the LM head chunk by chunk and the logits output is None, no
    float32 [S, V] written; not with attention DP, `return_hidden` or context logits."""
    common = dict(
        layout=layout,
        model_config=model_config,
        attention_fn=attention_fn,
        moe_fn=moe_fn,
        mesh=mesh,
        moe_options=moe_options,
        moe_stats=moe_stats,
    )
    if fused_argmax:
        if attention_dp_specs is not None or return_hidden:
            raise ValueError("the fused LM-head argmax has no attention-DP or hidden-state variant")
        kv_cache, counts, tokens = _greedy_step(params, kv_cache, inputs, prev_tokens, **common)
        return kv_cache, None, counts, None, pad_rows(tokens, fed_rows)
    if return_hidden and attention_dp_specs is None:
        kv_cache, logits, counts, context, hidden = hidden_states_step(
            params, kv_cache, inputs, prev_tokens, aux_layers=aux_layers, **common
        )
        return kv_cache, logits, counts, context, pad_rows(first_argmax(logits), fed_rows), hidden
    kv_cache, logits, counts, context, hidden = _model_step(
        params,
        kv_cache,
        inputs,
        prev_tokens,
        attention_dp_specs=attention_dp_specs,
        return_hidden=return_hidden,
        aux_layers=aux_layers,
        **common,
    )
    greedy = pad_rows(first_argmax(logits), fed_rows)
    return (kv_cache, logits, counts, context, greedy) + ((hidden,) if return_hidden else ())


def pad_rows(tokens: jax.Array, rows: int) -> jax.Array:
    """int32[S] tokens as int32[max(S, rows)] (a small decode bucket's tokens, padded with 0)."""
    return jnp.pad(tokens, (0, max(0, rows - tokens.shape[0])))


def _greedy_step(
    params,
    kv_cache,
    inputs: tuple,
    prev_tokens,
    *,
    layout: PackedLayout,
    model_config: ModelConfig,
    attention_fn: Callable,
    moe_fn: Callable,
    mesh: jax.sharding.Mesh,
    moe_options: Optional[EpMoeOptions],
    moe_stats: bool,
):
    """(KV cache, expert counts or None, each row's greedy token int32 [S]) of the layers and
    the fused LM-head argmax (`greedy_tokens`): the same layers as `_model_step`'s forward."""
    batch, context_index = fed_step_inputs(inputs, prev_tokens, layout)
    if context_index is not None:
        raise ValueError("a step returning context logits needs the full-logits forward, not the fused argmax")
    kwargs: dict[str, Any] = dict(
        config=model_config, attention_fn=attention_fn, moe_fn=moe_fn, mesh=mesh, moe_options=moe_options
    )
    counts = None
    if moe_stats:
        residual, kv_cache, stats = decode_layers_with_moe_stats(params, kv_cache, batch, **kwargs)
        counts = _expert_counts(stats)
    else:
        residual, kv_cache = decode_layers(params, kv_cache, batch, **kwargs)
    return kv_cache, counts, greedy_tokens(params, residual[batch.logits_indices], model_config)


def _model_step(
    params,
    kv_cache,
    inputs: tuple,
    prev_tokens,
    *,
    layout: PackedLayout,
    model_config: ModelConfig,
    attention_fn: Callable,
    moe_fn: Callable,
    mesh: jax.sharding.Mesh,
    moe_options: Optional[EpMoeOptions],
    moe_stats: bool,
    attention_dp_specs: Any,
    return_hidden: bool = False,
    aux_layers: tuple[int, ...] = (),
):
    batch, context_index = fed_step_inputs(inputs, prev_tokens, layout)
    if attention_dp_specs is not None:
        logits, kv_cache, stats, context, hidden = forward_attention_dp(
            params,
            kv_cache,
            batch,
            config=model_config,
            attention_fn=attention_fn,
            moe_fn=moe_fn,
            mesh=mesh,
            param_specs=attention_dp_specs,
            moe_options=moe_options,
            context_index=context_index,
            return_hidden=return_hidden,
            aux_layers=aux_layers,
        )
        return kv_cache, logits, _expert_counts(stats) if moe_stats else None, context, hidden
    kwargs: dict[str, Any] = dict(
        config=model_config, attention_fn=attention_fn, moe_fn=moe_fn, mesh=mesh, moe_options=moe_options
    )
    if context_index is not None:
        logits, context, kv_cache, stats = forward_with_rows(
            params, kv_cache, batch, context_index, moe_stats=moe_stats, **kwargs
        )
        return kv_cache, logits.astype(jnp.float32), _expert_counts(stats) if moe_stats else None, context, None
    if moe_stats:
        logits, kv_cache, stats = forward_with_moe_stats(params, kv_cache, batch, **kwargs)
        return kv_cache, logits.astype(jnp.float32), stats.expert_counts, None, None
    logits, kv_cache = forward(params, kv_cache, batch, **kwargs)
    return kv_cache, logits.astype(jnp.float32), None, None, None


def _expert_counts(stats: Optional[MoeStepStats]) -> jax.Array:
    if stats is None:
        raise ValueError("MoE statistics asked of a forward that has none (no MoE layers)")
    return stats.expert_counts
