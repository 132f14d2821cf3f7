"""DeepSeek-V3 / R1 (`DeepseekV3ForCausalLM`, also Kimi K2's architecture): the decoder layers.

What differs from the other decoders (the layers live here; the config fields in
`jaxllm.models.deepseek_config`, the weights in `jaxllm.models.deepseek_weights`, the
router in `jaxllm.models.moe.route_grouped_sigmoid`):

- attention is multi-head latent attention over a latent cache (`jaxllm.models.mla`);
- the router scores experts with a sigmoid; `e_score_correction_bias` is added for the
  choice only (the weights stay the plain sigmoid scores): the experts are split into
  `n_group` groups, each group scored by the sum of its best two biased scores, the top-k
  experts are chosen within the best `topk_group` groups, their weights optionally
  renormalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`;
- every MoE layer adds `n_shared_experts` shared experts (one SwiGLU FFN of
  n_shared_experts * moe_intermediate_size columns) to the routed output; the first
  `first_k_dense_replace` layers are dense;
- the multi-token-prediction layers some checkpoints carry (`model.layers.{num_hidden_layers}...`)
  are skipped by the loader with a log line, or loaded with `load_mtp=True` and run by
  `jaxllm.models.mtp` through the same layer function (`mla_decoder_layer`).

Depth: the layers run through `jaxllm.models.layer_runner.run_layers`, so with `scan_layers` the dense
prefix and the MoE layers are two layer stacks, each one `lax.scan` over a latent page pool
for all layers (`MlaKvCacheSpec.init_pool`): DeepSeek-V3's 61 layers trace as two scan bodies.

Parallelism: attention heads (q_b / q, k_b, v_b, o) are split like MHA heads; the latent
projections (q_a, kv_a, k_rope) and the latent cache are replicated; dense layers are
tensor-parallel; shared experts are replicated on every rank; routed experts run through
`jaxllm.models.ep_moe` as slots (expert parallelism) or column-split (MoE tensor parallelism).
Under attention data parallelism every device runs these layers on its own requests over its
own latent pool, the MLA weights replicated, and the routed experts through the attention-DP
MoE layer (`MlaStep.slot_moe_layer`, `jaxllm.models.parallel.attention_dp`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxllm.kv_cache.spec import MhaKvCacheSpec
from jaxllm.models.attention import AttentionFn, AttentionMetadata
from jaxllm.models.ep_moe import EpMoeOptions, ep_moe_block
from jaxllm.models.kv_cache_spec import kv_cache_spec
from jaxllm.models.kv_quant import layer_kv_scales
from jaxllm.models.layer_runner import LayerCapture, cache_geometry, layer_metadata, run_layers
from jaxllm.models.mla import latent_backend, mla_attention
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.moe import MoeFn, moe_block
from jaxllm.models.numerics import matmul_precision, rms_norm
from jaxllm.models.partitioning import rules_for
from jaxllm.models.quantization import qeinsum
from jaxllm.models.rope import rope_attention_factor, rope_cos_sin, rope_inv_freq
from jaxllm.step_batch import StepBatch
from sharding.expert_load import MoeStepStats, count_experts
from sharding.kernels import shard_attention, shard_kv_write, shard_moe
from sharding.mesh import ParallelConfig, expert_parallel_size, make_mesh
from sharding.rules import logical_to_physical


def _mlp(x: jax.Array, p: dict, precision: Optional[jax.lax.Precision]) -> jax.Array:
    gate = qeinsum("th,hi->ti", x, p["gate"], precision=precision)
    up = qeinsum("th,hi->ti", x, p["up"], precision=precision)
    return qeinsum("ti,ih->th", jax.nn.silu(gate) * up, p["down"], precision=precision)


def _backends(
    config: ModelConfig, attention_fn: AttentionFn, moe_fn: MoeFn, mesh: Optional[jax.sharding.Mesh], dtype: Any
) -> tuple[Callable, Callable, Callable, MoeFn]:
    """(expanded MHA attention, latent attention, latent write, MoE FFN); under a mesh in shard_map."""
    latent_fn = latent_backend(attention_fn)
    spec = kv_cache_spec(config, str(jnp.dtype(dtype)))
    if mesh is None:
        return attention_fn, latent_fn, spec.write, moe_fn
    rules = rules_for(config, mesh)
    latent_spec = spec.partition_spec(rules)
    mha_spec = MhaKvCacheSpec(1, config.num_heads, 1, "float32").partition_spec(rules)
    entry_spec = logical_to_physical(("tokens", None), rules)
    return (
        shard_attention(attention_fn, mesh, rules, mha_spec),
        shard_attention(latent_fn, mesh, rules, latent_spec),
        shard_kv_write(spec.write, mesh, rules, latent_spec, entry_spec),
        shard_moe(moe_fn, mesh, rules),
    )


@dataclass(frozen=True)
class MlaStep:
    """What every MLA decoder layer of one step shares: the backends, the metadata, RoPE, the
    valid-token mask. Built once per forward (`mla_step`); the MTP layers reuse it."""

    config: ModelConfig
    md: AttentionMetadata
    cos: jax.Array
    sin: jax.Array
    valid: jax.Array
    # The program's shape holds at most one token per sequence (decode buckets): MLA runs its
    # absorbed form. Decided when the program is built, never on the device (`mla_attention`).
    decode_only: bool
    mha_fn: Callable
    latent_fn: Callable
    write_fn: Callable
    moe_fn: MoeFn  # the raw expert FFN (expert-parallel slot layers wrap it themselves)
    sharded_moe_fn: MoeFn
    mesh: Optional[jax.sharding.Mesh]
    moe_options: Optional[EpMoeOptions]
    precision: Optional[jax.lax.Precision]
    # Attention data parallelism's MoE layer over experts stored as slots (see
    # `jaxllm.models.parallel.attention_dp`): (h, moe params, valid) -> (y, counts, dropped).
    slot_moe_layer: Optional[Callable] = None


def mla_step(
    batch: StepBatch,
    cache_dtype: Any,
    activation_dtype: Any,
    *,
    config: ModelConfig,
    attention_fn: AttentionFn,
    moe_fn: MoeFn,
    mesh: Optional[jax.sharding.Mesh],
    moe_options: Optional[EpMoeOptions],
    slot_moe_layer: Optional[Callable] = None,
) -> MlaStep:
    mha_fn, latent_fn, write_fn, sharded_moe_fn = _backends(config, attention_fn, moe_fn, mesh, cache_dtype)
    cos, sin = rope_cos_sin(batch.positions, rope_inv_freq(config), jnp.float32)
    factor = rope_attention_factor(config)
    cos, sin = (cos * factor).astype(activation_dtype), (sin * factor).astype(activation_dtype)
    num_tokens = batch.token_ids.shape[0]
    num_valid = batch.cu_q_lens[batch.num_seqs[0]]
    return MlaStep(
        config=config,
        md=AttentionMetadata.from_batch(batch),
        cos=cos,
        sin=sin,
        valid=jnp.arange(num_tokens, dtype=jnp.int32) < num_valid,
        decode_only=num_tokens <= batch.kv_lens.shape[0],
        mha_fn=mha_fn,
        latent_fn=latent_fn,
        write_fn=write_fn,
        moe_fn=moe_fn,
        sharded_moe_fn=sharded_moe_fn,
        mesh=mesh,
        moe_options=moe_options,
        precision=matmul_precision(config),
        slot_moe_layer=slot_moe_layer,
    )


def mla_decoder_layer(
    x: jax.Array, layer: dict, cache: Any, md: AttentionMetadata, step: MlaStep, index: jax.Array | int
) -> tuple[jax.Array, Any, Optional[jax.Array], Optional[jax.Array]]:
    """One DeepSeek-V3 decoder layer over its view `md` of the cache: the new residual, the new
    cache, and for MoE layers the expert counts and dropped rows (None for dense layers)."""
    config, prec = step.config, step.precision
    h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
    h, cache = mla_attention(
        h,
        layer["attn"],
        cache,
        md,
        step.cos,
        step.sin,
        config=config,
        mha_fn=step.mha_fn,
        latent_fn=step.latent_fn,
        write_fn=step.write_fn,
        decode_only=step.decode_only,
        precision=prec,
        # MTP layers (named by a string index) keep their own unquantized page pool
        kv_scale=None if config.kv_cache_quant is None or isinstance(index, str) else layer_kv_scales(config, index)[0],
    )
    x = x + h
    h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
    if "moe" not in layer:  # the dense prefix (first_k_dense_replace)
        return x + _mlp(h, layer["mlp"], prec), cache, None, None
    if "slots" in layer["moe"] and step.slot_moe_layer is not None:
        y, layer_counts, layer_dropped = step.slot_moe_layer(h, layer["moe"], step.valid)
    elif "slots" in layer["moe"]:
        ep_mesh = step.mesh if step.mesh is not None else make_mesh(ParallelConfig())
        y, layer_counts, layer_dropped = ep_moe_block(
            h,
            layer["moe"],
            config=config,
            moe_fn=step.moe_fn,
            mesh=ep_mesh,
            rules=rules_for(config, ep_mesh),
            options=step.moe_options or EpMoeOptions(),
            valid=step.valid,
        )
    else:
        if step.mesh is not None and expert_parallel_size(step.mesh) > 1:
            raise ValueError(
                f"layer {index}: an expert-parallel mesh needs the experts loaded as slots "
                "(load_params with the same mesh)"
            )
        y, ids = moe_block(h, layer["moe"], config=config, moe_fn=step.sharded_moe_fn, valid=step.valid)
        layer_counts = count_experts(ids, config.num_experts, step.valid)
        layer_dropped = jnp.zeros((), jnp.int32)
    if config.n_shared_experts:
        y = y + _mlp(h, layer["shared"], prec)
    return x + y, cache, layer_counts, layer_dropped


def decode_layers(
    params: dict,
    kv_cache: Any,
    batch: StepBatch,
    *,
    config: ModelConfig,
    attention_fn: AttentionFn,
    moe_fn: MoeFn,
    mesh: Optional[jax.sharding.Mesh],
    moe_options: Optional[EpMoeOptions],
    capture: Optional[LayerCapture] = None,
    slot_moe_layer: Optional[Callable] = None,
) -> tuple[jax.Array, Any, Optional[MoeStepStats]] | tuple[jax.Array, Any, Optional[MoeStepStats], jax.Array]:
    """Embedding and all decoder layers: the residual stream [T, H], the new cache, MoE stats
    (and with `capture`, the captured residual rows; see `run_layers`). `slot_moe_layer`: as
    `MlaStep.slot_moe_layer` (attention data parallelism).

    `kv_cache` is one latent page pool for all layers (`MlaKvCacheSpec.init_pool`; layer
    stacks, including the dense prefix's, run as scans) or a per-layer list (`scan_layers` off)."""
    pool_blocks, tokens_per_block = cache_geometry(config, params, kv_cache)
    cache_dtype = jax.tree_util.tree_leaves(kv_cache)[0].dtype
    x = params["embed"][batch.token_ids]
    step = mla_step(
        batch,
        cache_dtype,
        x.dtype,
        config=config,
        attention_fn=attention_fn,
        moe_fn=moe_fn,
        mesh=mesh,
        moe_options=moe_options,
        slot_moe_layer=slot_moe_layer,
    )

    def layer_fn(
        x: jax.Array, layer: dict, cache: Any, index: jax.Array | int
    ) -> tuple[jax.Array, Any, Optional[jax.Array], Optional[jax.Array]]:
        md = (
            step.md
            if pool_blocks is None
            else layer_metadata(step.md, index, pool_blocks, tokens_per_block, config.num_layers)
        )
        return mla_decoder_layer(x, layer, cache, md, step, index)

    return run_layers(params, kv_cache, x, config, layer_fn, capture=capture)
