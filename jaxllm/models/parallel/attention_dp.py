"""Attention data parallelism: each device its own requests and KV cache, the MoE layers shared.

With `enable_attention_dp` the N devices of the mesh (its `expert` x `tensor` axes, E x T,
rank d = e * T + t) are N attention-DP ranks. TensorRT-LLM's semantics: each rank runs
attention for its own requests over its own KV cache (its own block pool, its own
max_batch_size and max_num_tokens), and the MoE layers stay expert x tensor parallel over
all N devices, the tokens of every rank dispatched together.

Layout (SPMD, one program for all ranks):

- The step's inputs carry a leading rank axis split over the devices: every `StepBatch`
  field is [D, ...] (tokens [D, T_rank], sequences [D, S_rank]), the same token bucket on
  every rank (the largest any rank needs this step). Built on the host by
  `jaxllm.engine.ranked_planner`; the step plan stays plain numpy.
- The KV cache of each layer is [D, Hkv, blocks, tokens_per_block, head_dim] split over
  the devices on its leading axis: device d holds rank d's block pool, every KV head. With
  multi-head latent attention (DeepSeek-V3) it is the latent cache [D, blocks,
  tokens_per_block, kv_lora_rank + qk_rope_head_dim], split the same way.
- Attention (MLA's projections too), dense and embedding weights are replicated (no head or
  column split), the
  experts are stored as slots split over `expert` with their FFN columns over `tensor`,
  as under plain expert parallelism (`jaxllm.models.partitioning.attention_dp_rules`).
  Quantized weights (FP8, GGUF, AWQ / GPTQ) keep their scales beside their values: the
  replicated ones run as on one device, each device dequantizes its own expert shares.
- The whole decoder runs under one `shard_map` (`forward_attention_dp`): each device
  runs the single-device layers on its own batch, and each MoE layer
  (`dp_moe_layer`) starts from tokens that are already split over the devices. The T
  devices of an expert group first gather their tokens (all_gather over `tensor`, so the
  group holds the same rows, as the MoE tensor split needs), route them, dispatch them
  over `expert` exactly as `jaxllm.models.ep_moe` does (all_to_all, allgather + local slots
  + reduce-scatter, or ragged_all_to_all), and a reduce-scatter over `tensor` both sums the column partials and
  hands every device back its own tokens. No device ever holds the global token batch.
- Replica choice stays the global round robin of `sharding.slot_table.choose_slots`: the
  per-expert row counts of the earlier ranks (one all_gather of int32[E] per layer) offset
  each rank's occurrences. Expert counts for statistics are those counts summed.
- The ranks and their partition spec are `sharding.dp_ranks`; each rank's block pool is
  `jaxllm.models.kv_cache_spec.init_dp_kv_cache`.
- Logits come back [D * S_rank, V] in rank-major rows: sampler row d * S_rank + i is
  sequence i of rank d, and the overlap scheduler's feed index names those global rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.kv_cache.spec import MhaLayerCache, MlaLayerCache
from jaxllm.models.decoder import compute_logits, decode_layers_capturing
from jaxllm.models.ep_moe import EpMoeOptions, dispatch_body, expert_rows_operands
from jaxllm.models.layer_runner import LayerCapture
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.moe import MoeFn, quantized_moe_fn, route_layer
from jaxllm.step_batch import StepBatch
from sharding.dp_ranks import RANK_SPEC
from sharding.expert_load import MoeStepStats, count_experts
from sharding.mesh import EXPERT_AXIS, TENSOR_AXIS
from sharding.slot_table import SlotTable, choose_slots


def dp_moe_layer(
    h: jax.Array,
    p: dict,
    valid: jax.Array,
    *,
    config: ModelConfig,
    moe_fn: MoeFn,
    options: EpMoeOptions,
    ep: int,
    moe_tp: int,
    global_tokens: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One MoE layer inside the attention-DP shard_map, on this device's tokens h [T_rank, H]:
    (output [T_rank, H], global expert counts int32[E], dropped rows int32[])."""
    table: SlotTable = p["slots"]
    x, ok = h, valid
    if moe_tp > 1:  # the expert group's T devices work on the same rows
        x = jax.lax.all_gather(h, TENSOR_AXIS, axis=0, tiled=True)
        ok = jax.lax.all_gather(valid, TENSOR_AXIS, axis=0, tiled=True)
    weights, ids = route_layer(x, p, config)  # softmax top-k, or DeepSeek-V3's grouped sigmoid
    group_counts = count_experts(ids, config.num_experts, ok)
    if ep > 1:
        by_rank = jax.lax.all_gather(group_counts, EXPERT_AXIS)  # [ep, E]
        before = jnp.arange(ep)[:, None] < jax.lax.axis_index(EXPERT_AXIS)
        offset = jnp.sum(jnp.where(before, by_rank, 0), axis=0)
        counts = jnp.sum(by_rank, axis=0).astype(jnp.int32)
    else:
        offset, counts = None, group_counts
    slots = choose_slots(ids, table, ok, occurrence_offset=offset)
    # This device's slots and columns: quantized experts are dequantized here, their scales being
    # split like their values (`attention_dp_rules` checks the columns are whole scale blocks).
    x, experts, rows_ffn = expert_rows_operands(x, p, moe_fn, moe_tp=1)
    body = dispatch_body(options, global_tokens, rows_ffn=rows_ffn, ep=ep, moe_tp=1)
    out, dropped = body(x, slots, weights, *experts)
    if moe_tp > 1:  # sum the column partials, each device keeps its own rows
        out = jax.lax.psum_scatter(out, TENSOR_AXIS, scatter_dimension=0, tiled=True)
    return out.astype(h.dtype), counts, dropped[0]


def dp_slot_moe_layer(
    config: ModelConfig, moe_fn: MoeFn, mesh: jax.sharding.Mesh, options: EpMoeOptions | None = None
) -> Callable[[jax.Array, dict, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]:
    """The MoE layer the decoder layers run inside the attention-DP shard_map: `dp_moe_layer`
    over every rank's tokens (as many per rank as the calling device's: a forward's token
    bucket, or a drafter's rows)."""
    ep, moe_tp = int(mesh.shape[EXPERT_AXIS]), int(mesh.shape[TENSOR_AXIS])
    layer_fn = quantized_moe_fn(moe_fn, config)  # as `decode_layers` hands its MoE layers

    def layer(h: jax.Array, p: dict, valid: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return dp_moe_layer(
            h,
            p,
            valid,
            config=config,
            moe_fn=layer_fn,
            options=options or EpMoeOptions(),
            ep=ep,
            moe_tp=moe_tp,
            global_tokens=ep * moe_tp * h.shape[0],
        )

    return layer


def forward_attention_dp(
    params: Any,
    kv_cache: list[MhaLayerCache] | list[MlaLayerCache],
    batch: StepBatch,
    *,
    config: ModelConfig,
    attention_fn: Callable,
    moe_fn: MoeFn,
    mesh: jax.sharding.Mesh,
    param_specs: Any,
    moe_options: EpMoeOptions | None = None,
    context_index: jax.Array | None = None,
    return_hidden: bool = False,
    aux_layers: tuple[int, ...] = (),
) -> tuple[
    jax.Array, list[MhaLayerCache] | list[MlaLayerCache], MoeStepStats | None, jax.Array | None, jax.Array | None
]:
    """One step over the stacked per-rank `batch` ([D, ...] fields): float32 logits
    [D * S_rank, V] (rank-major rows), the updated caches, the MoE statistics, and with
    `context_index` int32[D, E_rank] (each rank's packed token indices) those tokens' float32
    logits [D * E_rank, V] (rank-major; speculative decoding's verification rows), else None;
    with `return_hidden` every packed token's final residual [D, T_rank, H] (split over the
    devices like the batch: what the MTP layers draft from), or with `aux_layers` the residuals
    entering those layers, flattened [D, T_rank, K * H] (EAGLE-3's features), else None."""
    options = moe_options or EpMoeOptions()
    moe_layer = dp_slot_moe_layer(config, moe_fn, mesh, options)
    has_moe = any(config.is_moe_layer(i) for i in range(config.num_layers))

    def body(params_, cache_, batch_, context_index_):
        local = jax.tree.map(lambda a: a[0], batch_)
        cache_local = jax.tree.map(lambda a: a[0], cache_)
        num_tokens = local.token_ids.shape[0]
        capture = LayerCapture(jnp.arange(num_tokens, dtype=jnp.int32), aux_layers) if aux_layers else None
        x, new_cache, stats, aux = decode_layers_capturing(
            params_,
            cache_local,
            local,
            config=config,
            attention_fn=attention_fn,
            moe_fn=moe_fn,
            mesh=None,
            moe_options=options,
            slot_moe_layer=moe_layer,
            capture=capture,
        )
        logits = compute_logits(params_, x[local.logits_indices], config).astype(jnp.float32)
        counts = stats.expert_counts if stats is not None else jnp.zeros((0, 0), jnp.int32)
        dropped = stats.dropped_rows if stats is not None else jnp.zeros((0,), jnp.int32)
        context = None
        if context_index_ is not None:
            context = compute_logits(params_, x[context_index_[0]], config).astype(jnp.float32)[None]
        hidden = None
        if return_hidden:
            hidden = (x if aux is None else aux.reshape(num_tokens, -1))[None]
        return logits[None], jax.tree.map(lambda a: a[None], new_cache), counts, dropped, context, hidden

    cache_specs = jax.tree.map(lambda _: RANK_SPEC, kv_cache)
    batch_specs = jax.tree.map(lambda _: RANK_SPEC, batch)
    context_spec = None if context_index is None else RANK_SPEC
    hidden_spec = RANK_SPEC if return_hidden else None
    logits, kv_cache, counts, dropped, context, hidden = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(param_specs, cache_specs, batch_specs, context_spec),
        out_specs=(RANK_SPEC, cache_specs, P(), P(), context_spec, hidden_spec),
        check_vma=False,
    )(params, kv_cache, batch, context_index)
    # The sampler sees every row (as under tensor parallelism, where the logits are gathered too).
    replicated = NamedSharding(mesh, P())
    logits = jax.lax.with_sharding_constraint(logits.reshape(-1, logits.shape[2]), replicated)
    if context is not None:
        context = jax.lax.with_sharding_constraint(context.reshape(-1, context.shape[2]), replicated)
    return logits, kv_cache, MoeStepStats(counts, dropped) if has_moe else None, context, hidden


def stack_batches(batches: list[StepBatch]) -> StepBatch:
    """Per-rank host batches of one token bucket -> one StepBatch with a leading rank axis."""
    names = StepBatch.__dataclass_fields__
    return StepBatch(
        **{
            name: None
            if getattr(batches[0], name) is None  # optional inputs left out (LoRA)
            else np.stack([getattr(b, name) for b in batches])
            for name in names
        }
    )
