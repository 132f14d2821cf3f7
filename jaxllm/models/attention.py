"""Attention backends behind one signature: `attention_fn(q, cache, metadata, *, sm_scale, sliding_window)`.

`AttentionMetadata` carries everything a paged attention kernel needs to know about the
step's ragged batch (a registered dataclass, so it passes through jit and shard_map as
one pytree). The backends here adapt the kernels in `pallas_kernels/` (which keep their
plain array arguments, so they stay usable without jaxllm) to the layer cache of a
`KvCacheSpec`. Under tensor parallelism `sharding.kernels.shard_attention` wraps any of
them in shard_map: each device runs the kernel on its own heads.

Each MHA backend carries, as its `latent` attribute, the matching backend for the latent
cache of multi-head latent attention (`latent_fn(q, cache, metadata, *, sm_scale,
value_dim)`, see `jaxllm.models.mla`): multi-query attention over the one latent "head"
whose values are its first `value_dim` columns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import jax

from jaxllm.kv_cache.spec import MhaLayerCache, MlaLayerCache
from jaxllm.step_batch import StepBatch

AttentionFn = Callable[..., jax.Array]


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    """The ragged batch as attention sees it (shapes as in `StepBatch`)."""

    slot_mapping: jax.Array  # int32[T] cache slot each new token's K/V is written to
    kv_lens: jax.Array  # int32[S] KV length of each sequence after this step
    block_tables: jax.Array  # int32[S, MB]
    cu_q_lens: jax.Array  # int32[S + 1]
    num_seqs: jax.Array  # int32[1]
    # `StepBatch.kv_work_items`: the `xla` backend's static bound on the step's work (or None).
    kv_work_items: Optional[int] = field(default=None, metadata=dict(static=True))

    @classmethod
    def from_batch(cls, batch: StepBatch) -> AttentionMetadata:
        return cls(
            batch.slot_mapping,
            batch.kv_lens,
            batch.block_tables,
            batch.cu_q_lens,
            batch.num_seqs,
            batch.kv_work_items,
        )


def _mha(kernel: Callable, *, takes_work_bound: bool = False) -> AttentionFn:
    """An MHA-cache backend from a kernel taking (q, k, v, kv_lens, block_tables, cu_q_lens, num_seqs).
    `takes_work_bound`: the kernel also takes the step's static work bound (`max_items`, from
    `AttentionMetadata.kv_work_items`): the tiled XLA kernel, whose loop it sizes."""

    def attention(
        q: jax.Array,
        cache: MhaLayerCache,
        md: AttentionMetadata,
        *,
        sm_scale: float,
        sliding_window: Optional[int] = None,
    ) -> jax.Array:
        bound = {"max_items": md.kv_work_items} if takes_work_bound else {}
        return kernel(
            q,
            cache.k,
            cache.v,
            md.kv_lens,
            md.block_tables,
            md.cu_q_lens,
            md.num_seqs,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            **bound,
        )

    attention.__name__ = f"mha_{getattr(kernel, '__name__', 'attention')}"
    attention.latent = _latent(kernel)
    attention.takes_work_bound = takes_work_bound
    return attention


def _latent(kernel: Callable) -> Callable:
    """A latent-cache backend from an MHA kernel: the latent array is passed as both the keys
    and the values of one KV head (no copy), and the output keeps the value columns."""

    def latent_attention(
        q: jax.Array, cache: MlaLayerCache, md: AttentionMetadata, *, sm_scale: float, value_dim: int
    ) -> jax.Array:
        kv = cache.latent[None]
        out = kernel(
            q, kv, kv, md.kv_lens, md.block_tables, md.cu_q_lens, md.num_seqs, sm_scale=sm_scale, sliding_window=None
        )
        return out[..., :value_dim]

    latent_attention.__name__ = f"latent_{getattr(kernel, '__name__', 'attention')}"
    return latent_attention


def latent_attention_of(attention_fn: AttentionFn) -> Callable:
    """The latent backend paired with `attention_fn` (the reference one for a bare function)."""
    latent = getattr(attention_fn, "latent", None)
    if latent is not None:
        return latent
    from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

    return _latent(ragged_paged_attention_reference)


def reference_attention() -> AttentionFn:
    from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

    return _mha(ragged_paged_attention_reference)


def xla_attention() -> AttentionFn:
    """The tiled XLA kernel; it reads the step's static work bound (`kv_work_items`) when the
    metadata carries one (the other backends loop inside their kernels and need none)."""
    from pallas_kernels.ragged_paged_attention.tiled_xla import ragged_paged_attention_tiled

    return _mha(ragged_paged_attention_tiled, takes_work_bound=True)


def pallas_attention(interpret: bool) -> AttentionFn:
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    attention = _mha(functools.partial(ragged_paged_attention, interpret=interpret))
    attention.latent = pallas_latent_attention(interpret)
    return attention


def pallas_latent_attention(interpret: bool) -> Callable:
    """The Pallas kernel's latent variant as a backend for the MLA latent cache."""
    from pallas_kernels.ragged_paged_attention import ragged_paged_latent_attention

    latent_kernel = functools.partial(ragged_paged_latent_attention, interpret=interpret)

    def pallas_latent_attention(
        q: jax.Array, cache: MlaLayerCache, md: AttentionMetadata, *, sm_scale: float, value_dim: int
    ) -> jax.Array:
        return latent_kernel(
            q,
            cache.latent,
            md.kv_lens,
            md.block_tables,
            md.cu_q_lens,
            md.num_seqs,
            sm_scale=sm_scale,
            value_dim=value_dim,
        )

    return pallas_latent_attention


def mosaic_or_triton_attention(interpret: bool) -> Callable:
    """The Mosaic GPU attention kernel where it takes the problem, else the Triton one (which
    also takes FP8 caches)."""
    from pallas_kernels.ragged_paged_attention import mosaic_gpu, ragged_paged_attention

    def attention(q, k_cache, v_cache, *metadata, sm_scale, sliding_window=None):
        num_kv_heads, _, tokens_per_block, head_dim = k_cache.shape
        if k_cache.dtype == q.dtype and mosaic_gpu.supports(
            q.dtype, q.shape[1], num_kv_heads, head_dim, tokens_per_block
        ):
            kernel = mosaic_gpu.ragged_paged_attention_mosaic
        else:
            kernel = ragged_paged_attention
        return kernel(
            q, k_cache, v_cache, *metadata, sm_scale=sm_scale, sliding_window=sliding_window, interpret=interpret
        )

    attention.__name__ = "ragged_paged_attention_mosaic"
    return attention


def mosaic_attention(interpret: bool) -> AttentionFn:
    """The Mosaic GPU (Hopper) kernel, falling back to the Triton one per call for problems
    it does not take (see `jaxllm.models.backends`)."""
    attention = _mha(mosaic_or_triton_attention(interpret))
    attention.latent = pallas_latent_attention(interpret)  # MLA's latent cache: the Triton latent kernel
    return attention
