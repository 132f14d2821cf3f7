"""Kernel backends under shard_map: what XLA cannot partition by itself.

Pallas kernels are opaque to XLA's partitioner, so every attention and MoE backend runs
inside `jax.shard_map` on each device's local pieces:

- attention: q [T, Hq, D] and the cache split by (KV) head over the tensor axis; each
  device attends its own heads; no communication (o's row-parallel reduction follows
  outside).
- MoE grouped FFN: the token rows are replicated, w_gate / w_up split by columns and
  w_down by rows (the `moe_mlp` logical axis); each device computes a partial sum of
  the expert outputs, reduced with `psum` over the tensor axis.

The wrappers only need the mesh and the rules, so any backend (reference, tiled XLA,
Pallas) is wrapped the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from sharding.rules import MeshAxis, ShardingRules, logical_to_physical, swap_last_two


def shard_attention(attention_fn: Callable, mesh: jax.sharding.Mesh, rules: ShardingRules, cache_spec: Any) -> Callable:
    """`attention_fn(q, cache, metadata, **static)` run per device on its heads.

    `cache_spec` is the layer cache pytree of PartitionSpecs (`KvCacheSpec.partition_spec`).
    """
    q_spec = logical_to_physical(("tokens", "heads", "head_dim"), rules)

    def sharded(q: jax.Array, cache: Any, metadata: Any, **static: Any) -> jax.Array:
        body = lambda q_, cache_, md_: attention_fn(q_, cache_, md_, **static)  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=(q_spec, cache_spec, P()), out_specs=q_spec, check_vma=False)(
            q, cache, metadata
        )

    return sharded


def shard_kv_write(
    write_fn: Callable, mesh: jax.sharding.Mesh, rules: ShardingRules, cache_spec: Any, entry_spec: Any
) -> Callable:
    """`write_fn(cache, entries, slot_mapping)` run per device on its own part of the cache."""

    def sharded(cache: Any, entries: Any, slot_mapping: jax.Array) -> Any:
        return jax.shard_map(
            write_fn, mesh=mesh, in_specs=(cache_spec, entry_spec, P()), out_specs=cache_spec, check_vma=False
        )(cache, entries, slot_mapping)

    return sharded


def shard_moe(moe_fn: Callable, mesh: jax.sharding.Mesh, rules: ShardingRules) -> Callable:
    """`moe_fn(x_sorted, group_sizes, w_gate, w_up, w_down)` with the expert FFN columns split:
    each device's partial output is summed with psum over the axes that split `moe_mlp`."""
    up_spec = logical_to_physical(("experts", "embed", "moe_mlp"), rules)
    down_spec = logical_to_physical(("experts", "moe_mlp", "embed"), rules)
    reduce_axis: MeshAxis = rules.moe_mlp

    def body(x, group_sizes, w_gate, w_up, w_down):
        y = moe_fn(x, group_sizes, w_gate, w_up, w_down)
        return jax.lax.psum(y, reduce_axis) if reduce_axis is not None else y

    def sharded(x, group_sizes, w_gate, w_up, w_down):
        return jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P(), up_spec, up_spec, down_spec), out_specs=P(), check_vma=False
        )(x, group_sizes, w_gate, w_up, w_down)

    fused = getattr(moe_fn, "fused", None)
    if fused is not None:  # the kernel that gathers rows and combines (jaxllm.models.moe), split the same way

        def fused_body(x, ids, weights, w_gate, w_up, w_down):
            y = fused(x, ids, weights, w_gate, w_up, w_down)
            return jax.lax.psum(y, reduce_axis) if reduce_axis is not None else y

        def fused_sharded(x, ids, weights, w_gate, w_up, w_down):
            return jax.shard_map(
                fused_body,
                mesh=mesh,
                in_specs=(P(), P(), P(), up_spec, up_spec, down_spec),
                out_specs=P(),
                check_vma=False,
            )(x, ids, weights, w_gate, w_up, w_down)

        # the same optional function attribute `moe_fn` may carry (mypy knows functions without attributes)
        sharded.fused = fused_sharded  # type: ignore[attr-defined]
    for name in ("fused_fp8", "fused_fp8_dynamic"):  # FP8 experts: the block scales split like their weights
        fused_fp8 = getattr(moe_fn, name, None)
        if fused_fp8 is not None:
            setattr(sharded, name, _shard_fused_fp8(fused_fp8, mesh, up_spec, down_spec, reduce_axis))
    return sharded


def _shard_fused_fp8(
    fused_fp8: Callable, mesh: jax.sharding.Mesh, up_spec: P, down_spec: P, reduce_axis: MeshAxis
) -> Callable:
    reads_k_major = getattr(fused_fp8, "reads_k_major", False)
    # K-major values ([E, N, K]) split along their swapped axes; scales keep the weights' order.
    up_value, down_value = (
        (swap_last_two(up_spec, 3), swap_last_two(down_spec, 3)) if reads_k_major else (up_spec, down_spec)
    )

    def fused_fp8_sharded(x, ids, weights, *experts, block):
        def body(*args):
            y = fused_fp8(*args, block=block)
            return jax.lax.psum(y, reduce_axis) if reduce_axis is not None else y

        specs = (P(), P(), P(), up_value, up_value, down_value, up_spec, up_spec, down_spec)
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(x, ids, weights, *experts)

    fused_fp8_sharded.reads_k_major = reads_k_major  # type: ignore[attr-defined]
    return fused_fp8_sharded
