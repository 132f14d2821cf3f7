"""Logical axis names -> mesh axes (in the style of jax-llm-examples' `ShardingRules`).

Weights and caches name their dimensions with logical axes ("heads", "mlp", "vocab", ...)
where they are declared (`jaxllm.models.weights`, `jaxllm.kv_cache.spec`); the rules say
which mesh axis, if any, splits each logical axis. `logical_to_physical` turns a tuple
of logical names into a `PartitionSpec`. Changing how a model is split is a change of
rules, not of the model code.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from sharding.mesh import TENSOR_AXIS

MeshAxis = Optional[str]
LogicalAxes = Sequence[Optional[str]]


@dataclass(frozen=True)
class ShardingRules:
    """The mesh axis each logical axis is split over (None: replicated)."""

    embed: MeshAxis = None  # hidden size
    heads: MeshAxis = TENSOR_AXIS  # query heads: q column-parallel, o row-parallel
    kv_heads: MeshAxis = TENSOR_AXIS  # KV heads of k/v weights and of the KV cache
    head_dim: MeshAxis = None
    mlp: MeshAxis = TENSOR_AXIS  # dense FFN intermediate: gate/up column-, down row-parallel
    experts: MeshAxis = None  # expert index (the expert-parallel axis, once it exists)
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
        if axis is not None and axis in used:
            axis = None
        if axis is not None:
            used.add(axis)
        spec.append(axis)
    return PartitionSpec(*spec)


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
    raise ValueError(f"num_key_value_heads={num_kv_heads} and tensor_parallel_size={tensor_parallel_size}: "
                     "one must divide the other")


def model_rules(*, tensor_parallel_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
                moe_intermediate_size: int, vocab_size: int) -> ShardingRules:
    """Default rules for a decoder, after checking that the split dimensions divide evenly.

    The vocabulary is split when it divides by the TP size (the LM head is the largest
    single matmul at decode and its weight the largest tensor of small models) and is
    otherwise replicated; heads and FFN columns must divide.
    """
    tp = tensor_parallel_size
    problems = [f"{name}={size}" for name, size in (
        ("num_attention_heads", num_heads), ("intermediate_size", intermediate_size),
        ("moe_intermediate_size", moe_intermediate_size)) if size and size % tp]
    if problems:
        raise ValueError(f"tensor_parallel_size={tp} must divide {', '.join(problems)}")
    kv_head_replicas(num_kv_heads, tp)
    return ShardingRules(vocab=TENSOR_AXIS if vocab_size % tp == 0 else None)
