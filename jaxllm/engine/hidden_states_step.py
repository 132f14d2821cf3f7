"""The model step of a speculating runner whose drafter reads the target's hidden states.

`ModelRunner(return_hidden=True)` (MTP, EAGLE-3) runs this in place of its usual forward: the
same outputs (KV cache, logits, expert counts, context logits of `context_index`) plus every
packed token's final residual [T, H] before the final norm (MTP's input) or, with `aux_layers`,
the residuals entering those layers flattened to [T, K * H] (EAGLE-3's fused features), from
`jaxllm.models.hidden_states.forward_with_hidden_states`. Under attention DP the attention-DP
forward returns them itself (`forward_attention_dp(return_hidden=True)`, per rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import jax
import jax.numpy as jnp

from jaxllm.engine.host_transfer import PackedLayout
from jaxllm.engine.step_inputs import fed_step_inputs
from jaxllm.models import ModelConfig
from jaxllm.models.decoder import compute_logits
from jaxllm.models.ep_moe import EpMoeOptions
from jaxllm.models.hidden_states import forward_with_hidden_states


def hidden_states_step(
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
    aux_layers: tuple[int, ...],
):
    """(KV cache, float32 logits [S, V], expert counts or None, context logits or None, hidden)."""
    batch, context_index = fed_step_inputs(inputs, prev_tokens, layout)
    rows = jnp.arange(batch.token_ids.shape[0], dtype=jnp.int32)
    out = forward_with_hidden_states(
        params,
        kv_cache,
        batch,
        rows,
        config=model_config,
        aux_layers=aux_layers,
        attention_fn=attention_fn,
        moe_fn=moe_fn,
        mesh=mesh,
        moe_options=moe_options,
        moe_stats=moe_stats,
    )
    context = None if context_index is None else compute_logits(params, out.hidden[context_index], model_config)
    if moe_stats and out.moe_stats is None:
        raise ValueError("MoE statistics asked of a forward that has none (no MoE layers)")
    counts = out.moe_stats.expert_counts if moe_stats and out.moe_stats is not None else None
    hidden = out.hidden if out.aux_hidden is None else out.aux_hidden.reshape(out.aux_hidden.shape[0], -1)
    return out.kv_cache, out.logits.astype(jnp.float32), counts, context, hidden
