"""Speculative drafters under attention data parallelism: each rank drafts for its own rows.

The drafter's page pool gets a leading rank axis split over the devices, as the target's
(`jaxllm.models.kv_cache_spec.init_dp_kv_cache`): rank d's drafter entries live on device d,
addressed by rank d's block ids. The drafting program runs under one `shard_map` like the
attention-DP forward (`jaxllm.models.parallel.attention_dp`): every device runs the
single-device drafting chain over its rank's rows of the step just read back ([D, ...] batch
fields, [D, T_rank, ...] hidden states or last tokens [D, S_rank]), and the MoE layers of the
drafter (the MTP layers', a MoE draft model's, its experts stored as slots like the target's)
dispatch the tokens of every rank together (`dp_slot_moe_layer`). Drafts come back
[D, S_rank, k]. The drafters' weights other than experts are replicated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.kv_cache.spec import MlaLayerCache
from jaxllm.models.decoder import compute_logits, decode_layers_with_moe_stats
from jaxllm.models.draft_chain import model_chain_drafts
from jaxllm.models.eagle3 import eagle3_draft
from jaxllm.models.eagle3_weights import Eagle3Config
from jaxllm.models.ep_moe import EpMoeOptions
from jaxllm.models.model_config import ModelConfig
from jaxllm.models.moe import MoeFn
from jaxllm.models.mtp import mtp_draft, mtp_kv_cache_spec
from jaxllm.models.parallel.attention_dp import dp_slot_moe_layer
from jaxllm.step_batch import StepBatch
from sharding.dp_ranks import RANK_SPEC, attention_dp_size


def init_dp_mtp_kv_cache(
    config: ModelConfig, num_blocks: int, tokens_per_block: int, dtype: Any, mesh: jax.sharding.Mesh
) -> MlaLayerCache:
    """Zeroed MTP latent pages per rank, [D, num_nextn_predict_layers * num_blocks,
    tokens_per_block, latent_dim] (rank d's pool on device d, `MlaKvCacheSpec.init_pool`'s
    layout within it)."""
    spec = mtp_kv_cache_spec(config, dtype)
    shape = (attention_dp_size(mesh), spec.num_layers * num_blocks, tokens_per_block, spec.latent_dim)
    dt = jnp.dtype(spec.dtype)
    return MlaLayerCache(jax.jit(lambda: jnp.zeros(shape, dt), out_shardings=NamedSharding(mesh, RANK_SPEC))())


def _per_rank(
    drafting: Callable[..., tuple[jax.Array, Any]],
    mesh: jax.sharding.Mesh,
    shared: tuple,
    shared_specs: tuple,
    cache: Any,
    batch: StepBatch,
    rows: jax.Array,
) -> tuple[jax.Array, Any]:
    """`drafting(*shared, cache, batch, rows) -> (drafts, cache)`, the single-device chain, run
    under one shard_map on every rank's slice of the [D, ...] `cache`, `batch` and `rows`
    (`shared`: replicated or split as `shared_specs` say): drafts [D, S_rank, k], caches [D, ...]."""

    def body(*args):
        *shared_, cache_, batch_, rows_ = args
        first = functools.partial(jax.tree.map, lambda a: a[0])
        drafts, new_cache = drafting(*shared_, first(cache_), first(batch_), rows_[0])
        return drafts[None], jax.tree.map(lambda a: a[None], new_cache)

    cache_specs = jax.tree.map(lambda _: RANK_SPEC, cache)
    batch_specs = jax.tree.map(lambda _: RANK_SPEC, batch)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(*shared_specs, cache_specs, batch_specs, RANK_SPEC),
        out_specs=(RANK_SPEC, cache_specs),
        check_vma=False,
    )(*shared, cache, batch, rows)


def mtp_draft_attention_dp(
    params: Any,
    cache: MlaLayerCache,
    batch: StepBatch,
    hidden: jax.Array,
    *,
    num_draft_tokens: int,
    config: ModelConfig,
    attention_fn: Callable,
    moe_fn: MoeFn,
    mesh: jax.sharding.Mesh,
    param_specs: Any,
    moe_options: EpMoeOptions | None = None,
) -> tuple[jax.Array, MlaLayerCache]:
    """`jaxllm.models.mtp.mtp_draft` on every rank's rows: drafts int32 [D, S_rank, k] and the
    per-rank MTP cache. `batch`: the stacked per-rank drafting batch, `hidden` [D, T_rank, H]."""
    moe_layer = dp_slot_moe_layer(config, moe_fn, mesh, moe_options)

    def drafting(params_, cache_, batch_, hidden_):
        drafts, new_cache, _ = mtp_draft(
            params_,
            cache_,
            batch_,
            hidden_,
            num_draft_tokens,
            config=config,
            attention_fn=attention_fn,
            moe_fn=moe_fn,
            mesh=None,
            moe_options=moe_options,
            own_blocks_only=True,
            slot_moe_layer=moe_layer,
        )
        return drafts, new_cache

    return _per_rank(drafting, mesh, (params,), (param_specs,), cache, batch, hidden)


def draft_model_attention_dp(
    params: Any,
    cache: Any,
    batch: StepBatch,
    last_tokens: jax.Array,
    *,
    num_draft_tokens: int,
    config: ModelConfig,
    tokens_per_block: int,
    num_blocks: int,
    attention_fn: Callable,
    moe_fn: MoeFn,
    mesh: jax.sharding.Mesh,
    param_specs: Any,
    moe_options: EpMoeOptions | None = None,
) -> tuple[jax.Array, Any]:
    """A draft model's chain (`draft_chain.model_chain_drafts`) on every rank's rows: drafts
    int32 [D, S_rank, k] and the per-rank draft caches ([D, ...] per layer, `init_dp_kv_cache`).
    `last_tokens` [D, S_rank]: each row's newest token."""
    moe_layer = dp_slot_moe_layer(config, moe_fn, mesh, moe_options)

    def drafting(params_, cache_, batch_, last_):
        def forward_fn(c: Any, b: StepBatch) -> tuple[jax.Array, Any]:
            x, c, _ = decode_layers_with_moe_stats(
                params_,
                c,
                b,
                config=config,
                attention_fn=attention_fn,
                moe_fn=moe_fn,
                mesh=None,
                moe_options=moe_options,
                slot_moe_layer=moe_layer,
            )
            return compute_logits(params_, x[b.logits_indices], config), c

        return model_chain_drafts(
            forward_fn,
            cache_,
            batch_,
            last_,
            num_draft_tokens,
            tokens_per_block=tokens_per_block,
            num_blocks=num_blocks,
        )

    return _per_rank(drafting, mesh, (params,), (param_specs,), cache, batch, last_tokens)


def eagle3_draft_attention_dp(
    params: Any,
    embed: jax.Array,
    cache: Any,
    batch: StepBatch,
    features: jax.Array,
    *,
    num_draft_tokens: int,
    config: Eagle3Config,
    mesh: jax.sharding.Mesh,
    attention_fn: Callable,
) -> tuple[jax.Array, Any]:
    """`jaxllm.models.eagle3.eagle3_draft` on every rank's rows: drafts int32 [D, S_rank, k] and
    the per-rank head caches. `features` [D, T_rank, 3 H]: each rank's fused target features;
    the head's weights and the target's embedding `embed` replicated; `attention_fn`: the
    target's attention backend (per rank, unsharded)."""

    def drafting(params_, embed_, cache_, batch_, features_):
        drafts, new_cache, _ = eagle3_draft(
            params_,
            embed_,
            cache_,
            batch_,
            features_,
            num_draft_tokens,
            config=config,
            attention_fn=attention_fn,
            own_blocks_only=True,
        )
        return drafts, new_cache

    replicated = (jax.tree.map(lambda _: P(), params), P())
    return _per_rank(drafting, mesh, (params, embed), replicated, cache, batch, features)
