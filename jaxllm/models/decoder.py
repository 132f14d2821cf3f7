"""The decoder forward pass over a packed `StepBatch` and a paged KV cache.

One implementation covers Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral: they differ only in
flags of `ModelConfig` (q/k norm, q/k/v biases, sparse layers, RoPE scaling, window).
DeepSeek-V3 (multi-head latent attention, grouped routing, shared experts) has its own
layer function in `jaxllm.models.deepseek`, entered from here and run by the same
`run_layers` of `jaxllm.models.layer_runner` (stacks under scan over a latent page pool).
Parameters are a plain pytree passed to the step as an argument; its layout, shapes and
logical axes are declared once in `jaxllm.models.weights`.

Attention and the grouped expert FFN are passed in as functions so kernel backends plug
in without touching the model; the KV cache is built by a `KvCacheSpec`
(`jaxllm.models.kv_cache_spec`),
written through the spec and read only by the attention backend.

Depth (`ModelConfig.scan_layers`, on by default): runs of consecutive layers of one kind
are stored stacked (`weights.layer_stacks`) and each run is one `lax.scan`, so the traced
and compiled program, and its compile time, do not grow with depth (dense-then-MoE models
have two stacks). The KV cache is then one page pool for all layers
(`MhaKvCacheSpec.init_pool`): layer i owns pages [i * num_blocks, (i + 1) * num_blocks),
and `layer_runner.layer_metadata` offsets the step's block tables and slot mapping by the layer index,
which inside the scan is a traced value. The pool is the scan's carry and every KV write
a scatter into it, which XLA performs in place (no copy of the cache per layer or step);
the kernels take the pool as if it were one big layer cache and need no layer argument.
Expert-parallel slot layers stack too (slot buffers [n, S, ...], slot tables [n, ...]; the
load balancer rewrites one layer's row in place, see `jaxllm.models.weights`); each layer's
expert counts are the scan's outputs. Layers stored apart (`params["layers"][i]` non-empty)
run unrolled between the stacks, over the same pool. With `scan_layers` off every layer
runs unrolled over a per-layer list of caches, as before.

Tensor parallelism: given a `mesh`, the weights arrive sharded (see `sharding.rules`),
XLA partitions the dense einsums from those shardings (q/k/v and gate/up split by
column, o and down by row, followed by an all-reduce), and the kernels, which XLA
cannot partition, run under shard_map (`sharding.kernels`): attention and the KV write
per device on its heads, the expert FFN on its columns with a psum.

Expert parallelism: when a MoE layer's experts are stored as slots (its params carry a
`slots` table; see `sharding.slot_table`), the layer runs `jaxllm.models.ep_moe.ep_moe_block`:
tokens dispatched to the EP rank owning each chosen slot and combined back, as
`moe_options` says. `forward_with_moe_stats` also returns the step's per-layer expert
counts (`sharding.expert_load.MoeStepStats`); the plain forward drops them, and XLA removes
the unused counting from its compiled program.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxllm.kv_cache.spec import MhaLayerCache
from jaxllm.models.attention import AttentionFn, AttentionMetadata, reference_attention
from jaxllm.models.deepseek import decode_layers as deepseek_decode_layers
from jaxllm.models.ep_moe import EpMoeOptions, ep_moe_block
from jaxllm.models.kv_cache_spec import KVCache, kv_cache_spec
from jaxllm.models.kv_quant import KvScales, layer_kv_scales, quantize_entries, scale_outputs, scale_queries
from jaxllm.models.layer_runner import LayerCapture, cache_geometry, layer_metadata, run_layers
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.moe import MoeFn, moe_block, quantized_moe_fn
from jaxllm.models.numerics import matmul_precision, rms_norm
from jaxllm.models.partitioning import rules_for
from jaxllm.models.quantization import qeinsum
from jaxllm.models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from jaxllm.models.weights import Params
from jaxllm.step_batch import StepBatch
from pallas_kernels.moe_grouped_gemm.reference import moe_grouped_ffn_reference
from sharding.expert_load import MoeStepStats, count_experts
from sharding.kernels import shard_attention, shard_kv_write, shard_moe
from sharding.mesh import ParallelConfig, expert_parallel_size, make_mesh
from sharding.rules import logical_to_physical

_REFERENCE_ATTENTION = reference_attention()


def lora_delta(x: jax.Array, w: dict, onehot: jax.Array, precision: Optional[jax.lax.Precision]) -> jax.Array:
    """The batched low-rank update of one projection: token t adds `(x[t] @ a[s]) @ b[s]` of its
    slot s (`onehot` [T, slots]; an all-zero row adds nothing). Every slot's update is computed
    for every token and selected per token with `where`, not masked by multiplying: `0 * NaN`
    is NaN, so a multiplied mask would let one slot's non-finite weights reach every row. At
    the small rank and slot counts of LoRA serving this costs less than gathering a weight
    matrix per token."""
    selected = onehot > 0
    h = jnp.einsum("ti,sir->tsr", x, w["a"], precision=precision)
    h = jnp.where(selected[:, :, None], h, jnp.zeros((), h.dtype))
    delta = None
    for slot in range(w["b"].shape[0]):  # b's slots one by one: a NaN times a masked 0 is NaN
        d = jnp.einsum("tr,ro->to", h[:, slot], w["b"][slot], precision=precision)
        d = jnp.where(selected[:, slot, None], d, jnp.zeros((), d.dtype))
        delta = d if delta is None else delta + d
    return delta


def attention_block(
    x: jax.Array,
    p: dict,
    cache: MhaLayerCache,
    md: AttentionMetadata,
    cos: jax.Array,
    sin: jax.Array,
    *,
    config: ModelConfig,
    attention_fn: AttentionFn,
    write_fn: Callable,
    lora: Optional[dict] = None,
    onehot: Optional[jax.Array] = None,
    kv_scales: KvScales = None,
) -> tuple[jax.Array, MhaLayerCache]:
    """Self-attention of one layer over its paged cache (RoPE, KV write, attention, o_proj): the
    output [T, H] and the cache. Its q/k/v weights set the input width (EAGLE-3's take 2H)."""
    prec = matmul_precision(config)
    q = qeinsum("th,hnd->tnd", x, p["q"], precision=prec)
    k = qeinsum("th,hnd->tnd", x, p["k"], precision=prec)
    v = qeinsum("th,hnd->tnd", x, p["v"], precision=prec)
    if lora is not None:
        q = q + lora_delta(x, lora["q"], onehot, prec).reshape(q.shape)
        k = k + lora_delta(x, lora["k"], onehot, prec).reshape(k.shape)
        v = v + lora_delta(x, lora["v"], onehot, prec).reshape(v.shape)
    if config.attention_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], config.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache = write_fn(cache, quantize_entries(k, v, kv_scales), md.slot_mapping)
    k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)
    out = attention_fn(
        scale_queries(q, k_scale), cache, md, sm_scale=config.head_dim**-0.5, sliding_window=config.sliding_window
    )
    out = scale_outputs(out, v_scale)
    y = qeinsum("tnd,ndh->th", out.astype(x.dtype), p["o"], precision=prec)
    if lora is not None:
        y = y + lora_delta(out.astype(x.dtype).reshape(out.shape[0], -1), lora["o"], onehot, prec)
    if config.o_proj_bias:
        y = y + p["o_bias"]
    return y, cache


def mlp_block(
    x: jax.Array, p: dict, config: ModelConfig, lora: Optional[dict] = None, onehot: Optional[jax.Array] = None
) -> jax.Array:
    """The SwiGLU FFN of a dense layer."""
    prec = matmul_precision(config)
    gate = qeinsum("th,hi->ti", x, p["gate"], precision=prec)
    up = qeinsum("th,hi->ti", x, p["up"], precision=prec)
    if lora is not None:
        gate = gate + lora_delta(x, lora["gate"], onehot, prec)
        up = up + lora_delta(x, lora["up"], onehot, prec)
    act = jax.nn.silu(gate) * up
    y = qeinsum("ti,ih->th", act, p["down"], precision=prec)
    if lora is not None:
        y = y + lora_delta(act, lora["down"], onehot, prec)
    return y


def _cache_keys(kv_cache: KVCache) -> jax.Array:
    return kv_cache[0].k if isinstance(kv_cache, list) else kv_cache.k


def attention_backends(
    config: ModelConfig, kv_cache: KVCache, attention_fn: AttentionFn, moe_fn: MoeFn, mesh: Optional[jax.sharding.Mesh]
) -> tuple[AttentionFn, Callable, MoeFn]:
    """The attention, KV-write and MoE functions of one step; under a mesh, wrapped in shard_map."""
    keys = _cache_keys(kv_cache)
    spec = kv_cache_spec(config, keys.dtype, keys.shape[0] // config.num_kv_heads)
    if mesh is None:
        return attention_fn, spec.write, moe_fn
    rules = rules_for(config, mesh)
    cache_spec = spec.partition_spec(rules)
    entry_spec = logical_to_physical(("tokens", "kv_heads", "head_dim"), rules)
    return (
        shard_attention(attention_fn, mesh, rules, cache_spec),
        shard_kv_write(spec.write, mesh, rules, cache_spec, (entry_spec, entry_spec)),
        shard_moe(moe_fn, mesh, rules),
    )


def decode_layers(
    params: Params,
    kv_cache: KVCache,
    batch: StepBatch,
    *,
    config: ModelConfig,
    attention_fn: AttentionFn = _REFERENCE_ATTENTION,
    moe_fn: MoeFn = moe_grouped_ffn_reference,
    mesh: Optional[jax.sharding.Mesh] = None,
    moe_options: Optional[EpMoeOptions] = None,
) -> tuple[jax.Array, KVCache]:
    """Embedding and all decoder layers: the residual stream [T, H] (before the final norm)."""
    x, new_cache, _ = decode_layers_with_moe_stats(
        params,
        kv_cache,
        batch,
        config=config,
        attention_fn=attention_fn,
        moe_fn=moe_fn,
        mesh=mesh,
        moe_options=moe_options,
    )
    return x, new_cache


@dataclass(frozen=True)
class _LayerContext:
    """What every layer of one step shares (closed over by the scan body)."""

    config: ModelConfig
    md: AttentionMetadata
    cos: jax.Array
    sin: jax.Array
    valid: jax.Array
    attention_fn: AttentionFn
    write_fn: Callable
    moe_fn: MoeFn
    raw_moe_fn: MoeFn
    mesh: Optional[jax.sharding.Mesh]
    moe_options: Optional[EpMoeOptions]
    pool_blocks: Optional[int]  # blocks per layer of a page pool; None for per-layer caches
    tokens_per_block: int
    slot_moe_layer: Optional[Callable] = None  # attention data parallelism's slot MoE layer
    lora_onehot: Optional[jax.Array] = None  # [T, slots] each token's LoRA slot (params["lora"])


def _decoder_layer(
    x: jax.Array, layer: dict, cache: Any, index: jax.Array | int, ctx: _LayerContext
) -> tuple[jax.Array, Any, Optional[jax.Array], Optional[jax.Array]]:
    """One decoder layer (`index` static, or traced inside a scan): the new residual, the new
    cache (its own per-layer cache, or the pool), and for MoE layers the expert counts and the
    dropped-row count."""
    config = ctx.config
    md = ctx.md
    if ctx.pool_blocks is not None:
        md = layer_metadata(md, index, ctx.pool_blocks, ctx.tokens_per_block, config.num_layers)
    h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
    lora = layer.get("lora")
    h, cache = attention_block(
        h,
        layer["attn"],
        cache,
        md,
        ctx.cos,
        ctx.sin,
        config=config,
        attention_fn=ctx.attention_fn,
        write_fn=ctx.write_fn,
        lora=lora,
        onehot=ctx.lora_onehot,
        kv_scales=layer_kv_scales(config, index),
    )
    x = x + h
    h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
    if "moe" in layer and "slots" in layer["moe"] and ctx.slot_moe_layer is not None:
        y, counts, dropped = ctx.slot_moe_layer(h, layer["moe"], ctx.valid)
        return x + y, cache, counts, dropped
    if "moe" in layer and "slots" in layer["moe"]:
        ep_mesh = ctx.mesh if ctx.mesh is not None else make_mesh(ParallelConfig())
        y, counts, dropped = ep_moe_block(
            h,
            layer["moe"],
            config=config,
            moe_fn=ctx.raw_moe_fn,
            mesh=ep_mesh,
            rules=rules_for(config, ep_mesh),
            options=ctx.moe_options or EpMoeOptions(),
            valid=ctx.valid,
        )
        return x + y, cache, counts, dropped
    if "moe" in layer:
        if ctx.mesh is not None and expert_parallel_size(ctx.mesh) > 1:
            raise ValueError(
                f"layer {index}: an expert-parallel mesh needs the experts loaded as slots "
                "(load_params with the same mesh)"
            )
        y, ids = moe_block(h, layer["moe"], config=config, moe_fn=ctx.moe_fn, valid=ctx.valid)
        return x + y, cache, count_experts(ids, config.num_experts, ctx.valid), jnp.zeros((), jnp.int32)
    return x + mlp_block(h, layer["mlp"], config, lora, ctx.lora_onehot), cache, None, None


def decode_layers_with_moe_stats(
    params: Params,
    kv_cache: KVCache,
    batch: StepBatch,
    *,
    config: ModelConfig,
    attention_fn: AttentionFn,
    moe_fn: MoeFn,
    mesh: Optional[jax.sharding.Mesh],
    moe_options: Optional[EpMoeOptions],
    slot_moe_layer: Optional[Callable] = None,
) -> tuple[jax.Array, KVCache, Optional[MoeStepStats]]:
    """`decode_layers` plus the step's MoE statistics (None for a dense model).
    `slot_moe_layer(h, layer_moe_params, valid) -> (y, counts, dropped)`, when given, runs the
    MoE layers stored as slots instead of `ep_moe_block` (attention data parallelism runs the
    whole decoder per device, see `jaxllm.models.parallel.attention_dp`)."""
    x, kv_cache, stats, _ = decode_layers_capturing(
        params,
        kv_cache,
        batch,
        config=config,
        attention_fn=attention_fn,
        moe_fn=moe_fn,
        mesh=mesh,
        moe_options=moe_options,
        slot_moe_layer=slot_moe_layer,
    )
    return x, kv_cache, stats


def decode_layers_capturing(
    params: Params,
    kv_cache: KVCache,
    batch: StepBatch,
    *,
    config: ModelConfig,
    attention_fn: AttentionFn,
    moe_fn: MoeFn,
    mesh: Optional[jax.sharding.Mesh],
    moe_options: Optional[EpMoeOptions],
    slot_moe_layer: Optional[Callable] = None,
    capture: Optional[LayerCapture] = None,
) -> tuple[jax.Array, KVCache, Optional[MoeStepStats], Optional[jax.Array]]:
    """`decode_layers_with_moe_stats` plus, with `capture`, the residual rows entering the
    captured layers [E, K, H] (see `layer_runner.LayerCapture`; None without)."""
    moe_fn = quantized_moe_fn(moe_fn, config)
    if config.is_mla:
        return deepseek_decode_layers(
            params,
            kv_cache,
            batch,
            config=config,
            attention_fn=attention_fn,
            moe_fn=moe_fn,
            mesh=mesh,
            moe_options=moe_options,
            capture=capture,
            slot_moe_layer=slot_moe_layer,
        )
    pool_blocks, tokens_per_block = cache_geometry(config, params, kv_cache)
    raw_moe_fn = moe_fn
    attention_fn, write_fn, moe_fn = attention_backends(config, kv_cache, attention_fn, moe_fn, mesh)
    x = params["embed"][batch.token_ids]
    cos, sin = rope_cos_sin(batch.positions, rope_inv_freq(config), x.dtype)
    num_tokens = batch.token_ids.shape[0]
    valid = jnp.arange(num_tokens, dtype=jnp.int32) < batch.cu_q_lens[batch.num_seqs[0]]
    lora = params.get("lora")
    ctx = _LayerContext(
        config,
        AttentionMetadata.from_batch(batch),
        cos,
        sin,
        valid,
        attention_fn,
        write_fn,
        moe_fn,
        raw_moe_fn,
        mesh,
        moe_options,
        pool_blocks,
        tokens_per_block,
        slot_moe_layer,
        _lora_onehot(lora, batch, x.dtype),
    )
    return run_layers(
        params,
        kv_cache,
        x,
        config,
        lambda x, layer, cache, index: _decoder_layer(x, layer, cache, index, ctx),
        lora=lora,
        capture=capture,
    )


def _lora_onehot(lora: Optional[dict], batch: StepBatch, dtype: Any) -> Optional[jax.Array]:
    """[T, slots] one-hot of each token's LoRA slot (`batch.lora_slots`, -1 = none), or None
    when the parameters carry no LoRA slots (the step is then the plain model)."""
    if lora is None:
        return None
    if batch.lora_slots is None:
        raise ValueError("params carry LoRA slots (params['lora']) but the batch has no lora_slots")
    leaves = [w for s in lora["layer_stacks"] for w in jax.tree_util.tree_leaves(s)]
    num_slots = leaves[0].shape[1] if leaves else jax.tree_util.tree_leaves(lora["layers"])[0].shape[0]
    return jax.nn.one_hot(batch.lora_slots, num_slots, dtype=dtype)


def compute_logits(params: Params, residual: jax.Array, config: ModelConfig) -> jax.Array:
    """Final norm and LM head: float32 logits [N, V] for residual rows [N, H]."""
    h = rms_norm(residual, params["final_norm"], config.rms_norm_eps)
    prec = matmul_precision(config)
    if config.tie_word_embeddings:
        return jnp.einsum("nh,vh->nv", h, params["embed"], precision=prec, preferred_element_type=jnp.float32)
    return jnp.einsum("nh,hv->nv", h, params["lm_head"], precision=prec, preferred_element_type=jnp.float32)


def forward(
    params: Params,
    kv_cache: KVCache,
    batch: StepBatch,
    *,
    config: ModelConfig,
    attention_fn: AttentionFn = _REFERENCE_ATTENTION,
    moe_fn: MoeFn = moe_grouped_ffn_reference,
    mesh: Optional[jax.sharding.Mesh] = None,
    moe_options: Optional[EpMoeOptions] = None,
) -> tuple[jax.Array, KVCache]:
    """One engine step: float32 logits [S, V] at `batch.logits_indices`, and the updated cache."""
    residual, kv_cache = decode_layers(
        params,
        kv_cache,
        batch,
        config=config,
        attention_fn=attention_fn,
        moe_fn=moe_fn,
        mesh=mesh,
        moe_options=moe_options,
    )
    return compute_logits(params, residual[batch.logits_indices], config), kv_cache


def forward_with_moe_stats(
    params: Params,
    kv_cache: KVCache,
    batch: StepBatch,
    *,
    config: ModelConfig,
    attention_fn: AttentionFn = _REFERENCE_ATTENTION,
    moe_fn: MoeFn = moe_grouped_ffn_reference,
    mesh: Optional[jax.sharding.Mesh] = None,
    moe_options: Optional[EpMoeOptions] = None,
) -> tuple[jax.Array, KVCache, MoeStepStats]:
    """`forward` plus the step's MoE statistics: expert counts [num_moe_layers, num_experts]
    over the whole batch (padding excluded) and rows dropped by a capacity-limited dispatch."""
    if not config.num_experts:
        raise ValueError(f"{config.architecture} has no MoE layers to collect statistics from")
    residual, kv_cache, stats = decode_layers_with_moe_stats(
        params,
        kv_cache,
        batch,
        config=config,
        attention_fn=attention_fn,
        moe_fn=moe_fn,
        mesh=mesh,
        moe_options=moe_options,
    )
    return compute_logits(params, residual[batch.logits_indices], config), kv_cache, stats


def forward_with_rows(
    params: Params,
    kv_cache: KVCache,
    batch: StepBatch,
    rows: jax.Array,
    *,
    config: ModelConfig,
    attention_fn: AttentionFn = _REFERENCE_ATTENTION,
    moe_fn: MoeFn = moe_grouped_ffn_reference,
    mesh: Optional[jax.sharding.Mesh] = None,
    moe_options: Optional[EpMoeOptions] = None,
    moe_stats: bool = False,
) -> tuple[jax.Array, jax.Array, KVCache, Optional[MoeStepStats]]:
    """`forward` plus float32 logits [E, V] of the packed tokens `rows` int32[E] (context
    logits of the requests that ask; see jaxllm.engine.logits_outputs); with `moe_stats`
    also the step's MoE statistics, else None."""
    kwargs = dict(config=config, attention_fn=attention_fn, moe_fn=moe_fn, mesh=mesh, moe_options=moe_options)
    if moe_stats:
        residual, kv_cache, stats = decode_layers_with_moe_stats(params, kv_cache, batch, **kwargs)
    else:
        (residual, kv_cache), stats = decode_layers(params, kv_cache, batch, **kwargs), None
    return (
        compute_logits(params, residual[batch.logits_indices], config),
        compute_logits(params, residual[rows], config),
        kv_cache,
        stats,
    )


def forward_all_logits(
    params: Params,
    kv_cache: KVCache,
    batch: StepBatch,
    *,
    config: ModelConfig,
    attention_fn: AttentionFn = _REFERENCE_ATTENTION,
    moe_fn: MoeFn = moe_grouped_ffn_reference,
    mesh: Optional[jax.sharding.Mesh] = None,
    moe_options: Optional[EpMoeOptions] = None,
) -> tuple[jax.Array, KVCache]:
    """Like `forward` but float32 logits for every token slot [T, V] (prompt scoring, tests)."""
    residual, kv_cache = decode_layers(
        params,
        kv_cache,
        batch,
        config=config,
        attention_fn=attention_fn,
        moe_fn=moe_fn,
        mesh=mesh,
        moe_options=moe_options,
    )
    return compute_logits(params, residual, config), kv_cache
