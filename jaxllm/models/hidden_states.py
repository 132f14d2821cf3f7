"""The target model's hidden states for draft models, as a side output of the step's forward.

Speculative decoding's draft modules run on the target's hidden states: DeepSeek-V3's MTP
layers on the final residual before the final norm (`jaxllm.models.mtp`), EAGLE-3 heads on
the residual entering three of its layers (`jaxllm.models.eagle3`). `forward_with_hidden_states`
returns them for chosen packed tokens beside the logits; nothing is kept on an object, and the
plain `forward` traces exactly as without this option (see `layer_runner.LayerCapture`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax

from jaxllm.models.attention import AttentionFn, reference_attention
from jaxllm.models.decoder import compute_logits, decode_layers_capturing
from jaxllm.models.ep_moe import EpMoeOptions
from jaxllm.models.kv_cache_spec import KVCache
from jaxllm.models.layer_runner import LayerCapture
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.moe import MoeFn
from jaxllm.models.weights import Params
from jaxllm.step_batch import StepBatch
from pallas_kernels.moe_grouped_gemm.reference import moe_grouped_ffn_reference
from sharding.expert_load import MoeStepStats

_REFERENCE_ATTENTION = reference_attention()


class HiddenStatesOutput(NamedTuple):
    """What `forward_with_hidden_states` returns (a tuple, so jit returns it as is)."""

    logits: jax.Array  # float32 [S, V] at batch.logits_indices, as `forward`
    kv_cache: KVCache
    hidden: jax.Array  # [E, H] the final residual (before the final norm) at the chosen rows
    aux_hidden: Optional[jax.Array]  # [E, K, H] the residual entering each of aux_layers, or None
    moe_stats: Optional[MoeStepStats]  # with moe_stats=True (MoE models), else None


def forward_with_hidden_states(
    params: Params,
    kv_cache: KVCache,
    batch: StepBatch,
    rows: jax.Array,
    *,
    config: ModelConfig,
    aux_layers: tuple[int, ...] = (),
    attention_fn: AttentionFn = _REFERENCE_ATTENTION,
    moe_fn: MoeFn = moe_grouped_ffn_reference,
    mesh: Optional[jax.sharding.Mesh] = None,
    moe_options: Optional[EpMoeOptions] = None,
    moe_stats: bool = False,
) -> HiddenStatesOutput:
    """`forward` plus the hidden states draft models run on, at the packed tokens `rows`
    int32[E]: the final residual before the final norm [E, H] (DeepSeek-V3's MTP layers) and,
    with `aux_layers`, the residual entering each of those layers [E, len(aux_layers), H]
    (EAGLE-3's low/mid/high features, `jaxllm.models.eagle3.default_aux_layers`); with
    `moe_stats` also the step's MoE statistics. Returned, not kept anywhere; `forward` itself
    traces exactly as before."""
    capture = LayerCapture(rows, tuple(aux_layers)) if aux_layers else None
    residual, kv_cache, stats, aux = decode_layers_capturing(
        params,
        kv_cache,
        batch,
        config=config,
        attention_fn=attention_fn,
        moe_fn=moe_fn,
        mesh=mesh,
        moe_options=moe_options,
        capture=capture,
    )
    logits = compute_logits(params, residual[batch.logits_indices], config)
    return HiddenStatesOutput(logits, kv_cache, residual[rows], aux, stats if moe_stats else None)
