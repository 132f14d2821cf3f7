"""Logical axis names -> mesh axes (in the style of jax-llm-examples' `ShardingRules`).

Weights and caches name their dimensions with logical axes ("heads", "mlp", "vocab", ...)
where they are declared (`jaxllm.models.weights`, `jaxllm.kv_cache.spec`); the rules say
which mesh axis, if any, splits each logical axis. `logical_to_physical` turns a tuple
of logical names into a `PartitionSpec`. Changing how a model is split is a change of
rules, not of the model code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

import jax
from jax.sharding import NamedSharding, PartitionSpec

from sharding.mesh import EXPERT_AXIS, TENSOR_AXIS

# One mesh axis, several (the dimension is split over their product), or None (replicated).
MeshAxis = Union[str, tuple[str, ...], None]
LogicalAxes = Sequence[Optional[str]]


@dataclass(frozen=True)
class ShardingRules:
    """The mesh axis each logical axis is split over (None: replicated)."""

    embed: MeshAxis = None  # hidden size
    heads: MeshAxis = TENSOR_AXIS  # query heads: q column-parallel, o row-parallel
    kv_heads: MeshAxis = TENSOR_AXIS  # KV heads of k/v weights and of the KV cache
    head_dim: MeshAxis = None
    mlp: MeshAxis = TENSOR_AXIS  # dense FFN intermediate: gate/up column-, down row-parallel
    experts: MeshAxis = None  # expert (slot) index: the expert-parallel axis when EP > 1
    moe_mlp: MeshAxis = TENSOR_AXIS  # expert FFN intermediate, split like the dense one
    vocab: MeshAxis = TENSOR_AXIS  # embedding rows and LM head columns
    tokens: MeshAxis = None  # the packed token dimension of activations
    cache_blocks: MeshAxis = None
    cache_tokens: MeshAxis = None

    def axis(self, logical: Optional[str]) -> MeshAxis:
        if logical is None:
            return None
        if logical not in _FIELD_NAMES:
            raise ValueError(f"unknown logical axis {logical!r}; known: {', '.join(sorted(_FIELD_NAMES))}")
        return getattr(self, logical)


_FIELD_NAMES = frozenset(f.name for f in fields(ShardingRules))


def logical_to_physical(logical: LogicalAxes, rules: ShardingRules) -> PartitionSpec:
    """PartitionSpec for a tensor whose dimensions carry these logical names.

    A mesh axis may split only one dimension of a tensor; the first dimension that asks
    for it gets it and later ones are replicated.
    """
    used: set[str] = set()
    spec = []
    for name in logical:
        axis = rules.axis(name)
        names = () if axis is None else ((axis,) if isinstance(axis, str) else tuple(axis))
        if used.intersection(names):
            axis, names = None, ()
        used.update(names)
        spec.append(axis)
    return PartitionSpec(*spec)


def swap_last_two(spec: PartitionSpec, ndim: int) -> PartitionSpec:
    """`spec` of an `ndim`-axis array whose last two axes are swapped (a K-major weight)."""
    axes = tuple(spec) + (None,) * (ndim - len(spec))
    return PartitionSpec(*axes[:-2], axes[-1], axes[-2])


def named_sharding(mesh: jax.sharding.Mesh, logical: LogicalAxes, rules: ShardingRules) -> NamedSharding:
    return NamedSharding(mesh, logical_to_physical(logical, rules))


def kv_head_replicas(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """How many copies of each KV head are kept so every tensor-parallel rank owns whole heads.

    With fewer KV heads than ranks each head is repeated (as vLLM does), so rank r holds
    a copy of KV head r * num_kv_heads // tp, the head its query heads attend to.
    """
    if num_kv_heads % tensor_parallel_size == 0:
        return 1
    if tensor_parallel_size % num_kv_heads == 0:
        return tensor_parallel_size // num_kv_heads
    raise ValueError(
        f"num_key_value_heads={num_kv_heads} and tensor_parallel_size={tensor_parallel_size}: one must divide the other"
    )


def model_rules(
    *,
    tensor_parallel_size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    moe_intermediate_size: int,
    vocab_size: int,
    expert_parallel_size: int = 1,
    num_slots: int = 0,
) -> ShardingRules:
    """Default rules for a decoder, after checking that the split dimensions divide evenly.

    `tensor_parallel_size` is the attention/dense TP size N. The vocabulary is split when
    it divides by N (the LM head is the largest single matmul at decode and its weight the
    largest tensor of small models) and is otherwise replicated; heads and FFN columns
    must divide. With expert parallelism E > 1 the mesh's `expert` x `tensor` axes (E x T,
    E * T = N) together carry the N-way split of attention and dense layers, MoE slots
    are split over `expert` and each expert's columns over `tensor` (T = N / E).
    """
    tp, ep = tensor_parallel_size, expert_parallel_size
    if ep < 1 or tp % ep:
        raise ValueError(f"expert_parallel_size={ep} must divide tensor_parallel_size={tp}")
    moe_tp = tp // ep
    problems = [
        f"{name}={size}"
        for name, size in (("num_attention_heads", num_heads), ("intermediate_size", intermediate_size))
        if size and size % tp
    ]
    if problems:
        # Attention data parallelism (each device its own requests, the attention weights whole) is
        # how a model spreads over more devices than it has heads.
        hint = (
            "; to spread attention over more devices than heads use --enable-attention-dp "
            "(enable_attention_dp=True: each device runs attention for its own requests)"
            if num_heads and num_heads % tp
            else ""
        )
        raise ValueError(f"tensor_parallel_size={tp} must divide {', '.join(problems)}{hint}")
    if moe_intermediate_size and moe_intermediate_size % moe_tp:
        raise ValueError(
            f"the MoE tensor-parallel size {moe_tp} must divide moe_intermediate_size={moe_intermediate_size}"
        )
    if ep > 1 and num_slots % ep:
        raise ValueError(f"moe_expert_parallel_size={ep} must divide the number of expert slots ({num_slots})")
    kv_head_replicas(num_kv_heads, tp)
    if ep == 1:
        return ShardingRules(vocab=TENSOR_AXIS if vocab_size % tp == 0 else None)
    both = (EXPERT_AXIS, TENSOR_AXIS)
    return ShardingRules(
        heads=both,
        kv_heads=both,
        mlp=both,
        experts=EXPERT_AXIS,
        moe_mlp=TENSOR_AXIS,
        vocab=both if vocab_size % tp == 0 else None,
    )


def param_partition_specs(params: Any) -> Any:
    """The PartitionSpec tree of loaded (concrete) parameters, for shard_map's in_specs."""

    def spec(a: jax.Array) -> PartitionSpec:
        sharding = getattr(a, "sharding", None)
        return sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()

    return jax.tree.map(spec, params)
